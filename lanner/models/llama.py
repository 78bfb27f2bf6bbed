"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM) over the paged KV cache.

Q/K/V and gate/up projections are fused into one matmul each: at batch 1 a step is a chain of
small GEMVs, so fewer, larger calls are what makes decode fast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lanner.distributed import shard_range, tp_size
from lanner.distributed.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_logits,
)
from lanner.layers.attention import AttentionMetadata, attention
from lanner.layers.rotary import RotaryEmbedding, apply_rotary
from lanner.models.config import ModelConfig
from lanner.models.moe import FusedMoE
from lanner.models.weights import load_checkpoint


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalize in float32, scale in the model dtype: the same rounding as transformers
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer = layer
        # under TP each rank takes whole KV groups (a KV head and the query heads that read it)
        D, Hkv, group = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
        if tp_size() > Hkv:
            raise ValueError(f"tp={tp_size()} exceeds the model's {Hkv} KV heads; use tp <= {Hkv}")
        s, e = shard_range(Hkv)
        self.num_kv_heads, self.num_heads, self.head_dim = e - s, (e - s) * group, D
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [(Hkv, group * D), (Hkv, D), (Hkv, D)],
                                             bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear([(Hkv, group * D)], cfg.hidden_size)
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
        return self.o_proj(attention(q, k, v, self.layer, k_cache, v_cache, meta, self.scale))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [(inter, 1), (inter, 1)])
        self.down_proj = RowParallelLinear([(inter, 1)], cfg.hidden_size)
        self.inter = self.down_proj.in_features  # this rank's share

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    """Whether layer i has a sparse MoE feed-forward, by each HF model's rule (Mixtral: all; Qwen3-MoE: every
    decoder_sparse_step-th layer not in mlp_only_layers)."""
    hf = cfg.hf
    if cfg.architecture == "MixtralForCausalLM":
        return True
    if cfg.architecture == "Qwen3MoeForCausalLM":
        return ((hf.get("num_experts") or hf.get("num_local_experts") or 0) > 0
                and i not in (hf.get("mlp_only_layers") or []) and (i + 1) % hf.get("decoder_sparse_step", 1) == 0)
    return False


class MoE(nn.Module):
    """Sparse feed-forward: a replicated router, softmax over all experts, top-k, then (Mixtral always, Qwen3-MoE
    with norm_topk_prob) the k weights renormalized to sum to 1; the experts are a FusedMoE."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf
        mixtral = cfg.architecture == "MixtralForCausalLM"
        num_experts = hf.get("num_experts") or hf["num_local_experts"]
        self.top_k = hf["num_experts_per_tok"]
        self.renormalize = mixtral or bool(hf.get("norm_topk_prob", False))
        self.gate = nn.Linear(cfg.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, cfg.hidden_size,
                                cfg.intermediate_size if mixtral else hf["moe_intermediate_size"])

    def forward(self, x):
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float)  # float32, as HF routes
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, ids, weights)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if is_moe_layer(cfg, index) else MLP(cfg)

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
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else ColumnParallelLinear(cfg.hidden_size, [(cfg.vocab_size, 1)])
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

    def kv_cache_shapes(self) -> list[tuple[tuple[int, ...], ...]]:
        """Per layer, the per-token shape of each cache tensor this rank keeps (here K and V of its KV heads)."""
        a = self.layers[0].self_attn
        return [((a.num_kv_heads, a.head_dim), (a.num_kv_heads, a.head_dim))] * len(self.layers)

    def compute_logits(self, hidden):
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if hasattr(head, "matmul"):  # GGUF blocks kept as stored (lanner.models.quant; single rank)
            return head.matmul(hidden)
        weight = head.weight
        return parallel_logits(hidden, weight, self.cfg.vocab_size)

    def checkpoint_name(self, name: str) -> tuple[str, int] | None:
        """HF checkpoint name -> (parameter name, piece of a fused parameter), or None to skip it."""
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None
        if ".experts." in name:  # MoE: layers.{i}.mlp.experts.{e}.{proj}.weight (Mixtral: block_sparse_moe, w1/w2/w3)
            layer, _, rest = name.replace(".block_sparse_moe.", ".mlp.").partition(".experts.")
            expert, proj, _ = rest.split(".")
            leaf, piece = FusedMoE.checkpoint_piece(int(expert), proj)
            return f"{layer}.experts.{leaf}", piece
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # Mixtral's router
        parts = name.split(".")
        fused = self.FUSED.get(parts[-2]) if len(parts) >= 2 else None
        if fused is None:
            return name, 0
        parts[-2] = fused[0]
        return ".".join(parts), fused[1]

    def load_weights(self, weights):
        """weights: iterable of (HF checkpoint name, tensor)."""
        load_checkpoint(self, weights)
