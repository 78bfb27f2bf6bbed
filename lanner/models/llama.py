"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM) over the paged KV cache.

Q/K/V and gate/up projections are fused into one matmul each: at batch 1 a step is a chain of
small GEMVs, so fewer, larger calls are what makes decode fast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lanner.layers.attention import AttentionMetadata, paged_attention
from lanner.layers.rotary import RotaryEmbedding, apply_rotary
from lanner.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalize in float32, scale in the model dtype: the same rounding as transformers
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        T, H, Hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, H + 2 * Hkv, self.head_dim)
        qk, v = qkv[:, : H + Hkv], qkv[:, H + Hkv :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
        qk = apply_rotary(qk, cos, sin)  # q and k heads in one pass: fewer small ops per layer
        q, k = qk[:, :H], qk[:, H:]
        return self.o_proj(paged_attention(q, k, v, k_cache, v_cache, meta, self.scale))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    # checkpoint name -> (fused parameter, shard index); shards are stacked in this order
    FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, freq_factors: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.freq_factors = freq_factors

    def init_rotary(self, device):
        """Called after weights are materialized (the module may be built on the meta device)."""
        cfg = self.cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, self.freq_factors).to(device)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, capture_layers=()):
        """Returns final hidden states [T, hidden] (pre-norm applied) and captured layer outputs."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions, x.dtype)
        captured = {}
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_caches[i]
            x = layer(x, cos, sin, k_cache, v_cache, meta)
            if i in capture_layers:
                captured[i] = x
        return self.norm(x), [captured[i] for i in capture_layers]

    def compute_logits(self, hidden):
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    @torch.no_grad()
    def load_weights(self, weights):
        """weights: iterable of (HF checkpoint name, tensor)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            parts = name.split(".")
            fused = self.FUSED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is not None:
                parts[-2] = fused[0]
                target = params[".".join(parts)]
                sizes = self._shard_sizes(fused[0])
                start = sum(sizes[: fused[1]])
                target[start : start + sizes[fused[1]]].copy_(tensor)
                loaded.add((".".join(parts), fused[1]))
            else:
                if name not in params:
                    raise KeyError(f"unexpected weight {name!r} in checkpoint")
                params[name].copy_(tensor)
                loaded.add((name, 0))
        expected = set()
        for pname in params:
            base = pname.split(".")[-2]
            n = len(self._shard_sizes(base)) if base in ("qkv_proj", "gate_up_proj") else 1
            expected |= {(pname, i) for i in range(n)}
        missing = sorted({p for p, _ in expected - loaded})
        if missing:
            raise KeyError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _shard_sizes(self, fused_name):
        cfg = self.cfg
        if fused_name == "qkv_proj":
            return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        return [cfg.intermediate_size, cfg.intermediate_size]
