"""GGUF weights kept in their stored type (lanner/models/quant.py, lowlat's csrc/quant.h) on the bundled Q4_1 / Q8_0
model: the repacking changes no value; lowlat's float-activation kernels match the float32 dequantized reference;
a row's bits do not depend on the other rows of its step (q8, q16 and float modes); speculative greedy equals plain
greedy; bad GGUF files get clear errors. The model is loaded once per module (stored and dequantized)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lanner import LLM, SamplingParams
from lanner.bench.forward import forward_rows, kv_caches
from lanner.models import quant
from lanner.models.config import UnsupportedModelError
from lanner.models.loader import ModelSource, load_config, load_model, open_gguf
from lanner.plugins import Hardware
from lanner.plugins.lowlat import LowLatPlugin
from conftest import needs_avx512, needs_lowlat

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def models():
    src = ModelSource.resolve(None)
    loaded = load_config(src)  # the GGUF header once (parsing its vocabulary is the slow part)
    stored, cfg = load_model(src, torch.float32, "cpu", loaded, weights="stored")
    dense, _ = load_model(src, torch.float32, "cpu", loaded)
    return stored, dense, cfg, loaded[2]


@pytest.fixture(scope="module")
def plugins(models):
    """One lowlat kernel per activation mode over the same stored model (no weight copies)."""
    stored, _, cfg, _ = models
    hw = Hardware.detect("cpu", torch.float32)
    out = {}
    for act in ("float", "q8", "q16"):
        p = LowLatPlugin(threads=1, act=act)
        p.check(cfg, hw)
        p.build(stored, cfg, hw)
        out[act] = p
    dense = LowLatPlugin(threads=1)  # float32 weights: invariant by default too
    dense.check(cfg, hw)
    dense.build(models[1], cfg, hw)
    out["dense"] = dense
    return out


def test_repack_keeps_every_value(models):
    """Repacked blocks dequantize to exactly what the gguf package gives, for the bundled file's types and for
    random Q4_0 / Q5_0 / Q8_0 / Q4_1 tensors with an odd block count (the padded pair)."""
    from gguf.quants import dequantize as reference

    stored, dense, _, reader = models
    cases = [(np.asarray(t.data), t.tensor_type, int(t.shape[0])) for t in reader.tensors[:4]
             if t.tensor_type.name in quant.STORED_TYPES]
    rng = np.random.default_rng(0)
    for name in ("Q4_0", "Q5_0", "Q8_0", "Q4_1"):
        qt = gguf.GGMLQuantizationType[name]
        x = rng.standard_normal((5, 96)).astype(np.float32)
        cases.append((gguf.quants.quantize(x, qt), qt, 96))
    for raw, qt, k in cases:
        p = quant.repack(raw, qt.name, k)
        got = quant.dequantize(p, k)
        assert torch.equal(got, torch.from_numpy(reference(raw, qt).copy())), qt.name
    # the stored model holds a third of the bytes of its float32 copy... and its dense views are that copy
    assert quant.weight_bytes(stored) < 0.22 * quant.weight_bytes(dense)
    assert torch.equal(stored.layers[3].mlp.down_proj.weight, dense.layers[3].mlp.down_proj.weight)


def _random_k_blocks(name, rows, k, seed):
    """Random but valid Q4_K / Q5_K / Q6_K rows (gguf-py cannot quantize to K-quants): random codes and integer scales,
    float16 super-block scales of ordinary size."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    if name in ("Q4_K", "Q5_K"):  # Q5_K: 32 bytes of fifth bits before the nibbles
        d = (rng.uniform(0.5, 2, (rows, nb, 2)) * 1e-3).astype(np.float16).view(np.uint8)  # d and dmin
        rest = rng.integers(0, 256, (rows, nb, 12 + 128 + (32 if name == "Q5_K" else 0)), dtype=np.uint8)
        blocks = np.concatenate([d.reshape(rows, nb, 4), rest], axis=2)
    else:
        rest = rng.integers(0, 256, (rows, nb, 208), dtype=np.uint8)
        d = (rng.uniform(0.5, 2, (rows, nb, 1)) * 1e-3).astype(np.float16).view(np.uint8)
        blocks = np.concatenate([rest, d], axis=2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_repack_keeps_every_value(name):
    from gguf.quants import dequantize as reference

    qt = gguf.GGMLQuantizationType[name]
    raw = _random_k_blocks(name, 7, 512, 1)
    p = quant.repack(raw, name, 512)
    got = quant.dequantize(p, 512)
    assert torch.equal(got, torch.from_numpy(reference(raw, qt).copy()))


@needs_lowlat
def test_one_pass_dequantized_tiles(models, plugins):
    """lowlat's dequant_t (the engine's prefill tiles) gives quant.dequantize's values bit for bit, transposed, in
    float32 and bf16, for every stored format and for row ranges that start past the first group and end inside a
    group; the stored model's QuantLinear layers use it, and their matmul is then the dense matmul's (up to the
    summation order of a GEMM over the transposed tile)."""
    kernel = plugins["q16"]._kernel
    rng = np.random.default_rng(0)
    cases = [(name, quant.repack(gguf.quants.quantize(rng.standard_normal((37, 96)).astype(np.float32),
                                                      gguf.GGMLQuantizationType[name]), name, 96), 37, 96)
             for name in ("Q4_0", "Q5_0", "Q8_0", "Q4_1")]
    cases += [(name, quant.repack(_random_k_blocks(name, 40, 512, 2), name, 512), 40, 512) for name in ("Q4_K", "Q5_K", "Q6_K")]
    for name, r, n, k in cases:
        packed = quant.interleave(r)
        want = quant.dequantize(r, k)
        for a, b in ((0, n), (16, n), (16, 32)):
            for dtype in (torch.float32, torch.bfloat16):
                got = kernel.dequant_t(packed, n, k, a, b, dtype == torch.bfloat16)[:, : b - a].T
                assert torch.equal(got, want[a:b].to(dtype)), (name, a, b, dtype)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.dequant_t(packed, n, k, 8, n, False)
    stored, dense, _, _ = models
    mod = stored.layers[2].mlp.down_proj
    assert mod.tile_kernel is not None
    x = torch.randn(3, mod.in_features, generator=torch.Generator().manual_seed(1))
    got, want = mod.matmul(x), F.linear(x, dense.layers[2].mlp.down_proj.weight)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _q8_activations(x):
    """llama.cpp's q8 activation rounding (per block of 32: d = amax / 127 as float16, codes to nearest even), as
    the float values the integer kernels multiply by."""
    b = x.double().reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    codes = torch.round(b * torch.where(amax > 0, 127 / amax, 0))
    return (codes * (amax / 127).half().double()).reshape(x.shape)


def _q16_activations(x):
    """lowlat's q16 rounding (per block of 32: d = amax / 16256 in float32, codes to nearest even)."""
    b = x.reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    codes = torch.round(b * torch.where(amax > 0, 16256 / amax, 0))
    return (codes.double() * (amax / 16256).double()).reshape(x.shape)


@needs_lowlat
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_kernels(plugins, name):
    """lowlat's GEMV over K-quant blocks, 1-4 rows per weight pass: float activations within 1e-5 of the float32
    dequantized matmul, q8 / q16 activations within 2e-3 / 2e-5 of the exact product with the rounded activations
    (a wrong sub-block scale is off by tens of percent)."""
    n, k = 40, 512
    p = quant.repack(_random_k_blocks(name, n, k, 2), name, k)
    packed = quant.interleave(p)
    w = quant.dequantize(p, k).double()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    for act, xr, tol in (("float", x.double(), 1e-5), ("q8", _q8_activations(x), 2e-3),
                         ("q16", _q16_activations(x), 2e-5)):
        want = xr @ w.T
        got = plugins[act]._kernel.qlinear(x, packed, n, True).double()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= tol, (act, err)
        greedy = plugins[act]._kernel.qlinear(x, packed, n, False, True)  # the LM head's fused argmax
        assert torch.equal(greedy, plugins[act]._kernel.qlinear(x, packed, n).argmax(-1)), act


@needs_lowlat
def test_mixed_fused_projection(plugins):
    """A fused projection whose pieces differ in type (Qwen2.5 Q4_K_M: Q4_K q / k beside a Q6_K v) keeps each piece
    as stored: the module's own matmul equals the float32 dequantized one, lowlat's row-segment GEMV matches it as
    test_k_quant_kernels does, and a row's bits do not depend on the other rows of the call."""
    k, pieces = 512, [("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16), ("Q4_K", 32)]
    mod = quant.MixedQuantLinear(96, k, [quant.STORED_TYPES[n][0] for n, _ in pieces], [r for _, r in pieces])
    assert [r.fmt for r in mod.runs] == ["u4k", "u6k", "u4k"]
    ref = []
    for i, (name, rows) in enumerate(pieces):
        p = quant.repack(_random_k_blocks(name, rows, k, 10 + i), name, k)
        mod.load("weight", p, i)
        ref.append(quant.dequantize(p, k))
    w = torch.cat(ref).double()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    assert torch.equal(mod.weight, torch.cat(ref))
    assert ((mod(x).double() - x.double() @ w.T).abs().max() / (x.double() @ w.T).abs().max()).item() <= 1e-5
    for act, xr, tol in (("float", x.double(), 1e-5), ("q8", _q8_activations(x), 2e-3),
                         ("q16", _q16_activations(x), 2e-5)):
        want = xr @ w.T
        got = plugins[act]._kernel.qlinear(x, mod.packed(), 96, True)
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= tol, act
        for m in (1, 3):
            assert torch.equal(plugins[act]._kernel.qlinear(x[m : m + 1], mod.packed(), 96, True), got[m : m + 1])
    with pytest.raises(RuntimeError, match="segments hold 96 rows, expected 112"):
        plugins["q16"]._kernel.qlinear(x, mod.packed(), 112, True)


PROMPT = list(range(1000, 1030))


@needs_lowlat
def test_float_activations_match_dequantized_reference(models, plugins):
    """act="float": prefill of 30 rows, then 2 decode steps, hidden states and logits within 1e-4 (relative max)
    of the float32 model built from the dequantized weights; act="q16" (the default) within 1e-3."""
    stored, dense, cfg, _ = models
    table = [0, 1, 2]
    for act, tol in (("float", 1e-4), ("q16", 1e-3)):
        kv_a, kv_b = kv_caches(cfg), kv_caches(cfg)
        for rows in ([(PROMPT, 0, table)], [([5000], 30, table)], [([77], 31, table)]):
            got = forward_rows(stored, plugins[act], kv_a, rows)
            want = forward_rows(dense, None, kv_b, rows)
            for g, w in zip(got, want):
                err = ((g - w).abs().max() / w.abs().max()).item()
                assert err <= tol, (act, err)


def _check_invariance(model, plug, cfg, dtype=torch.float32):
    """Sequence A's decode row gives the same bits (hidden and logits) alone, as row 1 of a verify chunk of its own
    sequence, and among 2-16 rows of other sequences of other lengths."""
    kv = kv_caches(cfg, dtype=dtype)
    a = (PROMPT, 0, [0, 1, 2])
    others = [(list(range(2000, 2000 + n)), 0, [3 + 3 * i, 4 + 3 * i, 5 + 3 * i]) for i, n in enumerate((9, 40))]
    for r in [a, *others]:
        forward_rows(model, plug, kv, [r])  # prefill every sequence
    alone = forward_rows(model, plug, kv, [([5000], 30, a[2])])
    chunk = forward_rows(model, plug, kv, [([5000, 6, 7], 30, a[2])])
    assert all(torch.equal(x[0], y[0]) for x, y in zip(alone, chunk))
    (_, _, t1), (_, _, t2) = others
    for rows in ([([8], 9, t1)], [([8] * 5, 9, t1)], [([8] * 7, 9, t1), ([11] * 8, 40, t2)]):  # 2, 6, 16 rows
        got = forward_rows(model, plug, kv, [*rows, ([5000], 30, a[2])])
        assert all(torch.equal(x[0], y[-1]) for x, y in zip(alone, got)), len(rows)


@needs_lowlat
@pytest.mark.parametrize("act", ["float", "q8", "q16", "dense"])
def test_batch_invariance(models, plugins, act):
    """Stored weights in every activation mode, and float32 weights."""
    stored, dense, cfg, _ = models
    _check_invariance(dense if act == "dense" else stored, plugins[act], cfg)


@needs_lowlat
def test_bf16_batch_invariance(models):
    """bf16 weights (the default dtype) with bf16 activations: lowlat's default is batch-invariant there too."""
    src = ModelSource.resolve(None)
    model, cfg = load_model(src, torch.bfloat16, "cpu", load_config(src))
    hw = Hardware.detect("cpu", torch.bfloat16)
    plug = LowLatPlugin(threads=1)
    plug.check(cfg, hw)
    plug.build(model, cfg, hw)
    assert plug.uses_dot == ("avx512_bf16" in hw.cpu_flags)  # the bf16 dot-product kernels where the CPU has them
    _check_invariance(model, plug, cfg, torch.bfloat16)


@pytest.fixture(scope="module", params=["q8", "q16"])
def llm_q8(request):
    return LLM(dtype="float32", weights="stored", plugin="lowlat",
               plugin_options={"lowlat": {"threads": 1, "act": request.param}}, spec="ngram", spec_max_batch=1,
               kv_cache_memory="0.25GiB")


@needs_lowlat
def test_prompt_again_from_prefix_cache_gives_same_tokens(llm_q8):
    """Stored weights: lowlat runs every prefill step, a long one in pieces of its rows, so a prompt's tokens get
    the batch-invariant kernels' bits however the prompt was chunked. Asked again, the prompt's full blocks come
    from the prefix cache and only its tail is recomputed (alone, in a step of a few rows): the same greedy tokens.
    (With the engine's own matmuls for prompts past 72 tokens, such repeats parted.)"""
    before = dict(llm_q8.engine.plugins.counts)
    words = quant.__doc__.split()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, speculative=False)
    for n in (150, 260, 330):
        prompt = " ".join(words[:n])
        first, again = llm_q8.generate(prompt, params)[0], llm_q8.generate(prompt, params)[0]
        assert first.metrics["prompt_tokens"] > 256 or n < 260
        assert again.metrics["cached_prompt_tokens"] >= first.metrics["prompt_tokens"] - 16
        assert again.token_ids == first.token_ids, n
    # a prefill step of more sequences than lowlat's max_batch (8) runs sequence by sequence: each prompt's first
    # token and its logprob are those it gets alone
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    prompts = [" ".join(words[5 * i : 5 * i + 12 + 2 * i]) for i in range(9)]  # one step: 9 short prompts
    batch = llm_q8.generate(prompts, one)
    for p, got in zip(prompts, batch):
        alone = llm_q8.generate(p, one)[0]
        assert (got.token_ids, got.logprobs[0]["logprob"]) == (alone.token_ids, alone.logprobs[0]["logprob"])
    counts = llm_q8.engine.plugins.counts
    assert counts.get(("none", "prefill"), 0) == before.get(("none", "prefill"), 0)
    assert counts[("lowlat", "prefill")] > before.get(("lowlat", "prefill"), 0)


@needs_lowlat
def test_long_prefill_on_the_engine_gemms():
    """gemm_prefill_from: a stored-weights prefill step of at least that many rows runs on the engine's forward
    (dequantized tiles, PyTorch's GEMM: AMX where the CPU has it) up to its last KV block, the rest and shorter
    steps on lowlat; the next token's logprob agrees between the two paths within the activations' rounding, and a
    prompt asked again (its last block recomputed alone from the prefix cache) gets the same bits. Negative values
    are refused."""
    with pytest.raises(ValueError, match="gemm_prefill_from"):
        LowLatPlugin(gemm_prefill_from=-1)
    prompt = " ".join(quant.__doc__.split()[:120])
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    got = {}
    for start in (64, 0):
        llm = LLM(dtype="float32", weights="stored", plugin="lowlat", enable_prefix_caching=bool(start),
                  plugin_options={"lowlat": {"threads": 1, "gemm_prefill_from": start}}, kv_cache_memory="0.25GiB")
        plugin = llm.engine.plugins.plugins[0]
        out = llm.generate(prompt, one)[0]
        assert out.metrics["prompt_tokens"] >= 64
        gemm_rows = plugin.gemm_rows
        assert (gemm_rows > 48) if start else (gemm_rows == 0), gemm_rows
        got[start] = (out.token_ids, out.logprobs[0]["logprob"])
        if start:
            again = llm.generate(prompt, one)[0]
            assert again.metrics["cached_prompt_tokens"] > 0 and plugin.gemm_rows == gemm_rows
            assert (again.token_ids, again.logprobs[0]["logprob"]) == got[start]
        llm.close()
    assert got[64][0] == got[0][0] and abs(got[64][1] - got[0][1]) < 0.02


@needs_lowlat
def test_speculative_greedy_equals_plain_q8(llm_q8):
    """With q8 / q16 activations (not float32 arithmetic) n-gram speculation still emits exactly the plain greedy
    tokens: the verify rows compute the bits of decode rows."""
    prompts = ["Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
               "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"]
    spec = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculative=False)
    counts = llm_q8.engine.plugins.counts
    for p in prompts:
        want = llm_q8.generate(p, plain)[0].token_ids
        got = llm_q8.generate(p, spec)[0]
        assert got.token_ids == want
    assert counts.get(("lowlat", "verify"), 0) > 5 and not llm_q8.engine.plugins.disabled


def test_gguf_file_reads_what_gguf_reader_reads(default_gguf):
    """lanner.models.gguf_file against the gguf package's reader on the bundled file: every field's value, every
    tensor's type, offset, shape and bytes."""
    mine, ref = open_gguf(default_gguf), gguf.GGUFReader(default_gguf)
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(mine.fields) == list(fields) and len(fields["tokenizer.ggml.tokens"]) == 49152
    for k, v in fields.items():
        got = mine.fields[k]
        assert (got.tolist() if isinstance(got, np.ndarray) else got) == v, k
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes, t.shape.tolist()) for t in mine.tensors] == \
           [(t.name, t.tensor_type, t.data_offset, t.n_bytes, t.shape.tolist()) for t in ref.tensors]
    for a, b in zip(mine.tensors, ref.tensors):
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_bad_gguf_files(tmp_path):
    def write(name, arch, tensor_type):
        w = gguf.GGUFWriter(str(tmp_path / name), arch)
        w.add_block_count(1)
        block, size = gguf.GGML_QUANT_SIZES[tensor_type]
        raw = np.zeros((4, 64 // block * size), dtype=np.uint8)  # rows of 64 elements
        w.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return str(tmp_path / name)

    good = write("ok.gguf", "llama", gguf.GGMLQuantizationType.Q8_0)
    assert len(open_gguf(good).tensors) == 1
    data = (tmp_path / "ok.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-40])
    with pytest.raises(ValueError, match="cut.gguf.*truncated"):
        open_gguf(str(cut))
    for name, junk in (("short.gguf", data[:20]), ("junk.gguf", b"GGUF" + bytes(range(256)) * 4)):
        (tmp_path / name).write_bytes(junk)
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            open_gguf(str(tmp_path / name))
    with pytest.raises(UnsupportedModelError, match="Q8_1"):
        open_gguf(write("q81.gguf", "llama", gguf.GGMLQuantizationType.Q8_1))
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        LLM(model=write("mamba.gguf", "mamba", gguf.GGMLQuantizationType.Q8_0), skip_tokenizer=True)


@needs_avx512
def test_avx2_build_is_bit_identical(models, plugins):
    """isa="avx2" (lowlat built without AVX-512: csrc/avx2.h runs the kernels on 256-bit halves, as on an AVX2-only
    CPU) computes the same bits as the AVX-512 build: stored Q4_1 / Q8_0 weights with float, q8 and q16 activations
    (VNNI there, 16-bit pair sums here), float32 weights, and the K-quant GEMVs."""
    stored, dense, cfg, _ = models
    hw = Hardware.detect("cpu", torch.float32)
    for act in ("float", "q8", "q16", "dense"):
        p = LowLatPlugin(threads=1, isa="avx2", **({} if act == "dense" else {"act": act}))
        p.check(cfg, hw)
        model = dense if act == "dense" else stored
        p.build(model, cfg, hw)
        assert p.extension().isa == "avx2" and plugins[act].extension().isa == "avx512"
        kv_a, kv_b = kv_caches(cfg), kv_caches(cfg)
        for rows in ([(PROMPT, 0, [0, 1, 2])], [([5000, 6, 7], 30, [0, 1, 2]), (list(range(9)), 0, [5])]):
            got, want = forward_rows(model, p, kv_a, rows), forward_rows(model, plugins[act], kv_b, rows)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), act
        for name in ("Q4_K", "Q5_K", "Q6_K"):
            if act == "dense":
                continue
            q = quant.repack(_random_k_blocks(name, 40, 512, 2), name, 512)
            packed = quant.interleave(q)
            x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
            for argmax in (False, True):
                assert torch.equal(p._kernel.qlinear(x, packed, 40, True, argmax),
                                   plugins[act]._kernel.qlinear(x, packed, 40, True, argmax))


def test_auto_weights_and_dtype(tmp_path):
    """'auto' keeps GGUF blocks as stored where lowlat runs them (CPU, one rank, plugins allowed), and then picks
    float32 on a CPU without bf16 arithmetic; elsewhere dequantized bf16. The LLM runs what its config says."""
    from lanner.config import EngineConfig
    from lanner.cpu import native_bf16

    cpu_dtype = "bfloat16" if native_bf16() else "float32"
    assert (EngineConfig().weights, EngineConfig().dtype) == ("stored", cpu_dtype)
    assert (EngineConfig(plugin="lowlat").weights, EngineConfig(dtype="bfloat16").dtype) == ("stored", "bfloat16")
    for kw in ({"plugin": None}, {"plugin": "none"}, {"tp": 2}, {"model": str(tmp_path)}):
        assert (EngineConfig(**kw).weights, EngineConfig(**kw).dtype) == ("dequantize", "bfloat16"), kw
    assert EngineConfig(weights="dequantize").dtype == "bfloat16"
    with pytest.raises(ValueError, match="weights: must be 'auto' or one of"):
        EngineConfig(weights="int4")
