"""The cudagraph plugin on the CPU: its padded decode and verify steps compile whole (torch.compile fullgraph=True,
inductor) and give the engine's own forward's logits and KV-cache writes, through the real ModelRunner and through
LLM. The CUDA graphs themselves need a GPU (tools/gpu_graphs.py); what is checked here is that the step they capture
has no graph break, no host synchronisation and the same results.

One plugin is built per module and its compiled step is shared by the tests (inductor on 2 cores: ~10-20 s per
compile class)."""
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

import lanner.plugins as plugins
from lanner import LLM, SamplingParams
from lanner.engine.runner import ModelRunner, SeqChunk
from lanner.models.loader import ModelSource, load_config, load_model
from lanner.plugins import Hardware, PluginMismatch, PluginRuntime, StepKind, register_plugin, select_plugins
from lanner.plugins.cudagraph import CudaGraphPlugin
from lanner.plugins.cudagraph.step import static_step

# the entry point is in pyproject.toml (checked below); registering the class too lets LLM(plugin="cudagraph") find it
# in a checkout whose installed metadata predates the entry point
register_plugin("cudagraph", CudaGraphPlugin)
# decode at batch 1 and 2 and verify (1 + 3 drafts) at batch 2: three of the four compile classes
OPTIONS = {"cpu": True, "batch_sizes": [1, 2], "rows": [1, 4], "contexts": [64]}
TABLES = {"a": [3, 4, 9, 10], "b": [7, 1, 12, 2], "c": [5, 6, 8, 11, 13]}


@pytest.fixture(scope="module")
def rig(tiny_llama):
    model, cfg = load_model(ModelSource.resolve(tiny_llama), torch.float32, "cpu")
    hw = Hardware.detect("cpu", torch.float32)
    plugin = CudaGraphPlugin(**OPTIONS)
    plugin.check(cfg, hw)
    plugin.build(model, cfg, hw)
    runtime = PluginRuntime([plugin])
    own = ModelRunner(model, 16, 16, torch.float32, "cpu")
    graphed = ModelRunner(model, 16, 16, torch.float32, "cpu", plugins=runtime)
    return plugin, runtime, own, graphed


def test_padded_steps_compile_whole_and_equal_the_engines_forward(rig):
    """Decode at batch 1 and 2 and a verify step of uneven rows (4 and 2, the second crossing a block boundary) run
    compiled and match the own forward: logits to 1e-5 and every KV slot (the padded rows wrote nothing). A
    one-token prompt at position 0 and a context past the largest bucket run the engine's forward."""
    plugin, runtime, own, graphed = rig
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, 256, (n,), generator=gen).tolist()

    def both(chunks, kind):
        want, got = own.run(chunks, kind), graphed.run(chunks, kind)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
        for layer_own, layer_graphed in zip(own.kv_caches, graphed.kv_caches):
            for a, b in zip(layer_own, layer_graphed):
                assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
        return got

    both([SeqChunk(ids(21), 0, TABLES["a"]), SeqChunk(ids(30), 0, TABLES["b"])], StepKind.PREFILL)
    both([SeqChunk(ids(1), 21, TABLES["a"])], StepKind.DECODE)
    both([SeqChunk(ids(1), 22, TABLES["a"]), SeqChunk(ids(1), 30, TABLES["b"])], StepKind.DECODE)
    out = both([SeqChunk(ids(4), 23, TABLES["a"], "all"), SeqChunk(ids(2), 31, TABLES["b"], "all")],
               StepKind.VERIFY)
    assert out.shape[0] == 6
    counts = runtime.counts
    assert counts[("none", "prefill")] == 1 and ("cudagraph", "prefill") not in counts
    assert counts[("cudagraph", "decode")] == 2 and counts[("cudagraph", "verify")] == 1
    assert counts[("cudagraph", "logits")] == 3  # the logits came out of the compiled step too
    assert plugin.eager_steps == 0 and not runtime.disabled
    # fullgraph=True raises on any graph break; one compile per class (batch 1, batch n, batch n x rows n)
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(static_step.__code__)
    assert 1 <= len(entries) <= 3

    both([SeqChunk(ids(1), 0, [14])], StepKind.DECODE)  # position 0: the slot padded rows write back
    both([SeqChunk(ids(70), 0, TABLES["c"])], StepKind.PREFILL)
    both([SeqChunk(ids(1), 70, TABLES["c"])], StepKind.DECODE)  # 71 tokens > the 64-token bucket
    assert plugin.eager_steps == 2 and counts[("cudagraph", "decode")] == 4


@pytest.mark.parametrize("dynamic", [True, False])
def test_buckets_warmed_at_build_serve_the_engines_cache(rig, dynamic):
    """With warmup (what build does on CUDA: every compile on a scratch KV cache, before the engine's exists), the
    engine's cache needs no further compile, with symbolic sizes and with dynamic=false (the fallback: one static
    compile per bucket); traced with aot_eager (the compiles are what is checked), the step equals the own
    forward."""
    _, _, own, _ = rig
    model, hw = own.model, Hardware.detect("cpu", torch.float32)
    plugin = CudaGraphPlugin(cpu=True, batch_sizes=[2, 4], rows=[1], contexts=[64], dynamic=dynamic, warmup=True,
                             backend="aot_eager")
    plugin.build(model, model.cfg, hw)
    before = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(static_step.__code__))
    runner = ModelRunner(model, 16, 16, torch.float32, "cpu", plugins=PluginRuntime([plugin]))
    chunks = [SeqChunk([7, 8, 9], 0, [3]), SeqChunk([4, 5], 0, [6])]
    assert torch.equal(runner.run(chunks, StepKind.PREFILL), own.run(chunks, StepKind.PREFILL))
    chunks = [SeqChunk([11], 3, [3]), SeqChunk([12], 2, [6])]
    want = own.run(chunks, StepKind.DECODE)
    assert torch.allclose(runner.run(chunks, StepKind.DECODE), want, atol=1e-5, rtol=1e-5)
    assert plugin.eager_steps == 0
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(static_step.__code__)) == before


def test_greedy_through_the_engine_equals_plain_and_memory_is_counted(rig, tiny_llama):
    """LLM(plugin="cudagraph") with n-gram speculation: the same greedy tokens as plugin=None, decode and verify
    steps through the plugin (each checked against the engine's forward by plugin_verify), prefill through the
    engine's forward, and the plugin's static buffers taken off the KV budget."""
    prompts = [[5, 17, 42, 99, 3, 5, 17, 42, 99, 3, 5, 17], [64, 128, 250, 11, 12, 13, 64, 128, 250]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    opts = dict(dtype="float32", kv_cache_memory="0.05GiB", skip_tokenizer=True, spec="ngram")
    with LLM(tiny_llama, **opts, plugin=None) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(tiny_llama, **opts, plugin="cudagraph", plugin_verify=1000,
             plugin_options={"cudagraph": OPTIONS}) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        rt = llm.engine.plugins
        plugin = rt.plugins[0]
        assert not rt.disabled and rt.counts[("none", "prefill")] >= 1
        assert rt.counts[("cudagraph", "verify")] >= 5 and rt.counts.get(("cudagraph", "decode"), 0) >= 1
        buffers = (plugin._raw, plugin._packed, plugin._host, plugin._hidden, plugin._logits, plugin._argmax)
        assert llm.engine.plugin_bytes == sum(t.numel() * t.element_size() for t in buffers)


def test_selection_options_and_entry_point(tiny_llama, monkeypatch):
    """check() names what does not fit (a CPU without cpu=true, TP, MoE), options are validated, pyproject's entry
    point loads the class, and --plugin auto passes it over: it runs only when named."""
    cfg = load_config(ModelSource.resolve(tiny_llama))[0]
    hw = Hardware.detect("cpu", torch.float32)
    with pytest.raises(PluginMismatch, match="CUDA graphs need a CUDA device, this engine runs on cpu"):
        CudaGraphPlugin().check(cfg, hw)
    with pytest.raises(PluginMismatch, match="runs on one rank only"):
        CudaGraphPlugin(cpu=True).check(cfg, Hardware("cpu", torch.float32, tp_size=2))
    moe = type(cfg)(**{**cfg.__dict__, "architecture": "MixtralForCausalLM", "hf": {"num_local_experts": 4}})
    with pytest.raises(PluginMismatch, match="not a dense Llama-family model"):
        CudaGraphPlugin(cpu=True).check(moe, hw)
    with pytest.raises(ValueError, match="unknown option"):
        CudaGraphPlugin(threads=2)
    with pytest.raises(ValueError, match="option cpu=1 has the wrong type"):
        CudaGraphPlugin(cpu=1)
    with pytest.raises(ValueError, match="batch_sizes must be a non-empty list of positive integers"):
        CudaGraphPlugin(batch_sizes=[0])
    spec = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    value = spec["project"]["entry-points"][plugins.GROUP]["cudagraph"]
    ep = EntryPoint("cudagraph", value, plugins.GROUP)
    assert ep.load() is CudaGraphPlugin
    monkeypatch.setattr(plugins, "discover", lambda: {"cudagraph": ep})
    assert select_plugins("auto", cfg, hw, {"cudagraph": {"cpu": True}}) == []
    assert [p.name for p in select_plugins("cudagraph", cfg, hw, {"cudagraph": {"cpu": True}})] == ["cudagraph"]
