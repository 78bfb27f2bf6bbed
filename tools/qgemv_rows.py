"""lowlat's q8 (or q16 / float) GEMVs over the bundled model's stored GGUF blocks against 1, 2, 4, 8 and 16 activation
rows: one `qlinear` pass over every quantized matrix but the embedding / LM head (the working set of a decode
step's matmuls, larger than L3), best of 15, ms per pass. What a verify row costs next to a decode row in the matmuls (the hybrid
speculation's row cost, docs/speculation.md).
Usage: OMP_NUM_THREADS=1 python tools/qgemv_rows.py [THREADS] [ACT (q8, q16, float; default q8)]"""
import sys
import time

import torch

from lanner import LLM
from lanner.models.quant import QuantLinear

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
act = sys.argv[2] if len(sys.argv) > 2 else "q8"
llm = LLM(weights="stored", dtype="float32", plugin="lowlat",
          plugin_options={"lowlat": {"threads": threads, "act": act}},
          spec=None, kv_cache_memory="0.05GiB")
kernel = llm.engine.plugins.plugins[0]._kernel
linears = [(m.packed(), m.out_features, m.in_features) for n, m in llm.engine.kv.runner.model.named_modules()
           if isinstance(m, QuantLinear) and "lm_head" not in n and "embed" not in n]
g = torch.Generator().manual_seed(0)
ms = {}
for rows in (1, 2, 4, 8, 16):
    xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, _, k in linears}}
    best = float("inf")
    for _ in range(15):
        t0 = time.perf_counter()
        for packed, n, k in linears:
            kernel.qlinear(xs[k], packed, n, True)
        best = min(best, time.perf_counter() - t0)
    ms[rows] = best * 1e3
print(f"{len(linears)} quantized matrices, {threads} thread(s), {llm.engine.plugins.plugins[0]._load_extension().isa}: " +
      ", ".join(f"{r} row(s) {v:.2f} ms ({v / ms[1]:.2f}x)" for r, v in ms.items()))
