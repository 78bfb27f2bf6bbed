"""lowlat's per-phase time of a decode step (GEMV, attention, barrier waits, the rest, the stored-type LM head; ms
per forward, thread 0) on the bundled model at two prompt lengths, one thread, 64 greedy tokens, best of 4.
Usage: python tools/lowlat_decode_profile.py [DTYPE ...]   (default: bfloat16 float32)"""
import sys

import torch
from tqdm import tqdm

from lanner import LLM, SamplingParams

PHASES = ["gemv", "attention", "barrier", "other", "lm_head"]
torch.set_num_threads(1)
text = open(__file__.replace("tools/lowlat_decode_profile.py", "docs/quantized.md")).read()
for dtype in sys.argv[1:] or ["bfloat16", "float32"]:
    llm = LLM(spec="none", dtype=dtype, plugin="lowlat", plugin_options={"lowlat": {"threads": 1}})
    kernel = llm.engine.plugins.plugins[0].kernel
    kernel.profile = True
    for chars in (2500, 7000):
        prompt = text[:chars] + "\n\nSummarize the above."
        n_prompt = len(llm.tokenizer.encode(prompt))
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2))  # the prompt's KV, cached from here on
        best = None
        for _ in tqdm(range(4), desc=f"{dtype} {n_prompt} tokens", leave=False):
            kernel.prof, kernel.prof_calls = [0.0] * 5, 0
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
            ms = [1000 * v / kernel.prof_calls for v in kernel.prof]
            best = ms if best is None or ms[1] < best[1] else best
        print(f"{dtype}, prompt {n_prompt} tokens: " + ", ".join(f"{k} {v:.2f}" for k, v in zip(PHASES, best)))
    llm.close()
