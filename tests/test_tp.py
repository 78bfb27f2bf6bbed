"""Tensor parallelism through the public API, with real worker processes on gloo (no mocks): greedy output equals
TP=1, speculative drafts stay on rank 0, a plugin collective that times out aborts the step on every rank, and a
worker that dies or hangs is a clean TPError that leaves no process behind.

Every engine start loads the model once per rank, so the default model (SmolLM2-135M) serves only the tests that
are about it (TP=2 == TP=1, the shipped draft head); the plugin and failure tests use a tiny random Llama written
here, which loads in a blink. Prompts are token ids and engines skip the tokenizer (seconds per start). Float32
only: in bfloat16 each rank rounds its partial sums before the all-reduce, so greedy output drifts from TP=1
after a few dozen tokens (measured on the default model: 29, 32 and 30 of 32 tokens equal).
"""
import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from lanner import LLM, SamplingParams
from lanner.distributed import TPError, tp_rank
from lanner.engine.async_engine import AsyncEngine, EngineDeadError
from lanner.plugins import Plugin, StepKind, plugin_all_reduce, register_plugin

# "The three primary colors are", "def fibonacci(n):", "Paris is the capital of"
PROMPTS = [[504, 1296, 3003, 4683, 359], [1604, 3987, 46477, 24, 94, 727], [38634, 314, 260, 3575, 282]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# plugin=None: the engine's own forward is the reference (lowlat runs where a test asks for it); plain decoding
# (spec="auto" speculates on every model), so step kinds and counts are the ones these tests assert on
OPTS = dict(dtype="float32", kv_cache_memory="0.1GiB", skip_tokenizer=True, plugin=None, spec="none")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Spawned workers take rank 0's thread count: 1 each on the shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def greedy_ids(model=None, prompts=PROMPTS, params=GREEDY, **options) -> list[list[int]]:
    with LLM(model, **(OPTS | options)) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


def assert_tp_matches(model=None, prompts=PROMPTS, params=GREEDY, tp=2, want=None, **options):
    """TP=tp greedy output through LLM equals TP=1's (`want`, computed when not given). Reusable for any model."""
    want = want if want is not None else greedy_ids(model, prompts, params, **options)
    assert greedy_ids(model, prompts, params, tp=tp, **options) == want


def gone(pid: int, within: float = 10.0) -> bool:
    """The process has exited (a zombie counts: it runs no more) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


TINY_PROMPTS = [[5, 17, 42, 99, 3], [200, 7, 7, 31], [64, 128, 250, 11, 12, 13]]


def test_tp2_matches_tp1_plain_and_with_the_draft_head_on_rank_0():
    """One TP=2 engine with the shipped EAGLE head: plain requests and speculative ones both give TP=1's plain
    greedy output. The head runs on rank 0 outside the group, on the gathered embedding table."""
    reference = greedy_ids()
    with LLM(**(OPTS | dict(tp=2, spec="draft", draft="hass"))) as llm:
        plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculative=False))
        assert [o.token_ids for o in plain] == reference
        assert all(o.metrics["spec_accept_length"] is None for o in plain)
        spec = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in spec] == reference
        assert all(o.metrics["spec_accept_length"] > 1 for o in spec)  # drafts were proposed and accepted
        assert llm.engine.proposer.embed_weight.shape[0] == llm.engine.model_config.vocab_size  # gathered whole


class SlowCollectivePlugin(Plugin):
    """Covers the target's decode steps: sums a flag over the ranks with plugin_all_reduce, then runs the model's
    own forward. On rank 1 its `slow_call`-th call first sleeps past the collective's timeout."""

    def __init__(self, timeout_s: float = 1.0, slow_call: int = 3):
        self.timeout_s, self.slow_call, self.calls = timeout_s, slow_call, 0

    def supports(self, model_config):
        return True

    def covers(self, step):
        return step.kind == StepKind.DECODE and step.model == "target"

    def forward(self, step, model, *args):
        self.calls += 1
        if tp_rank() == 1 and self.calls == self.slow_call:
            time.sleep(self.timeout_s + 2)
        plugin_all_reduce(torch.ones(1), self.timeout_s)
        return model(*args)


register_plugin("tp-test-slow", SlowCollectivePlugin)  # spawned workers get the registry


def test_plugin_collective_timeout_aborts_the_step_on_every_rank(tiny_llama):
    want = greedy_ids(tiny_llama, TINY_PROMPTS)
    with LLM(tiny_llama, **(OPTS | dict(plugin="tp-test-slow")), tp=2, tp_timeout_s=20) as llm:
        t0 = time.monotonic()
        outs = llm.generate(TINY_PROMPTS, GREEDY)
        assert time.monotonic() - t0 < 20  # the 3 s stall, not the 20 s watchdog
        assert [o.token_ids for o in outs] == want and all(o.error is None for o in outs)
        rt = llm.engine.plugins
        assert "PluginCollectiveAbort" in rt.disabled["tp-test-slow"] and rt.active == []
        assert rt.counts[("tp-test-slow", "decode")] == 2  # the calls before the aborted one
        assert b'lanner_plugin_failures_total{kind="decode",plugin="tp-test-slow"} 1.0' in \
            llm.engine.metrics.render()


def _fail_worker_mid_generation(model: str, sig: int, timeout_s: float):
    """Starts a TP=2 engine, sends `sig` to rank 1 during a long generation; -> (error, seconds from the signal
    to the error, the worker's Process). Checks that the failed engine refuses new work, also through the
    server's front end."""
    llm = LLM(model, **OPTS, tp=2, tp_timeout_s=timeout_s)
    proc = llm.engine.tp.procs[0]
    pid = proc.pid
    sent = []
    timer = threading.Timer(1.5, lambda: (os.kill(pid, sig), sent.append(time.monotonic())))
    timer.start()
    try:
        with pytest.raises(TPError) as err:
            llm.generate(TINY_PROMPTS, SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))
        elapsed = time.monotonic() - sent[0]
        with pytest.raises(TPError, match="tensor-parallel rank 1"):  # refuses new work with the same error
            llm.generate(TINY_PROMPTS[0], GREEDY)
        assert not llm.engine.has_unfinished()
        engine = AsyncEngine(llm.engine)  # the server's front end: /health and new requests answer 503 with this
        assert not engine.is_healthy and engine.error == str(err.value)
        with pytest.raises(EngineDeadError, match="tensor-parallel rank 1"):
            asyncio.run(anext(engine.generate(None, GREEDY, prompt_ids=[5, 6, 7])))
        engine.shutdown()
    finally:
        timer.cancel()
        llm.close()
    return str(err.value), elapsed, proc


def test_killed_worker_is_a_clean_error_and_leaves_no_process(tiny_llama):
    msg, elapsed, proc = _fail_worker_mid_generation(tiny_llama, signal.SIGKILL, 10)
    assert msg.startswith("tensor-parallel rank 1 exited (SIGKILL)"), msg
    assert elapsed < 10
    assert proc.exitcode == -signal.SIGKILL  # exited and reaped: no zombie, no orphan


def test_hung_worker_times_out_and_leaves_no_process(tiny_llama):
    msg, elapsed, proc = _fail_worker_mid_generation(tiny_llama, signal.SIGSTOP, 6)
    proc.kill()  # clean-up if the engine had not (a no-op on a reaped process: no stray signal to a reused pid)
    proc.join(5)
    assert msg.startswith("tensor-parallel rank 1 did not answer within 6 s (its process is stopped)"), msg
    assert elapsed < 6 + 4  # the collective's timeout, plus the step that was running
    assert proc.exitcode == -signal.SIGKILL  # the failed engine killed it


def test_workers_exit_when_rank_0_dies(tiny_llama):
    script = textwrap.dedent(f"""
        import os, signal, torch
        torch.set_num_threads(1)
        from lanner import LLM
        if __name__ == "__main__":
            llm = LLM({tiny_llama!r}, **{OPTS!r}, tp=2)
            print(llm.engine.tp.procs[0].pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    pid = int(r.stdout.split()[-1])
    if not gone(pid):  # still running, so still our orphan: do not leave it behind
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the worker outlived rank 0")


def test_bench_memory_reports_each_rank(tiny_llama, tmp_path):
    from lanner.cli import main

    out = tmp_path / "mem.json"
    assert main(["bench", "memory", "--model", tiny_llama, "--tp", "1,2", "--dtype", "float32", "--json",
                 str(out)]) == 0
    tp1, tp2 = json.loads(out.read_text())["sizes"]
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x float32
    assert tp1["kv_bytes_per_token_per_rank"] == [per_token]
    assert tp2["kv_bytes_per_token_per_rank"] == [per_token // 2] * 2  # one KV head each: split, not duplicated
    assert tp2["kv_bytes_per_token_duplicated"] == 0 and tp2["kv_bytes_per_token_unique"] == per_token
    assert sum(tp2["weight_bytes_per_rank"]) > tp1["weight_bytes_per_rank"][0] > max(tp2["weight_bytes_per_rank"])


def test_bad_tp_options_are_clear_errors():
    with pytest.raises(ValueError, match="tp: must be an integer >= 1"):
        LLM(tp=0)
    with pytest.raises(ValueError, match="tp_timeout_s: must be a positive number"):
        LLM(tp=2, tp_timeout_s=0)


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(__file__), "..", "lanner", "models", "tiny.py")),
                    reason="lanner.models.tiny is not there yet")
def test_tiny_mla_moe_tp2_matches_tp1(tmp_path):
    from lanner.models.tiny import make_tiny_model

    folder = make_tiny_model("glm_moe_dsa", str(tmp_path / "glm"))
    prompts = [[(7 * i + j) % 150 + 2 for j in range(n)] for i, n in enumerate((9, 17, 5))]
    assert_tp_matches(folder, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                      kv_cache_memory="0.01GiB", block_size=8)
    # MLA keeps the whole latent cache on every rank: half of TP=2's KV bytes are duplicates
    from lanner.bench.memory import measure
    from lanner.models.loader import ModelSource, load_config

    cfg, freq_factors, _ = load_config(ModelSource.resolve(folder))
    tp2 = measure(cfg, freq_factors, 2, torch.float32)
    assert tp2["kv_replicated_across_tp"] and tp2["kv_bytes_per_token_duplicated"] * 2 == \
        tp2["kv_bytes_per_token_total"] == 2 * tp2["kv_bytes_per_token_per_rank"][0]
