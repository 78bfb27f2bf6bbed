"""`lanner bench kv capacity` (lanner.bench.kv describes it): long-context requests decoded with sparse attention
over each KV system at equal device and host budgets, on the dense model or a tiny GLM-5-architecture one."""
from __future__ import annotations

import json
import math
import os
import time

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
    from lanner.kvcache.ula.quest_decoder import UlaDecoder

    max_len = args.doc_tokens + args.gen
    dec = UlaDecoder(model, cache, args.page_size, args.budget, args.group, max_len)
    return dec, min(cache.max_requests(dec.groups * max_len), cache.max_batch(args.budget, args.page_size))


def capacity(args, engine_kwargs: dict) -> dict:
    import torch
    from tqdm import tqdm

    from lanner.bench.kv_quality import long_documents
    from lanner.config import EngineConfig
    from lanner.kvcache.ula.quest_decoder import UlaDecoder
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


# ------------------------------------------------------------------ capacity on a tiny GLM-5-architecture model

MLA_TP_SYSTEMS = ("ula-tp", "hisparse-tp", "gpu-only-tp")  # run by the model under TP (heads split over TP_RANKS)


def mla_decoder(model, system: str, args, device_gb: float, host_gb: float, group=None):
    """(decoder, requests it admits) for the MLA model. Every system keeps every admitted request's indexer keys
    resident on the device (on every rank: the indexer is replicated; ula-tp: each key on one rank) out of the same
    device budget: the KV pools get what n requests' keys leave, for the largest n whose KV then still fits."""
    from lanner.kvcache.ula.mla_decoder import MlaDecoder, mla_entry_shape, selection_groups
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


def mla_prompts(model, docs, max_len):
    """Each document prefilled through an MLA decoder over a device-only cache -> its prompt state."""
    from lanner.kvcache.ula.mla_decoder import MlaDecoder, mla_entry_shape
    from lanner.kvcache.ula import GpuOnly

    prefiller = MlaDecoder(model, GpuOnly(mla_entry_shape(model), model.embed_tokens.weight.dtype, 0), max_len)
    return [prefiller.run_prefill(d) for d in docs]


def load_tiny(folder, dtype):
    """The tiny GLM-5-architecture model saved in `folder`, on the CPU."""
    from lanner.models.loader import ModelSource, load_model

    return load_model(ModelSource.resolve(folder), dtype, "cpu")[0]


def _mla_tp_worker(rank, port, folder, docs, systems, args, dtype, out):
    import torch
    import torch.distributed as dist

    from lanner.distributed import destroy_tp, init_tp

    torch.set_num_threads(args.threads)
    init_tp(rank, TP_RANKS, f"tcp://127.0.0.1:{port}", timeout_s=300)
    try:
        model = load_tiny(folder, dtype)  # this rank's heads; latent projection and indexer replicated
        group = dist.new_group(backend="gloo")  # the cache's gathers apart from the model's (a prefetch thread's)
        prompts = mla_prompts(model, docs, args.doc_tokens + args.gen)
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
    from lanner.kvcache.ula.mla_decoder import mla_entry_shape, mla_kv_bytes, selection_groups
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
        model = load_tiny(folder, dtype)
        local = [s for s in systems if s not in MLA_TP_SYSTEMS]
        if local:
            prompts = mla_prompts(model, docs, max_len)
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
