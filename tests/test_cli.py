"""The `lanner` command, run as a user runs it: the installed console script in a subprocess."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lanner import LLM, SamplingParams

_SCRIPT = Path(sys.executable).with_name("lanner")
LANNER = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "lanner"]
PROMPT = "The three primary colors are"


def lanner(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(LANNER + list(args), capture_output=True, text=True, cwd=cwd, timeout=timeout)


@pytest.mark.parametrize("command", [[], ["serve"], ["generate"], ["chat"], ["bench"], ["bench", "latency"],
                                     ["bench", "throughput"]])
def test_help(command):
    r = lanner(*command, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: lanner")
    assert len(r.stdout.split("\n\n")[1].strip()) > 20  # a real description, not just usage


def test_bad_option_is_a_clear_error():
    r = lanner("generate", "hi", "--dtype", "float16", "--device", "cpu")
    assert r.returncode != 0
    assert "float16 is only supported on CUDA" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def greedy_text():
    llm = LLM(dtype="float32")
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_generate_matches_python_api(greedy_text, stream):
    r = lanner("generate", PROMPT, "--max-tokens", "8", "--temperature", "0", "--dtype", "float32",
               *(["--stream"] if stream else []))
    assert r.returncode == 0, r.stderr
    assert greedy_text.strip()
    assert r.stdout == greedy_text + "\n"


def test_chat_repl_keeps_going_and_exits_on_eof():
    r = subprocess.run(LANNER + ["chat", "--temperature", "0", "--max-tokens", "4", "--dtype", "float32"],
                       input="Hello!\n/reset\nHi again.\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    replies = [line for line in r.stdout.split("> ") if line.strip()]
    assert len(replies) == 2  # one per message; /reset produces none
    assert "conversation cleared" in r.stderr


def test_bench_latency(tmp_path):
    """One run against its peers: transformers (in float32 Lanner's greedy tokens must equal its tokens on the same
    weights), llama.cpp (skipped loudly where absent), and Lanner without speculation and without plugins."""
    out = tmp_path / "lat.json"
    r = lanner("bench", "latency", "--max-tokens", "8", "--prompts", "1", "--dtype", "float32",
               "--json", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert {"benchmark", "model", "max_tokens", "prompts", "env", "systems", "greedy_match_vs_hf"} <= data.keys()
    lanner_result = data["systems"]["lanner"]
    assert lanner_result["tok_s"] > 0 and lanner_result["ttft_s"] > 0
    assert [p["output_tokens"] for p in lanner_result["per_prompt"]] == [8]
    assert data["systems"]["hf"]["tok_s"] > 0
    assert data["greedy_match_vs_hf"] == [{"prompt": 0, "matched_prefix": 8, "tokens": 8, "identical": True}]
    assert "vs HF" in r.stdout
    assert "llama.cpp" in data["systems"]
    if "skipped" in data["systems"]["llama.cpp"]:
        assert "SKIPPED" in r.stderr
    assert (tmp_path / "lat.png").stat().st_size > 0
    assert "| lanner |" in r.stdout
    # the default engine runs lowlat and hybrid speculation; the same without speculation and plain Lanner
    # (neither) are its peers in the same run
    spec = data["systems"]["lanner+auto+hybrid"]
    assert data["spec"] == "hybrid" and data["plugin"] == "auto" and "lanner+auto" in data["systems"]
    assert spec["speedup_vs_plain"] > 0 and spec["greedy_identical_to_plain"] is True  # float32: lossless


def test_bench_throughput(tmp_path):
    out = tmp_path / "tp.json"
    r = lanner("bench", "throughput", "--concurrency", "1,2", "--max-tokens", "8", "--num-requests", "2",
               "--dtype", "float32", "--weights", "dequantize", "--json", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["benchmark"] == "throughput"
    # the default engine speculates (hybrid), so plain decoding runs beside it at every level
    assert [(lv["system"], lv["concurrency"]) for lv in data["levels"]] == \
        [("spec-hybrid", 1), ("plain", 1), ("spec-hybrid", 2), ("plain", 2)]
    for lv in data["levels"]:
        assert lv["requests"] == 2 and lv["output_tokens"] == 16
        assert lv["output_tok_s"] > 0 and lv["ttft_p50_s"] > 0 and lv["mean_request_decode_tok_s"] > 0
        assert lv["ratio_vs_plain"] > 0 and (lv["tau"] is None) == (lv["system"] == "plain")
    assert data["levels"][0]["ratio_vs_lowest"] == 1.0
    assert data["levels"][1]["ratio_vs_plain"] == 1.0
    assert (tmp_path / "tp.png").stat().st_size > 0
    assert "| plain | 2 | 2 |" in r.stdout


def test_engine_options_are_generated_from_the_config_fields():
    """Every EngineConfig field marked for the CLI parses into the keyword EngineConfig takes, with its default when
    not given; renamed and inverted flags land on their field."""
    import dataclasses

    from lanner.cli import build_parser, engine_kwargs
    from lanner.config import EngineConfig

    defaults = engine_kwargs(build_parser().parse_args(["generate", "hi"]))
    cli_fields = [f for f in dataclasses.fields(EngineConfig) if f.metadata["cli"]]
    assert set(defaults) == {f.name for f in cli_fields}
    assert all(defaults[f.name] == f.default for f in cli_fields)
    args = build_parser().parse_args(["generate", "hi", "--no-prefix-caching", "--plugin-option", "lowlat.threads=1",
                                      "--plugin-option", "lowlat.act=q8", "--tp-timeout", "5", "--spec-tokens", "4",
                                      "--kv-cache-memory", "0.5", "--ngram-max", "3", "--no-spec", "--plugins", "none"])
    kw = engine_kwargs(args)
    assert {k: v for k, v in kw.items() if v != defaults[k]} == {
        "enable_prefix_caching": False, "plugin_options": {"lowlat": {"threads": 1, "act": "q8"}}, "tp_timeout_s": 5.0,
        "spec_tokens": 4, "kv_cache_memory": "0.5", "ngram_max": 3, "spec": "none", "plugin": "none"}
    assert EngineConfig(**kw).spec is None
