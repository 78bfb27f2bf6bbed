"""Tiny random-weight DeepSeek-V3.2 / GLM-5 / Gemma 3 checkpoints (Hugging Face folders) for tests and benchmarks.

Weights are drawn at unit scale (not HF's 0.02 init) so attention, indexer scores and routing are far from
uniform: a wrong selection, rope layout or routing shows up as a large logit difference, not a 1e-6 one.
32 indexer heads: with few ReLU heads some index scores are exactly 0 and top-k ties at 0 are broken
arbitrarily (transformers' own choice then depends on the sequence length).
"""
from __future__ import annotations

import json
import os

import torch

_COMMON = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=24, index_topk=16, index_head_dim=16, index_n_heads=32, max_position_embeddings=512,
    routed_scaling_factor=2.5, norm_topk_prob=True, bos_token_id=0, eos_token_id=1,
)

TINY_CONFIGS = {
    # YaRN with mscale != mscale_all_dim, so both the cos/sin attention factor and the softmax-scale correction
    # are exercised; 2 expert groups of 4 with 1 kept, so group-limited routing matters
    "deepseek_v32": dict(
        _COMMON, num_hidden_layers=3, n_group=2, topk_group=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 0.707,
                         "beta_fast": 32, "beta_slow": 1},
    ),
    # layers 1 and 3 reuse the selection of the indexer layer before them
    "glm_moe_dsa": dict(
        _COMMON, num_hidden_layers=4, n_group=1, topk_group=1, rms_norm_eps=1e-5,
        indexer_types=["full", "shared", "full", "shared"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # both layer types (a window of 8, so short prompts already slide), query_pre_attn_scalar != head_dim, linear
    # RoPE scaling on the global layers only, GQA and logit softcapping: each differs from Llama visibly
    "gemma3_text": dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        final_logit_softcapping=8.0, max_position_embeddings=512, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ),
}

# Gemma's norms scale by (1 + weight): their weights are drawn around 0, not 1
_ZERO_CENTRED_NORMS = ("gemma3_text",)


def make_tiny_model(arch: str, out_dir: str, seed: int = 0, mtp: bool = False, **overrides) -> str:
    """Writes config.json + model.safetensors of a tiny random `arch` model (a TINY_CONFIGS key)
    to out_dir and returns out_dir. overrides: config fields. mtp: add one multi-token prediction layer in the
    DeepSeek-V3 layout (`model.layers.{num_hidden_layers}`, see _add_mtp)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(TINY_CONFIGS)}")
    fields = TINY_CONFIGS[arch] | overrides
    n = fields["num_hidden_layers"]
    if mtp:  # one more decoder layer, drawn like the others: it becomes the MTP module's decoder layer
        fields = fields | {"num_hidden_layers": n + 1}
        if "indexer_types" in fields:
            fields["indexer_types"] = list(fields["indexer_types"]) + ["full"]  # its own indexer
    cfg = AutoConfig.for_model(arch, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_((0.0 if arch in _ZERO_CENTRED_NORMS else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:  # fan-in scaled: every projection's output is O(1)
                p.normal_(0.0, p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change some expert choices
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(out_dir)
    if mtp:
        _add_mtp(out_dir, n, seed)
    return out_dir


def _add_mtp(out_dir: str, n: int, seed: int):
    """Turns the saved model's last layer `n` into an MTP layer: adds enorm, hnorm, eh_proj and shared_head.norm,
    sets num_hidden_layers back to n. DeepSeek-V3.2 folders also get the layer's own copies of the embedding and
    LM head (DeepSeek-V3 checkpoints ship them); GLM-5 folders omit them (the main model's are used)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    weights = load_file(path)
    g = torch.Generator().manual_seed(seed + 1)
    p = f"model.layers.{n}."
    h = weights["model.norm.weight"].shape[0]
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[p + norm + ".weight"] = 1.0 + 0.2 * torch.randn(h, generator=g)
    weights[p + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg["model_type"] == "deepseek_v32":
        weights[p + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights[p + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, path, metadata={"format": "pt"})
    cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"] = n, 1
    for key in ("mlp_layer_types", "indexer_types", "layer_types"):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:n]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
