"""lowlat's stored-type GEMVs over a stored-weights model's GGUF blocks against 1, 2, 4, 5, 8, 9 and 16 activation
rows (--rows): one `qlinear` pass over every quantized matrix but the embedding / LM head (the working set of a decode
step's matmuls, larger than L3), best of 8 per round, 3 rounds, ms per pass. What a verify row costs next
to a decode row in the matmuls (the hybrid speculation's row cost, docs/speculation.md).
--prefetch, --block-rows and --amx-rows take comma-separated values (lowlat's set_qprefetch: bytes of codes
prefetched ahead, 0 off; set_block_rows: activation rows per block, 0 the mode's own; set_amx_gemv_rows: steps of
at least this many rows on AMX-INT8 tiles, 0 never); every combination runs in the same process, alternated per
round, for an A/B.
Usage: python tools/qgemv_rows.py [--threads N] [--act q8|q16|float] [--prefetch 0,3072] [--block-rows 4,5]
       [--amx-rows 0,2] [--rows 1,2,4] [--model GGUF] [--isa auto|avx512|avx2]"""
import argparse
import itertools
import time

import torch

from lanner import LLM
from lanner.models.quant import STORED_MODULES

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--act", default="q16", choices=("q8", "q16", "float"))
ap.add_argument("--prefetch", default="", help="bytes, comma-separated (default: the built-in distance)")
ap.add_argument("--block-rows", default="", help="rows, comma-separated (default: the mode's own)")
ap.add_argument("--amx-rows", default="", help="rows, comma-separated (default: the plugin's own)")
ap.add_argument("--rows", default="1,2,4,5,8,9,16", help="activation row counts, comma-separated")
ap.add_argument("--model", default=None)
ap.add_argument("--isa", default="auto", help="lowlat's build: auto, avx512 or avx2")
args = ap.parse_args()
ints = lambda s: [int(v) for v in s.split(",")] if s else [None]  # noqa: E731
configs = list(itertools.product(ints(args.prefetch), ints(args.block_rows), ints(args.amx_rows)))
torch.set_num_threads(args.threads)
llm = LLM(model=args.model, weights="stored", dtype="float32", plugin="lowlat",
          plugin_options={"lowlat": {"threads": args.threads, "act": args.act, "isa": args.isa}},
          spec=None, kv_cache_memory="0.2GiB", max_model_len=512)
plugin = llm.engine.plugins.plugins[0]
kernel, ext = plugin.kernel, plugin.extension()
linears = [(m.packed(), m.out_features, m.in_features) for n, m in llm.engine.kv.runner.model.named_modules()
           if isinstance(m, STORED_MODULES) and "lm_head" not in n and "embed" not in n and ".runs." not in n]
g = torch.Generator().manual_seed(0)
rows_list = ints(args.rows)
ms = {}
for rows in rows_list:
    xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, _, k in linears}}
    for _ in range(3):
        for cfg in configs:
            prefetch, block, amx = cfg
            if prefetch is not None:
                ext.set_qprefetch(prefetch)
            if block is not None:
                ext.set_block_rows(block)
            if amx is not None:
                ext.set_amx_gemv_rows(amx)
            for _ in range(8):
                t0 = time.perf_counter()
                for packed, n, k in linears:
                    kernel.qlinear(xs[k], packed, n, True)
                ms[cfg, rows] = min(ms.get((cfg, rows), float("inf")), (time.perf_counter() - t0) * 1e3)
print(f"{len(linears)} quantized matrices, {args.threads} thread(s), {args.act}, {ext.isa}, ms per pass:")
for cfg in configs:
    label = ", ".join(f"{name} {v}" for name, v in zip(("prefetch", "block rows", "amx rows"), cfg) if v is not None)
    print((label + ": " if label else "") +
          ", ".join(f"{r} row(s) {ms[cfg, r]:.2f} ({ms[cfg, r] / ms[cfg, 1]:.2f}x)" for r in rows_list))
