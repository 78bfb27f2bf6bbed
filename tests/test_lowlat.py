"""lowlat, Lanner's reference CPU kernel plugin (lanner/plugins/lowlat): the whole Llama-family forward in one
C++ call. Against the engine's own forward on the real default model (float32: identical greedy tokens and
<= 1e-4 per step, with n-gram and EAGLE-head speculation; bf16: within the 3e-2 verify tolerance), its kernels
on their own, a tiny random draft model of each structure (Qwen2 bias, Qwen3 q/k norm), and check()'s
refusals. The extension compiles once per machine (~20-60 s), then loads from torch's extension cache."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from lanner import LLM, SamplingParams
from lanner.layers.attention import build_attention_metadata, paged_attention
from lanner.models.config import ModelConfig
from lanner.models.llama import LlamaModel
from lanner.plugins import Hardware, PluginMismatch, Step, StepKind
from lanner.cpu import cpu_flags
from lanner.plugins.lowlat import LowLatPlugin
from conftest import needs_avx512, needs_lowlat

pytestmark = needs_lowlat

PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    ",
           "Paris is the capital of a country that is famous for its food, its art and"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@contextlib.contextmanager
def own_forward(llm):
    """The same engine without its plugins: the reference run costs no second model load."""
    eng = llm.engine
    saved = eng.plugins, eng.kv.runner.plugins
    eng.plugins = eng.kv.runner.plugins = None
    try:
        yield
    finally:
        eng.plugins, eng.kv.runner.plugins = saved


@pytest.fixture(scope="module")
def llm32_lowlat():
    # spec_max_batch=1: the 3-prompt batch decodes plainly (DECODE steps at batch 3), a lone prompt speculates
    return LLM(dtype="float32", weights="dequantize", plugin="lowlat", plugin_verify=1000, spec="ngram",
               spec_max_batch=1, kv_cache_memory="0.25GiB")


def test_float32_greedy_matches_own_forward(llm32_lowlat):
    llm = llm32_lowlat
    with own_forward(llm):
        want_batch = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        want_alone = llm.generate(PROMPTS[1], GREEDY)[0].token_ids
    before = dict(llm.engine.plugins.counts)
    # plugin_verify=1000: every step also runs the own forward and must agree to 1e-4 (else PluginVerifyError)
    got_batch = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    got_alone = llm.generate(PROMPTS[1], GREEDY)[0].token_ids
    assert got_batch == want_batch and got_alone == want_alone
    counts = {k: v - before.get(k, 0) for k, v in llm.engine.plugins.counts.items()}
    assert counts.get(("lowlat", "decode"), 0) >= 30 and counts.get(("lowlat", "verify"), 0) >= 5, counts
    assert counts.get(("lowlat", "prefill"), 0) >= 1, counts  # short prompts: one small prefill step
    assert not llm.engine.plugins.disabled
    # the plugin keeps only its activation buffers: no copy of the weights
    assert 0 < llm.engine.plugin_bytes < 16 * 2**20


def test_draft_tree_verify_matches_own_forward():
    """spec_tree: lowlat runs the tree VERIFY steps (a row reads its tree ancestors, at its depth's position), each
    checked against the engine's own forward under the tree mask (plugin_verify: 1e-4); greedy output equals
    plain decoding, and trees that branch were verified."""
    llm = LLM(dtype="float32", weights="dequantize", plugin="lowlat", plugin_verify=1000, spec="suffix", spec_tree=12,
              kv_cache_memory="0.25GiB")
    prompts = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
               "# Now a loop version:\n"]
    trees = []
    verify = llm.engine.spec.verify
    llm.engine.spec.verify = lambda it, logits: trees.append(it.draft.parents) or verify(it, logits)
    got = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    counts = dict(llm.engine.plugins.counts)
    with own_forward(llm):
        plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculative=False)
        assert got == [llm.generate(p, plain)[0].token_ids for p in prompts]
    assert any(p is not None and len(set(p)) < len(p) for p in trees)
    assert counts.get(("lowlat", "verify"), 0) > 5 and ("none", "verify") not in counts, counts
    assert not llm.engine.plugins.disabled


def test_bf16_within_verify_tolerance():
    """plugin_verify on every step of a short bf16 generation (3e-2 relative max on the hidden and the logits).
    Deterministic (fixed prompts; lowlat's results do not depend on the thread count). Over many steps the error
    has median ~1% and p90 ~2%, and ~2% of steps exceed 3e-2: the model's own bf16 forward moves as much when a
    few of its roundings change (results/lowlat_ablation.md)."""
    llm = LLM(dtype="bfloat16", weights="dequantize", plugin="lowlat", plugin_verify=8, kv_cache_memory="0.25GiB",
              spec=None)
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    counts = llm.engine.plugins.counts
    assert counts[("lowlat", "decode")] == 7 and not llm.engine.plugins.disabled
    assert llm.engine.plugins.plugins[0].uses_dot == ("avx512_bf16" in cpu_flags())


def test_bf16_speculation_is_lossless():
    """lowlat's kernels are batch-invariant, so in bf16 too a prompt decodes the same tokens alone and in a batch,
    and n-gram speculation (verify rows) emits exactly the plain tokens. (Not under plugin_verify: the steps it
    checks write the engine's own forward's KV, which differs from lowlat's in bf16 rounding.)"""
    llm = LLM(dtype="bfloat16", weights="dequantize", plugin="lowlat", kv_cache_memory="0.25GiB", spec="ngram")
    plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculative=False)
    want = [llm.generate(p, plain)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(PROMPTS, plain)] == want
    assert [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS] == want
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    counts = llm.engine.plugins.counts
    assert counts[("lowlat", "verify")] >= 5 and not llm.engine.plugins.disabled


def test_eagle_draft_head_steps():
    """spec="draft" with the shipped EAGLE-style head: lowlat runs the target's VERIFY steps and the head's whole
    greedy drafting (fusion, draft-extend and chain) in one C++ call per step; greedy output equals plain
    decoding."""
    llm = LLM(dtype="float32", weights="dequantize", spec="draft", draft="hass", plugin="lowlat", plugin_verify=1000,
              kv_cache_memory="0.25GiB")
    eng = llm.engine
    got = [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]
    counts = dict(eng.plugins.counts)
    eng.plugins = eng.kv.runner.plugins = eng.proposer.plugins = None
    assert got == [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]
    assert all(counts.get(("lowlat", k), 0) > 5 for k in ("verify", "draft_propose")), counts
    assert not any(k[0] == "none" for k in counts), counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_chain_matches_step_by_step(dtype):
    """The head's k - 1 chained greedy steps in one call give the tokens (and KV) of the step-by-step path the
    plugin runs otherwise (DraftHead arithmetic with lowlat's GEMV), for 3 rows of different lengths."""
    from lanner.models.loader import ModelSource, load_model
    from lanner.spec.draft_head import DraftHead
    from lanner.spec.drafts import resolve_draft

    target, cfg = load_model(ModelSource.resolve(None), dtype, "cpu")
    head = DraftHead.load(resolve_draft("hass"), dtype, "cpu")
    hw = Hardware.detect("cpu", dtype)
    plug = LowLatPlugin(head_weights="dense")
    plug.check(cfg, hw)
    plug.build(target, cfg, hw)
    bs, tables, lens, steps = 16, [[4, 0, 9], [1, 2, 3], [5, 6, 7]], [20, 33, 40], 5
    kv = torch.zeros(2, 10 * bs, head.Hkv, head.D, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    hs, firsts = [], []
    with torch.inference_mode():
        for b, n in enumerate(lens):  # draft-extend each row over random features
            feats = torch.randn(n, 3 * cfg.hidden_size, generator=g).to(dtype)
            meta = build_attention_metadata([n], [n], [tables[b]], bs, "cpu")
            logits, out = head(head.fuse(feats), target.embed_tokens(torch.randint(0, 40000, (n,), generator=g)),
                               torch.arange(n), kv[0], kv[1], meta)
            hs.append(out[-1])
            firsts.append(int(head.d2t[logits[-1].float().argmax()]))
        hidden, kv_ref = torch.stack(hs), kv.clone()
        want, x, tok, pos = [], hidden, torch.tensor(firsts), list(lens)
        for _ in range(steps):
            meta = build_attention_metadata([1] * 3, [p + 1 for p in pos], tables, bs, "cpu")
            logits, x = plug.forward(Step(StepKind.DRAFT, 3, 3, "draft_head"), head, x, target.embed_tokens(tok),
                                     torch.tensor(pos), kv_ref[0], kv_ref[1], meta)
            tok = head.d2t[logits.float().argmax(-1)]
            want.append(tok.tolist())
            pos = [p + 1 for p in pos]
        got = plug.draft_chain(head, target.embed_tokens.weight, hidden, torch.tensor(firsts), torch.tensor(lens),
                               steps, kv[0], kv[1], tables, bs)
    assert got.tolist() == [list(r) for r in zip(*want)]
    tol = 1e-5 if dtype == torch.float32 else 0.07  # bf16: an ulp here and there in the written K/V
    assert (kv.float() - kv_ref.float()).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_propose_matches_extend_then_chain(dtype):
    """The fused drafting call (fc, the draft-extend over each sequence's new rows, the chain) gives the tokens and
    KV of the plugin's separate steps: fc and the extend on lowlat's GEMV with PyTorch attention, then the chain.
    Three sequences with earlier context in their caches, 1, 3 and 5 new rows. With the head's matrices in Q8_0
    blocks (head_weights="q8", the default) the written K/V stay within Q8_0's error of the dense head's."""
    from lanner.models.loader import ModelSource, load_model
    from lanner.spec.draft_head import DraftHead
    from lanner.spec.drafts import resolve_draft

    target, cfg = load_model(ModelSource.resolve(None), dtype, "cpu")
    head = DraftHead.load(resolve_draft("hass"), dtype, "cpu")
    hw = Hardware.detect("cpu", dtype)
    plug, plug_q8 = LowLatPlugin(head_weights="dense"), LowLatPlugin()
    for p in (plug, plug_q8):
        p.check(cfg, hw)
        p.build(target, cfg, hw)
    bs, tables, steps = 16, [[4, 0, 9], [1, 2, 3], [5, 6, 7]], 4
    before, q_lens = [17, 30, 9], [1, 3, 5]  # positions already in the head's cache, new rows
    g = torch.Generator().manual_seed(1)
    kv = (torch.randn(2, 10 * bs, head.Hkv, head.D, generator=g) * 0.5).to(dtype)
    feats = torch.randn(sum(q_lens), 3 * cfg.hidden_size, generator=g).to(dtype)
    tokens = torch.randint(0, 40000, (sum(q_lens),), generator=g)
    positions = torch.tensor([p for b, n in zip(before, q_lens) for p in range(b, b + n)])
    ctx = [b + n for b, n in zip(before, q_lens)]
    last = torch.tensor(q_lens).cumsum(0) - 1
    with torch.inference_mode():
        kv_ref = kv.clone()
        meta = build_attention_metadata(q_lens, ctx, tables, bs, "cpu")
        hidden = plug.linear(feats, head.fc.weight)
        logits, out = plug.forward(Step(StepKind.DRAFT_EXTEND, len(tokens), 3, "draft_head"), head, hidden,
                                   target.embed_tokens(tokens), positions, kv_ref[0], kv_ref[1], meta)
        first = head.d2t[logits[last].float().argmax(-1)]
        rest = plug.draft_chain(head, target.embed_tokens.weight, out[last].contiguous(), first, torch.tensor(ctx),
                                steps - 1, kv_ref[0], kv_ref[1], tables, bs)
        want = torch.cat([first[:, None], rest], 1)
        kv_q8 = kv.clone()
        got = plug.draft_propose(head, target.embed_tokens.weight, feats, tokens, positions, q_lens, steps, kv[0],
                                 kv[1], tables, bs)
        plug_q8.draft_propose(head, target.embed_tokens.weight, feats, tokens, positions, q_lens, steps, kv_q8[0],
                              kv_q8[1], tables, bs)
    assert got.tolist() == want.tolist()
    tol = 1e-5 if dtype == torch.float32 else 0.07  # bf16: an ulp here and there in the written K/V
    assert (kv.float() - kv_ref.float()).abs().max().item() <= tol
    rows = [t * bs + i for t in tables[0] for i in range(bs)]  # one sequence's slots, written and not
    err = (kv_q8.float() - kv.float())[:, rows].abs().max().item()
    assert 0 < err <= 0.03 * kv.float()[:, rows].abs().max().item()
    with pytest.raises(RuntimeError, match="q_lens"):
        plug.draft_propose(head, target.embed_tokens.weight, feats, tokens, positions, [1, 3, 4], steps, kv[0],
                           kv[1], tables, bs)


def test_kernels_match_torch(llm32_lowlat):
    """GEMV and paged attention on their own: batched sequences of different lengths over scattered blocks."""
    plugin = llm32_lowlat.engine.plugins.plugins[0]
    torch.manual_seed(0)
    w = torch.randn(301, 200)  # an odd row count and K % 32 != 0: the kernels' tails
    for m in (1, 3, 6, 9, 20):
        x = torch.randn(m, 200)
        assert (plugin.linear(x, w) - F.linear(x, w)).abs().max() < 1e-4
    H, Hkv, D, bs = 9, 3, 64, 16
    kc, vc = torch.randn(60 * bs, Hkv, D), torch.randn(60 * bs, Hkv, D)
    q_lens, ctx_lens = [1, 2, 6], [40, 17, 90]
    tables = [[7, 3, 9], [20, 21], [50, 1, 2, 30, 31, 40]]
    meta = build_attention_metadata(q_lens, ctx_lens, tables, bs, "cpu")
    q = torch.randn(sum(q_lens), H, D)
    pos = torch.tensor([c - n + i for n, c in zip(q_lens, ctx_lens) for i in range(n)])
    want = paged_attention(q, kc[meta.slot_mapping], vc[meta.slot_mapping], kc, vc, meta, D ** -0.5)
    got = plugin._kernel.attention(q.view(-1, H * D), kc, vc, pos, q_lens, ctx_lens, tables, bs)
    assert (got - want).abs().max() < 1e-5


def tiny_model(**extra):
    cfg = {"architecture": "LlamaForCausalLM", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
           "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 256}
    c = ModelConfig(**{**cfg, **extra})
    torch.manual_seed(1)
    model = LlamaModel(c)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.2) + (1.0 if "norm" in name else 0.0))
    model.init_rotary("cpu")
    return model.eval()


@pytest.mark.parametrize("extra", [{}, {"attention_bias": True, "architecture": "Qwen2ForCausalLM"},
                                   {"qk_norm": True, "architecture": "Qwen3ForCausalLM", "head_dim": 32}])
@pytest.mark.parametrize("dtype,isa", [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                       pytest.param(torch.bfloat16, "avx512f", marks=needs_avx512)])
def test_draft_model_structures(llm32_lowlat, extra, dtype, isa):
    """A model other than the one built (a draft model) gets its own kernel on first use; each Llama-family
    variant (Qwen2's q/k/v bias, Qwen3's q/k norm) against its own forward, one batched mixed step; bf16 with
    AVX512_BF16 dot products and with the plain AVX-512F conversion path."""
    target = llm32_lowlat.engine.plugins.plugins[0]
    plugin = LowLatPlugin(threads=target.threads_used, isa=isa)
    model = tiny_model(**extra).to(dtype)
    plugin.build(model, model.cfg, Hardware.detect("cpu", dtype))
    draft = tiny_model(**extra).to(dtype)  # same structure, another model object: built lazily
    c = draft.cfg
    kv1 = torch.zeros(c.num_layers, 2, 40 * 16, c.num_kv_heads, c.head_dim, dtype=dtype)
    kv2 = kv1.clone()
    q_lens, ctx_lens, tables = [5, 1, 3], [20, 33, 3], [[4, 5], [9, 2, 7], [0]]
    meta = build_attention_metadata(q_lens, ctx_lens, tables, 16, "cpu")
    ids = torch.randint(0, 128, (9,))
    pos = torch.tensor([cl - ql + i for ql, cl in zip(q_lens, ctx_lens) for i in range(ql)])
    with torch.inference_mode():
        # earlier context in both caches from the own forward, then this step through both paths
        for b, (ql, cl) in enumerate(zip(q_lens, ctx_lens)):
            if cl > ql:
                m = build_attention_metadata([cl - ql], [cl - ql], [tables[b]], 16, "cpu")
                args = (torch.randint(0, 128, (cl - ql,)), torch.arange(cl - ql))
                draft(*args, [(kv1[i, 0], kv1[i, 1]) for i in range(2)], m, ())
                draft(*args, [(kv2[i, 0], kv2[i, 1]) for i in range(2)], m, ())
        want, wcap = draft(ids, pos, [(kv1[i, 0], kv1[i, 1]) for i in range(2)], meta, (0, 1))
        got, gcap = plugin.forward(Step(StepKind.VERIFY, 9, 3, "draft"), draft, ids, pos,
                                   [(kv2[i, 0], kv2[i, 1]) for i in range(2)], meta, (0, 1))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for g, w in [(got, want), (gcap[0], wcap[0]), (gcap[1], wcap[1]), (kv2, kv1)]:
        assert g.dtype == w.dtype and g.shape == w.shape
        assert ((g.float() - w.float()).abs().max() / w.float().abs().max()).item() <= tol
    assert plugin._kernel_for(draft) is not plugin._kernel  # the draft got its own kernel


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_build_is_bit_identical(dtype):
    """isa="avx2" (lowlat built without AVX-512: csrc/avx2.h, as on an AVX2-only CPU) against the AVX-512F build:
    the same logits, captured layers and KV bits for a mixed step (prefill chunk, verify rows, decode), with
    Qwen3's q/k norm. (bf16 against the AVX-512F conversion path: AVX512_BF16 dot products sum differently.)"""
    extra = {"qk_norm": True, "architecture": "Qwen3ForCausalLM", "head_dim": 32}
    model = tiny_model(**extra).to(dtype)
    c = model.cfg
    outs = []
    for isa in ("avx512f", "avx2"):
        plugin = LowLatPlugin(threads=2, isa=isa)
        hw = Hardware.detect("cpu", dtype)
        plugin.check(c, hw)
        plugin.build(model, c, hw)
        kv = torch.zeros(c.num_layers, 2, 40 * 16, c.num_kv_heads, c.head_dim, dtype=dtype)
        caches = [(kv[i, 0], kv[i, 1]) for i in range(c.num_layers)]
        steps = []
        for q_lens, ctx_lens in (([17, 3], [17, 3]), ([4, 1], [21, 4])):
            meta = build_attention_metadata(q_lens, ctx_lens, [[4, 5], [9]], 16, "cpu")
            ids = torch.randint(0, 128, (sum(q_lens),), generator=torch.Generator().manual_seed(sum(ctx_lens)))
            pos = torch.tensor([cl - ql + i for ql, cl in zip(q_lens, ctx_lens) for i in range(ql)])
            with torch.inference_mode():
                step = Step(StepKind.PREFILL if max(q_lens) > 8 else StepKind.VERIFY, len(ids), 2)
                hidden, cap = plugin.forward(step, model, ids, pos, caches, meta, (0, 1))
                steps.append((plugin.compute_logits(step, model, hidden), *cap))
        outs.append((steps, kv))
        assert plugin.extension().isa == ("avx2" if isa == "avx2" else "avx512")
    (s1, kv1), (s2, kv2) = outs
    assert all(torch.equal(a, b) for x, y in zip(s1, s2) for a, b in zip(x, y)) and torch.equal(kv1, kv2)


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="needs a CPU with AVX512_BF16")
@pytest.mark.parametrize("head_dim", [64, 32])
def test_bf16_dot_attention_is_bit_identical(head_dim):
    """bf16 attention through vdpbf16ps (on by default on such a CPU) against the FMA path: every output bit equal
    (the products are exact and the pairs are laid out so that the sums run in the FMA path's order), over
    batched sequences of odd lengths, scattered blocks, decode and verify rows."""
    model = tiny_model(num_heads=6, num_kv_heads=3, head_dim=head_dim).to(torch.bfloat16)
    plugin = LowLatPlugin(threads=1)
    hw = Hardware.detect("cpu", torch.bfloat16)
    plugin.check(model.cfg, hw)
    plugin.build(model, model.cfg, hw)
    kernel = plugin._kernel
    assert kernel.attn_dot
    kernel.attn_amx = False  # (the AMX path, where the CPU has it, is tests/test_attention_amx.py's)
    H, Hkv, D, bs = 6, 3, head_dim, 16
    torch.manual_seed(0)
    kc, vc = torch.randn(80 * bs, Hkv, D).bfloat16(), torch.randn(80 * bs, Hkv, D).bfloat16()
    q_lens, ctx_lens = [1, 5, 3], [1, 600, 45]
    tables = [[70], list(range(40, 78)), [9, 3, 30]]
    q = torch.randn(sum(q_lens), H * D).bfloat16()
    pos = torch.tensor([c - n + i for n, c in zip(q_lens, ctx_lens) for i in range(n)])
    outs = []
    for flag in (True, False):
        kernel.attn_dot = flag
        outs.append(kernel.attention(q, kc, vc, pos, q_lens, ctx_lens, tables, bs))
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0


@pytest.mark.parametrize("head_dim", [64, 48])
def test_thread_count_does_not_change_bits(head_dim):
    """One sequence's step on 1 and on 2 threads: attention items become runs of q heads that split a GQA group
    (6 heads over 3 kv groups, 2 threads: heads 0-2 and 3-5), the GEMVs split their rows; every output bit is the
    same. head_dim 64 takes the kernel compiled for that size, 48 the one reading it at run time."""
    model = tiny_model(num_heads=6, num_kv_heads=3, head_dim=head_dim)
    # two chunks of prefill, then 3 verify rows
    outs = [one_sequence(LowLatPlugin(threads=t), model, ((40, 40), (40, 80), (3, 83)), [7, 2, 9, 4, 11, 30], 60)
            for t in (1, 2)]
    (s1, kv1), (s2, kv2) = outs
    assert all(torch.equal(a, b) for a, b in zip(s1, s2)) and torch.equal(kv1, kv2)


def one_sequence(plugin, model, steps, table, blocks, attn_split=True):
    """plugin built for model runs one sequence's steps ((q_len, ctx_len), random ids) over a zeroed cache of
    `blocks` 16-token blocks: (the logits of each step, the cache)."""
    c, dtype = model.cfg, next(model.parameters()).dtype
    hw = Hardware.detect("cpu", dtype)
    plugin.check(c, hw)
    plugin.build(model, c, hw)
    plugin._kernel.attn_split = attn_split
    kv = torch.zeros(c.num_layers, 2, blocks * 16, c.num_kv_heads, c.head_dim, dtype=dtype)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(c.num_layers)]
    logits = []
    for ql, cl in steps:
        meta = build_attention_metadata([ql], [cl], [table], 16, "cpu")
        ids = torch.randint(0, 128, (ql,), generator=torch.Generator().manual_seed(cl))
        with torch.inference_mode():
            step = Step(StepKind.PREFILL if ql > 8 else StepKind.VERIFY, ql, 1)
            hidden, _ = plugin.forward(step, model, ids, torch.arange(cl - ql, cl), caches, meta, ())
            logits.append(plugin.compute_logits(step, model, hidden))
    return logits, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_attention_keeps_the_bits(dtype):
    """Flash-decoding: one sequence over three 512-key parts (one kv group for 4 q heads, so that heads alone give
    2 threads nothing to split), prefilled in 256-row chunks, then 8 verify rows whose last two cross into a new
    part, then a decode row. Its parts spread over 2 threads (attn_split) give every logit and KV bit of the same
    parts folded on one thread (attn_split off; 1 thread). bf16 runs the AMX kernel where the CPU has it. (The
    fold against PyTorch's attention: tests/test_kv_q8.py, ctx 600.)"""
    model = tiny_model(num_heads=4, num_kv_heads=1, head_dim=32, max_position_embeddings=2048).to(dtype)
    steps = ((256, 256), (256, 512), (256, 768), (250, 1018), (8, 1026), (1, 1027))
    table = [(7 * j) % 80 for j in range(80)]  # scattered blocks
    outs = [one_sequence(LowLatPlugin(threads=t, prefill_rows=256), model, steps, table, 80, attn_split=split)
            for t, split in ((1, True), (2, False), (2, True))]
    for steps, kv in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0][0], steps)) and torch.equal(outs[0][1], kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_argmax_is_torchs_argmax(dtype):
    """Greedy steps' LM head returns the argmax, not the logits (compute_argmax): the first index of the largest
    model-dtype value, as torch's argmax of compute_logits, on 1 and 2 threads (whose column slices meet at row
    64): exact ties inside and across the slices, float32 values that round to one bf16 value (where the float32
    argmax differs), random rows, and (float32) a NaN, which torch counts as the largest."""
    model = tiny_model().to(dtype)
    w = model.lm_head.weight.data
    w[:, 2:7] = 0
    h = torch.zeros(5, 64, dtype=dtype)
    h[0, 2], w[5, 2], w[30, 2], w[70, 2], w[80, 2] = 1, 1000, 1000, 1000, 1000  # ties across the slices -> 5
    h[1, 3], w[70, 3], w[100, 3] = 1, 1000, 1000  # ties in the second slice -> 70
    h[2, 4], w[10, 4], w[80, 4] = 1, -1000, 1  # one largest
    h[3, 7:] = torch.randn(57)
    h[4, 5], h[4, 6], w[20, 5], w[20, 6], w[90, 5], w[90, 6] = 1, 1, 4096, 1, 4096, 8  # 4097 < 4104
    exact = F.linear(h.double(), w.double())
    want = [5, 70, 80, int(exact[3].argmax()), 20 if dtype == torch.bfloat16 else 90]  # bf16: both are 4096
    plugins = []
    for threads in (1, 2):
        plugin = LowLatPlugin(threads=threads)
        hw = Hardware.detect("cpu", dtype)
        plugin.check(model.cfg, hw)
        plugin.build(model, model.cfg, hw)
        plugins.append(plugin)
    step = Step(StepKind.VERIFY, 5, 1)
    for plugin in plugins:
        got = plugin.compute_argmax(step, model, h)
        assert got.tolist() == want and torch.equal(got, plugin.compute_logits(step, model, h).argmax(-1))
    if dtype == torch.float32:
        w[90, 5] = float("nan")  # every row's logit 90 (NaN * 0 is NaN)
        for plugin in plugins:
            assert plugin.compute_argmax(step, model, h).tolist() == [90] * 5


def test_check_names_the_mismatch():
    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    flags = frozenset({"avx512f", "avx512_bf16"})
    plugin = LowLatPlugin()
    plugin.check(cfg, Hardware("cpu", torch.bfloat16, "test cpu", None, flags))
    assert plugin.variant == "avx512"
    with pytest.raises(PluginMismatch, match="lowlat: CUDA path not built"):
        plugin.check(cfg, Hardware("cuda:0", torch.bfloat16, "GPU", (9, 0)))
    with pytest.raises(PluginMismatch, match="neither AVX-512F nor AVX2.*f16c"):
        plugin.check(cfg, Hardware("cpu", torch.bfloat16, "old cpu", None, frozenset({"avx2", "fma"})))
    plugin.check(cfg, Hardware("cpu", torch.bfloat16, "avx2 cpu", None, frozenset({"avx2", "fma", "f16c"})))
    assert plugin.variant == "avx2"  # an AVX2-only CPU gets the AVX2 build
    with pytest.raises(PluginMismatch, match="lacks the avx512f flag"):
        LowLatPlugin(isa="avx512f").check(cfg, Hardware("cpu", torch.bfloat16, "avx2 cpu", None,
                                                        frozenset({"avx2", "fma", "f16c"})))
    plugin.check(cfg, Hardware("cpu", torch.float32, "test cpu", None, flags, tp_size=2))  # TP: tests/test_lowlat_tp.py
    with pytest.raises(PluginMismatch, match="float16"):
        plugin.check(cfg, Hardware("cpu", torch.float16, "test cpu", None, flags))
    with pytest.raises(ValueError, match="unknown option.*'thread'"):
        LowLatPlugin(thread=2)
    with pytest.raises(ValueError, match="max_rows"):
        LowLatPlugin(max_rows=0)
    with pytest.raises(ValueError, match="allreduce must be"):
        LowLatPlugin(allreduce="nccl")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        LowLatPlugin(timeout_s=0)
    # what it covers: small steps of the target, a draft model, an EAGLE-style draft head
    plugin = LowLatPlugin(max_rows=8, prefill_rows=16)
    assert plugin.covers(Step(StepKind.DECODE, 8, 8)) is False  # not built yet
    plugin._kernel = object()
    assert plugin.covers(Step(StepKind.DECODE, 8, 8)) and plugin.covers(Step(StepKind.VERIFY, 6, 1, "draft"))
    assert plugin.covers(Step(StepKind.PREFILL, 16, 1)) and not plugin.covers(Step(StepKind.PREFILL, 17, 1))
    assert not plugin.covers(Step(StepKind.VERIFY, 9, 1)) and not plugin.covers(Step(StepKind.DECODE, 9, 9))
    assert plugin.covers(Step(StepKind.DRAFT, 1, 1, "draft_head"))
