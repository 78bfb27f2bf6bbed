"""Where a speculative step's time goes on the agent-session replay (bundled model, lowlat, one thread, greedy):
forward + verification ms by the rows a step verifies (median, count), the hybrid proposer's fitted step-cost line,
and per decode / verify step the engine's time outside forward + verification (drafting, scheduling, appending
tokens) next to the drafting call alone; then lowlat's own phases (GEMV, attention, barrier waits, the rest, the LM
head; thread 0) summed over those steps, and their medians by rows per step. ATTN_PREFETCH: attention's KV prefetch
distance in 16-key tiles (default 2; 0 switches it off, for an A/B).
Usage: python tools/replay_step_profile.py [SPEC (hybrid, none, suffix, ...)] [ACT (q16, q8, float)] [ATTN_PREFETCH]"""
import collections
import statistics
import sys
import time

import torch

from lanner import LLM, SamplingParams
from lanner.bench.sessions import DEFAULT_SESSIONS, assistant_prompts, load_sessions

torch.set_num_threads(1)
spec = sys.argv[1] if len(sys.argv) > 1 else "hybrid"
act = sys.argv[2] if len(sys.argv) > 2 else "q16"
llm = LLM(spec=None if spec == "none" else spec, draft="default" if spec == "hybrid" else None,
          plugin="lowlat", plugin_options={"lowlat": {"threads": 1, "act": act}})
eng = llm.engine
plugin = eng.plugins.plugins[0]
plugin.extension().set_attn_prefetch(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
kernel = plugin.kernel
kernel.profile = True
phases = [0.0] * 5  # lowlat's phases over the decode / verify steps
by_rows_phases = collections.defaultdict(list)  # rows -> each such step's phases
cur, steps, propose_s = {}, [], []
after_step, engine_step, propose = eng.spec.after_step, eng.step, eng.spec.propose


def timed_after_step(seconds, rows):
    cur.update(forward=seconds, rows=rows)
    return after_step(seconds, rows)


def timed_step():
    cur.clear()
    before = list(kernel.prof)
    t0 = time.perf_counter()
    out = engine_step()
    if "forward" in cur:  # a decode / verify step (prefill steps are not timed by the proposer)
        steps.append((time.perf_counter() - t0, cur["forward"], cur["rows"]))
        step_phases = [a - b for a, b in zip(kernel.prof, before)]
        phases[:] = [p + d for p, d in zip(phases, step_phases)]
        by_rows_phases[cur["rows"]].append(step_phases)
    return out


def timed_propose(items):
    t0 = time.perf_counter()
    out = propose(items)
    propose_s.append(time.perf_counter() - t0)
    return out


eng.spec.after_step, eng.step, eng.spec.propose = timed_after_step, timed_step, timed_propose
for session in load_sessions(DEFAULT_SESSIONS):
    for ids, max_tokens, _ in assistant_prompts(session, llm.tokenizer):
        llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
by_rows = collections.defaultdict(list)
for _, forward, rows in steps:
    by_rows[rows].append(forward * 1e3)
print(f"{spec}, {act}: forward + verification ms by rows per step (median, steps):")
print(", ".join(f"{r}: {statistics.median(v):.2f} ({len(v)})" for r, v in sorted(by_rows.items())))
line = getattr(getattr(eng.spec.proposer, "cost", None), "line", None)
if line:
    a, b = line
    print(f"hybrid's fitted line T(n) = {a * 1e3:.2f} + {b * 1e3:.2f} n ms: " +
          ", ".join(f"{n}: {(a + b * n) * 1e3:.1f}" for n in (1, 2, 3, 4, 8, 17)))
n = len(steps)
print(f"{n} decode / verify steps, per step: engine {1e3 * sum(s[0] for s in steps) / n:.2f} ms, forward + "
      f"verification {1e3 * sum(s[1] for s in steps) / n:.2f} ms, the rest {1e3 * sum(s[0] - s[1] for s in steps) / n:.2f}"
      f" ms (drafting {1e3 * sum(propose_s) / max(1, len(propose_s)):.2f} ms per call)")
print("lowlat over those steps (s, thread 0): " +
      ", ".join(f"{k} {v:.2f}" for k, v in zip(("gemv", "attention", "barrier", "other", "lm_head"), phases)))
print("lowlat's phases by rows per step (ms, median over the steps of that size, 3+ steps; thread 0):")
for rows, steps_phases in sorted(by_rows_phases.items()):
    if len(steps_phases) >= 3:
        med = [1e3 * statistics.median(x[i] for x in steps_phases) for i in range(5)]
        print(f"{rows} ({len(steps_phases)}): " +
              ", ".join(f"{k} {m:.2f}" for k, m in zip(("gemv", "attention", "barrier", "other", "lm_head"), med)))
