"""DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa) over the paged KV cache: multi-head latent attention
(MLA), DeepSeek sparse attention (DSA: a lightning indexer picks each query's top-k context tokens) and
DeepSeek MoE (sigmoid, group-limited routing with a correction bias, shared experts).

Cache, per token and layer: the normalized compressed KV (kv_lora_rank) and the roped shared key
(qk_rope_head_dim) as one latent entry, plus, on layers that run their own indexer, the indexer's key
(index_head_dim). GLM-5 "shared" layers keep no index keys and reuse the previous indexer layer's selection.

Attention reads the latent cache only through `gather_selected_latent`, for the tokens the indexer selected:
- absorbed (decode / verify): kv_b_proj's K part is folded into the query, scores and the weighted sum are taken
  in latent space against each query's own selected entries, and the V part is applied after;
- expanded (prefill): the union of the sequence's selected entries is expanded to per-head K/V once and each
  query attends to its own selection through a mask.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from lanner.distributed import all_reduce, shard_range, tp_size
from lanner.distributed.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_logits,
)
from lanner.layers.attention import AttentionMetadata
from lanner.models.config import ModelConfig
from lanner.models.dsa_step import DsaStep, LatentStore, ShardedIndexKeys, gather_selected_latent
from lanner.models.llama import RMSNorm
from lanner.models.mla_rope import MlaRotary, rope_half, rope_interleaved, softmax_scale
from lanner.models.moe import FusedMoE
from lanner.models.weights import load_checkpoint

log = logging.getLogger("lanner")

# steps with at most this many query rows per sequence take the absorbed path (decode, speculative verify)
ABSORB_MAX_Q = 16
# query rows per block of the absorbed path: bounds the gathered [rows, topk, latent] tensor
ABSORB_ROWS = 64
# elements of one block of indexer scores ([B, rows, index heads, context], float32): bounds long-context prefill
INDEX_SCORE_ELEMS = 2**27


# ---------------------------------------------------------------- attention

class Indexer(nn.Module):
    """DSA lightning indexer: scores every context token for every query with a few small ReLU heads and
    keeps the top `index_topk`. Replicated under TP: every rank computes the same selection (over UlaCache TP
    every rank scores only the positions whose keys it stores and the ranks merge their top-k: the same set)."""

    def __init__(self, hf: dict, interleaved: bool):
        super().__init__()
        self.n_heads, self.head_dim = hf["index_n_heads"], hf["index_head_dim"]
        self.rope_dim, self.topk = hf["qk_rope_head_dim"], hf["index_topk"]
        self.wq_b = nn.Linear(hf["q_lora_rank"], self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hf["hidden_size"], self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hf["hidden_size"], self.n_heads, bias=False)
        self.rope = rope_interleaved if interleaved else rope_half  # GLM-5: interleaved; DeepSeek-V3.2: half
        self.scale = self.head_dim ** -0.5

    def _rope(self, x, cos, sin):  # rope on the leading rope_dim features only
        r = self.rope_dim
        return torch.cat([self.rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, x, q_resid, cos, sin, key_cache, step: DsaStep) -> torch.Tensor:
        """Writes this step's index keys, returns the selected context positions [B, Qmax, K]."""
        T = x.shape[0]
        key_cache[step.meta.slot_mapping] = self._rope(self.k_norm(self.wk(x))[:, None], cos, sin)[:, 0]
        L = step.allowed.shape[-1]
        if L <= self.topk:  # the whole context fits: every token is selected (as transformers does)
            return step.select_all()
        q = step.pad(self._rope(self.wq_b(q_resid).view(T, self.n_heads, self.head_dim), cos, sin)).float()
        w = step.pad(self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5)
        if isinstance(key_cache, ShardedIndexKeys):  # each rank holds and scores its own positions' keys
            return key_cache.select_top(self, q, w, step)
        keys = key_cache[step.ctx_slots]  # [B, L, D]
        return self.top(q, w, keys, step.allowed, self.topk)[1]

    def top(self, q, w, keys, allowed, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Q, H, D], w [B, Q, H] (float32), keys [B, L, D], allowed [B, Q, L] -> the k best scores per query
        row and their columns of `keys`, [B, Q, k] each."""
        keys = keys.float().transpose(1, 2).unsqueeze(1)  # [B, 1, D, L]
        B, Q, L = q.shape[0], q.shape[1], keys.shape[-1]
        rows = max(1, INDEX_SCORE_ELEMS // (B * self.n_heads * L))
        vals, cols = [], []
        for s in range(0, Q, rows):
            scores = F.relu(torch.matmul(q[:, s : s + rows], keys) * self.scale)  # [B, rows, H, L]
            scores = torch.matmul(w[:, s : s + rows].unsqueeze(-2), scores).squeeze(-2)  # head-weighted sum
            scores = scores.masked_fill(~allowed[:, s : s + rows], float("-inf"))
            v, c = scores.topk(k, dim=-1)
            vals.append(v)
            cols.append(c)
        return torch.cat(vals, dim=1), torch.cat(cols, dim=1)


class MLAttention(nn.Module):
    def __init__(self, hf: dict, has_indexer: bool, interleaved_indexer: bool):
        super().__init__()
        H, hidden = hf["num_attention_heads"], hf["hidden_size"]
        if tp_size() > H:
            raise ValueError(f"tp={tp_size()} exceeds the model's {H} attention heads")
        if not hf.get("q_lora_rank"):  # transformers' DSA models always compress q: the indexer reads q_resid
            raise ValueError("deepseek sparse attention needs q_lora_rank (the indexer reads the compressed query)")
        s, e = shard_range(H)
        self.num_heads = e - s
        self.nope, self.rope_dim, self.v_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        self.rank = hf["kv_lora_rank"]
        bias = hf.get("attention_bias", False)
        self.q_a_proj = nn.Linear(hidden, hf["q_lora_rank"], bias=bias)
        self.q_a_layernorm = RMSNorm(hf["q_lora_rank"], 1e-6)
        self.q_b_proj = ColumnParallelLinear(hf["q_lora_rank"], [(H, self.nope + self.rope_dim)])
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = ColumnParallelLinear(self.rank, [(H, self.nope + self.v_dim)])
        self.o_proj = RowParallelLinear([(H, self.v_dim)], hidden, bias=bias)
        self.indexer = Indexer(hf, interleaved_indexer) if has_indexer else None
        self.scale = softmax_scale(hf)

    def forward(self, x, cos, sin, caches, step: DsaStep):
        T, H = x.shape[0], self.num_heads
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_rot = self.q_b_proj(q_resid).view(T, H, -1).split([self.nope, self.rope_dim], dim=-1)
        q_rot = rope_interleaved(q_rot, cos, sin)
        kv, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent_cache = caches[0]
        latent_cache[step.meta.slot_mapping] = torch.cat(
            [self.kv_a_layernorm(kv), rope_interleaved(k_rot[:, None], cos, sin)[:, 0]], dim=-1)
        if self.indexer is not None:
            step.selected = self.indexer(x, q_resid, cos, sin, caches[1], step)
        attend = self._absorbed if step.absorbed else self._expanded
        return self.o_proj(attend(q_nope, q_rot, latent_cache, step).reshape(T, H * self.v_dim))

    def _absorbed(self, q_nope, q_rot, latent_cache, step: DsaStep):
        """Latent-space attention: q_nope @ W_UK scores against the cached latent directly, and W_UV is applied to
        the latent-space result; per query only its selected tokens are gathered."""
        H, R = self.num_heads, self.rank
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, R)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rot], dim=-1)  # [T, H, R + rope]
        slots, valid = step.selected_slots()  # [T, K]
        if isinstance(latent_cache, LatentStore):  # it sees the whole step's selection before the reads
            latent_cache.plan_selected(slots, valid)
        out = []
        for s in range(0, q.shape[0], ABSORB_ROWS):
            e = s + ABSORB_ROWS
            lat = gather_selected_latent(latent_cache, slots[s:e])  # [t, K, R + rope]
            scores = torch.matmul(q[s:e], lat.transpose(1, 2)) * self.scale  # [t, H, K]
            scores = scores.masked_fill(~valid[s:e, None], float("-inf"))
            p = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
            out.append(torch.einsum("thr,hvr->thv", torch.matmul(p, lat[..., :R]), w_uv))
        return torch.cat(out)  # [T, H, v]

    def _expanded(self, q_nope, q_rot, latent_cache, step: DsaStep):
        """K/V expanded from the latent of the tokens any query of the sequence selected, once per sequence;
        each query is masked to its own selection."""
        H, R = self.num_heads, self.rank
        mask = step.selected_mask()  # [B, Q, L]
        B, Q, _ = mask.shape
        union = mask.any(1)  # [B, L]
        U = int(union.sum(1).max())
        cols = torch.argsort((~union).to(torch.int8), dim=1, stable=True)[:, :U]  # selected positions first
        lat = gather_selected_latent(latent_cache, step.ctx_slots.gather(1, cols))  # [B, U, R + rope]
        kv = self.kv_b_proj(lat[..., :R]).view(B, U, H, self.nope + self.v_dim)
        k = torch.cat([kv[..., : self.nope], lat[:, :, None, R:].expand(B, U, H, self.rope_dim)], dim=-1)
        q = step.pad(torch.cat([q_nope, q_rot], dim=-1))  # [B, Q, H, nope + rope]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), kv[..., self.nope :].transpose(1, 2),
            attn_mask=mask.gather(2, cols[:, None].expand(B, Q, U))[:, None], scale=self.scale)
        return step.unpad(out.transpose(1, 2))  # [T, H, v]


# ---------------------------------------------------------------- feed-forward

class MLP(nn.Module):
    """SwiGLU, gate|up column-parallel, down row-parallel."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [(inter, 1), (inter, 1)])
        self.down_proj = RowParallelLinear([(inter, 1)], hidden)
        self.inter = self.down_proj.in_features  # this rank's share

    def forward(self, x, reduce: bool = True):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        h = F.silu(gate) * up
        return self.down_proj(h) if reduce else F.linear(h, self.down_proj.weight)


class Router(nn.Module):
    """Sigmoid scores; the correction bias steers the choice only; experts come from the top `topk_group` groups
    (a group scores the sum of its 2 best experts); chosen scores are renormalized and scaled."""

    def __init__(self, hf: dict):
        super().__init__()
        E = hf["n_routed_experts"]
        self.weight = nn.Parameter(torch.empty(E, hf["hidden_size"]))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E))
        self.top_k, self.n_group, self.topk_group = hf["num_experts_per_tok"], hf["n_group"], hf["topk_group"]
        self.norm_topk_prob, self.scaling = hf["norm_topk_prob"], hf["routed_scaling_factor"]

    def _apply(self, fn, recurse=True):
        # transformers keeps the router in float32 (expert choice would flip on bf16 rounding): model casts skip it
        super()._apply(fn, recurse)
        return super()._apply(lambda t: t.float(), recurse)

    def forward(self, x):
        T, E = x.shape[0], self.weight.shape[0]
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.topk_group < self.n_group:
            groups = choice.view(T, self.n_group, -1).topk(2, dim=-1)[0].sum(-1)  # [T, n_group]
            keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(
                1, groups.topk(self.topk_group, dim=-1, sorted=False)[1], True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class MoE(nn.Module):
    def __init__(self, hf: dict):
        super().__init__()
        self.gate = Router(hf)
        self.experts = FusedMoE(hf["n_routed_experts"], hf["hidden_size"], hf["moe_intermediate_size"])
        shared = hf.get("n_shared_experts") or 0
        self.shared_experts = MLP(hf["hidden_size"], hf["moe_intermediate_size"] * shared) if shared else None

    def forward(self, x):
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights, reduce=False)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, reduce=False)
        return all_reduce(out)  # one all-reduce for routed and shared experts


# ---------------------------------------------------------------- model

def layer_types(hf: dict) -> tuple[list[bool], list[bool]]:
    """Per layer: (MoE feed-forward?, runs its own indexer?), from the config fields transformers reads."""
    n = hf["num_hidden_layers"]
    mlp = hf.get("mlp_layer_types")
    if mlp is not None:
        moe = [t == "sparse" for t in mlp]
    else:  # the original DeepSeek rule (transformers assumes moe_layer_freq 1, what every checkpoint has)
        k, freq = hf.get("first_k_dense_replace", 3), hf.get("moe_layer_freq") or 1
        moe = [i >= k and i % freq == 0 for i in range(n)]
    kinds = hf.get("indexer_types")
    if kinds is None:  # GLM-5: a pattern ("FSS..."), else every index_topk_freq-th layer from the offset on
        pattern = hf.get("index_topk_pattern")
        if pattern is not None:
            kinds = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    own = [t == "full" for t in kinds]
    if not own[0]:
        raise ValueError("indexer_types: the first layer must run its own indexer ('full')")
    return moe, own


class DecoderLayer(nn.Module):
    def __init__(self, hf: dict, moe: bool, has_indexer: bool, interleaved_indexer: bool):
        super().__init__()
        eps = hf.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.self_attn = MLAttention(hf, has_indexer, interleaved_indexer)
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.mlp = MoE(hf) if moe else MLP(hf["hidden_size"], hf["intermediate_size"])

    def forward(self, x, cos, sin, caches, step):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, caches, step)
        return x + self.mlp(self.post_attention_layernorm(x))


def fused_param(name: str) -> tuple[str, int]:
    """A decoder layer's checkpoint name -> (parameter name, piece): routed experts and gate/up projections go into
    fused parameters."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[-4] == "experts":  # ....mlp.experts.e.proj.weight
        leaf, piece = FusedMoE.checkpoint_piece(int(parts[-3]), parts[-2])
        return ".".join(parts[:-3] + [leaf]), piece
    if len(parts) >= 2 and parts[-2] in ("gate_proj", "up_proj"):  # dense MLP and shared experts
        return ".".join(parts[:-2] + ["gate_up_proj", parts[-1]]), int(parts[-2] == "up_proj")
    return name, 0


class MtpLayer(DecoderLayer):
    """DeepSeek-V3's multi-token prediction module, checkpoint layer `num_hidden_layers` (GLM-4.5+ / GLM-5 use the
    same layout). At position p: eh_proj(concat[enorm(embedding of token p+1), hnorm(h_p)]), with h_p the target's
    last hidden state before the final norm, then one decoder layer of the model's own type over its own cache;
    shared_head (norm, head) gives the logits of token p+2. Chained steps feed its output hidden state back as h."""

    def __init__(self, hf: dict, prefix: str, moe: bool, has_indexer: bool, interleaved: bool, own_embed: bool,
                 own_head: bool):
        super().__init__(hf, moe, has_indexer, interleaved)
        h, eps, vocab = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6), hf["vocab_size"]
        self.prefix = prefix  # checkpoint names of this layer start with it ("layers.N.", "model." removed)
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps)
        # checkpoints may omit these where they are the main model's: the caller then uses the main model's
        self.shared_head.head = nn.Linear(h, vocab, bias=False) if own_head else None
        self.embed_tokens = nn.Embedding(vocab, h) if own_embed else None

    def forward(self, hidden, token_emb, positions, caches, meta: AttentionMetadata, rotary: MlaRotary,
                absorbed: bool):
        """hidden: [T, h] target hidden states (or this module's previous output); token_emb: [T, h] embeddings of
        the next tokens. Returns the output hidden state [T, h] (before shared_head.norm)."""
        x = self.eh_proj(torch.cat([self.enorm(token_emb), self.hnorm(hidden)], dim=-1))
        cos, sin = rotary.lookup(positions, x.dtype)
        step = DsaStep.build(meta, absorbed)
        if self.self_attn.indexer is None:  # no indexer of its own and no earlier layer to share one with: dense
            step.selected = step.select_all()
        return super().forward(x, cos, sin, caches, step)

    def kv_cache_shapes(self) -> list[tuple[tuple[int, ...], ...]]:
        a = self.self_attn
        latent = (a.rank + a.rope_dim,)
        return [(latent, (a.indexer.head_dim,)) if a.indexer is not None else (latent,)]

    def checkpoint_name(self, name: str) -> tuple[str, int] | None:
        name = name.removeprefix("model.")
        return fused_param(name.removeprefix(self.prefix)) if name.startswith(self.prefix) else None


class DeepseekModel(nn.Module):
    kv_replicated_across_tp = True  # the latent and index-key caches are whole on every rank
    # "auto": absorbed for decode/verify-sized steps and long contexts, expanded for prefill; tests force each
    attn_path = "auto"

    def __init__(self, cfg: ModelConfig, freq_factors: torch.Tensor | None = None):
        super().__init__()
        self.cfg, hf = cfg, cfg.hf
        self.hf = hf
        moe, own = layer_types(hf)
        interleaved = cfg.architecture == "GlmMoeDsaForCausalLM" or hf.get("model_type") == "glm_moe_dsa"
        self.interleaved_indexer = interleaved
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(hf, moe[i], own[i], interleaved) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, hf.get("rms_norm_eps", 1e-6))
        self.lm_head = None if cfg.tie_word_embeddings else ColumnParallelLinear(cfg.hidden_size, [(cfg.vocab_size, 1)])
        self.skipped_mtp = 0

    def init_rotary(self, device):
        """Called after weights are materialized (the module may be built on the meta device)."""
        self.rotary = MlaRotary(self.hf, self.hf["qk_rope_head_dim"], self.cfg.max_position_embeddings).to(device)

    def _absorbed(self, meta: AttentionMetadata) -> bool:
        if self.attn_path != "auto":
            return self.attn_path == "absorbed"
        # few queries, or a context so much longer than the selection that expanding it would cost more
        return meta.max_q_len <= ABSORB_MAX_Q or max(meta.ctx_lens) > 2 * self.hf["index_topk"]

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, capture_layers=()):
        """Returns final hidden states [T, hidden] (final norm applied) and captured layer outputs."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions, x.dtype)
        step = DsaStep.build(meta, self._absorbed(meta))
        captured = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_caches[i], step)
            if i in capture_layers:
                captured[i] = x
        return self.norm(x), [captured[i] for i in capture_layers]

    def kv_cache_shapes(self) -> list[tuple[tuple[int, ...], ...]]:
        """Per layer: the latent entry (kv_lora_rank + qk_rope_head_dim), and the index key on indexer layers."""
        latent = (self.hf["kv_lora_rank"] + self.hf["qk_rope_head_dim"],)
        return [(latent, (self.hf["index_head_dim"],)) if layer.self_attn.indexer is not None else (latent,)
                for layer in self.layers]

    def compute_logits(self, hidden):
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return parallel_logits(hidden, weight, self.cfg.vocab_size)

    def checkpoint_name(self, name: str) -> tuple[str, int] | None:
        """HF checkpoint name -> (parameter name, piece of a fused parameter), or None to skip it."""
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None
        parts = name.split(".")
        if parts[0] == "layers" and int(parts[1]) >= len(self.layers):
            self.skipped_mtp += 1  # next-token-prediction (MTP) layers follow the decoder; Lanner does not run them
            return None
        return fused_param(name)

    def load_weights(self, weights):
        """weights: iterable of (HF checkpoint name, tensor)."""
        self.skipped_mtp = 0
        load_checkpoint(self, weights)
        if self.skipped_mtp:
            log.info("skipped %d MTP (next-token prediction) tensors at layers >= %d: the target does not run them "
                     "(draft='mtp' loads them into a draft module)", self.skipped_mtp, len(self.layers))

    def make_mtp(self, names) -> MtpLayer:
        """An empty MTP module shaped after the checkpoint tensor `names` of layer num_hidden_layers (the first MTP
        layer; later ones, if any, go unused). Fill it with lanner.models.weights.load_checkpoint."""
        prefix = f"layers.{len(self.layers)}."
        own = {n.removeprefix("model.").removeprefix(prefix) for n in names
               if n.removeprefix("model.").startswith(prefix) and not n.endswith("_scale_inv")}
        if not own:
            raise ValueError(f"this checkpoint has no MTP (next-token prediction) layer: no tensors at layer "
                             f"{len(self.layers)} (num_nextn_predict_layers: {self.hf.get('num_nextn_predict_layers', 0)})")
        return MtpLayer(self.hf, prefix, moe=any(n.startswith("mlp.experts.") for n in own),
                        has_indexer=any(n.startswith("self_attn.indexer.") for n in own),
                        interleaved=self.interleaved_indexer, own_embed="embed_tokens.weight" in own,
                        own_head="shared_head.head.weight" in own)
