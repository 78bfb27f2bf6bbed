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
import math
import os
import time

HELP = "KV-cache benchmarks: sparse access traces (trace), PB-LRU vs exact LRU (lru), UlaCache capacity (capacity)"
DESCRIPTION = __doc__


def add_arguments(p):
    p.add_argument("what", choices=["trace", "lru", "capacity", "engine"],
                   help="trace: record a sparse access trace (+ quality); lru: replay a trace through PB-LRU and "
                        "exact LRU; capacity: admitted requests, throughput and TPOT of gpu-only, hisparse, ula-dp "
                        "and ula-tp; engine: --requests long requests through the engine (kv_tier) per system: how "
                        "many run at once, throughput, TTFT, and whether the outputs agree")
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


# ------------------------------------------------------------------ capacity

SYSTEMS = ("gpu-only", "hisparse", "ula-dp", "ula-tp")
TPOT_BATCHES = (1, 2, 4, 8)
TP_RANKS = 2


def make_cache(system: str, args, shape, dtype, groups: int, device_gb: float, host_gb: float, group=None):
    """The system's KV backend under these budgets (tp systems: this rank's)."""
    from lanner.kvcache.ula import make_backend

    return make_backend(system, shape, dtype, device_gb, host_gb, (args.hisparse_buffer or 0) * groups,
                        args.tp_buffer, group)


def measure(dec, n: int, prompts, args, show: bool = True) -> dict:
    """Admits n requests (what the system's accounting allows), decodes them all in one step, then times
    decode steps per batch size; finally checks that one more request does not fit."""
    import statistics
    import time

    from tqdm import tqdm

    from lanner.kvcache.ula import CacheFull

    cache, max_len = dec.cache, args.doc_tokens + args.gen
    logits = {}
    bar = tqdm(desc=f"{cache.name}: admit {n}", unit="step", disable=not show)

    def add(i):
        dec.add(i, prompts[i % len(prompts)], max_len)
        logits[i] = prompts[i % len(prompts)].logits

    def decode(rids):
        out = dec.step(rids, [int(logits[r].argmax()) for r in rids])
        for r, row in zip(rids, out):
            logits[r] = row
        bar.update(1)

    for i in range(n):
        add(i)
    if n:
        decode(list(range(n)))  # every admitted request in one step: the accounting holds when running
    points = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= n} | ({n} if n else set()))
    tok_s, tpot, tpot_prefetch = {}, {}, {}
    ula = cache.name.startswith("ula")
    for b in points:
        for prefetch in (False, True) if ula and b in TPOT_BATCHES else (False,):
            dec.set_prefetch(prefetch)
            rids = sorted(logits, key=dec.length)[:b]  # the least decoded: no request outgrows its max_len
            bar.set_description(f"{cache.name}: batch {b}{' prefetch' if prefetch else ''}")
            decode(rids)  # warm-up
            times = []
            for _ in range(args.decode_steps):
                t0 = time.perf_counter()
                decode(rids)
                times.append(time.perf_counter() - t0)
            dt = statistics.median(times)  # the CPU is shared: the median step resists other jobs' bursts
            if prefetch:
                tpot_prefetch[b] = dt * 1e3
            else:
                tok_s[b], tpot[b] = b / dt, dt * 1e3
    dec.set_prefetch(False)
    store = getattr(cache, "store", None)
    # latent bytes this process stores per context token (ula: entries written, wherever they live)
    stored = None if store is None else int(store.live.sum()) * cache.entry_bytes / sum(map(dec.length, logits))
    stats = dict(cache.stats)
    for attr in ("evicted", "loaded"):
        store = getattr(cache, "store", None)
        if store is not None:
            stats[attr] = getattr(store, attr)
    # one more request must not fit: refused at admission, or its step's device working set does not fit
    refused = None
    try:
        add(n)
        decode(list(range(n + 1)))
    except CacheFull as e:
        refused = f"{type(e).__name__}: {e}"
    bar.close()
    peak = max(tok_s, key=tok_s.get) if tok_s else None
    return {"system": cache.name, "admitted": n, "next_refused": refused, "peak_tok_s": tok_s.get(peak, 0.0),
            "peak_batch": peak, "tok_s": tok_s, "tpot_ms": {b: tpot.get(b) for b in TPOT_BATCHES},
            "tpot_ms_prefetch": {b: tpot_prefetch[b] for b in tpot_prefetch} if ula else None,
            "device_hit_rate": stats["hits"] / stats["accesses"] if stats.get("accesses") else None,
            "moves": stats, "stored_bytes_per_token": stored}


def _tp_worker(rank, port, model, prompts, args, shape, dtype, groups, out):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    # a process group of its own, not lanner.distributed's TP state: the dense model runs whole on each rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP_RANKS,
                            timeout=datetime.timedelta(seconds=300))
    try:
        cache = make_cache("ula-tp", args, shape, dtype, groups, args.device_gb / TP_RANKS, args.host_gb / TP_RANKS)
        row = measure(*dense_decoder(model, cache, args), prompts, args, show=rank == 0)
        if rank == 0:
            with open(out, "w") as f:
                json.dump([row], f)
    finally:
        dist.destroy_process_group()


def dense_decoder(model, cache, args):
    """(decoder, requests it admits) for the dense model: Quest selection, --group layers per entry."""
    from lanner.engine.ula_dense import UlaDecoder

    max_len = args.doc_tokens + args.gen
    dec = UlaDecoder(model, cache, args.page_size, args.budget, args.group, max_len)
    return dec, min(cache.max_requests(dec.groups * max_len), cache.max_batch(args.budget, args.page_size))


def capacity(args, engine_kwargs: dict) -> dict:
    import torch
    from tqdm import tqdm

    from lanner.config import EngineConfig
    from lanner.kvcache.quest import long_documents
    from lanner.engine.ula_dense import UlaDecoder
    from lanner.kvcache.ula import GpuOnly, entry_shape
    from lanner.models.loader import ModelSource, load_model
    from lanner.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    if args.kv_model == "glm-tiny":
        return capacity_mla(args, engine_kwargs)
    args.group = args.group or 10
    args.hisparse_buffer = args.hisparse_buffer or 2 * args.budget
    systems = [s for s in (args.systems or ",".join(SYSTEMS)).split(",") if s]
    cfg = EngineConfig(**engine_kwargs)
    if cfg.device != "cpu":
        raise SystemExit("lanner bench kv capacity runs on the CPU (ula-tp uses gloo)")
    src = ModelSource.resolve(cfg.model)
    model, mcfg = load_model(src, cfg.torch_dtype, cfg.device)
    tok = Tokenizer(src, mcfg.eos_token_ids)
    docs = long_documents(tok, args.doc_tokens, args.docs or 2)
    shape, dtype = entry_shape(model, args.group), cfg.torch_dtype
    groups = mcfg.num_layers // args.group
    max_len = args.doc_tokens + args.gen
    prefiller = UlaDecoder(model, GpuOnly(shape, dtype, 0), args.page_size, args.budget, args.group, max_len)
    prompts = [prefiller.run_prefill(d) for d in tqdm(docs, desc="prefill", unit="doc")]  # shared by all requests
    rows = []
    for system in systems:
        if system != "ula-tp":
            cache = make_cache(system, args, shape, dtype, groups, args.device_gb, args.host_gb)
            rows.append(measure(*dense_decoder(model, cache, args), prompts, args))
            continue
        # fork: the ranks share the loaded model and the prefilled prompts
        rows += run_tp(_tp_worker, (model, prompts, args, shape, dtype, groups))
    entry_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    print_rows(rows)
    result = {"model": src.name, "dtype": cfg.dtype, "device": "cpu", "threads_per_process": args.threads,
              "doc_tokens": args.doc_tokens, "gen": args.gen, "docs": len(docs), "group": args.group,
              "budget": args.budget, "page_size": args.page_size, "device_gb": args.device_gb,
              "host_gb": args.host_gb, "tp_ranks": TP_RANKS, "tp_buffer": args.tp_buffer,
              "hisparse_buffer_tokens_per_group": args.hisparse_buffer, "entry_shape": list(shape),
              "entry_bytes": entry_bytes, "request_bytes": entry_bytes * groups * max_len,
              "page_bounds_bytes_per_request": 2 * 4 * groups * prefiller.pages * shape[2] * shape[3],
              "decode_steps": args.decode_steps, "rows": rows}
    return write_result(result, args)


def run_tp(worker, worker_args: tuple) -> list[dict]:
    """Runs worker(rank, port, *worker_args, out) on TP_RANKS forked processes; rank 0 writes its rows to out."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(worker, args=(port, *worker_args, out), nprocs=TP_RANKS, start_method="fork", join=True)
        with open(out) as f:
            rows = json.load(f)
    for row in rows:
        for key in ("tok_s", "tpot_ms", "tpot_ms_prefetch"):
            if row[key] is not None:
                row[key] = {int(b): v for b, v in row[key].items()}
    return rows


def print_rows(rows: list[dict]):
    from lanner.bench.report import fmt, markdown_table

    headers = ["system", "admitted", "next refused", "peak tok/s (batch)"] + \
              [f"TPOT ms b={b}" for b in TPOT_BATCHES] + ["ula prefetch TPOT ms b=1..8", "device hit %"]
    table = []
    for r in rows:
        pf = r["tpot_ms_prefetch"]
        table.append([r["system"], r["admitted"], "yes" if r["next_refused"] else "NO",
                      f"{r['peak_tok_s']:.1f} ({r['peak_batch']})"] +
                     [fmt(r["tpot_ms"][b]) for b in TPOT_BATCHES] +
                     ["/".join(fmt(pf.get(b)) for b in TPOT_BATCHES) if pf else "-",
                      fmt(None if r["device_hit_rate"] is None else 100 * r["device_hit_rate"])])
    print(markdown_table(headers, table))


def ratios(rows: list[dict]) -> dict:
    """Admitted requests and peak decode throughput of UlaCache against the HiSparse baseline(s) in the run."""
    by = {r["system"]: r for r in rows}
    out = {}
    for ula, base in (("ula-dp", "hisparse"), ("ula-tp", "hisparse"), ("ula-tp", "hisparse-tp")):
        if ula in by and base in by and by[base]["admitted"] and by[base]["peak_tok_s"]:
            out[f"{ula}/{base}"] = {"admitted": by[ula]["admitted"] / by[base]["admitted"],
                                    "peak_tok_s": by[ula]["peak_tok_s"] / by[base]["peak_tok_s"]}
    for k, v in out.items():
        print(f"{k}: admitted {v['admitted']:.2f}x, peak decode throughput {v['peak_tok_s']:.2f}x")
    return out


def write_result(result: dict, args) -> dict:
    from lanner.bench.report import bar_chart, output_paths, write_json

    rows = result["rows"]
    result["ratios"] = ratios(rows)
    json_path, png = output_paths(args.json, args.out_dir, "bench_kv_capacity")
    write_json(json_path, result)
    bar_chart(png, [f"{r['system']}\n({r['admitted']} req)" for r in rows], [r["peak_tok_s"] for r in rows],
              f"peak decode tok/s, same KV budgets ({args.device_gb:g} GiB device, {args.host_gb:g} GiB host)",
              "tokens / s")
    print(f"results: {json_path}, {png}")
    return result


# ------------------------------------------------------------------ engine

ENGINE_SYSTEMS = ("gpu-only", "hisparse", "ula-dp")


def engine_admission(args, engine_kwargs: dict) -> dict:
    """The same long requests through LLMEngine's UlaCache mode (kv_tier) for each system at equal budgets."""
    import statistics
    import time

    import torch
    from tqdm import tqdm

    from lanner.bench.report import bar_chart, markdown_table, output_paths, write_json
    from lanner.engine.sampling import SamplingParams
    from lanner.kvcache.quest import long_documents
    from lanner.llm import LLM

    torch.set_num_threads(args.threads)
    systems = [s for s in (args.systems or ",".join(ENGINE_SYSTEMS)).split(",") if s]
    params = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    rows, outputs, docs = [], {}, None
    for system in systems:
        llm = LLM(**engine_kwargs | {"kv_tier": system, "kv_device_gb": args.device_gb, "kv_host_gb": args.host_gb,
                                     "sparse_budget": args.budget, "sparse_group": args.group or 10,
                                     "sparse_page": args.page_size, "max_num_seqs": args.requests})
        eng = llm.engine
        if docs is None:
            docs = long_documents(llm.tokenizer, args.doc_tokens, args.docs or 4)
        reqs = [eng.add_request(docs[i % len(docs)], params) for i in range(args.requests)]
        running, done, t0 = [], {}, time.perf_counter()
        with tqdm(total=len(reqs), desc=system, unit="req") as bar:
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o
                        bar.update(1)
                running.append(len(eng.scheduler.running))
        wall = time.perf_counter() - t0
        outs = [done[r.request_id] for r in reqs]
        errors = [o.error for o in outs if o.error]
        outputs[system] = [o.token_ids for o in outs]
        tokens = sum(len(o.token_ids) for o in outs)
        rows.append({"system": system, "requests": len(reqs), "max_running": max(running), "wall_s": wall,
                     "output_tok_s": tokens / wall, "errors": errors,
                     "ttft_p50_s": statistics.median(o.metrics["ttft_s"] for o in outs),
                     "identical_to_" + systems[0]: outputs[system] == outputs[systems[0]]})
        llm.close()
    table = [[r["system"], r["requests"], r["max_running"], f"{r['output_tok_s']:.1f}", f"{r['ttft_p50_s']:.1f}",
              f"{r['wall_s']:.0f}", "yes" if r["identical_to_" + systems[0]] else "NO", len(r["errors"])]
             for r in rows]
    print(markdown_table(["system", "requests", "most running at once", "output tok/s", "TTFT p50 s", "wall s",
                          f"tokens = {systems[0]}'s", "errors"], table))
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


# ------------------------------------------------------------------ capacity on a tiny GLM-5-architecture model

MLA_TP_SYSTEMS = ("ula-tp", "hisparse-tp", "gpu-only-tp")  # run by the model under TP (heads split over TP_RANKS)


def mla_decoder(model, system: str, args, device_gb: float, host_gb: float, group=None):
    """(decoder, requests it admits) for the MLA model. Every system keeps every admitted request's indexer keys
    resident on the device (on every rank: the indexer is replicated; ula-tp: each key on one rank) out of the same
    device budget: the KV pools get what n requests' keys leave, for the largest n whose KV then still fits."""
    from lanner.engine.ula_mla import MlaDecoder, mla_entry_shape, selection_groups
    from lanner.kvcache.ula import GB

    shape, groups = mla_entry_shape(model), len(selection_groups(model))
    dtype = model.embed_tokens.weight.dtype
    max_len = args.doc_tokens + args.gen
    n_entries = groups * max_len
    key_rows = -(-n_entries // TP_RANKS) if system == "ula-tp" else n_entries  # one request's keys on this rank
    keys_gb = key_rows * model.hf["index_head_dim"] * dtype.itemsize / GB
    step_entries = model.hf["index_topk"] + 1  # one request's selection and new token, per group

    def build(n):
        """-> (the cache for n requests, or None, and what limits n)."""
        if n * keys_gb > device_gb:
            return None, "indexer keys alone exceed the device budget"
        try:
            cache = make_cache(system, args, shape, dtype, groups, device_gb - n * keys_gb, host_gb, group)
        except ValueError as e:  # too little device memory left for a pool
            return None, str(e)
        if cache.max_requests(n_entries) < n:
            return None, "KV memory (max_requests)"
        if cache.max_batch(step_entries, 1) < n:
            return None, "device slots for one step's selections (max_batch)"
        return cache, None

    lo, hi = 0, 1
    while build(hi)[0] is not None:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if build(mid)[0] is not None else (lo, mid)
    cache, limit = build(lo)[0], build(lo + 1)[1]
    if cache is None:
        raise SystemExit(f"{system}: the device budget ({device_gb:g} GiB) holds no KV pool")
    return MlaDecoder(model, cache, max_len, index_gb=lo * keys_gb), lo, limit


def measure_mla(model, system, args, device_gb, host_gb, prompts, group=None, show=True) -> dict:
    dec, n, limit = mla_decoder(model, system, args, device_gb, host_gb, group)
    # the device budget is split for exactly n requests' indexer keys: the (n+1)-th is refused by them; `limit`
    # says what would not fit with n+1 requests' keys taken out
    return measure(dec, n, prompts, args, show) | {"system": system, "limit": limit}


def _mla_prompts(model, docs, max_len):
    from lanner.engine.ula_mla import MlaDecoder, mla_entry_shape
    from lanner.kvcache.ula import GpuOnly

    prefiller = MlaDecoder(model, GpuOnly(mla_entry_shape(model), model.embed_tokens.weight.dtype, 0), max_len)
    return [prefiller.run_prefill(d) for d in docs]


def _load_tiny(folder, dtype):
    from lanner.models.loader import ModelSource, load_model

    return load_model(ModelSource.resolve(folder), dtype, "cpu")[0]


def _mla_tp_worker(rank, port, folder, docs, systems, args, dtype, out):
    import torch
    import torch.distributed as dist

    from lanner.distributed import destroy_tp, init_tp

    torch.set_num_threads(args.threads)
    init_tp(rank, TP_RANKS, f"tcp://127.0.0.1:{port}", timeout_s=300)
    try:
        model = _load_tiny(folder, dtype)  # this rank's heads; latent projection and indexer replicated
        group = dist.new_group(backend="gloo")  # the cache's gathers apart from the model's (a prefetch thread's)
        prompts = _mla_prompts(model, docs, args.doc_tokens + args.gen)
        per_rank = args.device_gb / TP_RANKS, args.host_gb / TP_RANKS
        rows = [measure_mla(model, s, args, *per_rank, prompts, group, show=rank == 0) for s in systems]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        destroy_tp()


def capacity_mla(args, engine_kwargs: dict) -> dict:
    import tempfile

    import torch

    from lanner.bench.report import fmt, markdown_table
    from lanner.config import EngineConfig
    from lanner.engine.ula_mla import mla_entry_shape, mla_kv_bytes, selection_groups
    from lanner.models.tiny import make_tiny_model

    cfg = EngineConfig(**engine_kwargs)
    if cfg.device != "cpu":
        raise SystemExit("lanner bench kv capacity runs on the CPU (ula-tp uses gloo)")
    dtype = cfg.torch_dtype
    systems = [s for s in (args.systems or ",".join(SYSTEMS + ("hisparse-tp", "gpu-only-tp"))).split(",") if s]
    args.hisparse_buffer = args.hisparse_buffer or 2 * args.budget
    max_len = args.doc_tokens + args.gen
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(2, 160, (args.doc_tokens,), generator=g).tolist() for _ in range(args.docs or 2)]
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        # index_topk = --budget: the tokens each decode query reads
        make_tiny_model("glm_moe_dsa", folder, index_topk=args.budget, max_position_embeddings=max(512, max_len))
        model = _load_tiny(folder, dtype)
        local = [s for s in systems if s not in MLA_TP_SYSTEMS]
        if local:
            prompts = _mla_prompts(model, docs, max_len)
            for s in local:
                rows[s] = measure_mla(model, s, args, args.device_gb, args.host_gb, prompts)
        tp = [s for s in systems if s in MLA_TP_SYSTEMS]
        if tp:
            rows |= {r["system"]: r for r in run_tp(_mla_tp_worker, (folder, docs, tp, args, dtype))}
    rows = [rows[s] for s in systems]
    print_rows(rows)
    for r in rows:
        print(f"{r['system']}: {r['admitted']} admitted; with one more request's indexer keys taken out of the "
              f"device budget, the limit is: {r['limit']}")
    shape, groups = mla_entry_shape(model), len(selection_groups(model))
    dup = mla_kv_bytes(model, TP_RANKS, dtype)
    measured = {r["system"]: r["stored_bytes_per_token"] for r in rows if r["system"] == "ula-tp"}
    dup["measured_ula_tp_latent_rank0"] = measured.get("ula-tp")
    print(markdown_table(
        [f"KV bytes per token per rank, TP{TP_RANKS}", "latent", "indexer keys", "total"],
        [["replicated (plain TP model, gpu-only-tp)", dup["latent"], dup["index_keys"], dup["per_rank_replicated"]],
         ["UlaCache TP (each entry and key on one rank)", fmt(dup["latent"] / TP_RANKS),
          fmt(dup["index_keys"] / TP_RANKS), fmt(dup["per_rank_ula_tp"])],
         ["UlaCache TP, measured on rank 0", fmt(dup["measured_ula_tp_latent_rank0"]), "-", "-"]]))
    entry_bytes = math.prod(shape) * dtype.itemsize
    result = {"model": "glm-tiny (random GLM-5 architecture: 4 layers, 2 selection groups, MLA latent 32 + 8)",
              "dtype": cfg.dtype, "device": "cpu", "threads_per_process": args.threads,
              "doc_tokens": args.doc_tokens, "gen": args.gen, "docs": len(docs), "index_topk": args.budget,
              "device_gb": args.device_gb, "host_gb": args.host_gb, "tp_ranks": TP_RANKS, "tp_buffer": args.tp_buffer,
              "hisparse_buffer_tokens_per_group": args.hisparse_buffer, "entry_shape": list(shape),
              "entry_bytes": entry_bytes, "request_bytes": entry_bytes * groups * max_len,
              "request_index_key_bytes": groups * max_len * model.hf["index_head_dim"] * dtype.itemsize,
              "kv_bytes_per_token": dup, "decode_steps": args.decode_steps, "rows": rows}
    return write_result(result, args)
