"""The engine over UlaCache (`kv_tier`): requests are admitted by the KV system's own accounting and decoded
with sparse attention whose KV lives behind logical addresses (lanner.kvcache.ula): dense Llama-family models
with Quest page selection (UlaDecoder: an entry is one token's K and V of `sparse_group` layers), DeepSeek-V3.2 /
GLM-5 models with their own DSA indexer (MlaDecoder: an entry is one token's latent for the layers sharing one
indexer's selection; each query reads index_topk tokens; the indexer keys stay resident beside the KV budgets,
as Quest's page bounds do).

Admission: a waiting request (oldest first) is admitted when the running limit allows, a decode step with it
still fits the device pool's worst case (every request reading `sparse_budget` tokens), and the KV system can
open its whole address range (prompt + max_tokens entries per layer group): a gpu-only system counts its
device pool, HiSparse its host pool and per-request device buffers, ula-dp device + host slots. A request that
does not fit waits until others finish; one that could never fit is refused when it is made. One request is
prefilled per step (dense, whole prompt), after one sparse decode step over every running request. Sampling,
stop handling, outputs and metrics are LLMEngine's; speculative decoding and plugins do not run here (the config
refuses them), nor does prefix caching (every request prefills its whole prompt).

Tensor parallelism (DSA models): every rank builds the same decoder over its share of the KV system (ula-tp: one
address space over the ranks' pools; hisparse / gpu-only: the replicated latent, as the plain TP model keeps it)
and rank 0 sends each add / step / close to the workers before running its own, so the model's and the cache's
collectives line up (lanner.distributed.worker)."""
from __future__ import annotations

import itertools
import logging
import time

import torch.distributed as dist

from lanner.config import EngineConfig
from lanner.distributed import TPError, tp_rank, tp_size
from lanner.engine.llm_engine import LLMEngine, RequestError
from lanner.engine.loading import load_target
from lanner.engine.request import Request, RequestOutput, Status
from lanner.engine.sampling import sample
from lanner.engine.scheduler import RequestQueue
from lanner.engine.ula_dense import UlaDecoder
from lanner.engine.ula_mla import MlaDecoder, mla_entry_shape, selection_groups
from lanner.kvcache.ula import entry_shape, make_backend
from lanner.plugins import Hardware

log = logging.getLogger("lanner.engine")


class UlaScheduler(RequestQueue):
    """FIFO admission against a KV system (the checks are UlaEngine.step's); `release` closes a request's range."""

    def __init__(self, decoder: UlaDecoder | MlaDecoder, max_num_seqs: int, max_queue_len: int, release):
        super().__init__(max_num_seqs, max_queue_len)  # never preempts: a request holds its whole range
        self.decoder, self.release = decoder, release
        self.max_batch = decoder.cache.max_batch(decoder.budget, decoder.page)

    def can_admit(self) -> bool:
        return bool(self.waiting) and len(self.running) < min(self.max_num_seqs, self.max_batch)

    def _release(self, req: Request):
        self.release(req)


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
    """A tensor-parallel worker of UlaEngine: the same decoder calls as rank 0, so the model's and the cache's
    collectives line up."""
    hardware = Hardware.detect(device, config.torch_dtype, tp_size(), tp_rank())
    model, model_config = load_target(config, hardware)[:2]
    decoder = build_decoder(config, model, model_config)[0]

    def step(arg, payload):  # payload: handles, then one token each
        n = len(payload) // 2
        decoder.step(payload[:n], payload[n:])

    return {"ula.add": lambda h, payload: decoder.add(h, decoder.run_prefill(payload[1:]), payload[0]),
            "ula.step": step, "ula.close": lambda h, payload: decoder.close(h)}


class UlaEngine(LLMEngine):
    tp_worker = staticmethod(ula_worker)

    def _build_cache(self, config: EngineConfig):
        self.decoder, self.groups, budget, how = build_decoder(config, self.model, self.model_config)
        cache = self.decoder.cache
        self.handles: dict[str, int] = {}  # request id -> the decoder's id for it (the same on every TP rank)
        self._next_handle = itertools.count()
        self.scheduler = UlaScheduler(self.decoder, config.max_num_seqs, config.max_queue_len, self._close)
        if self.scheduler.max_batch < 1:
            raise ValueError(f"kv_device_gb: {config.kv_device_gb} GiB cannot hold one decode step's selection "
                             f"({budget} tokens x {self.groups} groups); raise it")
        self.runner, self.proposer, self.plugins = None, None, None
        self.capacity = cache.max_requests(1)  # entries
        per_rank = " per rank" if config.tp > 1 else ""
        self.kv_summary = (f"{config.kv_tier} over {cache.entry_bytes} B entries (one token, "
                           f"{cache.shape[0]} layers): {self.capacity} entries{per_rank}, decode steps of "
                           f"up to {self.scheduler.max_batch} requests, {how} {budget}")

    def _on_ranks(self, name: str, arg: int, payload: list[int], local):
        """local() here, and the same decoder call on every other TP rank first."""
        return local() if self.tp is None else self.tp.call(name, arg, payload, local)

    def _close(self, req: Request):
        h = self.handles.pop(req.request_id, None)
        if h is not None:
            self._on_ranks("ula.close", h, [], lambda: self.decoder.close(h))

    def _entries(self, tokens: int) -> int:
        return self.groups * tokens

    def _check_fits(self, tokens: int):
        if self.decoder.cache.max_requests(self._entries(tokens)) < 1:
            raise RequestError(f"prompt plus max_tokens ({tokens} tokens) does not fit in the {self.config.kv_tier} "
                               f"KV budget ({self.capacity // self.groups} tokens); raise kv_device_gb / kv_host_gb",
                               "max_tokens")

    def step(self) -> list[RequestOutput]:
        sch, outputs = self.scheduler, []
        decoding = list(sch.running)
        if decoding:
            handles, tokens = [self.handles[r.request_id] for r in decoding], [r.all_ids[-1] for r in decoding]
            outputs += self._run(decoding, lambda: self._on_ranks("ula.step", 0, handles + tokens,
                                                                  lambda: self.decoder.step(handles, tokens)))
        if sch.can_admit():
            req = sch.waiting[0]
            max_len = len(req.prompt_ids) + req.max_tokens  # nothing is generated before admission
            if self.decoder.cache.can_open(self._entries(max_len)):
                sch.waiting.popleft()
                req.status = Status.RUNNING
                sch.running.append(req)
                outputs += self._run([req], lambda: self._prefill(req, max_len))
            elif not sch.running:  # nothing will free space (_check_fits passed it on totals alone)
                req.error = f"its KV range ({max_len} tokens) does not fit the empty {self.config.kv_tier} cache"
                self._finish(req, "error")
                outputs.append(self._output(req))
            # else: it stays first in line until running requests finish and free their ranges
        self._update_gauges()
        return outputs

    def _prefill(self, req: Request, max_len: int):
        req.first_scheduled_time = req.first_scheduled_time or time.perf_counter()
        h = self.handles[req.request_id] = next(self._next_handle)

        def local():
            pre = self.decoder.run_prefill(req.prompt_ids)
            self.decoder.add(h, pre, max_len)
            return pre.logits[None]

        return self._on_ranks("ula.add", h, [max_len] + list(req.prompt_ids), local)

    def _run(self, reqs: list[Request], forward) -> list[RequestOutput]:
        """Runs forward() -> logits [len(reqs), V], samples one token per request and emits their outputs; a
        failure fails these requests only."""
        outputs = []
        try:
            logits = forward()
            result = sample(logits, reqs)
        except TPError as e:  # the ranks are out of step: fail everything, refuse new work
            self._fail_engine(e)
            raise
        except Exception as e:  # a bug or a bad input: fail these requests, keep serving the rest
            log.exception("UlaCache step failed; failing %d requests", len(reqs))
            self.metrics.step_errors.inc()
            for req in reqs:
                req.error = f"internal error: {type(e).__name__}: {e}"
                self._finish(req, "error")
                outputs.append(self._output(req))
            return outputs
        for req, tok, lp in zip(reqs, result.token_ids, result.logprobs):
            req.num_computed = req.num_tokens
            reason = self._accept_token(req, tok, lp)
            if reason:
                self._finish(req, reason)
            outputs.append(self._output(req))
        return outputs

    def _update_gauges(self):
        cache = self.decoder.cache
        used = sum(n for _, n in cache.requests.values())
        capacity = getattr(cache, "capacity", self.capacity)  # ula-tp: all ranks' entries
        self.metrics.queue_len.set(len(self.scheduler.waiting))
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.kv_usage.set(used / capacity if capacity else 0.0)


def make_engine(config: EngineConfig) -> LLMEngine:
    """The engine a config asks for: over UlaCache when `kv_tier` is set, else the paged-cache engine."""
    return UlaEngine(config) if config.kv_tier is not None else LLMEngine(config)
