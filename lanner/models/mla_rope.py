"""Rotary embedding of DeepSeek-style multi-head latent attention (DeepSeek-V3.2, GLM-5, their MTP layers): the
checkpoint's rope parameters (default or YaRN with mscale), the softmax scale that YaRN corrects, a cos/sin table,
and the interleaved and rotate-half layouts."""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(hf: dict) -> dict:
    """The HF rope dict as transformers standardizes it (old configs: `rope_scaling` + top-level `rope_theta`)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "original_max_position_embeddings" in hf:  # a top-level value wins, as in transformers
        rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return rope


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(hf: dict, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float64, factor on cos/sin): default RoPE or YaRN as transformers computes them."""
    rope = rope_parameters(hf)
    base, kind = rope["rope_theta"], rope["rope_type"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise ValueError(f"unsupported rope type {kind!r} for MLA; Lanner supports default and yarn")
    orig = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or hf["max_position_embeddings"] / orig
    attn_factor = rope.get("attention_factor")
    if attn_factor is None:
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attn_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                       else _yarn_mscale(factor))
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: the frequency is kept, 0: it is divided by the factor
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolate) + 1.0 / pos_freqs * extrapolate
    return inv_freq, float(attn_factor)


def softmax_scale(hf: dict) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)^2 when the config scales RoPE."""
    scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    rope = rope_parameters(hf)
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        scale *= _yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


class MlaRotary(nn.Module):
    """cos/sin of each position and frequency ([max_pos, dim / 2]); looked up once per step for all layers."""

    def __init__(self, hf: dict, dim: int, max_pos: int):
        super().__init__()
        inv_freq, attn_factor = rope_frequencies(hf, dim)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", (freqs.cos() * attn_factor).float(), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attn_factor).float(), persistent=False)

    def lookup(self, positions, dtype):
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def rope_interleaved(x, cos, sin):
    """DeepSeek's MLA layout: pairs (x0, x1), (x2, x3), ...; the result lists the rotated evens, then the odds
    (transformers' layout; q and k share it, so dot products are those of the interleaved rotation)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half(x, cos, sin):
    """rotate-half layout: pairs (x_i, x_{i + d/2})."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
