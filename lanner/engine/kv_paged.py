"""The paged KV system: a block pool with prefix caching, the scheduler that fills it (chunked prefill,
preemption) and the model runner that reads it. One of the engine's two KV systems (the other is UlaCache,
lanner.kvcache.ula.system); the engine talks to either through lanner.engine.kv_system.KVSystem."""
from __future__ import annotations

import torch

from lanner.config import EngineConfig
from lanner.distributed import all_gather_rows, split_sizes, tp_rank, tp_size
from lanner.engine.loading import kv_blocks, load_target
from lanner.engine.request import Request, RequestError
from lanner.engine.runner import ModelRunner, SeqChunk, decode_step, encode_step
from lanner.engine.scheduler import ScheduledItem, Scheduler
from lanner.engine.step import StepOutput, logits_mode
from lanner.kvcache.block_manager import BlockManager
from lanner.kvcache.layout import KVLayout
from lanner.plugins import Hardware, StepKind


def paged_worker(config: EngineConfig, device: str) -> dict | None:
    """A tensor-parallel worker (lanner.distributed.worker runs it on ranks > 0): its shard, its own KV pool with
    rank 0's block count, and the handlers for rank 0's calls."""
    hardware = Hardware.detect(device, config.torch_dtype, tp_size(), tp_rank())
    model, model_config, plugin_runtime, plugin_bytes, _ = load_target(config, hardware)
    layout = KVLayout.of(model, config.window_kv)
    kv_q8 = config.kv_cache_dtype == "q8"
    num_blocks = kv_blocks(config, ModelRunner.bytes_per_token(model, config.torch_dtype, layout, kv_q8), plugin_bytes)
    if num_blocks < 2:  # rank 0 raises the error that names the budget
        return None
    # no captured layers: only rank 0 feeds a draft head
    runner = ModelRunner(model, num_blocks, config.block_size, config.torch_dtype, device, (), plugin_runtime,
                         layout=layout, kv_q8=kv_q8)
    return {"step": lambda code, payload: runner.run(*decode_step(code, payload, layout.num_groups)),
            "gather_embedding": lambda arg, payload: all_gather_rows(
                model.embed_tokens.weight, split_sizes(model_config.vocab_size, tp_size()))}


class PagedKV:
    worker = staticmethod(paged_worker)
    supports_trees = True

    def __init__(self, config: EngineConfig, model, plugins, plugin_bytes: int, tp, draft_bytes: int = 0,
                 capture=()):
        """draft_bytes: KV bytes per token of a draft that shares the block tables (and so the budget);
        capture: the layers whose outputs a draft head reads (ModelRunner.features)."""
        self.config, self.tp = config, tp
        self.layout = KVLayout.of(model, config.window_kv)
        kv_q8 = config.kv_cache_dtype == "q8"
        per_token = ModelRunner.bytes_per_token(model, config.torch_dtype, self.layout, kv_q8) + draft_bytes
        self.bytes_per_token, self.plugin_bytes = per_token, plugin_bytes  # a benchmark sizes a pool of N blocks
        self.num_blocks = kv_blocks(config, per_token, plugin_bytes)
        if self.num_blocks < 2:
            raise ValueError(f"kv_cache_memory: {config.kv_cache_memory!r} leaves room for {self.num_blocks} blocks"
                             + (f" after plugins took {plugin_bytes / 2**20:.0f} MiB" if plugin_bytes else ""))
        self.block_size = config.block_size
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.session_idle_s)
        # a lone request's longer prefill steps; not with sliding windows, whose block count assumes
        # max_num_batched_tokens-token chunks (KVLayout.blocks_for)
        solo = config.solo_prefill_tokens
        if solo is None:
            solo = max([p.solo_prefill_tokens or 0 for p in plugins.active] if plugins is not None else [0])
        if any(w is not None for w in self.layout.windows):
            solo = 0
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_queue_len, self.layout, solo)
        self.runner = ModelRunner(model, self.num_blocks, config.block_size, config.torch_dtype, config.device,
                                  capture, plugins, layout=self.layout, kv_q8=kv_q8)
        windows = [w for w in self.layout.windows if w is not None]
        self.summary = (f"{self.num_blocks} {'q8 ' if kv_q8 else ''}KV blocks x {config.block_size} tokens "
                        f"({self.num_blocks * config.block_size * per_token / 2**30:.2f} GiB"
                        + (f" on each of {config.tp} ranks" if config.tp > 1 else "")
                        + (f"; {self.layout.num_groups} layer groups of {self.layout.members}, {len(windows)} of "
                           f"them keeping a {windows[0]}-token window" if windows else "") + ")")

    @property
    def features(self) -> torch.Tensor | None:
        """The captured layers' outputs of the last run, one row per scheduled token and draft token."""
        return self.runner.features

    def check_fits(self, tokens: int):
        """Raises RequestError when a request of `tokens` tokens (prompt + max_tokens) can never fit."""
        if self.layout.blocks_for(tokens, self.config.max_num_batched_tokens, self.block_size) > self.num_blocks:
            raise RequestError(f"prompt plus max_tokens ({tokens} tokens) does not fit in the KV cache "
                               f"({self.capacity_tokens()} tokens); raise kv_cache_memory", "max_tokens")

    def capacity_tokens(self) -> int:
        """The longest request the pool holds (a sliding group keeps only its window)."""
        lo, hi = 0, self.num_blocks * self.block_size
        while lo < hi:  # blocks_for grows with the tokens
            mid = (lo + hi + 1) // 2
            fits = self.layout.blocks_for(mid, self.config.max_num_batched_tokens, self.block_size) <= self.num_blocks
            lo, hi = (mid, hi) if fits else (lo, mid - 1)
        return lo

    def run(self, items: list[ScheduledItem], kind: StepKind, argmax: bool = False) -> StepOutput:
        """One forward over the scheduled tokens and drafts -> their rows of lanner.engine.step.StepLayout:
        float32 logits, or with argmax a greedy step's token ids (under TP the logits, whose head is a collective
        every rank runs alike)."""
        tables = self.scheduler.tables
        chunks = []
        for it in items:
            bt = tables[it.request.request_id]
            chunks.append(SeqChunk(it.request.all_ids[it.start : it.start + it.num_tokens] + it.draft.tokens,
                                   it.start, bt.table, logits_mode(it), it.draft.parents, bt.groups))
        if self.tp is None:
            rows = self.runner.run(chunks, kind, argmax)
            return StepOutput(token_ids=rows.tolist()) if argmax else StepOutput(logits=rows)
        logits = self.tp.call("step", *encode_step(chunks, kind), lambda: self.runner.run(chunks, kind))
        return StepOutput(logits=logits)

    def block_table(self, req: Request) -> list[int]:
        """The running request's group-0 block table (a draft's KV shares it)."""
        return self.scheduler.tables[req.request_id].table

    def keep_path(self, req: Request, first: int, path: list[int]):
        """After a tree verify whose draft nodes took the slots of positions first..: the accepted nodes' KV moves
        to the slots of positions first, first + 1, .. (a node's slot index is never below its path position, and
        the path's nodes come in slot order, so no source is overwritten before it is read)."""
        moves = [(first + i, first + d) for d, i in enumerate(path) if i != d]
        if moves:
            bs, dev = self.block_size, self.config.device
            index = []  # per group: (source slots, destination slots)
            bt = self.scheduler.tables[req.request_id]
            for table in [bt.table] + bt.groups:
                slot = lambda p: table[p // bs] * bs + p % bs
                index.append((torch.tensor([slot(s) for s, _ in moves], device=dev),
                              torch.tensor([slot(d) for _, d in moves], device=dev)))
            for layer, g in zip(self.runner.kv_caches, self.layout.layer_group):
                src, dst = index[g]
                for cache in layer:
                    cache[dst] = cache[src]

    def commit(self, req: Request, finishing: bool):
        """After a step: names the verified full blocks (before a finish frees them, so they stay reusable) and
        rolls back the blocks taken for rejected draft positions."""
        bt = self.scheduler.tables[req.request_id]
        self.block_manager.commit_full_blocks(bt.table, bt.hashes, req.all_ids, min(req.num_computed, req.num_tokens),
                                              bt.groups)
        if not finishing:
            self.scheduler.trim(req)

    def update_gauges(self, metrics):
        bm = self.block_manager
        metrics.kv_usage.set(bm.usage())
        if bm.query_tokens:
            metrics.prefix_hit_rate.set(bm.hit_tokens / bm.query_tokens)
