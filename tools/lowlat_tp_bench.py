"""lowlat under tensor parallelism: single-stream greedy decode tok/s of the default model at TP=1 and TP=2, with
lowlat (its all-reduce inside the kernel through shared memory, or through the process group) and without.

    python tools/lowlat_tp_bench.py [--dtype bfloat16] [--tokens 128] [--cycles 3] [--spec none]
        [--systems tp1-none,tp1-lowlat,tp2-none,tp2-lowlat-group,tp2-lowlat-shm] [--out results/lowlat_tp_bench.json]

One thread per rank (the 2-core box holds one rank per core). Each system is its own engine (a process holds one
TP group at a time), so the systems run in turn, `--cycles` times over (a fresh engine each time, in the same
order: a shared machine slows all alike); each turn generates `--tokens` tokens for a 16-token prompt twice (the
first is a warm-up). Reported: median tok/s over the cycles, each cycle's tok/s, and whether every system gave
TP=1 plain decoding's tokens (float32: identical expected; bfloat16: each TP rank rounds its partial sums, so
TP=2 may part from TP=1 at a near-tie, but every TP=2 system should agree with tp2-none).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from lanner.bench.report import bar_chart, markdown_table

SYSTEMS = {
    "tp1-none": dict(tp=1),
    "tp1-lowlat": dict(tp=1, plugin="lowlat"),
    "tp2-none": dict(tp=2),
    "tp2-lowlat-group": dict(tp=2, plugin="lowlat", allreduce="group"),
    "tp2-lowlat-shm": dict(tp=2, plugin="lowlat", allreduce="shm"),
}


def run_system(name: str, a, prompt) -> tuple[float, list[int], dict]:
    from lanner import LLM, SamplingParams

    spec = dict(SYSTEMS[name])
    options = {"threads": 1}
    if "allreduce" in spec:
        options["allreduce"] = spec.pop("allreduce")
    plugin = spec.pop("plugin", None)
    kw = dict(model=a.model, dtype=a.dtype, skip_tokenizer=True, spec=None if a.spec == "none" else a.spec,
              kv_cache_memory="0.25GiB", **spec)
    if plugin:
        kw |= dict(plugin=plugin, plugin_options={plugin: options})
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    with LLM(**kw) as llm:
        llm.generate(prompt, params)  # warm-up: first touch of weights and caches
        rt = llm.engine.plugins
        kernel = rt.plugins[0].kernel if rt and spec["tp"] > 1 else None
        if kernel is not None:
            kernel.tp_wait_stats()  # reset
        t = time.perf_counter()
        out = llm.generate(prompt, params)[0]
        dt = time.perf_counter() - t
        info = {"plugin_calls": {f"{p}/{k}": n for (p, k), n in (rt.counts.items() if rt else [])},
                "plugin_disabled": dict(rt.disabled) if rt else {}}
        if kernel is not None and options.get("allreduce") == "shm":
            exchanges, wait_s = kernel.tp_wait_stats()
            info |= {"rank0_exchanges": exchanges, "rank0_wait_s": wait_s, "rank0_wait_share": wait_s / dt}
    return a.tokens / dt, out.token_ids, info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled default model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--spec", default="none", help="speculative mode of every system (none, draft, ngram, auto)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default=None, help="a JSON report, with a PNG next to it (default: print only)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # spawned workers take rank 0's thread count
    names = a.systems.split(",")
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    prompt = torch.randint(100, 40000, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = {n: [] for n in names}
    tokens, extra = {}, {}
    for c in range(a.cycles):
        for n in names:
            tok_s, ids, info = run_system(n, a, prompt)
            runs[n].append(tok_s)
            tokens[n], extra[n] = ids, info
            waits = (f", rank 0 waited {info['rank0_wait_s'] * 1e3:.0f} ms in {info['rank0_exchanges']} exchanges "
                     f"({info['rank0_wait_share']:.0%} of the time)") if "rank0_wait_s" in info else ""
            print(f"cycle {c + 1}/{a.cycles} {n}: {tok_s:.1f} tok/s{waits}", flush=True)
    ref = names[0]
    rows = [{"system": n, "tok_s": statistics.median(runs[n]), "tok_s_runs": runs[n],
             "same_tokens_as_" + ref: tokens[n] == tokens[ref], **extra[n]} for n in names]
    base = {r["system"]: r["tok_s"] for r in rows}
    for r in rows:  # lowlat's gain over the engine's own forward at the same TP size
        peer = r["system"].split("-")[0] + "-none"
        r["vs_" + "same_tp_none"] = r["tok_s"] / base[peer] if peer in base else None
    report = {"dtype": a.dtype, "tokens": a.tokens, "cycles": a.cycles, "spec": a.spec, "threads_per_rank": 1,
              "torch": torch.__version__, "systems": rows}
    print(markdown_table(["system", "tok/s (median)", "runs", "vs none at the same TP", f"same tokens as {ref}"],
                         [[r["system"], f"{r['tok_s']:.1f}", " / ".join(f"{x:.1f}" for x in r["tok_s_runs"]),
                           f"{r['vs_same_tp_none']:.2f}x" if r["vs_same_tp_none"] else "-",
                           "yes" if r["same_tokens_as_" + ref] else "no"] for r in rows]))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        png = os.path.splitext(a.out)[0] + ".png"
        bar_chart(png, [r["system"] for r in rows], [r["tok_s"] for r in rows],
                  f"default model, {a.dtype}, single-stream decode, 1 thread per rank", "tokens / s")
        print(f"results: {a.out}, {png}")


if __name__ == "__main__":
    main()
