"""Gemma 3 text decoder (HF `Gemma3ForCausalLM` / `gemma3_text`, GGUF arch `gemma3`) over the paged KV cache.

Differences from the Llama family it builds on: RMSNorm scales by (1 + weight) in float32; each block has
pre- and post-norms around attention and the feed-forward; q/k norms; GeGLU with tanh GELU; the embedding is
scaled by sqrt(hidden); attention is scaled by query_pre_attn_scalar ** -0.5; local layers attend over a
sliding window with their own RoPE base (10k), global layers over everything (1M base, optional scaling);
optional final logit softcapping; tied embeddings.

KV: `layer_windows()` asks for a grouped layout (lanner.kvcache.layout): under the engine's paged cache the local
layers' blocks are let go as the window slides, so they keep about `sliding_window` tokens each; under a flat
layout (one table, as tests and draft models use) every layer keeps the whole context and local layers only read
the window.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lanner.distributed.layers import VocabParallelEmbedding
from lanner.layers.attention import AttentionMetadata, group_metadata, window_metadata
from lanner.layers.rotary import RotaryFrequencies
from lanner.models.config import ModelConfig
from lanner.models.llama import MLP, Attention, LlamaModel

SLIDING, FULL = "sliding_attention", "full_attention"
LOCAL_ROPE_THETA = 10_000.0  # Gemma 3's local base when a config does not say (HF default; llama.cpp hard-codes it)
SLIDING_WINDOW_PATTERN = 6  # every 6th layer is global when a config has no layer_types


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, then cast: transformers' Gemma3RMSNorm rounding."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        out = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)


class GemmaAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.hf["query_pre_attn_scalar"] ** -0.5


class GemmaMLP(MLP):
    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, index: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_type = layer_type
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(cfg, index)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def layer_types(cfg: ModelConfig) -> list[str]:
    types = cfg.hf.get("layer_types") or [
        SLIDING if (i + 1) % cfg.hf.get("sliding_window_pattern", SLIDING_WINDOW_PATTERN) else FULL
        for i in range(cfg.num_layers)]
    if len(types) != cfg.num_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"gemma3: layer_types must list {cfg.num_layers} of {SLIDING!r} / {FULL!r}, got {types}")
    return list(types)


def rope_params(cfg: ModelConfig) -> dict[str, tuple[float, dict | None]]:
    """Layer type -> (theta, scaling) from either config form: transformers >= 5's per-type `rope_parameters`, or
    the hub's `rope_theta` + `rope_local_base_freq` + `rope_scaling` (global layers only)."""
    hf = cfg.hf
    per_type = hf.get("rope_parameters") or {}
    if FULL in per_type:
        out = {}
        for t in (SLIDING, FULL):
            p = dict(per_type.get(t) or {})
            theta = p.pop("rope_theta", LOCAL_ROPE_THETA if t == SLIDING else cfg.rope_theta)
            out[t] = (theta, p if (p.get("rope_type") or p.get("type") or "default") != "default" else None)
        return out
    scaling = hf.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type") or "default") == "default":
        scaling = None
    return {SLIDING: (hf.get("rope_local_base_freq", LOCAL_ROPE_THETA), None),
            FULL: (hf.get("rope_theta", cfg.rope_theta), scaling)}


def gguf_fields(g, cfg: ModelConfig) -> dict:
    """The HF-named Gemma 3 fields this model reads, from GGUF metadata (g: key under `gemma3.` -> value). The
    window pattern, local RoPE base and attention scale are not stored: llama.cpp fixes them by model size."""
    heads = cfg.num_heads
    # llama.cpp: 27B (62 layers) scales by hidden / heads, every other size by head_dim
    scalar = cfg.hidden_size // heads if cfg.num_layers == 62 else cfg.head_dim
    return {"layer_types": None, "sliding_window_pattern": SLIDING_WINDOW_PATTERN, "sliding_window": cfg.sliding_window,
            "query_pre_attn_scalar": scalar, "rope_local_base_freq": LOCAL_ROPE_THETA, "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling, "final_logit_softcapping": g("final_logit_softcapping"),
            "attn_logit_softcapping": g("attn_logit_softcapping")}


class Gemma3Model(LlamaModel):
    def __init__(self, cfg: ModelConfig, freq_factors: torch.Tensor | None = None):
        nn.Module.__init__(self)
        hf = cfg.hf
        if hf.get("attn_logit_softcapping"):
            raise ValueError("gemma3: attn_logit_softcapping (Gemma 2 style) is not supported")
        if hf.get("use_bidirectional_attention"):
            raise ValueError("gemma3: use_bidirectional_attention (embedding models) is not supported")
        if freq_factors is not None:
            raise ValueError("gemma3: GGUF rope_freqs are not supported")
        if not cfg.tie_word_embeddings:
            raise ValueError("gemma3: only tied embeddings are supported (the LM head is the embedding)")
        self.cfg = cfg
        self.freq_factors = None
        self.window = cfg.sliding_window
        types = layer_types(cfg)
        if SLIDING in types and not self.window:
            raise ValueError("gemma3: sliding_attention layers need a sliding_window")
        # a plain embedding, scaled in forward: GGUF blocks kept as stored replace the module (QuantEmbedding)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, t, i) for i, t in enumerate(types))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None
        self.softcap = hf.get("final_logit_softcapping")

    def init_rotary(self, device):
        ropes = rope_params(self.cfg)
        self.rotary = nn.ModuleDict({t: RotaryFrequencies(self.cfg.head_dim, *ropes[t]) for t in (SLIDING, FULL)})
        self.rotary.to(device)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, capture_layers=()):
        x = self.embed_tokens(input_ids)
        x = x * self.embed_scale(x.dtype)
        rope = {t: r.lookup(positions, x.dtype) for t, r in self.rotary.items()}
        if meta.group_tables is None:
            window = window_metadata(meta, self.window) if self.window else None
            metas = [meta if layer.layer_type == FULL else window for layer in self.layers]
        else:
            windows = {g: w for g, w in zip(meta.layer_group, self.layer_windows())}
            groups = [meta] + [group_metadata(meta, tables, windows[g]) for g, tables in enumerate(meta.group_tables, 1)]
            metas = [groups[g] for g in meta.layer_group]
        captured = {}
        for i, layer in enumerate(self.layers):
            cos, sin = rope[layer.layer_type]
            x = layer(x, cos, sin, *kv_caches[i], metas[i])
            if i in capture_layers:
                captured[i] = x
        return self.norm(x), [captured[i] for i in capture_layers]

    def layer_windows(self) -> list[int | None]:
        """Per layer: the window of a sliding-window layer, None for a global one (lanner.kvcache.layout)."""
        return [self.window if layer.layer_type == SLIDING else None for layer in self.layers]

    def embed_scale(self, dtype) -> torch.Tensor:
        """sqrt(hidden) rounded to the model dtype first (as transformers scales the embedding); the tied LM head
        is the unscaled embedding."""
        return torch.tensor(self.cfg.hidden_size ** 0.5, dtype=dtype)

    def compute_logits(self, hidden):
        logits = super().compute_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
