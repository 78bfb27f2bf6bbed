"""The plugin framework with a real out-of-tree plugin: examples/lanner-plugin-example, pip-installed here."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from lanner import LLM, SamplingParams
from lanner.plugins import (
    Hardware,
    PluginMismatch,
    PluginVerifyError,
    discover,
    select_plugins,
    tensor_bytes,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lanner-plugin-example"
PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Paris is the capital of"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def example_installed():
    """Installs the example package as a user would (a wheel build, not an import path hack); removes it after."""
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        str(EXAMPLE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    importlib.invalidate_caches()
    yield
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", "lanner-plugin-example"],
                   capture_output=True)


@pytest.fixture(scope="module")
def plain_outputs():
    llm = LLM(dtype="float32", kv_cache_memory="0.25GiB", spec=None, plugin=None)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm.engine.kv.num_blocks


def test_discovery_through_entry_points(example_installed):
    eps = discover()
    assert "example" in eps and eps["example"].dist.name == "lanner-plugin-example"
    assert "lowlat" in eps  # Lanner's own plugin is found the same way
    out = subprocess.run([str(Path(sys.executable).with_name("lanner")), "plugins", "list"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "| example | lanner_plugin_example:ExamplePlugin | lanner-plugin-example 0.1.0" \
        in out.stdout


def test_check_fails_before_any_weight_loads(example_installed, monkeypatch):
    import lanner.engine.loading as loading

    loads = []
    real_load = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    with pytest.raises(PluginMismatch, match="example: needs a cuda device, this engine runs on cpu"):
        LLM(plugin="example", plugin_options={"example": {"require": "cuda"}})
    assert loads == []
    # auto mode skips the plugin that does not fit and loads the model without it
    llm = LLM(plugin="auto", plugin_options={"example": {"require": "cuda"}}, kv_cache_memory="0.25GiB")
    assert len(loads) == 1 and "example" not in [p.name for p in (llm.engine.plugins.plugins
                                                                  if llm.engine.plugins else [])]


def test_selection_errors_name_the_cause(example_installed, llm32):
    cfg, hw = llm32.engine.model_config, Hardware.detect("cpu", llm32.engine.config.torch_dtype)
    with pytest.raises(PluginMismatch, match="plugin 'nope' is not installed; installed plugins: .*example"):
        select_plugins("nope", cfg, hw)
    with pytest.raises(PluginMismatch, match="does not support the model structure Qwen3ForCausalLM"):
        select_plugins("example", type(cfg)(**{**cfg.__dict__, "architecture": "Qwen3ForCausalLM"}), hw)
    with pytest.raises(PluginMismatch, match="example: supports tp_size 1, got 2"):
        select_plugins("example", cfg, Hardware("cpu", hw.dtype, tp_size=2))
    with pytest.raises(PluginMismatch, match="failed to load: TypeError: .*unexpected keyword argument 'bogus'"):
        select_plugins("example", cfg, hw, {"example": {"bogus": 1}})


def test_build_memory_comes_off_the_kv_budget(example_installed, plain_outputs):
    _, plain_blocks = plain_outputs
    llm = LLM(dtype="float32", kv_cache_memory="0.25GiB", spec=None, plugin="example",
              plugin_options={"example": {"build_mib": 64}})
    eng = llm.engine
    assert eng.plugin_bytes == 64 * 2**20
    block_bytes = (0.25 * 2**30) / plain_blocks  # what one block costs at this budget
    assert plain_blocks - eng.kv.num_blocks == pytest.approx(64 * 2**20 / block_bytes, abs=1)
    assert b'lanner_plugin_build_bytes{plugin="example"} 6.7108864e+07' in eng.metrics.render()
    # the model's own weights, which a plugin may reference, are not counted
    assert tensor_bytes([eng.model.embed_tokens.weight], {eng.model.embed_tokens.weight.data_ptr()}) == 0


def test_dispatch_covers_decode_and_matches_the_engine(example_installed, plain_outputs):
    want, _ = plain_outputs
    llm = LLM(dtype="float32", kv_cache_memory="0.25GiB", spec=None, plugin="example", plugin_verify=3)
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    counts = llm.engine.plugins.counts
    assert counts[("example", "decode")] >= 11  # 12 tokens: 1 from prefill, the rest from batch-3 decode steps
    assert counts[("none", "prefill")] >= 1 and ("example", "prefill") not in counts
    text = llm.engine.metrics.render().decode()
    assert 'lanner_plugin_steps_total{kind="decode",plugin="example"}' in text
    assert 'lanner_plugin_verified_steps_total{kind="decode",plugin="example"} 3.0' in text
    # with its logits head too
    llm3 = LLM(dtype="float32", kv_cache_memory="0.25GiB", spec=None, plugin="example", plugin_verify=2,
               plugin_options={"example": {"logits": True}})
    assert [o.token_ids for o in llm3.generate(PROMPTS, GREEDY)] == want
    assert llm3.engine.plugins.counts[("example", "logits")] == llm3.engine.plugins.counts[("example", "decode")]
    assert 'kind="logits",plugin="example"} 2.0' in llm3.engine.metrics.render().decode()  # verified twice
    # a batch above max_batch runs on the engine's own forward
    llm2 = LLM(dtype="float32", kv_cache_memory="0.25GiB", spec=None, plugin="example",
               plugin_options={"example": {"max_batch": 2}})
    assert [o.token_ids for o in llm2.generate(PROMPTS, GREEDY)] == want
    assert ("example", "decode") not in llm2.engine.plugins.counts
    assert llm2.engine.plugins.counts[("none", "decode")] >= 11


def test_runtime_failure_falls_back_and_loses_nothing(example_installed, plain_outputs):
    want, _ = plain_outputs
    llm = LLM(dtype="float32", kv_cache_memory="0.25GiB", spec=None, plugin="example", plugin_options={"example": {"fail_at": 3}})
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want and all(o.error is None for o in outs)
    rt = llm.engine.plugins
    assert "failing on purpose in call 3" in rt.disabled["example"] and rt.active == []
    assert rt.counts[("example", "decode")] == 2  # the calls before the failure
    assert b'lanner_plugin_failures_total{kind="decode",plugin="example"} 1.0' in llm.engine.metrics.render()


def test_verify_fails_loudly_on_mismatch(example_installed):
    llm = LLM(dtype="float32", kv_cache_memory="0.25GiB", spec=None, plugin="example", plugin_verify=2,
              plugin_options={"example": {"perturb": 0.5}})
    with pytest.raises(PluginVerifyError, match=r"plugin example \(decode, 1 tokens, batch 1\): output 0 differs"):
        llm.generate(PROMPTS[0], GREEDY)


def test_cli_plugin_options_and_check(example_installed):
    lanner = str(Path(sys.executable).with_name("lanner"))
    r = subprocess.run([lanner, "plugins", "check", "--plugin-option", "example.require=\"cuda\""],
                       capture_output=True, text=True)
    assert "| example | does not fit: example: needs a cuda device" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([lanner, "generate", "Hello", "--max-tokens", "4", "--plugin", "example", "--plugin-verify",
                        "2", "--dtype", "float32"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_bench_latency_compares_the_plugin_with_plain(example_installed, tmp_path):
    lanner = str(Path(sys.executable).with_name("lanner"))
    out = tmp_path / "lat.json"
    r = subprocess.run([lanner, "bench", "latency", "--plugin", "example", "--no-spec", "--max-tokens", "6",
                        "--prompts", "1", "--no-hf", "--dtype", "float32", "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import json
    systems = json.loads(out.read_text())["systems"]
    assert systems["lanner+example"]["greedy_identical_to_plain"] is True
    assert systems["lanner+example"]["speedup_vs_plain"] > 0 and systems["lanner"]["tok_s"] > 0
