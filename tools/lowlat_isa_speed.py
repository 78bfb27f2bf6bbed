"""Decode tok/s of lowlat's AVX-512 and AVX2 builds (isa=avx2: csrc/avx2.h) on the bundled model, bf16 and the
GGUF blocks as stored (q8 and q16 activations), one thread, 128 greedy tokens, the builds alternated over 3 rounds in one
process; prints the best of each. Usage: python tools/lowlat_isa_speed.py"""
import time

import torch
from lanner import LLM, SamplingParams
torch.set_num_threads(1)
prompt = "Write a Python function that checks whether a number is prime, with a docstring and tests."
res = {}
configs = [("bf16 avx512 (dot)", dict(dtype="bfloat16", isa="auto")), ("bf16 avx512f", dict(dtype="bfloat16", isa="avx512f")),
           ("bf16 avx2", dict(dtype="bfloat16", isa="avx2")),
           *((f"q4_1 stored {act} {isa}", dict(dtype="float32", weights="stored", isa=isa, act=act))
             for act in ("q8", "q16") for isa in ("avx512", "avx2"))]
llms = {}
for name, c in configs:
    kw = dict(dtype=c["dtype"], spec="none", plugin="lowlat", kv_cache_memory="0.25GiB",
              plugin_options={"lowlat": {"threads": 1, "isa": {"avx512": "auto"}.get(c["isa"], c["isa"]),
                                         **({"act": c["act"]} if "act" in c else {})}})
    if "weights" in c: kw["weights"] = c["weights"]
    llms[name] = LLM(**kw)
    llms[name].generate(prompt, SamplingParams(temperature=0, max_tokens=8))
p = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
for r in range(3):
    for name in llms:
        t = time.perf_counter(); o = llms[name].generate(prompt, p)[0]; dt = time.perf_counter() - t
        res.setdefault(name, []).append(128 / dt)
for name, v in res.items():
    print(f"{name}: best {max(v):.1f} tok/s  (runs {', '.join(f'{x:.1f}' for x in v)})")
