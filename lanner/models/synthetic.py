"""Sizes that do not ship: random-weight Llama GGUFs of real geometries, quantized to Q4_K_M by llama.cpp's own
quantizer, for speed comparisons at 1-8B (`--model synthetic:llama-8b`).

Weight values do not change a dense model's speed (they change acceptance, so speculation is measured on real
models only). The tokenizer is Qwen2.5's, copied from the catalog's Qwen GGUF (`make model-qwen`): a real BPE
vocabulary that llama.cpp and Lanner both load, of 151,936 tokens where Llama-3 has 128,256 (the embedding and
output matrices are 18% larger than the real models'; 2% of the 8B file). The float16 file is written tensor by
tensor (never whole in memory), quantized by `llama_model_quantize` (llama-cpp-python: `make peers`), then
deleted; the Q4_K_M file stays cached under $LANNER_CACHE/synthetic.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from lanner.models.catalog import CATALOG, assemble, cache_root

PREFIX = "synthetic:"
# Llama-3.2-1B, Llama-3.2-3B (both tie the output matrix to the embedding), Llama-3.1-8B
GEOMETRIES = {
    "llama-1b": dict(layers=16, hidden=2048, inter=8192, heads=32, kv_heads=8, head_dim=64, tied=True),
    "llama-3b": dict(layers=28, hidden=3072, inter=8192, heads=24, kv_heads=8, head_dim=128, tied=True),
    "llama-8b": dict(layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, tied=False),
}
TOKENIZER_FROM = "qwen2.5-coder-1.5b"
Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M


def names() -> list[str]:
    return [PREFIX + k for k in GEOMETRIES]


def path_for(model: str, threads: int | None = None) -> str:
    """The cached Q4_K_M GGUF of `model` ("synthetic:<geometry>"), built on first use."""
    geo = model.removeprefix(PREFIX)
    if geo not in GEOMETRIES:
        raise ValueError(f"model {model!r}: no such synthetic geometry; choose one of {', '.join(names())}")
    out = os.path.join(cache_root(), "synthetic", f"{geo}-q4_k_m.gguf")
    if not os.path.isfile(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        f16 = out.removesuffix("-q4_k_m.gguf") + f"-f16.{os.getpid()}.gguf"
        try:
            write_f16(f16, geo)
            quantize(f16, out + ".partial", threads or os.cpu_count() or 1)
            os.replace(out + ".partial", out)
        finally:
            for p in (f16, out + ".partial"):
                if os.path.exists(p):
                    os.remove(p)
    return out


def _tokenizer_fields(source: str):
    """The tokenizer's key-values of the GGUF at `source`: [(key, value, type, array item type)]."""
    import gguf

    reader = gguf.GGUFReader(source)
    out = []
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
            else:
                val = [int(f.parts[i][0]) for i in f.data]
            out.append((key, val, vtype, sub))
        elif vtype == gguf.GGUFValueType.STRING:
            out.append((key, bytes(f.parts[f.data[0]]).decode("utf-8"), vtype, None))
        else:
            out.append((key, f.parts[f.data[0]][0].item(), vtype, None))
    return out


def write_f16(path: str, geo: str | dict, seed: int = 0, tokenizer_from: str | None = None):
    """A float16 Llama GGUF of geometry `geo` (a GEOMETRIES name or such a dict) with random weights (std 0.02;
    norms 1, float32), streamed to `path`, with the tokenizer of the GGUF `tokenizer_from` (default: the
    catalog's Qwen file)."""
    import gguf
    from tqdm import tqdm

    g = GEOMETRIES[geo] if isinstance(geo, str) else geo
    fields = _tokenizer_fields(tokenizer_from or assemble(CATALOG[TOKENIZER_FROM]))
    vocab = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
    h, kvd = g["hidden"], g["kv_heads"] * g["head_dim"]
    shapes = [("token_embd.weight", (vocab, h))]
    for i in range(g["layers"]):
        shapes += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (g["heads"] * g["head_dim"], h)),
                   (f"blk.{i}.attn_k.weight", (kvd, h)), (f"blk.{i}.attn_v.weight", (kvd, h)),
                   (f"blk.{i}.attn_output.weight", (h, g["heads"] * g["head_dim"])),
                   (f"blk.{i}.ffn_norm.weight", (h,)), (f"blk.{i}.ffn_gate.weight", (g["inter"], h)),
                   (f"blk.{i}.ffn_up.weight", (g["inter"], h)), (f"blk.{i}.ffn_down.weight", (h, g["inter"]))]
    shapes.append(("output_norm.weight", (h,)))
    if not g["tied"]:
        shapes.append(("output.weight", (vocab, h)))

    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"synthetic {geo} (random weights)")
    w.add_block_count(g["layers"])
    w.add_context_length(32768)
    w.add_embedding_length(h)
    w.add_feed_forward_length(g["inter"])
    w.add_head_count(g["heads"])
    w.add_head_count_kv(g["kv_heads"])
    w.add_key_length(g["head_dim"])
    w.add_value_length(g["head_dim"])
    w.add_rope_dimension_count(g["head_dim"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(1)  # mostly float16
    for key, val, vtype, sub in fields:
        w.add_key_value(key, val, vtype, sub_type=sub)
    # one random pool, read at a random offset per tensor: llama.cpp's quantizer and both engines' speed do not
    # care whether values repeat, and drawing 8 billion normals would take minutes
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)
    for name, shape in shapes:  # norms in float32: llama.cpp keeps 1-D tensors as they are and multiplies in f32
        dt = np.dtype(np.float32 if len(shape) == 1 else np.float16)
        w.add_tensor_info(name, shape, dt, int(np.prod(shape)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape in tqdm(shapes, desc=f"writing {geo} (float16)", unit="tensor"):
        n = int(np.prod(shape))
        if len(shape) == 1:
            t = np.ones(shape, dtype=np.float32)
        else:
            t = np.resize(np.roll(pool, -int(rng.integers(len(pool)))), n).reshape(shape)
        w.write_tensor_data(t)
    w.close()


def quantize(src: str, dst: str, threads: int):
    try:
        import llama_cpp
    except ImportError:
        raise RuntimeError("synthetic models are quantized by llama.cpp's quantizer: install llama-cpp-python "
                           "(`make peers`)") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = Q4_K_M
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}) failed with code {rc}")
