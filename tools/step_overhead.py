"""The engine's own time per step outside lowlat's kernels: wall time minus the kernels' profiled phases (forward and
LM head). Plain decoding (default): a greedy generation of 300 tokens after a ~230-token prompt, per token (the
prompt's prefill step is one of the 300), 4 generations, each printed. `hybrid`: the agent-session replay (26 turns,
greedy, hybrid speculation with its drafting and verification), per engine step (prefill steps included), 2
passes, each printed.
Usage: python tools/step_overhead.py [THREADS] [plain|hybrid]"""
import sys
import time

import torch

from lanner import LLM, SamplingParams
from lanner.bench.sessions import DEFAULT_SESSIONS, assistant_prompts, load_sessions

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
mode = sys.argv[2] if len(sys.argv) > 2 else "plain"
torch.set_num_threads(threads)
hybrid = mode == "hybrid"
llm = LLM(spec="hybrid" if hybrid else None, plugin="lowlat", plugin_options={"lowlat": {"threads": threads}})
kernel = llm.engine.plugins.plugins[0].kernel
steps = 0
engine_step = llm.engine.step


def counted_step():
    global steps
    steps += 1
    return engine_step()


llm.engine.step = counted_step
if hybrid:
    turns = [(ids, n) for s in load_sessions(DEFAULT_SESSIONS) for ids, n, _ in assistant_prompts(s, llm.tokenizer)]

    def run():
        llm.engine.spec.proposer.forget()  # each pass drafts from the sessions alone, not the previous pass
        for ids, n in turns:
            llm.generate(ids, SamplingParams(temperature=0, max_tokens=n))
else:
    ids = llm.tokenizer.encode("Write a long story about a robot who learns to paint. " * 20)

    def run():
        llm.generate(ids, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
llm.generate(llm.tokenizer.encode("Hello"), SamplingParams(temperature=0, max_tokens=8))
kernel.profile = True
out = []
for _ in range(2 if hybrid else 4):
    before, steps = list(kernel.prof), 0
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    out.append((wall - sum(a - b for a, b in zip(kernel.prof, before))) / steps * 1e3)
unit = "step (agent-session replay, hybrid)" if hybrid else "token"
print(f"{threads} thread(s): engine time outside the kernels, ms per {unit}: " + " ".join(f"{x:.3f}" for x in out))
