"""The engine's own prefill over stored GGUF weights (QuantLinear's tile-by-tile dequantizing matmul): one
1400-token prompt of the bundled model, prefix caching off, one thread, best of 4, ms to the first token
(lowlat.prefill_rows=0: lowlat, which runs stored-weights prefill by default, leaves it to the engine).
Usage: python tools/quant_prefill_time.py"""
import time

import torch

from lanner import LLM, SamplingParams

torch.set_num_threads(1)
llm = LLM(spec=None, plugin="lowlat", plugin_options={"lowlat": {"threads": 1, "prefill_rows": 0}},  # the engine's path
          enable_prefix_caching=False)
text = open(__file__.replace("tools/quant_prefill_time.py", "docs/quantized.md")).read()
ids = llm.tokenizer.encode(text)[:1400]
best = float("inf")
for _ in range(4):
    t0 = time.perf_counter()
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=1))[0]
    best = min(best, time.perf_counter() - t0)
print(f"prefill of {len(ids)} tokens: {best * 1e3:.0f} ms (first token {out.token_ids[0]})")
