"""lowlat step time on the bundled model with lowlat.invariant off and on: a 1-row decode and 6- and 16-row
verify steps at a 500-token context, bf16 and float32, best of 3 x 10 steps, alternating.
Usage: python tools/lowlat_invariance_cost.py [THREADS]"""
import sys
import time

import torch

from lanner.bench.forward import forward_rows, kv_caches
from lanner.models.loader import ModelSource, load_config, load_model
from lanner.plugins import Hardware
from lanner.plugins.lowlat import LowLatPlugin

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(threads)
src = ModelSource.resolve(None)
loaded = load_config(src)
for dt in (torch.bfloat16, torch.float32):
    model, cfg = load_model(src, dt, "cpu", loaded)
    hw = Hardware.detect("cpu", dt)
    plug = LowLatPlugin(threads=threads); plug.check(cfg, hw); plug.build(model, cfg, hw)
    kv = kv_caches(cfg, blocks=80, dtype=dt)
    table = list(range(64))
    [forward_rows(model, plug, kv, [(list(range(1000 + c, 1050 + c)), c, table)]) for c in range(0, 500, 50)]
    for rows in (1, 6, 16):
        res = {}
        for rep in range(3):
            for inv in (False, True):
                plug.kernel.invariant = inv
                t = time.perf_counter()
                for _ in range(10):
                    forward_rows(model, plug, kv, [(list(range(5, 5 + rows)), 500, table)])
                res.setdefault(inv, []).append((time.perf_counter() - t) / 10 * 1000)
        print(f"{dt!s:15s} rows {rows:2d}: default {min(res[False]):6.2f} ms  invariant {min(res[True]):6.2f} ms  ratio {min(res[True])/min(res[False]):.3f}", flush=True)
