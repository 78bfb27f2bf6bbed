"""`lanner bench kv`: sparse-attention KV access traces and the device-pool replacement policies replaying them.

- `lanner bench kv trace`: decodes real long text (ShareGPT conversations) with Quest-style sparse attention on
  the model, teacher-forced, and writes the access trace plus the sparse-vs-dense quality (top-1 agreement,
  perplexity) per budget.
- `lanner bench kv lru --trace FILE`: replays the trace through PB-LRU and the exact timestamp LRU over one
  shared device pool: batch b = b recorded requests decoding side by side (their entries are distinct logical
  addresses); reports hit rate and scheduling time per step, from batch 1 to the largest batch whose step still
  fits in the pool.
- `lanner bench kv capacity`: long-context requests (real text) decoded with Quest-sparse attention over four KV
  systems with the same total device and host budgets: gpu-only, hisparse, ula-dp and ula-tp (2 gloo ranks, each
  with half of each budget). Per system: requests admitted at once (memory accounting, confirmed by decoding that
  many together and by the next one failing), decode throughput per batch size (its peak), and time per output
  token at batch 1-8 (ula: also with the layer-group prefetch); step times are medians over --decode-steps.
  `--kv-model glm-tiny`: the same on a tiny random GLM-5-architecture model (MLA latent entries, the DSA indexer's
  top-k as the selection, --budget = index_topk; prompts are random tokens), with ula-tp running the model itself
  under TP (heads split over 2 gloo ranks), two more rows run by the same TP model: gpu-only-tp (the plain TP
  model: every rank stores the whole latent) and hisparse-tp (HiSparse under TP: every rank keeps the whole
  latent history on its host and its own device buffers, as the latent is replicated under TP), and a report of KV
  bytes per token per rank, replicated vs UlaCache TP. The indexer keys stay resident on the device in every
  system and are counted in its device budget: on every rank, except under ula-tp, where each key lives on one
  rank (address mod P) like the latent and the ranks merge their top-k.
  Ratios: admitted requests and peak throughput of ula-dp and ula-tp against hisparse, and of ula-tp against
  hisparse-tp (the TP deployment of the same baseline).
"""
from __future__ import annotations

import json
import os
import time

from lanner.bench.kv_capacity import capacity

HELP = "KV-cache benchmarks: sparse access traces (trace), PB-LRU vs exact LRU (lru), UlaCache capacity (capacity)"
DESCRIPTION = __doc__


def add_arguments(p):
    p.add_argument("what", choices=["trace", "lru", "capacity", "engine"],
                   help="trace: record a sparse access trace (+ quality); lru: replay a trace through PB-LRU and "
                        "exact LRU; capacity: admitted requests, throughput and TPOT of gpu-only, hisparse, ula-dp "
                        "and ula-tp; engine: --requests long requests through the engine (kv_tier) per system: how "
                        "many run at once, throughput, TTFT, and whether the outputs agree (with --spec ngram / "
                        "suffix / draft / hybrid each system also runs with speculation)")
    p.add_argument("--trace", default="results/kv_trace.jsonl", help="access trace to write (trace) or replay (lru)")
    p.add_argument("--json", default=None, help="results JSON (default: results/bench_kv_<what>.json)")
    p.add_argument("--out-dir", default="results")
    # trace
    p.add_argument("--docs", type=int, default=None,
                   help="trace: long documents, one request each (default 4); capacity: distinct prompts the "
                        "requests cycle through (default 2)")
    p.add_argument("--doc-tokens", type=int, default=2048, help="trace, capacity: tokens per document (prompt)")
    p.add_argument("--steps", type=int, default=64, help="trace: decode steps per document")
    p.add_argument("--page-size", type=int, default=16, help="trace, capacity: Quest page size")
    p.add_argument("--budget", type=int, default=256, help="trace, capacity: tokens each decode query reads")
    p.add_argument("--quality-budgets", default="128,256,512",
                   help="trace: budgets whose quality vs dense is reported (the first doc only, no trace)")
    p.add_argument("--group", type=int, default=None,
                   help="layers sharing one selection (trace default 1; capacity default 10: an entry holds them)")
    # lru
    p.add_argument("--slots", type=int, default=0,
                   help="lru: device pool slots (default: 16 steps' worth of one request's entries, so batch 1 "
                        "rarely evicts and batch 16 evicts every step)")
    p.add_argument("--batch", default="", help="lru: batch sizes (default: 1, 2, 4 ... up to the largest that fits)")
    p.add_argument("--buckets", type=int, default=64, help="lru: PB-LRU buckets")
    p.add_argument("--span", type=int, default=1, help="lru: decode steps per PB-LRU bucket epoch")
    p.add_argument("--repeat", type=int, default=3, help="lru: timing repeats (the minimum is reported)")
    # capacity
    p.add_argument("--device-gb", type=float, default=0.2, help="capacity: KV device budget (GiB, all ranks)")
    p.add_argument("--host-gb", type=float, default=1.0, help="capacity: KV host budget (GiB, all ranks)")
    p.add_argument("--gen", type=int, default=64, help="capacity: output tokens a request may decode (its size)")
    p.add_argument("--decode-steps", type=int, default=8, help="capacity: timed decode steps per batch size")
    p.add_argument("--requests", type=int, default=16, help="engine: requests submitted at once")
    p.add_argument("--systems", default=None,
                   help="capacity: systems to run (default gpu-only,hisparse,ula-dp,ula-tp; glm-tiny adds "
                        "hisparse-tp,gpu-only-tp)")
    p.add_argument("--hisparse-buffer", type=int, default=0,
                   help="capacity: hisparse device buffer per request, tokens per layer group (default 2 x budget)")
    p.add_argument("--tp-buffer", type=float, default=0.5,
                   help="capacity: ula-tp share of each rank's device budget for its buffer of other ranks' selected "
                        "entries (a step may find all of a selection on one rank: the home pool and the buffer must "
                        "each hold a whole step, so an even split admits the largest batch)")
    p.add_argument("--threads", type=int, default=1, help="capacity: torch threads per process (rank)")
    p.add_argument("--kv-model", choices=["default", "glm-tiny"], default="default",
                   help="capacity: default: --model (dense, Quest selection); glm-tiny: a tiny random GLM-5-"
                        "architecture model (MLA + DSA indexer), built on the fly")


def run(args, engine_kwargs: dict) -> dict:
    if args.what == "capacity":
        return capacity(args, engine_kwargs)
    if args.what == "engine":
        return engine_admission(args, engine_kwargs)
    return record_trace(args, engine_kwargs) if args.what == "trace" else replay_lru(args)


# ------------------------------------------------------------------ trace

def record_trace(args, engine_kwargs: dict) -> dict:
    from tqdm import tqdm

    from lanner.bench.kv_quality import evaluate, long_documents
    from lanner.bench.report import markdown_table, output_paths, write_json
    from lanner.config import EngineConfig
    from lanner.models.loader import ModelSource, load_model
    from lanner.tokenizer import Tokenizer

    cfg = EngineConfig(**engine_kwargs)
    src = ModelSource.resolve(cfg.model)
    model, mcfg = load_model(src, cfg.torch_dtype, cfg.device)
    tok = Tokenizer(src, mcfg.eos_token_ids)
    prefix = args.doc_tokens - args.steps - 1
    args.group = args.group or 1
    docs = long_documents(tok, args.doc_tokens, args.docs or 4)
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
        steps.append(torch.unique(torch.cat(parts)))  # what an engine hands the policy: deduplicated, sorted
    return steps, batch * G * max_ctx


def replay_lru(args) -> dict:
    import torch

    from lanner.bench.report import line_chart, markdown_table, output_paths, write_json
    from lanner.kvcache.lru import PBLRU, ExactLRU

    requests, max_ctx = load_trace(args.trace)
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
        for make in (lambda n=num_addrs: PBLRU(slots, n, args.buckets, args.span),
                     lambda n=num_addrs: ExactLRU(slots, n)):
            best, hit = None, None
            for _ in range(args.repeat):
                pol = make()
                t0 = time.perf_counter()
                for s in steps:
                    pol.access(s, unique=True)
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


# ------------------------------------------------------------------ engine

ENGINE_SYSTEMS = ("gpu-only", "hisparse", "ula-dp")


def engine_admission(args, engine_kwargs: dict) -> dict:
    """The same long requests through LLMEngine's UlaCache mode (kv_tier) for each system at equal budgets."""
    import statistics
    import time

    import torch
    from tqdm import tqdm

    from lanner.bench.kv_quality import long_documents
    from lanner.bench.report import bar_chart, markdown_table, output_paths, write_json
    from lanner.engine.sampling import SamplingParams
    from lanner.llm import LLM

    torch.set_num_threads(args.threads)
    systems = [s for s in (args.systems or ",".join(ENGINE_SYSTEMS)).split(",") if s]
    # --spec ngram / suffix / draft / hybrid: each system also runs with those drafts verified over its KV
    spec = engine_kwargs.get("spec") if engine_kwargs.get("spec") not in (None, "none", "auto") else None
    runs = [(system, s) for system in systems for s in ((None, spec) if spec else (None,))]
    params = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    rows, outputs, docs, first = [], {}, None, systems[0]
    for system, spec in runs:
        name = system + (f"+{spec}" if spec else "")
        llm = LLM(**engine_kwargs | {"kv_tier": system, "kv_device_gb": args.device_gb, "kv_host_gb": args.host_gb,
                                     "sparse_budget": args.budget, "sparse_group": args.group or 10,
                                     "sparse_page": args.page_size, "max_num_seqs": args.requests, "spec": spec,
                                     "draft": engine_kwargs.get("draft") if spec else None})
        eng = llm.engine
        if docs is None:
            docs = long_documents(llm.tokenizer, args.doc_tokens, args.docs or 4)
        reqs = [eng.add_request(docs[i % len(docs)], params) for i in range(args.requests)]
        running, done, t0 = [], {}, time.perf_counter()
        with tqdm(total=len(reqs), desc=name, unit="req") as bar:
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o
                        bar.update(1)
                running.append(len(eng.scheduler.running))
        wall = time.perf_counter() - t0
        outs = [done[r.request_id] for r in reqs]
        errors = [o.error for o in outs if o.error]
        outputs[name] = [o.token_ids for o in outs]
        tokens = sum(len(o.token_ids) for o in outs)
        verify = sum(o.metrics["spec_verify_steps"] for o in outs)
        emitted = sum(o.metrics["spec_accept_length"] * o.metrics["spec_verify_steps"] for o in outs if verify)
        plain = next((r for r in rows if r["system"] == system), None)  # this system without speculation
        rows.append({"system": name, "kv_tier": system, "spec": spec, "requests": len(reqs),
                     "max_running": max(running), "wall_s": wall, "output_tok_s": tokens / wall, "errors": errors,
                     "ttft_p50_s": statistics.median(o.metrics["ttft_s"] for o in outs),
                     # decode time per output token, prefills of other requests included (one per step)
                     "tpot_p50_ms": 1000 * statistics.median(o.metrics["tpot_s"] for o in outs),
                     "tau": emitted / verify if verify else None,
                     "speedup_vs_plain": tokens / wall / plain["output_tok_s"] if plain and spec else None,
                     "identical_to_" + first: outputs[name] == outputs[first]})
        llm.close()
    table = [[r["system"], r["requests"], r["max_running"], f"{r['output_tok_s']:.1f}",
              f"{r['speedup_vs_plain']:.2f}x" if r["speedup_vs_plain"] else "", f"{r['tau']:.2f}" if r["tau"] else "",
              f"{r['tpot_p50_ms']:.0f}", f"{r['ttft_p50_s']:.1f}", f"{r['wall_s']:.0f}",
              "yes" if r["identical_to_" + first] else "NO", len(r["errors"])] for r in rows]
    print(markdown_table(["system", "requests", "most running at once", "output tok/s", "vs no speculation",
                          "tokens per verify step", "TPOT p50 ms", "TTFT p50 s", "wall s", f"tokens = {first}'s",
                          "errors"], table))
    result = {"benchmark": "kv engine", "engine": engine_kwargs, "doc_tokens": args.doc_tokens, "gen": args.gen,
              "budget": args.budget, "group": args.group or 10, "page_size": args.page_size,
              "device_gb": args.device_gb, "host_gb": args.host_gb, "rows": rows}
    json_path, png = output_paths(args.json, args.out_dir, "bench_kv_engine")
    write_json(json_path, result)
    bar_chart(png, [f"{r['system']}\n({r['max_running']} at once)" for r in rows], [r["output_tok_s"] for r in rows],
              f"{args.requests} x {args.doc_tokens}-token requests through the engine "
              f"({args.device_gb:g} GiB device, {args.host_gb:g} GiB host)", "output tokens / s")
    print(f"results: {json_path}, {png}")
    return result
