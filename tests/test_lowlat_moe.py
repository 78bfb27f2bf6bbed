"""lowlat on MoE models (Qwen3-MoE, Mixtral): the router's top-k against torch.topk (ties included), one mixed
step (decode rows, verify rows, a prefill chunk) against the engine's own forward on tiny random models, the bf16
rounding points bit for bit where the GEMVs are exact, the expert dispatch batching the rows that share an
expert, the kernel referencing (not copying) the model's weights, and greedy generation through the engine."""
import pytest
import torch
import torch.nn.functional as F

from lanner import LLM, SamplingParams
from lanner.layers.attention import build_attention_metadata
from lanner.models.config import ModelConfig
from lanner.models.llama import LlamaModel
from lanner.plugins import (
    Hardware,
    PluginMismatch,
    Step,
    StepKind,
    storage_ptrs,
    tensor_bytes,
)
from lanner.plugins.lowlat import LowLatPlugin
from conftest import needs_avx512, needs_lowlat

pytestmark = needs_lowlat

# layer 1 of the Qwen3-MoE model is dense (mlp_only_layers): both feed-forward kinds in one forward
MOE = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", {"intermediate_size": 96, "qk_norm": True},
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 40, "norm_topk_prob": True,
                   "mlp_only_layers": [1]}),
    "mixtral": ("MixtralForCausalLM", {"intermediate_size": 37}, {"num_local_experts": 8, "num_experts_per_tok": 2}),
}


def tiny_moe(name, num_layers=3, seed=1):
    arch, extra, hf = MOE[name]
    c = ModelConfig(architecture=arch, vocab_size=128, hidden_size=64, num_layers=num_layers, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=256, hf=hf, **extra)
    torch.manual_seed(seed)
    model = LlamaModel(c)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in n else 0.2) + (1.0 if "norm" in n else 0.0))
    model.init_rotary("cpu")
    return model.eval()


def built(model, dtype, isa="auto"):
    plugin = LowLatPlugin(threads=2, isa=isa)
    plugin.check(model.cfg, Hardware.detect("cpu", dtype))
    plugin.build(model, model.cfg, Hardware.detect("cpu", dtype))
    return plugin


def mixed_step(model, plugin, seed=0):
    """One step of 10 rows: a 5-row verify over 15 earlier tokens, a decode row, a 3-token prefill chunk of a new
    sequence, a decode row; the earlier context goes into both KV caches through the own forward first. Returns
    (own, plugin) results: (hidden, [captured per layer], kv caches)."""
    c, dtype = model.cfg, next(model.parameters()).dtype
    L = c.num_layers
    kv = [torch.zeros(L, 2, 40 * 16, c.num_kv_heads, c.head_dim, dtype=dtype) for _ in range(2)]
    q_lens, ctx_lens, tables = [5, 1, 3, 1], [20, 33, 3, 9], [[4, 5], [9, 2, 7], [0], [11]]
    g = torch.Generator().manual_seed(seed)
    meta = build_attention_metadata(q_lens, ctx_lens, tables, 16, "cpu")
    ids = torch.randint(0, 128, (sum(q_lens),), generator=g)
    pos = torch.tensor([cl - ql + i for ql, cl in zip(q_lens, ctx_lens) for i in range(ql)])
    out = []
    with torch.inference_mode():
        for b, (ql, cl) in enumerate(zip(q_lens, ctx_lens)):
            if cl > ql:
                m = build_attention_metadata([cl - ql], [cl - ql], [tables[b]], 16, "cpu")
                args = (torch.randint(0, 128, (cl - ql,), generator=g), torch.arange(cl - ql))
                for k in kv:
                    model(*args, [(k[i, 0], k[i, 1]) for i in range(L)], m, ())
        for k, run in zip(kv, (model, lambda *a: plugin.forward(Step(StepKind.VERIFY, 10, 4), model, *a))):
            hidden, cap = run(ids, pos, [(k[i, 0], k[i, 1]) for i in range(L)], meta, tuple(range(L)))
            out.append((hidden, cap, k))
    return out


def rel(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("name", list(MOE))
@pytest.mark.parametrize("dtype,isa", [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                       pytest.param(torch.bfloat16, "avx512f", marks=needs_avx512)])
def test_mixed_step_matches_own_forward(name, dtype, isa):
    model = tiny_moe(name).to(dtype)
    plugin = built(model, dtype, isa)
    (want, wcap, wkv), (got, gcap, gkv) = mixed_step(model, plugin)
    # float32: the same arithmetic up to summation order (measured <= 2e-6); bf16: the verify tolerance (this
    # tiny random model amplifies a GEMV's summation order as much as a dense one does)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for g, w in [(got, want), *zip(gcap, wcap), (gkv, wkv)]:
        assert rel(g, w) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_do_not_depend_on_thread_count(dtype):
    """1, 2 and 3 threads split the router (8 experts), the expert intermediate size (40) and hidden unevenly;
    the outputs and KV writes are the same bit for bit (each GEMV row is summed the same way on any thread)."""
    model = tiny_moe("qwen3_moe").to(dtype)
    runs = []
    for threads in (1, 2, 3):
        plugin = LowLatPlugin(threads=threads)
        plugin.build(model, model.cfg, Hardware.detect("cpu", dtype))
        _, (hidden, cap, kv) = mixed_step(model, plugin)
        runs.append([hidden, *cap, kv])
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


@pytest.mark.parametrize("isa", ["auto", pytest.param("avx512f", marks=needs_avx512)])
def test_bf16_rounding_points_bit_exact(isa):
    """Where every GEMV is exact (+-1 activations, weights on a 1/16 grid, o_proj zero), the MoE layer's output
    is the engine's bit for bit: the kernel rounds to bf16 where the module does (router logits, gate/up, SiLU,
    SiLU * up, down output, the routing weight, weight * output, each expert's index_add_, the residual add).
    The grid also makes router logits tie, so torch.topk's tie-breaking is exercised. (Leaving the weight *
    output product unrounded, for one, drops this to ~85%.)"""
    for name, hf in [("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
                     ("qwen3_moe", {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 24,
                                    "norm_topk_prob": False})]:
        arch, extra, _ = MOE[name]
        c = ModelConfig(architecture=arch, vocab_size=128, hidden_size=64, num_layers=1, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=256, hf=hf,
                        **{**extra, "intermediate_size": 32})
        model, g = LlamaModel(c), torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.fill_(1.0)
                elif "o_proj" in n:
                    p.zero_()
                elif "embed" in n:
                    p.copy_(torch.randint(0, 2, p.shape, generator=g) * 2.0 - 1)
                else:
                    p.copy_(torch.randint(-8, 9, p.shape, generator=g) / (8 if n.endswith("gate.weight") else 16))
        model.init_rotary("cpu")
        model = model.eval().bfloat16()
        plugin = built(model, torch.bfloat16, isa)
        kv = torch.zeros(2, 2, 20 * 16, 2, 16, dtype=torch.bfloat16)
        T = 64
        meta = build_attention_metadata([T], [T], [[0, 1, 2, 3]], 16, "cpu")
        ids, pos = torch.randint(0, 128, (T,), generator=g), torch.arange(T)
        with torch.inference_mode():
            _, (want,) = model(ids, pos, [(kv[0, 0], kv[0, 1])], meta, (0,))
            _, (got,) = plugin.forward(Step(StepKind.PREFILL, T, 1), model, ids, pos, [(kv[1, 0], kv[1, 1])], meta,
                                       (0,))
        assert (got == want).float().mean().item() >= 0.999, name


@pytest.mark.parametrize("name", list(MOE))
def test_rows_sharing_an_expert_are_batched(name):
    """The kernel's log of its expert GEMV passes (record_moe): per MoE layer one pass per expert some row picked,
    ascending, over exactly the rows that picked it (the counts of the engine's own routing), so an expert that
    several rows picked streams its weights once for all of them."""
    model = tiny_moe(name)
    plugin = built(model, torch.float32)
    routed = {}  # layer -> the own forward's top-k ids [T, k]

    def hook(i):
        def f(mod, args, _out):
            probs = F.softmax(F.linear(args[0], mod.gate.weight), dim=-1, dtype=torch.float)
            routed[i] = probs.topk(mod.top_k, dim=-1).indices
        return f

    handles = [lyr.mlp.register_forward_hook(hook(i)) for i, lyr in enumerate(model.layers)
               if hasattr(lyr.mlp, "experts")]
    kernel = plugin._kernel
    kernel.record_moe = True
    try:
        mixed_step(model, plugin)
    finally:
        kernel.record_moe = False
        for h in handles:
            h.remove()
    log = [tuple(e) for e in kernel.moe_log]
    want = [(i, e, n) for i in sorted(routed) for e, n in enumerate(torch.bincount(routed[i].flatten(), minlength=8)
                                                                      .tolist()) if n]
    assert log == want
    assert sum(n for *_, n in log) == 10 * 2 * len(routed)  # 10 rows x top-2 per MoE layer
    assert len(log) < 10 * 2 * len(routed) and max(n for *_, n in log) >= 3  # shared experts: fewer passes than picks
    kernel.record_moe = True
    try:
        mixed_step(model, plugin, seed=1)  # another step: the log is that step's only
    finally:
        kernel.record_moe = False
    assert sum(n for *_, n in kernel.moe_log) == 10 * 2 * len(routed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_topk_matches_torch(dtype):
    """The router's softmax + top-k (+ renormalization) against MoE.forward's torch ops, on logits with many ties
    (four distinct values) and on random ones: the same experts (torch.topk's order and tie-breaking: nth_element
    below k * 64 <= E, a heap from there) and weights within 2 float32 ulp."""
    for E, k, renorm in [(8, 1, True), (8, 2, False), (8, 3, True), (16, 8, False), (128, 2, True), (130, 2, False),
                         (128, 8, True)]:
        arch = "MixtralForCausalLM" if renorm else "Qwen3MoeForCausalLM"
        hf = {"num_local_experts": E, "num_experts": E, "num_experts_per_tok": k, "moe_intermediate_size": 16}
        c = ModelConfig(architecture=arch, vocab_size=16, hidden_size=32, intermediate_size=16, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=16, hf=hf)
        model = LlamaModel(c)
        model.init_rotary("cpu")
        kernel = built(model.to(dtype), dtype)._kernel
        g = torch.Generator().manual_seed(E + k)
        for x in (torch.randint(0, 4, (300, E), generator=g) / 4.0, torch.randn(300, E, generator=g) * 2):
            x = x.to(dtype)
            w, ids = torch.softmax(x, -1, dtype=torch.float).topk(k, dim=-1)
            if renorm:
                w = w / w.sum(-1, keepdim=True)
            got_ids, got_w = kernel.test_route(x)
            assert torch.equal(got_ids, ids), (E, k)
            assert (got_w - w).abs().max().item() <= 2.4e-7, (E, k)


def test_kernel_references_the_model_weights():
    """build copies no weight: the plugin holds only its activation buffers (what the engine accounts), and an
    in-place change to the model's experts and router shows in the kernel's next forward."""
    model = tiny_moe("qwen3_moe")
    plugin = built(model, torch.float32)
    assert tensor_bytes(plugin, storage_ptrs(model)) == plugin._scratch.untyped_storage().nbytes()
    with torch.no_grad():
        for lyr in model.layers:
            if hasattr(lyr.mlp, "experts"):
                lyr.mlp.experts.w2.mul_(-2.0)
                lyr.mlp.experts.w13[3].zero_()
                lyr.mlp.gate.weight.mul_(1.5)
    (want, _, _), (got, _, _) = mixed_step(model, plugin)
    assert rel(got, want) <= 1e-5


def test_check_names_an_unsupported_moe():
    c = tiny_moe("mixtral", num_layers=1).cfg
    hw = Hardware("cpu", torch.float32, "test cpu", None, frozenset({"avx512f"}))
    bad = ModelConfig(**{**c.__dict__, "hf": {"num_local_experts": 4, "num_experts_per_tok": 6}})
    assert LowLatPlugin().supports(c) and not LowLatPlugin().supports(bad)
    with pytest.raises(PluginMismatch, match="top_k 6 of 4 experts"):
        LowLatPlugin().check(bad, hw)
    with pytest.raises(PluginMismatch, match="architecture DeepseekV32ForCausalLM not supported"):
        LowLatPlugin().check(ModelConfig(**{**c.__dict__, "architecture": "DeepseekV32ForCausalLM"}), hw)


# ---------------------------------------------------------------- through the engine, from a checkpoint


def hf_checkpoint(name, folder):
    """test_moe's tiny checkpoint (Qwen3-MoE with a dense layer between MoE ones; Mixtral), saved."""
    from test_moe import make_hf

    make_hf(name).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("name", list(MOE))
def test_greedy_generation_matches_without_plugin(name, tmp_path):
    """LLM(plugin="lowlat") against LLM(plugin=None) on a tiny MoE checkpoint: identical greedy tokens for a
    batch of three prompts (prefill steps, then decode steps at batch 3, 2, 1 as they finish), every lowlat step
    also checked against the own forward (plugin_verify)."""
    folder = hf_checkpoint(name, tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 12, 20)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 16, 20)]
    common = {"model": folder, "dtype": "float32", "skip_tokenizer": True, "kv_cache_memory": "0.01GiB", "spec": None}
    want = [o.token_ids for o in LLM(**common, plugin=None).generate(prompts, params)]
    llm = LLM(**common, plugin="lowlat", plugin_verify=1000)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    counts = llm.engine.plugins.counts
    assert counts.get(("lowlat", "decode"), 0) >= 20 and counts.get(("lowlat", "prefill"), 0) >= 1, counts
    assert not llm.engine.plugins.disabled
    assert 0 < llm.engine.plugin_bytes < 2**20
