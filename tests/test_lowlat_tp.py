"""lowlat under tensor parallelism, with real gloo worker processes (no mocks): every rank runs lowlat on its shard
and the all-reduces happen inside the kernel call, through a memory segment the ranks share (or, across hosts,
the process group). Greedy output equals TP=1's plain engine, the first steps of each kind are checked against the
engine's own TP forward on every rank (plugin_verify), and a rank that stalls past lowlat's wait limit makes every
rank abort that step together, after which the engine carries on without lowlat and loses nothing.
"""
import glob
import time

import pytest
import torch
from test_lowlat_moe import hf_checkpoint
from test_tp import GREEDY, OPTS, PROMPTS, TINY_PROMPTS, greedy_ids, one_thread  # noqa: F401 (a fixture)

from lanner import LLM, SamplingParams
from lanner.distributed import tp_rank
from lanner.plugins import register_plugin
from lanner.plugins.lowlat.plugin import LowLatPlugin


def lowlat(verify=1000, **options):
    return dict(plugin="lowlat", plugin_verify=verify, plugin_options={"lowlat": {"threads": 1, **options}})


def segments() -> set:
    return set(glob.glob("/dev/shm/lanner-lowlat-*"))


def test_default_model_tp2_with_the_draft_head_equals_tp1_plain():
    """The default model (9 query / 3 KV heads: the ranks hold 6 + 2 and 3 + 1; the vocabulary in halves) at TP=2
    with lowlat on both ranks and the shipped hass head on rank 0: speculative and plain requests give TP=1's plain
    greedy tokens. The shared segment is counted in the plugin's memory and unlinked as soon as every rank has
    mapped it (a crash leaves nothing in /dev/shm)."""
    want = greedy_ids()
    before = segments()
    with LLM(**(OPTS | lowlat(verify=2) | dict(tp=2, spec="draft", draft="hass"))) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculative=False)
        assert [o.token_ids for o in llm.generate(PROMPTS, plain)] == want
        rt = llm.engine.plugins
        assert not rt.disabled
        for kind in ("prefill", "decode", "verify", "logits", "draft_propose"):
            assert rt.counts.get(("lowlat", kind), 0) > 0, rt.counts
        plugin = rt.plugins[0]
        assert plugin._segment is not None and plugin.consistent_failures
        assert llm.engine.plugin_bytes >= plugin._segment.numel()
        assert segments() == before


@pytest.mark.parametrize("allreduce", ["shm", "group"])
def test_tiny_tp2_equals_tp1_over_both_all_reduce_paths(tiny_llama, allreduce):
    """Every lowlat step (forward and logits) on both ranks is checked against the engine's own TP forward."""
    want = greedy_ids(tiny_llama, TINY_PROMPTS)
    with LLM(tiny_llama, **(OPTS | lowlat(allreduce=allreduce)), tp=2) as llm:
        assert [o.token_ids for o in llm.generate(TINY_PROMPTS, GREEDY)] == want
        rt = llm.engine.plugins
        assert not rt.disabled and rt.counts[("lowlat", "decode")] >= 20
        plugin = rt.plugins[0]
        assert (plugin._segment is not None) == (allreduce == "shm")
        assert plugin.consistent_failures == (allreduce == "shm")  # the group path needs the engine's agreement


def test_tiny_tp2_bf16_tracks_the_engines_tp_forward(tiny_llama):
    """bfloat16: each rank rounds its partials where the engine's modules do, so every step stays within the
    verify tolerance and the tokens equal the engine's own TP=2 forward."""
    want = greedy_ids(tiny_llama, TINY_PROMPTS, dtype="bfloat16", tp=2)
    assert greedy_ids(tiny_llama, TINY_PROMPTS, dtype="bfloat16", tp=2, **lowlat()) == want


def test_moe_tp2_equals_tp1(tmp_path):
    """A tiny Qwen3-MoE (MoE, dense, MoE layers; expert intermediate size 37, split 19 / 18): the experts' partial
    sums are all-reduced inside the kernel like the dense feed-forward's."""
    folder = hf_checkpoint("qwen3_moe", tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 12, 20)]
    want = greedy_ids(folder, prompts, GREEDY, spec=None)
    assert greedy_ids(folder, prompts, GREEDY, spec=None, tp=2, **lowlat()) == want


class StalledRankLowLat(LowLatPlugin):
    """lowlat whose rank 1 stalls for `stall_s` before its `slow_call`-th target forward."""

    name = "lowlat-stalled-rank"
    slow_call, stall_s = 3, 3.0

    def _model_forward(self, model, *args):
        if id(model) == self._target_id:
            self.target_calls = getattr(self, "target_calls", 0) + 1
            if tp_rank() == 1 and self.target_calls == self.slow_call:
                time.sleep(self.stall_s)
        return super()._model_forward(model, *args)


register_plugin(StalledRankLowLat.name, StalledRankLowLat)  # spawned workers get the registry


@pytest.mark.parametrize("allreduce", ["shm", "group"])
def test_a_stalled_rank_aborts_the_step_on_every_rank(tiny_llama, allreduce):
    """lowlat's wait limit (1 s) is far below the engine's watchdog (20 s): rank 0 gives up on the stalled rank,
    both ranks raise PluginCollectiveAbort in the same step, the step reruns on the engine's own forward, lowlat is
    disabled, and every request completes with the plain engine's tokens."""
    want = greedy_ids(tiny_llama, TINY_PROMPTS)
    name = StalledRankLowLat.name
    options = {name: {"threads": 1, "allreduce": allreduce, "timeout_s": 1.0}}
    with LLM(tiny_llama, **(OPTS | dict(plugin=name)), tp=2, tp_timeout_s=20, plugin_options=options) as llm:
        t0 = time.monotonic()
        outs = llm.generate(TINY_PROMPTS, GREEDY)
        assert time.monotonic() - t0 < 15  # the stall and the 1 s waits, not the watchdog
        assert [o.token_ids for o in outs] == want and all(o.error is None for o in outs)
        rt = llm.engine.plugins
        assert "PluginCollectiveAbort" in rt.disabled[name] and rt.active == []
        forwards = sum(n for (p, kind), n in rt.counts.items() if p == name and kind != "logits")
        assert forwards == StalledRankLowLat.slow_call - 1  # the calls before the aborted one
        assert rt.counts[("none", "decode")] > 0
