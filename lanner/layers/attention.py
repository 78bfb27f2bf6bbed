"""Attention over the paged KV cache.

The cache of one layer is a flat slot array `[num_blocks * block_size, kv_heads, head_dim]`; a token's
slot is `block_table[pos // block_size] * block_size + pos % block_size`. A step's batch is a list of
sequences, each contributing `q_len` new tokens (prefill chunk, 1 decode token, or k+1 verify rows)
after `ctx_len - q_len` cached ones. `AttentionMetadata` is built once per step and shared by all layers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from lanner.kvcache import q8


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slots the new tokens' K/V are written to
    batch_size: int
    max_q_len: int
    kv_slots: torch.Tensor | None  # [B, Lmax] slots to gather, None when kv_range is used
    kv_range: tuple[int, int] | None  # single sequence whose KV is contiguous: slice, no gather
    mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool, None when no masking is needed
    is_causal: bool  # single sequence prefill from position 0: SDPA's causal fast path
    q_dest: torch.Tensor | None  # [T] row of each token in the padded [B * Qmax] layout; None if dense
    # the step's layout as given, for kernels (plugins) that build their own: per sequence
    q_lens: list[int] | None = None
    ctx_lens: list[int] | None = None
    block_tables: list[list[int]] | None = None
    block_size: int = 0
    # None: dense attention over the paged cache; else where this step's attention reads and writes
    backend: AttentionBackend | None = None
    # draft trees (lanner.engine.runner.SeqChunk.parents), for kernels: per sequence [] or a bit mask per row of
    # the step's rows it reads (itself and its ancestors; `mask` holds the same)
    tree: list[list[int]] | None = None
    # a grouped KV layout (lanner.kvcache.layout): groups 1..'s per-sequence tables (-1: a block let go, never
    # read) and each layer's group; None: every layer reads and writes through block_tables
    group_tables: list[list[list[int]]] | None = None
    layer_group: list[int] | None = None


class _Lazy:
    """A metadata tensor built on its first read (within the step): lowlat reads the step's layout (q_lens, ctx_lens,
    block_tables), not the gather indices and masks PyTorch's attention needs, and building those cost ~3% of a
    decode step there (tools/step_overhead.py)."""

    __slots__ = ("build",)

    def __init__(self, build):
        self.build = build


def _lazy_field(name: str) -> property:
    key = "_" + name

    def get(self):
        value = self.__dict__[key]
        if isinstance(value, _Lazy):
            value = self.__dict__[key] = value.build()
        return value

    def put(self, value):
        self.__dict__[key] = value

    return property(get, put)


for _name in ("slot_mapping", "kv_slots", "mask"):
    setattr(AttentionMetadata, _name, _lazy_field(_name))


class AttentionBackend:
    """A step's attention other than dense reads of the paged cache (AttentionMetadata.backend): Quest-sparse
    reads of it (lanner.kvcache.quest.QuestSelector), or KV behind UlaCache's addresses
    (lanner.kvcache.ula.quest_decoder).
    Models call `attention` with their layer index; the backend gets it, so it needs no call order."""

    def forward(self, q, k, v, layer: int, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError


def attention(q, k, v, layer: int, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (this step's tokens of layer `layer`) -> [T, H * D]."""
    if meta.backend is not None:
        return meta.backend.forward(q, k, v, layer, k_cache, v_cache, meta, scale)
    return paged_attention(q, k, v, k_cache, v_cache, meta, scale)


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, select=None):
    """Writes k, v to the cache and attends. select(qp, kp) -> bool [B, 1, 1, L]: the tokens each decode query
    reads (sparse attention; single-query steps only). A uint8 cache holds Q8_0 rows (lanner.kvcache.q8)."""
    quantized = k_cache.dtype == torch.uint8
    k_cache[meta.slot_mapping] = q8.quantize(k) if quantized else k
    v_cache[meta.slot_mapping] = q8.quantize(v) if quantized else v
    B, Qmax = meta.batch_size, meta.max_q_len
    H, D = q.shape[1], q.shape[2]
    if meta.q_dest is None:
        qp = q.view(B, Qmax, H, D)
    else:
        qp = q.new_zeros(B * Qmax, H, D)
        qp[meta.q_dest] = q
        qp = qp.view(B, Qmax, H, D)
    if meta.kv_range is not None:
        s, e = meta.kv_range
        kp, vp = k_cache[s:e].unsqueeze(0), v_cache[s:e].unsqueeze(0)
    else:
        kp, vp = k_cache[meta.kv_slots], v_cache[meta.kv_slots]
    if quantized:
        kp, vp = q8.dequantize(kp, q.dtype), q8.dequantize(vp, q.dtype)
    mask = meta.mask
    if select is not None and Qmax == 1:
        mask = select(qp, kp)
    Hkv = kp.shape[2]
    if qp.is_cuda and H != Hkv and not meta.is_causal:
        # fold each KV group's query heads into the query axis: one K/V head per SDPA head. CUDA's SDPA sends
        # enable_gqa (and boolean masks with it) to its math path, which cost 1.2 ms per call at batch 8 on an
        # H200 (51 ms per decode step, 3.5x batch 1); the fold keeps it on the fused kernels
        out = sdpa_grouped(qp, kp, vp, mask, scale)
    else:
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
            attn_mask=mask, is_causal=meta.is_causal, scale=scale, enable_gqa=True,
        )  # [B, H, Qmax, D]
        out = out.transpose(1, 2).reshape(B * Qmax, H * D)
    return out if meta.q_dest is None else out[meta.q_dest]


def sdpa_grouped(qp, kp, vp, mask, scale):
    """GQA attention without enable_gqa: qp [B, Q, H, D], kp/vp [B, L, Hkv, D], mask [B, 1, Q, L] or None ->
    [B * Q, H * D]. The g = H / Hkv query heads of a KV head become g * Q query rows of one SDPA head."""
    B, Q, H, D = qp.shape
    Hkv = kp.shape[2]
    g = H // Hkv
    qg = qp.reshape(B, Q, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * Q, D)
    out = F.scaled_dot_product_attention(
        qg, kp.transpose(1, 2), vp.transpose(1, 2), scale=scale,
        attn_mask=None if mask is None else mask.repeat(1, 1, g, 1),  # rows are (group head, query)
    )  # [B, Hkv, g * Q, D]
    return out.view(B, Hkv, g, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H * D)


def build_attention_metadata(q_lens, ctx_lens, block_tables, block_size, device) -> AttentionMetadata:
    """q_lens/ctx_lens: per-sequence ints; block_tables: per-sequence lists of block ids. slot_mapping, kv_slots and
    mask are built on their first read (_Lazy)."""
    B = len(q_lens)
    Qmax, Lmax = max(q_lens), max(ctx_lens)

    def slot_mapping():
        slots = []
        for ql, cl, bt in zip(q_lens, ctx_lens, block_tables):
            for p in range(cl - ql, cl):
                slots.append(bt[p // block_size] * block_size + p % block_size)
        return torch.tensor(slots, dtype=torch.long, device=device)

    q_dest = None
    if any(ql != Qmax for ql in q_lens):
        q_dest = torch.tensor([b * Qmax + i for b, ql in enumerate(q_lens) for i in range(ql)], device=device)
    kv_range = None
    if B == 1:
        bt = block_tables[0]
        nb = (ctx_lens[0] + block_size - 1) // block_size
        if all(bt[i] == bt[0] + i for i in range(nb)):
            kv_range = (bt[0] * block_size, bt[0] * block_size + ctx_lens[0])

    def kv_slots():
        nb = (Lmax + block_size - 1) // block_size
        table = torch.tensor([bt[:nb] + [0] * (nb - len(bt[:nb])) for bt in block_tables], dtype=torch.long)
        offs = torch.arange(Lmax)
        return (table[:, offs // block_size] * block_size + offs % block_size).to(device)

    is_causal = B == 1 and ctx_lens[0] == q_lens[0] and Qmax > 1

    def mask():
        ctx = torch.tensor(ctx_lens)
        ql = torch.tensor(q_lens)
        i = torch.arange(Qmax)
        qpos = (ctx - ql)[:, None] + i[None, :]  # [B, Qmax] absolute position of each query row
        j = torch.arange(Lmax)
        m = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < ctx[:, None, None])
        m[:, :, 0] |= i[None, :] >= ql[:, None]  # padded query rows attend to slot 0: avoids NaN rows
        return m[:, None].to(device)

    masked = not is_causal and not (Qmax == 1 and all(c == Lmax for c in ctx_lens))
    return AttentionMetadata(_Lazy(slot_mapping), B, Qmax, None if kv_range is not None else _Lazy(kv_slots), kv_range,
                             _Lazy(mask) if masked else None, is_causal, q_dest, list(q_lens), list(ctx_lens),
                             block_tables, block_size)


def group_metadata(meta: AttentionMetadata, tables: list[list[int]], window: int | None) -> AttentionMetadata:
    """The same step over a layer group's own block tables (a grouped KV layout), for full (window None) or
    sliding-window layers. Blocks let go (-1) lie before every query's window: never written or read."""
    tables = [[max(b, 0) for b in bt] for bt in tables]
    own = replace(build_attention_metadata(meta.q_lens, meta.ctx_lens, tables, meta.block_size,
                                           meta.slot_mapping.device), mask=meta.mask, tree=meta.tree)
    return own if window is None else window_metadata(own, window)


def window_metadata(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The same step for a sliding-window layer: query position p reads keys p - window < j <= p (transformers'
    and llama.cpp's rule), and only those slots are gathered, so a local layer's read stays window-sized however
    long the context. Returns `meta` itself when no query's window cuts anything off."""
    if meta.ctx_lens is None:
        raise ValueError("sliding-window attention needs the step's layout (q_lens, ctx_lens, block_tables)")
    if max(meta.ctx_lens) <= window:
        return meta
    bs, dev = meta.block_size, meta.slot_mapping.device
    ctx, ql = torch.tensor(meta.ctx_lens), torch.tensor(meta.q_lens)
    lo = (ctx - ql - window + 1).clamp(min=0)  # [B] first position any of the sequence's queries can see
    lens = ctx - lo
    Lw, Qmax = int(lens.max()), meta.max_q_len
    j = torch.arange(Lw)
    kpos = torch.minimum(lo[:, None] + j[None, :], ctx[:, None] - 1)  # [B, Lw]; padding repeats a real slot
    nb = max(len(bt) for bt in meta.block_tables)
    table = torch.tensor([bt + [0] * (nb - len(bt)) for bt in meta.block_tables], dtype=torch.long)
    kv_slots = table.gather(1, kpos // bs) * bs + kpos % bs
    i = torch.arange(Qmax)
    qpos = (ctx - ql)[:, None] + i[None, :]  # [B, Qmax] each row's position
    trees = [(b, rows) for b, rows in enumerate(meta.tree or []) if rows]
    for b, rows in trees:  # a tree row sits at its depth past the step's first slot
        qpos[b, : len(rows)] = int(ctx[b] - ql[b]) + torch.tensor([bin(r).count("1") - 1 for r in rows])
    kp, qp = kpos[:, None, :], qpos[:, :, None]
    mask = (kp <= qp) & (kp > qp - window) & (j[None, None, :] < lens[:, None, None])
    for b, rows in trees:  # of the step's own slots, a tree row reads its ancestors and itself (trees are shallow)
        n, at = len(rows), int(ctx[b] - ql[b] - lo[b])
        mask[b, :n, at : at + n] = torch.tensor([[r >> c & 1 for c in range(n)] for r in rows], dtype=torch.bool)
    mask[:, :, 0] |= i[None, :] >= ql[:, None]  # padded query rows attend to slot 0: avoids NaN rows
    return replace(meta, kv_slots=kv_slots.to(dev), kv_range=None, mask=mask[:, None].to(dev), is_causal=False,
                   backend=None)
