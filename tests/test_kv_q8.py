"""The q8 KV cache (kv_cache_dtype="q8", lanner/kvcache/q8.py): the Q8_0 row format, lowlat's attention over it
against PyTorch's over the same rows, lowlat's writer against the Python quantizer, batch invariance, and on the
default model: greedy speculation lossless under q8, and the logits within a stated tolerance of the bf16 cache's
(docs/quantized.md#kv-cache)."""
import pytest
import torch

from lanner import LLM, SamplingParams
from lanner.bench.forward import divergence, teacher_forced_logprobs
from lanner.config import EngineConfig
from lanner.kvcache import q8
from lanner.layers.attention import build_attention_metadata, paged_attention
from lanner.plugins import Hardware, Step, StepKind
from lanner.plugins.lowlat import LowLatPlugin
from conftest import needs_lowlat
from test_lowlat import tiny_model


def test_q8_rows_round_trip():
    torch.manual_seed(0)
    x = torch.randn(7, 3, 64) * torch.logspace(-1, 2, 7)[:, None, None]  # (fp16 scales are normal here)
    x[0, 0, :32] = 0  # an all-zero block: scale 0, values 0
    rows = q8.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (7, 3, 68)
    y = q8.dequantize(rows, torch.float32)
    step = x.reshape(7, 3, 2, 32).abs().amax(-1, keepdim=True) / 127
    err = (y - x).reshape(7, 3, 2, 32).abs()
    assert (err <= step * (0.5 + 127 * 2**-11)).all()  # half a step, plus up to 127 times the fp16 scale's error
    assert torch.equal(y[0, 0, :32], torch.zeros(32))
    assert torch.equal(q8.quantize(y), rows)  # what q8 rows hold requantizes to the same bytes
    with pytest.raises(ValueError, match="head_dim 48"):
        q8.row_bytes(48)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="UlaCache"):
        EngineConfig(kv_cache_dtype="q8", kv_tier="ula-dp")


def build(model, dtype=torch.float32, threads=1):
    plugin = LowLatPlugin(threads=threads)
    hw = Hardware.detect("cpu", dtype)
    plugin.check(model.cfg, hw)
    plugin.build(model, model.cfg, hw)
    return plugin


@needs_lowlat
@pytest.mark.parametrize("head_dim", [64, 32])
def test_lowlat_attention_over_q8_rows(head_dim):
    """lowlat's attention over q8 rows equals PyTorch's over the same rows (float32), and a sequence's rows get
    the same bits alone as in a batch. head_dim 64: the kernel compiled for that size; 32 the run-time one."""
    model = tiny_model(num_heads=6, num_kv_heads=3, head_dim=head_dim)
    kernel = build(model)._kernel
    H, Hkv, D, bs = 6, 3, head_dim, 16
    torch.manual_seed(0)
    kc = q8.quantize(torch.randn(80 * bs, Hkv, D))
    vc = q8.quantize(torch.randn(80 * bs, Hkv, D))
    q_lens, ctx_lens = [1, 5, 3], [1, 600, 45]
    tables = [[70], list(range(40, 78)), [9, 3, 30]]
    q = torch.randn(sum(q_lens), H, D)
    pos = torch.tensor([c - n + i for n, c in zip(q_lens, ctx_lens) for i in range(n)])
    meta = build_attention_metadata(q_lens, ctx_lens, tables, bs, "cpu")
    k_new, v_new = (q8.dequantize(c[meta.slot_mapping], torch.float32) for c in (kc, vc))
    want = paged_attention(q, k_new, v_new, kc.clone(), vc.clone(), meta, D ** -0.5)
    got = kernel.attention(q.view(-1, H * D), kc, vc, pos, q_lens, ctx_lens, tables, bs)
    assert (got - want).abs().max() < 1e-5
    alone = kernel.attention(q[1:6].reshape(-1, H * D), kc, vc, pos[1:6], [5], [600], tables[1:2], bs)
    assert torch.equal(alone, got[1:6])


@needs_lowlat
def test_lowlat_writes_the_pythons_q8_rows():
    """A prefill through lowlat into a float32 cache and into a q8 one: the first layer's K/V do not depend on the
    cache, so its q8 rows must be the Python quantizer's bytes of the float32 rows."""
    model = tiny_model(num_heads=4, num_kv_heads=2, head_dim=32)
    plugin = build(model)
    c = model.cfg
    slots, ql = 8 * 16, 50
    meta = build_attention_metadata([ql], [ql], [[3, 1, 6, 2]], 16, "cpu")
    ids = torch.randint(0, 128, (ql,), generator=torch.Generator().manual_seed(0))
    caches = {}
    for name, shape, dtype in (("f32", (c.num_kv_heads, c.head_dim), torch.float32),
                               ("q8", (c.num_kv_heads, q8.row_bytes(c.head_dim)), torch.uint8)):
        caches[name] = [(torch.zeros(slots, *shape, dtype=dtype), torch.zeros(slots, *shape, dtype=dtype))
                        for _ in range(c.num_layers)]
        with torch.inference_mode():
            plugin.forward(Step(StepKind.PREFILL, ql, 1), model, ids, torch.arange(ql), caches[name], meta, ())
    for f32, rows in zip(caches["f32"][0], caches["q8"][0]):
        assert torch.equal(q8.quantize(f32), rows)
    assert caches["q8"][1][0].any()  # the second layer was written too


@needs_lowlat
def test_q8_speculation_is_lossless_and_close_to_bf16():
    """The default engine (lowlat, hybrid speculation) on a q8 cache: greedy output equals plain decoding on the
    same cache, and its pool holds 1.77x the tokens of a bf16 one in the same memory (the draft head's bf16 KV
    shares the budget). Against the bf16 cache, teacher-forced over 128 tokens of real code after 384 more: mean
    next-token KL <= 0.01 nats and top-1 agreement >= 0.9, the stated tolerance (docs/quantized.md#kv-cache)."""
    llm = LLM(dtype="bfloat16", kv_cache_dtype="q8", kv_cache_memory="0.25GiB")
    eng = llm.engine
    assert eng.kv.runner.kv_caches[0][0].dtype == torch.uint8 and eng.config.spec == "hybrid"
    code = open(q8.__file__).read()
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = llm.generate(code[:1500], greedy)[0]
    assert eng.plugins.counts.get(("lowlat", "verify"), 0) >= 3, eng.plugins.counts
    saved, eng.proposer = eng.proposer, None
    try:
        plain = llm.generate(code[:1500], greedy)[0]
    finally:
        eng.proposer = saved
    assert spec.token_ids == plain.token_ids
    ref = LLM(dtype="bfloat16", kv_cache_memory="0.25GiB")
    assert eng.kv.num_blocks / ref.engine.kv.num_blocks > 1.75
    ids = llm.tokenizer.encode(code)[:513]  # (teacher forcing overwrites the cached prefix blocks: no reuse below)
    nxt = torch.tensor(ids[385:])
    got = divergence(*(teacher_forced_logprobs(x, ids[:512], 128) for x in (ref, llm)), nxt)
    assert got["kl_mean"] <= 0.01 and got["top1_agree"] >= 0.9, got
