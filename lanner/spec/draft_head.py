"""EAGLE-3-style draft head.

Input at draft position p: the target's hidden states at p from three layers (low, middle, high), fused by a
linear layer, next to the embedding of token p+1; one decoder layer (its own norms, attention over its own KV
cache, MLP); a final norm and an output head over a reduced draft vocabulary (the N most frequent target
tokens; `d2t` maps draft ids to target ids). The row at p predicts token p+2. Chaining feeds the head's own
output hidden state back in place of the target features, exactly as training-time test does.

`num_layers` > 1 adds plain pre-norm decoder layers after the first (each with its own attention and MLP): an
option that `lanner train-curve` compares against one layer on the learning curve. Serving runs one-layer heads.

Checkpoint: a folder with config.json (`"architectures": ["LannerDraftHead"]`) and model.safetensors. The
token embedding is the target's (frozen, not stored).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
from torch import nn

from lanner.layers.attention import AttentionMetadata, paged_attention
from lanner.layers.rotary import RotaryEmbedding, apply_rotary
from lanner.models.config import ModelConfig
from lanner.models.llama import MLP, RMSNorm
from lanner.spec.drafts import HEAD_ARCH as ARCH



@dataclass
class DraftHeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_vocab_size: int
    draft_vocab_size: int
    feature_layers: list[int]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    rope_scaling: dict | None = None  # the target's (llama3 / yarn / ...): the head's positions are the target's
    num_layers: int = 1  # decoder layers; serving (the proposer, lowlat's fused draft step) runs one

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int | None = None) -> DraftHeadConfig:
        L = target.num_layers
        return cls(hidden_size=target.hidden_size, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                   head_dim=target.head_dim, intermediate_size=target.intermediate_size,
                   target_vocab_size=target.vocab_size,
                   draft_vocab_size=min(draft_vocab_size or 8192, target.vocab_size),
                   feature_layers=[min(2, L - 1), L // 2, max(L - 3, 0)], rms_norm_eps=target.rms_norm_eps,
                   rope_theta=target.rope_theta, max_position_embeddings=target.max_position_embeddings,
                   rope_scaling=target.rope_scaling)

    def as_model_config(self) -> ModelConfig:
        """The geometry the paged KV pool needs (one layer)."""
        return ModelConfig(architecture=ARCH, vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)


def _split_rope(qkv: torch.Tensor, H: int, Hkv: int, cos, sin):
    qk = apply_rotary(qkv[:, : H + Hkv], cos, sin)
    return qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]


class HeadLayer(nn.Module):
    """A decoder layer after the first (num_layers > 1): pre-norm attention and MLP on the running hidden."""

    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        h, self.H, self.Hkv, self.D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, (self.H + 2 * self.Hkv) * self.D, bias=False)
        self.o_proj = nn.Linear(self.H * self.D, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.as_model_config())

    def qkv(self, x, cos, sin):
        qkv = self.qkv_proj(self.input_layernorm(x)).view(x.shape[0], self.H + 2 * self.Hkv, self.D)
        return _split_rope(qkv, self.H, self.Hkv, cos, sin)

    def post(self, x, attn):
        out = x + self.o_proj(attn)
        return out + self.mlp(self.post_attention_layernorm(out))


class DraftHead(nn.Module):
    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        self.cfg = cfg
        h, H, Hkv, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.H, self.Hkv, self.D = H, Hkv, D
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)  # on the fused target features
        self.qkv_proj = nn.Linear(2 * h, (H + 2 * Hkv) * D, bias=False)
        self.o_proj = nn.Linear(H * D, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.as_model_config())
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.layers = nn.ModuleList(HeadLayer(cfg) for _ in range(cfg.num_layers - 1))  # empty: one layer
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size), persistent=True)
        self.scale = D ** -0.5
        self.init_rotary("cpu")

    @property
    def model_cfg(self) -> ModelConfig:
        return self.cfg.as_model_config()

    def init_rotary(self, device):
        c = self.cfg
        self.rotary = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling).to(device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[T, 3h] target features -> [T, h] (the head's input hidden)."""
        return self.fc(features)

    def qkv(self, hidden, token_emb, positions):
        """-> q [T, H, D], k and v [T, Hkv, D] with RoPE applied (shared by inference and training)."""
        T = hidden.shape[0]
        x = torch.cat([self.input_layernorm(token_emb), self.hidden_norm(hidden)], dim=-1)
        qkv = self.qkv_proj(x).view(T, self.H + 2 * self.Hkv, self.D)
        return _split_rope(qkv, self.H, self.Hkv, *self.rotary.lookup(positions, hidden.dtype))

    def first_layer_out(self, hidden, attn):
        """attn: [T, H * D] -> the first decoder layer's output hidden [T, h]."""
        out = hidden + self.o_proj(attn)
        return out + self.mlp(self.post_attention_layernorm(out))

    def logits(self, out):
        """The last layer's output hidden -> draft-vocabulary logits."""
        return self.lm_head(self.norm(out))

    def post(self, hidden, attn):
        """attn: [T, H * D] -> (draft-vocabulary logits [T, N], output hidden [T, h]); one-layer heads."""
        out = self.first_layer_out(hidden, attn)
        return self.logits(out), out

    def forward(self, hidden, token_emb, positions, k_cache, v_cache, meta: AttentionMetadata):
        """hidden: [T, h] fused target features or the head's own previous output; token_emb: [T, h].
        Returns (logits over the draft vocabulary [T, N], output hidden [T, h])."""
        q, k, v = self.qkv(hidden, token_emb, positions)
        return self.post(hidden, paged_attention(q, k, v, k_cache, v_cache, meta, self.scale))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.d2t[draft_ids]

    # ------------------------------------------------------------------ checkpoint
    def save(self, folder: str):
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"architectures": [ARCH], **asdict(self.cfg)}, f, indent=2)
        # bfloat16 on disk: half the size, and what the head is served in by default
        state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).detach().contiguous().cpu()
                 for k, v in self.state_dict().items()}
        save_file(state, os.path.join(folder, "model.safetensors"))

    @classmethod
    def load(cls, folder: str, dtype=torch.float32, device="cpu") -> DraftHead:
        from safetensors.torch import load_file

        cfg = json.load(open(os.path.join(folder, "config.json")))
        cfg.pop("architectures", None)
        head = cls(DraftHeadConfig(**cfg))
        head.load_state_dict({k: v.float() if v.is_floating_point() else v
                              for k, v in load_file(os.path.join(folder, "model.safetensors")).items()})
        head = head.to(device=device, dtype=dtype)
        head.d2t = head.d2t.long()
        head.init_rotary(device)
        return head.eval().requires_grad_(False)


def random_draft_head(target_cfg: ModelConfig, draft_vocab_size: int = 8192, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig.for_target(target_cfg, draft_vocab_size))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
    return head
