"""The engine's own time per decode token outside lowlat's kernels: wall time of a greedy generation (bundled model,
lowlat, plain decoding, 300 tokens after a ~230-token prompt) minus the kernels' profiled phases (forward and LM
head), per token; 4 generations per run, each printed (the prompt's prefill step is one of the 300).
Usage: python tools/step_overhead.py [THREADS]"""
import sys
import time

import torch

from lanner import LLM, SamplingParams

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(threads)
llm = LLM(spec=None, plugin="lowlat", plugin_options={"lowlat": {"threads": threads}})
kernel = llm.engine.plugins.plugins[0]._kernel
ids = llm.tokenizer.encode("Write a long story about a robot who learns to paint. " * 20)
llm.generate(ids, SamplingParams(temperature=0, max_tokens=8))
kernel.profile = True
out = []
for _ in range(4):
    before = list(kernel.prof)
    t0 = time.perf_counter()
    llm.generate(ids, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    wall = time.perf_counter() - t0
    out.append((wall - sum(a - b for a, b in zip(kernel.prof, before))) / 300 * 1e3)
print(f"{threads} thread(s): engine time outside the kernels, ms per token: " + " ".join(f"{x:.3f}" for x in out))
