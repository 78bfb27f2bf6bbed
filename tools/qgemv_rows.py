"""lowlat's q8 (or q16 / float) GEMVs over a stored-weights model's GGUF blocks against 1, 2, 4, 5, 8, 9 and 16
activation rows: one `qlinear` pass over every quantized matrix but the embedding (the LM head included; the
working set of a decode step's matmuls, larger than L3), best of 8 per round, 3 rounds, ms per pass. What a verify
row costs next to a decode row in the matmuls (the hybrid speculation's row cost, docs/speculation.md).
QPREFETCH: comma-separated weight-stream prefetch distances in bytes (lowlat's _set_qprefetch; 0 is off),
alternated in the same process for an A/B; default: the built-in distance only.
Usage: python tools/qgemv_rows.py [THREADS] [ACT (q8, q16, float; default q8)] [QPREFETCH] [MODEL]"""
import sys
import time

import torch

from lanner import LLM
from lanner.models.quant import QuantLinear

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
act = sys.argv[2] if len(sys.argv) > 2 else "q8"
distances = [int(v) for v in sys.argv[3].split(",")] if len(sys.argv) > 3 else [None]
model = sys.argv[4] if len(sys.argv) > 4 else None
torch.set_num_threads(threads)
llm = LLM(model=model, weights="stored", dtype="float32", plugin="lowlat",
          plugin_options={"lowlat": {"threads": threads, "act": act}},
          spec=None, kv_cache_memory="0.05GiB")
plugin = llm.engine.plugins.plugins[0]
kernel, ext = plugin._kernel, plugin._load_extension()
linears = [(m.packed(), m.out_features, m.in_features) for n, m in llm.engine.kv.runner.model.named_modules()
           if isinstance(m, QuantLinear) and "embed" not in n]
g = torch.Generator().manual_seed(0)
ms = {}
for rows in (1, 2, 4, 5, 8, 9, 16):
    xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, _, k in linears}}
    for _ in range(3):
        for d in distances:
            if d is not None:
                ext._set_qprefetch(d)
            for _ in range(8):
                t0 = time.perf_counter()
                for packed, n, k in linears:
                    kernel.qlinear(xs[k], packed, n, True)
                ms[d, rows] = min(ms.get((d, rows), float("inf")), (time.perf_counter() - t0) * 1e3)
print(f"{len(linears)} quantized matrices, {threads} thread(s), {act}, {ext.isa}:")
for d in distances:
    print(("" if d is None else f"prefetch {d} B: ") +
          ", ".join(f"{r} row(s) {ms[d, r]:.2f} ms ({ms[d, r] / ms[d, 1]:.2f}x)" for r in (1, 2, 4, 5, 8, 9, 16)))
