"""lowlat's paged attention on its own, against the engine's own paged_attention (PyTorch SDPA) in the same run.

Geometries (random weights of one layer; the kernel only reads the head counts): `smollm` = SmolLM2-135M (9 q
heads, 3 kv groups, head_dim 64, 30 layers), `qwen` = Qwen2.5-Coder-1.5B (12 / 2 / 128, 28 layers). Per context,
a decode row and verify runs of 4 / 8 / 16 rows, one thread, every layer its own cache (the working set of a real
step, larger than L3), blocks scattered at random over the pool. bf16 runs lowlat's FMA kernel and, on a CPU with
AMX-BF16, its AMX kernel (csrc/attention_amx.h); float32 runs the FMA kernel. Best of 3, ms per step of all layers.

Usage: python tools/lowlat_attention.py [--geometry qwen] [--contexts 512,4096,32768] [--rows 1,4,8,16]
           [--dtypes bfloat16] [--no-sdpa] [--replot]
Writes results/lowlat_attention_<geometry>.json and .png; stop other jobs first (it is a benchmark)."""
import argparse
import json
import os
import time

import torch

from lanner.bench.report import markdown_table, pyplot, write_json
from lanner.layers.attention import build_attention_metadata, paged_attention
from lanner.models.config import ModelConfig
from lanner.models.llama import LlamaModel
from lanner.plugins import Hardware
from lanner.plugins.lowlat import LowLatPlugin

GEOMETRIES = {"smollm": (9, 3, 64, 30), "qwen": (12, 2, 128, 28)}
ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--geometry", choices=GEOMETRIES, default="qwen")
ap.add_argument("--contexts", default="512,4096,32768")
ap.add_argument("--rows", default="1,4,8,16")
ap.add_argument("--dtypes", default="bfloat16,float32")
ap.add_argument("--no-sdpa", action="store_true", help="skip PyTorch's SDPA (slow at long contexts)")
ap.add_argument("--replot", action="store_true", help="redraw the PNG from the geometry's JSON, measure nothing")
args = ap.parse_args()
torch.set_num_threads(1)
H, Hkv, D, L = GEOMETRIES[args.geometry]
bs = 16
result = {"geometry": {"name": args.geometry, "heads": H, "kv_heads": Hkv, "head_dim": D, "layers": L},
          "threads": 1, "block_size": bs, "runs": []}


def kernel_for(dtype):
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=H * D, intermediate_size=64,
                      num_layers=1, num_heads=H, num_kv_heads=Hkv, head_dim=D, max_position_embeddings=65536)
    model = LlamaModel(cfg).to(dtype).eval()
    model.init_rotary("cpu")
    plugin = LowLatPlugin(threads=1)
    hw = Hardware.detect("cpu", dtype)
    plugin.check(cfg, hw)
    plugin.build(model, cfg, hw)
    return plugin._kernel


def best_ms(fn, caches):
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for kc, vc in caches:
            fn(kc, vc)
        best = min(best, time.perf_counter() - t)
    return round(1000 * best, 3)


def measure_context(kernel, dtype, variants, ctx):
    nblk = (ctx + bs - 1) // bs + 1
    torch.manual_seed(0)
    caches = [(torch.randn(nblk * bs, Hkv, D).to(dtype), torch.randn(nblk * bs, Hkv, D).to(dtype)) for _ in range(L)]
    table = torch.randperm(nblk)[: (ctx + bs - 1) // bs].tolist()
    for rows in (int(r) for r in args.rows.split(",")):
        q = torch.randn(rows, H * D).to(dtype)
        pos = torch.arange(ctx - rows, ctx)
        meta = build_attention_metadata([rows], [ctx], [table], bs, "cpu")
        row = {"dtype": str(dtype).removeprefix("torch."), "context": ctx, "rows": rows}
        for v in variants:
            kernel.attn_amx = v == "amx"
            row[f"{v}_ms"] = best_ms(
                lambda kc, vc: kernel.attention(q, kc, vc, pos, [rows], [ctx], [table], bs), caches)
        if not args.no_sdpa:  # the engine's path (it writes the step's k/v first: the same values back)
            slots = meta.slot_mapping
            row["sdpa_ms"] = best_ms(lambda kc, vc: paged_attention(q.view(rows, H, D), kc[slots], vc[slots], kc, vc,
                                                                    meta, D ** -0.5), caches)
        if "amx_ms" in row:
            row["amx_speedup"] = round(row["fma_ms"] / row["amx_ms"], 2)
        result["runs"].append(row)
        print(row, flush=True)


path = os.path.join(os.path.dirname(__file__), "..", "results", f"lowlat_attention_{args.geometry}.json")
if args.replot:
    with open(path) as f:
        result = json.load(f)
else:
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        kernel = kernel_for(dtype)
        variants = ["fma"] + (["amx"] if dtype == torch.bfloat16 and kernel.attn_amx else [])
        for ctx in (int(c) for c in args.contexts.split(",")):
            measure_context(kernel, dtype, variants, ctx)
cols = ["fma_ms", "amx_ms", "sdpa_ms", "amx_speedup"]
print(markdown_table(["dtype", "context", "rows", *cols],
                     [[r["dtype"], r["context"], r["rows"], *(r.get(c, "-") for c in cols)] for r in result["runs"]]))
if not args.replot:
    write_json(path, result)
plt = pyplot()
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for ax, dt in zip(axes, ("bfloat16", "float32")):
    for ci, ctx in enumerate(sorted({r["context"] for r in result["runs"]})):
        runs = [r for r in result["runs"] if r["dtype"] == dt and r["context"] == ctx]
        for v, style in (("fma", "--"), ("amx", "-")):
            if runs and f"{v}_ms" in runs[0]:
                ax.plot([r["rows"] for r in runs], [r[f"{v}_ms"] for r in runs], style, marker="o", color=f"C{ci}",
                        label=f"{v}, {ctx} keys")
    ax.set_title(f"{args.geometry} geometry, {dt}: lowlat attention, {L} layers")
    ax.set_xlabel("rows in the step (1 = decode)")
    ax.set_ylabel("ms per step, 1 thread")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(path.replace(".json", ".png"), dpi=120)
print(f"wrote {path} and .png")
