"""Greedy steps through the LM head's fused argmax against the same steps through the logits (the engine's path
before compute_argmax), alternated in one process over the same prompts: ms of forward + verification per
generated token, best of 3 rounds, one lowlat thread. Tokens must be identical both ways.
Usage: python tools/greedy_argmax_ab.py [MODEL (default: the bundled one)] [SPEC (none, suffix, hybrid, ...)]"""
import sys

import torch

from lanner import LLM, SamplingParams

torch.set_num_threads(1)
model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "default" else None
spec = sys.argv[2] if len(sys.argv) > 2 else "none"
llm = LLM(**({"model": model} if model else {}), spec=None if spec == "none" else spec,
          plugin="lowlat", plugin_options={"lowlat": {"threads": 1}})
eng = llm.engine
seconds, rows = [], []
after_step = eng.spec.after_step
eng.spec.after_step = lambda s, r: (seconds.append(s), rows.append(r), after_step(s, r))
prompts = ["The history of the Roman Empire", "def quicksort(arr):",
           "Explain how a transformer language model works.", "A recipe for bread:"]
best, outputs = {}, {}
for rnd in range(3):
    for fused in (True, False):
        eng.fused_argmax = fused
        seconds.clear(), rows.clear()
        tokens = 0
        for p in prompts:
            out = llm.generate(p, SamplingParams(temperature=0, max_tokens=96, ignore_eos=True))[0]
            tokens += len(out.token_ids)
            outputs.setdefault(p, set()).add(tuple(out.token_ids))
        ms = 1000 * sum(seconds) / tokens
        best[fused] = min(best.get(fused, ms), ms)
        print(f"round {rnd} {'fused argmax' if fused else 'logits':12}: {ms:.3f} ms per token, "
              f"{sum(rows) / len(rows):.2f} rows per step", flush=True)
print(f"{spec}: fused {best[True]:.3f} ms, logits {best[False]:.3f} ms per token ({best[False] / best[True]:.3f}x); "
      f"tokens identical: {all(len(v) == 1 for v in outputs.values())}")
