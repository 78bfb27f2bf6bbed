"""`lanner bench kv`: sparse-attention KV access traces and the device-pool replacement policies replaying them.

- `lanner bench kv trace`: decodes real long text (ShareGPT conversations) with Quest-style sparse attention on
  the model, teacher-forced, and writes the access trace plus the sparse-vs-dense quality (top-1 agreement,
  perplexity) per budget.
- `lanner bench kv lru --trace FILE`: replays the trace through PB-LRU and the exact timestamp LRU over one
  shared device pool: batch b = b recorded requests decoding side by side (their entries are distinct logical
  addresses); reports hit rate and scheduling time per step, from batch 1 to the largest batch whose step still
  fits in the pool.
"""
from __future__ import annotations

import json
import os
import time

HELP = "KV-cache benchmarks: sparse access traces (trace) and PB-LRU vs exact LRU (lru)"
DESCRIPTION = __doc__


def add_arguments(p):
    p.add_argument("what", choices=["trace", "lru"], help="trace: record a sparse access trace (+ quality); "
                   "lru: replay a trace through PB-LRU and exact LRU")
    p.add_argument("--trace", default="results/kv_trace.jsonl", help="access trace to write (trace) or replay (lru)")
    p.add_argument("--json", default=None, help="results JSON (default: results/bench_kv_<what>.json)")
    p.add_argument("--out-dir", default="results")
    # trace
    p.add_argument("--docs", type=int, default=4, help="trace: long documents (one request each)")
    p.add_argument("--doc-tokens", type=int, default=2048, help="trace: tokens per document")
    p.add_argument("--steps", type=int, default=64, help="trace: decode steps per document")
    p.add_argument("--page-size", type=int, default=16, help="trace: Quest page size")
    p.add_argument("--budget", type=int, default=256, help="trace: tokens each decode query reads")
    p.add_argument("--quality-budgets", default="128,256,512",
                   help="trace: budgets whose quality vs dense is reported (the first doc only, no trace)")
    p.add_argument("--group", type=int, default=1, help="trace: layers sharing one selection")
    # lru
    p.add_argument("--slots", type=int, default=0,
                   help="lru: device pool slots (default: 16 steps' worth of one request's entries, so batch 1 "
                        "rarely evicts and batch 16 evicts every step)")
    p.add_argument("--batch", default="", help="lru: batch sizes (default: 1, 2, 4 ... up to the largest that fits)")
    p.add_argument("--buckets", type=int, default=64, help="lru: PB-LRU buckets")
    p.add_argument("--span", type=int, default=1, help="lru: decode steps per PB-LRU bucket epoch")
    p.add_argument("--repeat", type=int, default=3, help="lru: timing repeats (the minimum is reported)")


def run(args, engine_kwargs: dict) -> dict:
    return record_trace(args, engine_kwargs) if args.what == "trace" else replay_lru(args)


# ------------------------------------------------------------------ trace

def record_trace(args, engine_kwargs: dict) -> dict:
    import torch
    from tqdm import tqdm

    from lanner.bench.report import markdown_table, output_paths, write_json
    from lanner.config import EngineConfig
    from lanner.kvcache.quest import evaluate, long_documents
    from lanner.models.loader import ModelSource, load_model
    from lanner.tokenizer import Tokenizer

    cfg = EngineConfig(**engine_kwargs)
    src = ModelSource.resolve(cfg.model)
    model, mcfg = load_model(src, cfg.torch_dtype, cfg.device)
    tok = Tokenizer(src, mcfg.eos_token_ids)
    prefix = args.doc_tokens - args.steps - 1
    docs = long_documents(tok, args.doc_tokens, args.docs)
    budgets = [int(b) for b in args.quality_budgets.split(",") if b]
    os.makedirs(os.path.dirname(os.path.abspath(args.trace)), exist_ok=True)
    with tqdm(total=args.steps * (len(docs) + len(budgets)), desc="kv trace", unit="step") as bar:
        t0 = time.perf_counter()
        traced = evaluate(model, docs, prefix, args.steps, args.page_size, args.budget, args.group, args.trace,
                          progress=lambda: bar.update(1))
        trace_s = time.perf_counter() - t0
        quality = []
        for b in budgets:
            q = evaluate(model, docs[:1], prefix, args.steps, args.page_size, b, args.group,
                         progress=lambda: bar.update(1))
            quality.append({"budget": b, **q})
    rows = [[q["budget"], f"{q['top1_agreement']:.3f}", f"{q['ppl_dense']:.3f}", f"{q['ppl_sparse']:.3f}"]
            for q in quality]
    print(markdown_table(["budget (tokens)", "top-1 agreement", "ppl dense", "ppl sparse"], rows))
    result = {"model": src.name, "dtype": cfg.dtype, "docs": len(docs), "doc_tokens": args.doc_tokens,
              "prefix": prefix, "steps": args.steps, "page_size": args.page_size, "budget": args.budget,
              "group": args.group, "layers": mcfg.num_layers, "trace": args.trace, "trace_seconds": trace_s,
              "traced_quality": traced, "quality": quality}
    json_path, _ = output_paths(args.json, args.out_dir, "bench_kv_trace")
    write_json(json_path, result)
    print(f"trace: {args.trace}; results: {json_path}")
    return result


# ------------------------------------------------------------------ lru

def load_trace(path: str):
    """-> (per request: list of steps, each a list of per-group position tensors), max context + 1."""
    import torch

    reqs: dict[int, dict[int, list]] = {}
    max_ctx = 0
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            reqs.setdefault(r["request"], {})[r["step"]] = [torch.tensor(g, dtype=torch.long) for g in r["groups"]]
            max_ctx = max(max_ctx, r["ctx"])
    if not reqs:
        raise ValueError(f"trace {path} is empty")
    return [[steps[s] for s in sorted(steps)] for _, steps in sorted(reqs.items())], max_ctx + 1


def batch_steps(requests, batch: int, max_ctx: int):
    """Address lists per step for `batch` requests decoding side by side. Request i replays recorded request
    i mod R; entry (request, group, position) has address (i * G + group) * max_ctx + position."""
    import torch

    G = len(requests[0][0])
    n_steps = min(len(r) for r in requests)
    steps = []
    for t in range(n_steps):
        parts = [requests[i % len(requests)][t][g] + (i * G + g) * max_ctx for i in range(batch) for g in range(G)]
        steps.append(torch.cat(parts))
    return steps, batch * G * max_ctx


def replay_lru(args) -> dict:
    import torch

    from lanner.bench.report import line_chart, markdown_table, output_paths, write_json
    from lanner.kvcache.lru import PBLRU, ExactLRU

    requests, max_ctx = load_trace(args.trace)
    G = len(requests[0][0])
    per_step_one = max(int(sum(g.numel() for g in step)) for step in requests[0])
    slots = args.slots or 16 * per_step_one
    if args.batch:
        batches = [int(b) for b in args.batch.split(",")]
    else:
        batches, b = [], 1
        while b * per_step_one <= slots:
            batches.append(b)
            b *= 2
    if not batches:
        raise ValueError(f"--slots {slots} cannot hold one request's step ({per_step_one} entries)")
    rows = []
    for b in batches:
        steps, num_addrs = batch_steps(requests, b, max_ctx)
        for make in (lambda: PBLRU(slots, num_addrs, args.buckets, args.span), lambda: ExactLRU(slots, num_addrs)):
            best, hit = None, None
            for _ in range(args.repeat):
                pol = make()
                t0 = time.perf_counter()
                for s in steps:
                    pol.access(s)
                dt = (time.perf_counter() - t0) / len(steps)
                best = dt if best is None else min(best, dt)
                hit = pol.hit_rate
            rows.append({"policy": pol.name, "batch": b, "hit_rate": hit, "sched_ms": best * 1e3,
                         "entries_per_step": int(sum(s.numel() for s in steps) / len(steps))})
            print(f"batch {b:3d} {pol.name:7s} hit {hit:.4f}  {best * 1e3:.3f} ms/step", flush=True)
    table = []
    for b in batches:
        pb = next(r for r in rows if r["batch"] == b and r["policy"] == "pb-lru")
        lru = next(r for r in rows if r["batch"] == b and r["policy"] == "lru")
        table.append([b, pb["entries_per_step"], f"{100 * pb['hit_rate']:.2f}", f"{100 * lru['hit_rate']:.2f}",
                      f"{100 * (pb['hit_rate'] - lru['hit_rate']):+.2f}", f"{pb['sched_ms']:.3f}",
                      f"{lru['sched_ms']:.3f}", f"{lru['sched_ms'] / pb['sched_ms']:.2f}x"])
    print(markdown_table(["batch", "entries/step", "PB-LRU hit %", "LRU hit %", "diff (pp)", "PB-LRU ms",
                          "LRU ms", "LRU/PB-LRU time"], table))
    json_path, png = output_paths(args.json, args.out_dir, "bench_kv_lru")
    torch_threads = torch.get_num_threads()
    write_json(json_path, {"trace": args.trace, "slots": slots, "buckets": args.buckets, "span": args.span,
                           "torch_threads": torch_threads, "rows": rows})
    line_chart(png, batches, {p: [r["sched_ms"] for r in rows if r["policy"] == p] for p in ("pb-lru", "lru")},
               f"scheduling time per decode step ({slots} slots)", "batch", "ms / step")
    print(f"results: {json_path}, {png}")
    return {"rows": rows}
