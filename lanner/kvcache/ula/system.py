"""The UlaCache KV system (`kv_tier`): requests are admitted by the KV system's own accounting and decoded
with sparse attention whose KV lives behind logical addresses (lanner.kvcache.ula): dense Llama-family models
with Quest page selection (UlaDecoder: an entry is one token's K and V of `sparse_group` layers), DeepSeek-V3.2 /
GLM-5 models with their own DSA indexer (MlaDecoder: an entry is one token's latent for the layers sharing one
indexer's selection; each query reads index_topk tokens; the indexer keys stay resident beside the KV budgets,
as Quest's page bounds do). The engine drives it as it drives the paged system, through
lanner.engine.kv_system.KVSystem.

Admission (UlaScheduler): a gpu-only system counts its device pool, HiSparse its host pool and per-request device
buffers, ula-dp device + host slots; a request that could never fit is refused when it is made. Plugins do not run
here (the decoders run the model's own forward), nor does prefix caching (every request prefills its whole prompt).

Tensor parallelism (DSA models): every rank builds the same decoder over its share of the KV system (ula-tp: one
address space over the ranks' pools; hisparse / gpu-only: the replicated latent, as the plain TP model keeps it)."""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from lanner.config import EngineConfig
from lanner.distributed import tp_rank, tp_size
from lanner.engine.loading import load_target
from lanner.engine.request import Request, RequestError, Status
from lanner.engine.scheduler import RequestQueue, ScheduledItem
from lanner.engine.step import StepOutput
from lanner.kvcache.ula.quest_decoder import UlaDecoder
from lanner.kvcache.ula.mla_decoder import MlaDecoder, mla_entry_shape, selection_groups
from lanner.kvcache.ula import entry_shape, make_backend
from lanner.plugins import Hardware


def build_decoder(config: EngineConfig, model, model_config):
    """The sparse decoder over the KV system `config.kv_tier` (this rank's, under TP: every rank builds the same
    one) -> (decoder, layer groups, tokens a query reads, how they are chosen)."""
    cfg, dtype = model_config, config.torch_dtype
    max_len = min(config.max_model_len or cfg.max_context, cfg.max_context)
    if cfg.family == "deepseek":  # DSA: the model's indexer selects, its layers sharing a selection form a group
        shape, groups = mla_entry_shape(model), len(selection_groups(model))
        budget, how = model.hf["index_topk"], "DSA index_topk"
    elif cfg.family == "llama" and cfg.num_layers % config.sparse_group == 0 and config.tp == 1:
        shape, groups = entry_shape(model, config.sparse_group), cfg.num_layers // config.sparse_group
        budget, how = config.sparse_budget, "Quest budget"
    else:
        raise ValueError(f"kv_tier: UlaCache decodes dense Llama-family models whose layer count ({cfg.num_layers}) "
                         f"sparse_group ({config.sparse_group}) divides, at tp=1 (under TP their KV heads are split: "
                         f"nothing is stored twice), and DeepSeek-V3.2 / GLM-5 (DSA) models; not "
                         f"{cfg.architecture} at tp={config.tp}")
    # the cache's own gloo group under TP: its gathers (some from a prefetch thread) stay apart from the model's
    group = dist.new_group(backend="gloo") if config.tp > 1 else None
    # HiSparse's device buffer per request: twice what one query reads, in every group (as in bench kv)
    cache = make_backend(config.kv_tier, shape, dtype, config.kv_device_gb, config.kv_host_gb,
                         hisparse_buffer=2 * budget * groups, group=group, device=config.device,
                         poison=config.kv_poison)
    if cfg.family == "deepseek":
        return MlaDecoder(model, cache, max_len), groups, budget, how
    return UlaDecoder(model, cache, config.sparse_page, budget, config.sparse_group, max_len), groups, budget, how


def ula_worker(config: EngineConfig, device: str) -> dict:
    """A tensor-parallel worker over UlaCache: the same decoder calls as rank 0, so the model's and the cache's
    collectives line up."""
    hardware = Hardware.detect(device, config.torch_dtype, tp_size(), tp_rank())
    model, model_config = load_target(config, hardware)[:2]
    decoder = build_decoder(config, model, model_config)[0]

    def step(arg, payload):  # payload: handles, then one token each
        n = len(payload) // 2
        decoder.step(payload[:n], payload[n:])

    return {"ula.add": lambda h, payload: decoder.add(h, decoder.run_prefill(payload[1:]), payload[0]),
            "ula.step": step, "ula.close": lambda h, payload: decoder.close(h)}


class UlaScheduler(RequestQueue):
    """FIFO admission against a KV system: every running request decodes each step, and the oldest waiting one
    is prefilled (whole prompt) when the running limit allows, a decode step with it still fits the device pool's
    worst case, and the KV system can open its whole address range. Never preempts: a request holds its range."""

    def __init__(self, kv: UlaKV, max_num_seqs: int, max_queue_len: int):
        super().__init__(max_num_seqs, max_queue_len)
        self.kv = kv
        self.max_batch = kv.decoder.cache.max_batch(kv.decoder.budget, kv.decoder.page)

    def schedule(self, spec_tokens=None) -> list[ScheduledItem]:
        self.refused = []
        n = len(self.running)
        ks = [spec_tokens(r, n) if spec_tokens is not None and self.kv.verifies else 0 for r in self.running]
        dec = self.kv.decoder
        if any(ks) and not dec.cache.step_fits([k + 1 for k in ks], dec.budget, dec.page):
            ks = [0] * n  # the drafts' queries would not fit the device slots: a plain step
        items = [ScheduledItem(r, r.num_computed, 1, num_spec=k) for r, k in zip(self.running, ks)]
        if self.waiting and len(self.running) < min(self.max_num_seqs, self.max_batch):
            req = self.waiting[0]
            max_len = len(req.prompt_ids) + req.max_tokens  # nothing is generated before admission
            if self.kv.can_open(max_len):
                self.waiting.popleft()
                req.status = Status.RUNNING
                self.running.append(req)
                items.append(ScheduledItem(req, 0, len(req.prompt_ids), admitted=True))
            elif not self.running:  # nothing will free space (check_fits passed it on totals alone)
                req.error = f"its KV range ({max_len} tokens) does not fit the empty {self.kv.config.kv_tier} cache"
                self.refused.append(req)
            # else: it stays first in line until running requests finish and free their ranges
        return items

    def _release(self, req: Request):
        self.kv.close(req)


class UlaKV:
    """Requests decoded with sparse attention over a UlaCache KV system (lanner.kvcache.ula). Under tensor
    parallelism rank 0 sends each add / step / close to the workers before running its own, so the model's and the
    cache's collectives line up (ula_worker)."""
    worker = staticmethod(ula_worker)
    supports_trees = False  # a verify step reads its drafts as one chain per request

    def __init__(self, config: EngineConfig, model, model_config, tp, capture=()):
        """capture: the layers whose outputs a draft head reads (features)."""
        self.config, self.tp = config, tp
        self.num_blocks = None  # no block tables: a draft head keeps KV blocks of its own
        self.decoder, self.groups, budget, how = build_decoder(config, model, model_config)
        self.decoder.capture_layers = tuple(capture)
        self.features: torch.Tensor | None = None  # the last run's captured outputs, a row per token and draft
        cache = self.decoder.cache
        self.handles: dict[str, int] = {}  # request id -> the decoder's id for it (the same on every TP rank)
        self._next_handle = itertools.count()
        # verify steps run rank 0's decoder only (the workers' step message carries one token per request)
        self.verifies = config.tp == 1
        if config.spec is not None and not self.verifies:
            raise ValueError(f"spec: over kv_tier={config.kv_tier!r} drafts are verified at tp=1; drop "
                             f"spec={config.spec!r} or tp={config.tp}")
        self.scheduler = UlaScheduler(self, config.max_num_seqs, config.max_queue_len)
        if self.scheduler.max_batch < 1:
            raise ValueError(f"kv_device_gb: {config.kv_device_gb} GiB cannot hold one decode step's selection "
                             f"({budget} tokens x {self.groups} groups); raise it")
        self.capacity = cache.max_requests(1)  # entries
        per_rank = " per rank" if config.tp > 1 else ""
        self.summary = (f"{config.kv_tier} over {cache.entry_bytes} B entries (one token, {cache.shape[0]} layers): "
                        f"{self.capacity} entries{per_rank}, decode steps of up to {self.scheduler.max_batch} "
                        f"requests, {how} {budget}")

    def _on_ranks(self, name: str, arg: int, payload: list[int], local):
        """local() here, and the same decoder call on every other TP rank first."""
        return local() if self.tp is None else self.tp.call(name, arg, payload, local)

    def can_open(self, tokens: int) -> bool:
        return self.decoder.cache.can_open(self.groups * tokens)

    def check_fits(self, tokens: int):
        if self.decoder.cache.max_requests(self.groups * tokens) < 1:
            raise RequestError(f"prompt plus max_tokens ({tokens} tokens) does not fit in the {self.config.kv_tier} "
                               f"KV budget ({self.capacity // self.groups} tokens); raise kv_device_gb / kv_host_gb",
                               "max_tokens")

    def close(self, req: Request):
        h = self.handles.pop(req.request_id, None)
        if h is not None:
            self._on_ranks("ula.close", h, [], lambda: self.decoder.close(h))

    def run(self, items: list[ScheduledItem], kind=None, argmax: bool = False) -> StepOutput:
        """The decode step over the running requests, then the new request's prefill -> float32 logits: a row per
        item, and per draft token of a verifying one (lanner.engine.step.StepLayout; always logits: `argmax` is
        the paged cache's shortcut)."""
        decoding = [it for it in items if it.num_tokens == 1 and it.start > 0]
        logits, feats = [], []
        if decoding:
            handles = [self.handles[it.request.request_id] for it in decoding]
            if any(it.draft for it in decoding):  # a verify step: accept() (commit) says how much stays
                tokens = [[it.request.all_ids[-1]] + it.draft.tokens for it in decoding]
                logits.append(self.decoder.step(handles, tokens, commit=False))
            else:
                tokens = [it.request.all_ids[-1] for it in decoding]
                logits.append(self._on_ranks("ula.step", 0, handles + tokens,
                                             lambda: self.decoder.step(handles, tokens)))
            feats.append(self.decoder.features)
        for it in items[len(decoding):]:
            pre = self._prefill(it.request)
            logits.append(pre.logits[None])
            feats.append(pre.features)
        self.features = None if not self.decoder.capture_layers else torch.cat(feats)
        return StepOutput(logits=torch.cat(logits))

    def _prefill(self, req: Request):
        max_len = len(req.prompt_ids) + req.max_tokens
        h = self.handles[req.request_id] = next(self._next_handle)

        def local():
            pre = self.decoder.run_prefill(req.prompt_ids)
            self.decoder.add(h, pre, max_len)
            return pre

        return self._on_ranks("ula.add", h, [max_len] + list(req.prompt_ids), local)

    def block_table(self, req: Request) -> list[int]:
        raise ValueError("UlaCache requests have no block tables (num_blocks is None)")

    def keep_path(self, req: Request, first: int, path: list[int]):
        raise ValueError("UlaCache verifies draft chains only; spec_tree runs on the paged KV cache")

    def commit(self, req: Request, finishing: bool):
        """After a verify step: the request keeps its verified positions (a plain step committed itself; a
        request's range is its own until it finishes)."""
        if finishing or not self.verifies:
            return
        st, h = self.decoder.step_state, self.handles.get(req.request_id)
        if st is not None and not st.commit and h in st.rids and self.decoder.length(h) < req.num_computed:
            self.decoder.accept(h, req.num_computed)

    def update_gauges(self, metrics):
        cache = self.decoder.cache
        used = sum(n for _, n in cache.requests.values())
        capacity = getattr(cache, "capacity", self.capacity)  # ula-tp: all ranks' entries
        metrics.kv_usage.set(used / capacity if capacity else 0.0)
