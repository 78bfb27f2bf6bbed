"""Rotary position embedding (HF rotate-half convention) with Llama-3 / linear scaling."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, freq_factors: torch.Tensor | None = None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:  # GGUF stores Llama-3 scaling pre-computed as per-frequency divisors
        return inv_freq / freq_factors.double()
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}; Lanner supports default, linear, llama3")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin table; `lookup` is done once per step and shared by all layers."""

    def __init__(self, head_dim, max_pos, theta, scaling=None, freq_factors=None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling, freq_factors)
        t = torch.arange(max_pos, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype):
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RotaryFrequencies(torch.nn.Module):
    """RotaryEmbedding's lookup without the table: cos/sin of this step's positions, computed in float64 like the
    table. For long-context models a [max_pos, head_dim] table per RoPE variant would take 100s of MB."""

    def __init__(self, head_dim, theta, scaling=None, freq_factors=None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling, freq_factors), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype):
        freqs = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos().float().to(dtype), emb.sin().float().to(dtype)
