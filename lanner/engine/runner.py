"""One forward per step: gathers the scheduled tokens, builds attention metadata, returns logits."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from lanner.kvcache import q8
from lanner.kvcache.layout import KVLayout
from lanner.layers.attention import build_attention_metadata
from lanner.plugins import PluginRuntime, Step, StepKind


@dataclass
class SeqChunk:
    """One sequence's part of a forward: `tokens` at positions start.. over `block_table`."""
    tokens: list[int]
    start: int
    block_table: list[int]
    logits: str = "last"  # "last" | "all" | "none": which rows' logits the caller wants
    # a draft tree after the first token: each node's parent (-1: the first token). Nodes take consecutive slots;
    # a node's position is the first token's plus its depth, and it attends to its ancestors only
    parents: list[int] | None = None
    # a grouped KV layout's other groups' tables (lanner.kvcache.layout; block_table is group 0's), else empty
    group_tables: list[list[int]] = ()

    def positions(self) -> list[int]:
        if self.parents is None:
            return list(range(self.start, self.start + len(self.tokens)))
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent + 1] + 1)
        return [self.start + d for d in depth]

    def tree_mask(self) -> torch.Tensor:
        """[n, n] bool: row i may read chunk token j (j is i itself or one of its ancestors)."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents, start=1):
            mask[i] |= mask[parent + 1]
        return mask


LOGITS = ("last", "all", "none")


def encode_step(chunks: list[SeqChunk], kind: StepKind | None) -> tuple[int, list[int]]:
    """A step as ints for tensor-parallel workers -> (kind code, payload): per chunk [n_tokens, start, n_blocks,
    logits mode], then tokens and tables (group 0's, then the other groups', all n_blocks long)."""
    payload = [len(chunks)]
    for c in chunks:
        payload += (len(c.tokens), c.start, len(c.block_table), LOGITS.index(c.logits))
    for c in chunks:
        payload += c.tokens
        payload += c.block_table
        for table in c.group_tables:
            payload += table
    return (-1 if kind is None else list(StepKind).index(kind)), payload


def decode_step(code: int, payload: list[int], groups: int = 1) -> tuple[list[SeqChunk], StepKind | None]:
    n, chunks, at = payload[0], [], 1 + 4 * payload[0]
    for i in range(n):
        n_tok, start, n_blocks, mode = payload[1 + 4 * i : 5 + 4 * i]
        at += n_tok
        tables = [payload[at + g * n_blocks : at + (g + 1) * n_blocks] for g in range(groups)]
        chunks.append(SeqChunk(payload[at - n_tok : at], start, tables[0], LOGITS[mode], group_tables=tables[1:]))
        at += groups * n_blocks
    return chunks, (None if code < 0 else list(StepKind)[code])


def zeros(*shape: int, dtype, device) -> torch.Tensor:
    """torch.zeros, but on CPU from calloc'd (numpy) memory: the OS maps zero pages lazily, so a GiB-sized cache
    costs nothing until its blocks are written (torch.zeros writes every page up front: 0.4-4.6 s per GiB on a VM).
    Sliced to a 64-byte boundary so that SIMD rows do not straddle cache lines."""
    if torch.device(device).type != "cpu":
        return torch.zeros(*shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(nbytes + 64, np.uint8))
    start = -raw.data_ptr() % 64
    return raw[start : start + nbytes].view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype, device, capture_layers=(),
                 plugins: PluginRuntime | None = None, role: str = "target", layout: KVLayout | None = None,
                 kv_q8: bool = False):
        """layout: how layers share the pool (lanner.kvcache.layout); None: flat, one table for every layer;
        kv_q8: Q8_0 rows (lanner.kvcache.q8), not the model dtype."""
        self.plugins, self.role = plugins, role  # role: "target" | "draft" (Step.model for plugin dispatch)
        # layers whose outputs the last run() keeps in self.features ([T, len * hidden]), for draft heads
        self.capture_layers = tuple(capture_layers)
        self.features: torch.Tensor | None = None
        self.model, self.block_size, self.device = model, block_size, device
        if str(device).startswith("cuda"):
            # cuDNN's SDPA builds an execution plan per shape, and the KV length changes every decode step: 1.4 ms
            # of CPU per attention call on an H200 (42 ms per step at batch 8). Flash / memory-efficient kernels
            # take any length
            torch.backends.cuda.enable_cudnn_sdp(False)
        # per layer, the cache tensors the model asks for (K and V for Llama; a latent + index-key cache for MLA/DSA),
        # [slots, *per-token shape]; zero-filled because padded attention rows read slots that were never written
        # (masked, but 0 * NaN would still poison them)
        slots = num_blocks * block_size
        shapes = model.kv_cache_shapes()
        if kv_q8:
            shapes, dtype = q8.cache_shapes(shapes), torch.uint8
        self.layout = layout or KVLayout.flat(len(shapes))
        if self.layout.is_flat:
            self.kv_caches = [tuple(zeros(slots, *shape, dtype=dtype, device=device) for shape in layer)
                              for layer in shapes]
        else:  # layers of different groups share a member tensor: their tables hold disjoint blocks
            pool = [tuple(zeros(slots, *shape, dtype=dtype, device=device) for shape in shapes[0])
                    for _ in range(self.layout.members)]
            self.kv_caches = [pool[m] for m in self.layout.layer_member]

    @staticmethod
    def bytes_per_token(model_or_cfg, dtype, layout: KVLayout | None = None, kv_q8: bool = False) -> int:
        """KV bytes one token of a pool block takes on this rank: from the model's cache shapes, or a dense
        ModelConfig's geometry; under a grouped layout, a block holds one group's layers."""
        if hasattr(model_or_cfg, "kv_cache_shapes"):
            shapes = model_or_cfg.kv_cache_shapes()
        else:
            c = model_or_cfg
            shapes = [((c.num_kv_heads, c.head_dim),) * 2] * c.num_layers
        if layout is not None and not layout.is_flat:
            shapes = shapes[: layout.members]
        if kv_q8:
            shapes, dtype = q8.cache_shapes(shapes), torch.uint8
        elems = sum(math.prod(s) for layer in shapes for s in layer)
        return elems * dtype.itemsize

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk], kind: StepKind | None = None, argmax: bool = False) -> torch.Tensor:
        """Returns float32 logits for the requested rows, in chunk order ([rows, vocab]); with argmax only their
        argmax (int64 [rows], first index on ties: a greedy step's tokens). `kind` tells plugins what step this is
        (default: PREFILL if any chunk has several tokens, else DECODE)."""
        ids, pos, q_lens, ctx_lens, rows = [], [], [], [], []
        t = 0
        for c in chunks:
            n = len(c.tokens)
            ids.extend(c.tokens)
            pos.extend(c.positions())
            q_lens.append(n)
            ctx_lens.append(c.start + n)
            t += n
            if c.logits == "last":
                rows.append(t - 1)
            elif c.logits == "all":
                rows.extend(range(t - n, t))
        dev = self.device
        meta = build_attention_metadata(q_lens, ctx_lens, [c.block_table for c in chunks], self.block_size, dev)
        if not self.layout.is_flat:
            meta.group_tables = [[c.group_tables[g - 1] for c in chunks] for g in range(1, self.layout.num_groups)]
            meta.layer_group = list(self.layout.layer_group)
        trees = [b for b, c in enumerate(chunks) if c.parents is not None]
        if trees:  # a tree chunk's own columns: ancestors only (the causal mask lets a row read every earlier one)
            meta.tree = [[] for _ in chunks]
            for b in trees:
                c = chunks[b]
                n, reads = len(c.tokens), c.tree_mask()
                meta.mask[b, 0, :n, c.start : c.start + n] = reads.to(dev)
                meta.tree[b] = (reads.long() << torch.arange(n)).sum(1).tolist()
        args = (torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), self.kv_caches, meta,
                self.capture_layers)
        step = None
        if self.plugins is None:
            hidden, captured = self.model(*args)
        else:
            if kind is None:
                kind = StepKind.PREFILL if any(len(c.tokens) > 1 for c in chunks) else StepKind.DECODE
            step = Step(kind, t, len(chunks), self.role, tree=bool(trees))
            hidden, captured = self.plugins.forward(step, self.model, *args)
        self.features = torch.cat(captured, dim=-1) if captured else None
        if not rows:
            return torch.empty(0, dtype=torch.long) if argmax else hidden.new_empty(0, 0)
        if len(rows) != t:  # (rows ascend: as many as the step's tokens means all of them, no gather)
            hidden = hidden[torch.tensor(rows, device=dev)]
        if step is None:
            logits = self.model.compute_logits(hidden)
            return logits.argmax(-1) if argmax else logits.float()
        if argmax:
            return self.plugins.compute_argmax(step, self.model, hidden)
        return self.plugins.compute_logits(step, self.model, hidden).float()
