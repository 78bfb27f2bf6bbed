"""The q8 KV cache (`kv_cache_dtype="q8"`): every (token, KV head) row of head_dim values is stored as Q8_0
blocks, each an fp16 scale followed by 32 int8 values (34 bytes for 32 values: 53% of bf16's bytes, 27% of
float32's). A block's scale is amax / 127 and a value is round(x / scale) (ties to even), as llama.cpp's q8_0 KV
cache does. lowlat's kernel (csrc/attention.h) writes and reads the same layout; this module is PyTorch's side
(lanner.layers.attention.paged_attention) and the cache's shapes.

A dequantized value q * scale is exact in float32 (an 8-bit times an 11-bit significand), so both paths read the
same values; lowlat attends over them in float32, PyTorch's SDPA in the model dtype."""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "q8")
BLOCK = 32  # values per Q8_0 block
BLOCK_BYTES = 2 + BLOCK  # fp16 scale, then the int8 values


def row_bytes(head_dim: int) -> int:
    """Bytes of one (token, KV head) row."""
    if head_dim % BLOCK:
        raise ValueError(f"kv_cache_dtype='q8': head_dim {head_dim} is not a multiple of {BLOCK}")
    return head_dim // BLOCK * BLOCK_BYTES


def cache_shapes(shapes):
    """A model's per-layer KV shapes ((kv_heads, head_dim), (kv_heads, head_dim)) as q8 shapes (uint8 rows);
    other caches (MLA's latent) get an error naming the cause."""
    out = []
    for layer in shapes:
        if len(layer) != 2 or any(len(s) != 2 for s in layer):
            raise ValueError("kv_cache_dtype='q8' needs a key and a value cache of [kv_heads, head_dim] per layer; "
                             f"this model's caches are {layer} (MLA latents are not quantized)")
        out.append(tuple((h, row_bytes(d)) for h, d in layer))
    return out


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D / 32 * 34] uint8 Q8_0 rows."""
    *lead, d = x.shape
    xb = x.float().reshape(*lead, d // BLOCK, BLOCK)
    scale = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(xb * inv).clamp_(-127, 127).to(torch.int8)
    blocks = torch.cat([scale.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], -1)
    return blocks.reshape(*lead, d // BLOCK * BLOCK_BYTES)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D / 32 * 34] uint8 Q8_0 rows -> [..., D] in `dtype`."""
    *lead, nbytes = rows.shape
    blocks = rows.reshape(*lead, nbytes // BLOCK_BYTES, BLOCK_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * scale).reshape(*lead, nbytes // BLOCK_BYTES * BLOCK).to(dtype)
