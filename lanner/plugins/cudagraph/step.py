"""The capturable step: one Llama-family forward (embedding, layers, norm, LM head, greedy argmax) whose every tensor
has a shape fixed by its bucket and whose every index is computed on the device, so it compiles whole
(torch.compile fullgraph=True) and replays as a CUDA graph.

A bucket is (Bp sequences, Qp rows each, NB blocks each). The step's sequences fill the first rows of `src` /
`start` / `qlen` / `tables`; the rest are padding: a padded row attends to key 0 only and writes back the value its
slot already holds, so it changes nothing. Keys are gathered through the block table up to NB * block_size
positions and masked by each sequence's length: shape-static paged attention."""
from __future__ import annotations

import torch

from lanner.kvcache import q8
from lanner.layers.attention import AttentionBackend, AttentionMetadata, paged_attention


class PaddedWrite(AttentionBackend):
    """The engine's paged attention, but padded rows write back their slot's own value (old K/V), so they need no
    slot of their own and never corrupt the cache. Padded rows' slots are the position-0 slot of their sequence's
    first block, which no decode or verify row writes (those start at position >= 1)."""

    def __init__(self, pad: torch.Tensor):
        self.pad = pad  # [rows] bool

    def forward(self, q, k, v, layer, k_cache, v_cache, meta, scale):
        keep = self.pad[:, None, None]
        k_old, v_old = k_cache[meta.slot_mapping], v_cache[meta.slot_mapping]
        if k_cache.dtype == torch.uint8:  # q8 rows: written back unchanged (requantizing Q8_0 values is exact)
            k_old, v_old = q8.dequantize(k_old, k.dtype), q8.dequantize(v_old, v.dtype)
        k = torch.where(keep, k_old, k)
        v = torch.where(keep, v_old, v)
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale)


def static_step(model, raw_ids, start, qlen, src, out_rows, tables, kv_caches, block_size: int, capture_layers=()):
    """One forward over a padded bucket, all on the device.

    raw_ids [R]: the step's token ids in the engine's row order (rows past the step's are stale, never read as real
    rows); start / qlen [Bp]: each sequence's first new position and row count (padding: 0 / 0); src [Bp, Qp]: which
    raw row fills each padded row (padding: any); out_rows [Bp * Qp]: the padded row of each raw row (the first T are
    the step's, in its order); tables [Bp, NB]: block tables (padding: the first block of sequence 0).
    Returns (hidden, captured layers, logits, argmax), rows in raw order, Bp * Qp of them."""
    Bp, Qp = src.shape
    NB = tables.shape[1]
    dev = src.device
    i = torch.arange(Qp, device=dev)
    real = i[None, :] < qlen[:, None]  # [Bp, Qp]
    pos = torch.where(real, start[:, None] + i[None, :], 0)
    # padded rows sit at position 0 of their sequence's first block: a slot that is never written in this step
    slot = tables.gather(1, pos // block_size) * block_size + pos % block_size
    j = torch.arange(NB * block_size, device=dev)
    kv_slots = tables[:, j // block_size] * block_size + j % block_size  # [Bp, L]
    ctx = (start + qlen)[:, None, None]
    # a padded row reads key 0 (its own slot): a row with no key would be NaN
    mask = ((j <= pos[:, :, None]) & (j < ctx)) | ((j == 0) & ~real[:, :, None])
    meta = AttentionMetadata(slot.reshape(-1), Bp, Qp, kv_slots, None, mask[:, None], False, None,
                             backend=PaddedWrite(~real.reshape(-1)))
    hidden, captured = model(raw_ids[src.reshape(-1)], pos.reshape(-1), kv_caches, meta, capture_layers)
    hidden = hidden[out_rows]
    logits = model.compute_logits(hidden)
    return hidden, [c[out_rows] for c in captured], logits, logits.argmax(-1)
