"""What lowlat's C++ kernels are built from: the name -> tensor dicts and the options a model's shapes fix for
csrc/model.h's Model(tensors, **options) and csrc/head.h's Head, Gemma 3's set_gemma settings and set_quant's
GGUF blocks kept as stored. The model's own tensors, no copies: the kernels keep references, so an in-place change
to a weight shows in their next call."""
from __future__ import annotations

import gguf
import torch

from lanner.models.quant import STORED_MODULES, interleave, repack
from lanner.plugins.base import PluginMismatch


def feed_forwards(model):
    """Per layer the feed-forward kind: "dense" (MLP: gate_up_proj, down_proj) or "moe" (MoE: a router `gate`
    and FusedMoE `experts` with stacked w13 / w2), plus the MoE settings shared by the MoE layers (experts,
    expert intermediate size, top_k, renormalize); PluginMismatch names a layer of any other structure."""
    kinds, moe = [], None
    for i, lyr in enumerate(model.layers):
        mlp = lyr.mlp
        if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):
            kinds.append("dense")
            continue
        experts = getattr(mlp, "experts", None)
        if experts is None or not hasattr(mlp, "gate") or not hasattr(experts, "w13") or \
                getattr(mlp.gate, "bias", None) is not None:
            raise PluginMismatch(f"lowlat: layer {i}'s feed-forward ({type(mlp).__name__}) is neither a dense "
                                 "SwiGLU MLP nor a routed MoE (bias-free router, FusedMoE experts)")
        settings = (experts.num_experts, experts.inter, int(mlp.top_k), bool(mlp.renormalize))
        if moe is not None and settings != moe:
            raise PluginMismatch(f"lowlat: MoE layers differ in experts / size / top_k ({moe} vs {settings})")
        moe = settings
        kinds.append("moe")
    return kinds, moe


def rope_tables(model, need: int, rows: int):
    """Gemma's global cos, sin and local cos, sin tables, float32 [rows >= need, head_dim] (rows doubled until
    they are enough): its own rotary modules' lookup over positions 0..rows-1 (the values its forward uses; it
    keeps no table)."""
    from lanner.models.gemma import FULL, SLIDING

    while rows < need:
        rows *= 2
    pos = torch.arange(rows)
    return [t.reshape(rows, -1).contiguous() for kind in (FULL, SLIDING)
            for t in model.rotary[kind].lookup(pos, torch.float32)]


def model_weights(model, dtype, gemma: bool, rope) -> tuple[dict, dict]:
    """Model(tensors, **options)'s tensors and the options the model's shapes fix, for this rank's shard under
    TP (heads, intermediate size and vocabulary rows; whole models otherwise). rope: the (global) cos and sin
    tables."""
    layers = model.layers
    att = [lyr.self_attn for lyr in layers]
    kinds, moe = feed_forwards(model)
    none = torch.empty(0, dtype=dtype)  # the other kind's weight on a layer (no storage)

    def per_layer(kind, get):
        return [get(lyr.mlp).data if k == kind else none for lyr, k in zip(layers, kinds)]

    def w(mod):  # the dense weight, or an empty [N, 0] stand-in for stored blocks (set_quant passes those)
        return torch.empty(mod.out_features, 0, dtype=dtype) if isinstance(mod, STORED_MODULES) else mod.weight.data

    tensors = {
        "embed_tokens": w(model.embed_tokens), "norm": model.norm.weight.data, "rope_cos": rope[0],
        "rope_sin": rope[1],
        "input_layernorm": [lyr.input_layernorm.weight.data for lyr in layers],
        "qkv_proj": [w(a.qkv_proj) for a in att],
        "o_proj": [w(a.o_proj) for a in att],
        # the MLP's input norm (Gemma: pre_feedforward_layernorm; set_gemma passes its (1 + w))
        "post_attention_layernorm": [(lyr.pre_feedforward_layernorm if gemma else lyr.post_attention_layernorm)
                                     .weight.data for lyr in layers],
        "gate_up_proj": per_layer("dense", lambda m: w(m.gate_up_proj)),
        "down_proj": per_layer("dense", lambda m: w(m.down_proj)),
    }
    if att[0].qkv_proj.bias is not None:
        tensors["qkv_proj.bias"] = [a.qkv_proj.bias.data for a in att]
    if not gemma:  # Gemma's q/k norms are (1 + w): set_gemma's
        if att[0].q_norm is not None:
            tensors["q_norm"] = [a.q_norm.weight.data for a in att]
        if att[0].k_norm is not None:
            tensors["k_norm"] = [a.k_norm.weight.data for a in att]
    options = {"hidden": model.cfg.hidden_size, "heads": att[0].num_heads, "kv_heads": att[0].num_kv_heads,
               "head_dim": model.cfg.head_dim, "eps": float(model.cfg.rms_norm_eps), "scale": float(att[0].scale),
               "inter": next((lyr.mlp.inter for lyr, k in zip(layers, kinds) if k == "dense"), 0)}
    if moe:
        tensors |= {"router": per_layer("moe", lambda m: m.gate.weight),
                    "experts.w13": per_layer("moe", lambda m: m.experts.w13),
                    "experts.w2": per_layer("moe", lambda m: m.experts.w2)}
        _, options["moe_inter"], options["top_k"], options["renorm"] = moe
        options["moe_layers"] = [int(k == "moe") for k in kinds]
    return tensors, options


def gemma_settings(model, dtype) -> tuple:
    """set_gemma's arguments: per layer the float32 (1 + w) of input_layernorm, post_attention_layernorm,
    pre_feedforward_layernorm, post_feedforward_layernorm, q_norm and k_norm, the final norm's, the local-layer
    flags, the window and the embedding scale."""
    from lanner.models.gemma import SLIDING

    def one_plus(norms):  # GemmaRMSNorm's float32 (1 + w): the kernel rounds once, after the product
        return [1.0 + n.weight.float() for n in norms]

    layers = model.layers
    return (one_plus(lyr.input_layernorm for lyr in layers), one_plus(lyr.post_attention_layernorm for lyr in layers),
            one_plus(lyr.pre_feedforward_layernorm for lyr in layers),
            one_plus(lyr.post_feedforward_layernorm for lyr in layers),
            one_plus(lyr.self_attn.q_norm for lyr in layers), one_plus(lyr.self_attn.k_norm for lyr in layers),
            1.0 + model.norm.weight.float(), [int(lyr.layer_type == SLIDING) for lyr in layers],
            int(model.window or 0), float(model.embed_scale(dtype)))


def stored_weights(model) -> list:
    """set_quant's weights: per layer qkv, o, gate_up and down as their packed GGUF blocks ([] for a dense one; a
    MixedQuantLinear's runs one after another), then the embedding's."""
    def packed(mod):
        return mod.packed() if isinstance(mod, STORED_MODULES) else []

    ws = [packed(m) for lyr in model.layers
          for m in (lyr.self_attn.qkv_proj, lyr.self_attn.o_proj, getattr(lyr.mlp, "gate_up_proj", None),
                    getattr(lyr.mlp, "down_proj", None))]
    return [*ws, packed(model.embed_tokens)]


HEAD_MATRICES = ("fc", "qkv_proj", "o_proj", "mlp.gate_up_proj", "mlp.down_proj", "lm_head")


def head_q8(head) -> list[list[torch.Tensor]]:
    """Head.set_quant's weights: the head's six matrices (HEAD_MATRICES) quantized to Q8_0 by gguf's quantizer and
    repacked into the stored-type layout (lanner.models.quant), as a GGUF Q8_0 file would load."""
    out = []
    for name in HEAD_MATRICES:
        w = head.get_submodule(name).weight.detach().float().numpy()
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        out.append(interleave(repack(raw, "Q8_0", w.shape[1])))
    return out


def head_weights(head, embed_weight) -> tuple[dict, dict]:
    """Head(tensors, **options)'s tensors (an EAGLE-style draft head's, with the target's embedding) and the
    options its shapes fix."""
    tensors = {
        "embed_tokens": embed_weight.data, "fc": head.fc.weight.data,
        "input_layernorm": head.input_layernorm.weight.data,
        "hidden_norm": head.hidden_norm.weight.data, "qkv_proj": head.qkv_proj.weight.data,
        "o_proj": head.o_proj.weight.data, "post_attention_layernorm": head.post_attention_layernorm.weight.data,
        "gate_up_proj": head.mlp.gate_up_proj.weight.data, "down_proj": head.mlp.down_proj.weight.data,
        "norm": head.norm.weight.data, "lm_head": head.lm_head.weight.data, "d2t": head.d2t.data,
        "rope_cos": head.rotary.cos.float().contiguous(), "rope_sin": head.rotary.sin.float().contiguous(),
    }
    c = head.cfg
    options = {"hidden": c.hidden_size, "inter": c.intermediate_size, "heads": head.H, "kv_heads": head.Hkv,
               "head_dim": head.D, "eps": float(c.rms_norm_eps), "scale": float(head.scale)}
    return tensors, options
