"""Prefill matmul efficiency: lowlat's stored-type kernel (q8 activations) against PyTorch's bf16 GEMM and its int8
GEMM (torch._int_mm, oneDNN VNNI) on one layer's matrix shapes of a stored-weights model, M activation rows, best
of 3, GMAC/s. What a repacked int8 prefill kernel could reach on this CPU (issue 42, item 4).
Usage: python tools/gemm_efficiency.py [--model qwen2.5-coder-1.5b] [--rows 256] [--threads 1] [--layer 3]"""
import argparse
import time

import torch

from lanner import LLM
from lanner.models.quant import STORED_MODULES

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model", default="qwen2.5-coder-1.5b")
ap.add_argument("--rows", type=int, default=256)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--layer", type=int, default=3)
args = ap.parse_args()
torch.set_num_threads(args.threads)
llm = LLM(model=args.model, weights="stored", dtype="float32", plugin="lowlat", spec=None, max_model_len=512,
          kv_cache_memory="0.2GiB", plugin_options={"lowlat": {"threads": args.threads, "act": "q8"}})
kernel = llm.engine.plugins.plugins[0].kernel
M = args.rows


def best(fn):
    fn()
    t = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


for name, m in llm.engine.kv.runner.model.named_modules():
    if not isinstance(m, STORED_MODULES) or f"layers.{args.layer}." not in name or ".runs." in name:
        continue
    N, K = m.out_features, m.in_features
    x, w = torch.randn(M, K), m.packed()
    wb, xb = torch.randn(N, K, dtype=torch.bfloat16), x.bfloat16()
    xi, wi = torch.randint(-127, 127, (M, K), dtype=torch.int8), torch.randint(-127, 127, (K, N), dtype=torch.int8)
    gmac = M * N * K / 1e9
    t_low = best(lambda: kernel.qlinear(x, w, N, True, False))
    t_bf16 = best(lambda: torch.nn.functional.linear(xb, wb))
    t_int8 = best(lambda: torch._int_mm(xi, wi))
    print(f"{name:36s} {N}x{K}: lowlat q8 {gmac / t_low:6.1f}  torch bf16 {gmac / t_bf16:6.1f}  "
          f"torch int8 {gmac / t_int8:6.1f} GMAC/s")
