"""Prefill of a stored-weights model through lowlat (the default: pieces of 256 rows) against the engine's own
forward (lowlat.prefill_rows=0: QuantLinear's dequantizing matmuls + SDPA): ms to the first token for 300 / 1400 /
3000-token prompts, prefix caching off, alternated over rounds (best per path), and whether the first 24 greedy
tokens agree. Then lowlat's chunk invariance: a 1300-token prompt prefilled in steps of 512, 256 and 96 tokens
gives the same tokens and logprobs, bit for bit. Then, per path, 5 prompts (300-1200 tokens) asked twice with
prefix caching on (the repeat recomputes only the tail): how many repeats part from the first answer (24 greedy
tokens), and the next token's top-10 logprobs against the float32 dequantized model (max absolute difference).
Usage: python tools/prefill_paths.py [THREADS] [MODEL]"""
import sys
import time

import torch

from lanner import LLM, SamplingParams

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
model = sys.argv[2] if len(sys.argv) > 2 else None
torch.set_num_threads(threads)
text = open(__file__.replace("tools/prefill_paths.py", "lanner/models/quant.py")).read()
text += open(__file__.replace("tools/prefill_paths.py", "lanner/plugins/lowlat/plugin.py")).read()


def engine(**kw):
    opts = {"threads": threads, **kw.pop("lowlat", {})}
    return LLM(model=model, spec=None, plugin="lowlat", plugin_options={"lowlat": opts},
               enable_prefix_caching=False, **kw)


paths = {"lowlat": engine(), "engine": engine(lowlat={"prefill_rows": 0})}
tok = paths["lowlat"].tokenizer
ids = tok.encode(text * 2)
lengths = (300, 1400, 3000)
best = {(p, n): float("inf") for p in paths for n in lengths}
first = {}
for _ in range(3):
    for name, llm in paths.items():
        for n in lengths:
            t0 = time.perf_counter()
            out = llm.generate(ids[:n], SamplingParams(temperature=0, max_tokens=1))[0]
            best[name, n] = min(best[name, n], time.perf_counter() - t0)
for name, llm in paths.items():
    first[name] = llm.generate(ids[:1400], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids
print(f"{threads} thread(s), ms to the first token (best of 3, alternated):")
for name in paths:
    print(f"  {name:7s} " + ", ".join(f"{n} tokens {best[name, n] * 1e3:.0f}" for n in lengths))
print(f"  first 24 greedy tokens after 1400 prompt tokens agree: {first['lowlat'] == first['engine']}")
for llm in paths.values():
    llm.close()

outs = {}
for step in (512, 256, 96):
    llm = engine(max_num_batched_tokens=step)
    o = llm.generate(ids[:1300], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0))[0]
    outs[step] = (o.token_ids, [x["logprob"] for x in o.logprobs])
    llm.close()
print("lowlat prefill in steps of 512 / 256 / 96 tokens, same tokens and logprobs bit for bit:",
      outs[512] == outs[256] == outs[96])

ref = LLM(model=model, dtype="float32", weights="dequantize", plugin="none", spec=None, enable_prefix_caching=False)
lengths = (300, 517, 700, 1000, 1203)
top = SamplingParams(temperature=0, max_tokens=1, logprobs=10)
want = [dict(ref.generate(ids[:n], top)[0].logprobs[0]["top"]) for n in lengths]
ref.close()
for name, kw in (("lowlat", {}), ("engine", {"prefill_rows": 0})):
    llm = LLM(model=model, spec=None, plugin="lowlat", plugin_options={"lowlat": {"threads": threads, **kw}})
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    parted = sum(llm.generate(ids[:n], greedy)[0].token_ids != llm.generate(ids[:n], greedy)[0].token_ids
                 for n in lengths)
    err = []
    for n, w in zip(lengths, want):
        got = dict(llm.generate(ids[:n], top)[0].logprobs[0]["top"])
        err.append(max(abs(got[t] - w[t]) for t in w if t in got))
    print(f"{name}: prompts whose repeat parted {parted} of {len(lengths)}; top-10 logprob error vs float32 "
          + " ".join(f"{e:.3f}" for e in err))
    llm.close()
