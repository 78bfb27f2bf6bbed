"""lowlat's paged attention on its own, SmolLM2-135M geometry (9 q heads, 3 kv groups, head_dim 64, 30 layers,
block size 16), one decode row and 8 verify rows at 500 / 2000 / 4000-token contexts, against the engine's own
paged_attention (PyTorch SDPA) in the same run. "cold": a different layer's cache per call, 30 layers (the working
set of a real decode step, larger than L3); "warm": one layer's cache again and again. Best of 5, ms per step of
30 layers. Writes results/lowlat_attention.json.
Usage: python tools/lowlat_attention.py [THREADS]"""
import json
import os
import sys
import time

import torch

from lanner.layers.attention import build_attention_metadata, paged_attention
from lanner.models.loader import ModelSource, load_config, load_model
from lanner.plugins import Hardware
from lanner.plugins.lowlat import LowLatPlugin

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(threads)
H, Hkv, D, bs, L = 9, 3, 64, 16, 30
src = ModelSource.resolve(None)
results = {"threads": threads, "geometry": {"heads": H, "kv_heads": Hkv, "head_dim": D, "layers": L}, "runs": []}
for dt in (torch.float32, torch.bfloat16):
    model, cfg = load_model(src, dt, "cpu", load_config(src))
    plug = LowLatPlugin(threads=threads)
    hw = Hardware.detect("cpu", dt)
    plug.check(cfg, hw)
    plug.build(model, cfg, hw)
    kernel = plug.kernel
    for ctx in (500, 2000, 4000):
        nblk = (ctx + bs - 1) // bs + 1
        torch.manual_seed(0)
        caches = [(torch.randn(nblk * bs, Hkv, D).to(dt), torch.randn(nblk * bs, Hkv, D).to(dt)) for _ in range(L)]
        table = torch.randperm(nblk)[: (ctx + bs - 1) // bs].tolist()  # scattered blocks, as after reuse
        for rows in (1, 8):
            q = torch.randn(rows, H * D).to(dt)
            pos = torch.arange(ctx - rows, ctx)
            meta = build_attention_metadata([rows], [ctx], [table], bs, "cpu")
            slots = meta.slot_mapping

            def lowlat(kc, vc):
                kernel.attention(q, kc, vc, pos, [rows], [ctx], [table], bs)

            def sdpa(kc, vc):  # the engine's path (it writes the step's k/v first: the same values back)
                paged_attention(q.view(rows, H, D), kc[slots], vc[slots], kc, vc, meta, D ** -0.5)

            row = {"dtype": str(dt).removeprefix("torch."), "context": ctx, "rows": rows}
            for name, fn in (("lowlat", lowlat), ("sdpa", sdpa)):
                for mode in ("cold", "warm"):
                    best = float("inf")
                    for _ in range(5):
                        t = time.perf_counter()
                        for layer in range(L):
                            fn(*caches[layer if mode == "cold" else 0])
                        best = min(best, time.perf_counter() - t)
                    row[f"{name}_{mode}_ms"] = round(1000 * best, 3)
            row["speedup_cold"] = round(row["sdpa_cold_ms"] / row["lowlat_cold_ms"], 2)
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
out = os.path.join(os.path.dirname(__file__), "..", "results", "lowlat_attention.json")
with open(out, "w") as f:
    json.dump(results, f, indent=1)
print(f"wrote {out}")
