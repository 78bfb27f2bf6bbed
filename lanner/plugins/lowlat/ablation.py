"""The lowlat ablation: single-stream greedy decode tokens/s on the default model, one technique at a time.

    python -m lanner.plugins.lowlat.ablation [--dtypes bfloat16,float32] [--tokens 128] [--reps 3] [--threads 2]
        [--merge results/lowlat_ablation.json]  # keep the other (threads, dtype) runs of an earlier report

Variants, all on one engine per dtype (LLM(spec="ngram", plugin="lowlat")) so that they share weights and KV pool;
each is switched on and off between runs, and the runs are interleaved (a, b, c, ..., a, b, c, ...) so that a
shared or throttled machine slows them alike:

  own        the engine's own forward (PyTorch linears, SDPA) and LM head
  gemv       own forward, but lowlat's C++ GEMV for the decoder's four linears (monkeypatched, ablation only)
  gemv+head  ... and lowlat's GEMV for the LM head
  fused-nohead  lowlat's one-call C++ forward, PyTorch LM head
  fused      lowlat's one-call C++ forward and its LM head (core's compute_logits hook)
  own+ngram  the own forward with n-gram speculation (k=5), for reference
  fused+ngram  lowlat with n-gram speculation (VERIFY steps of k+1 rows)

Writes results/lowlat_ablation.json and .md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

PROMPT = ("Write a Python function that returns the n-th Fibonacci number, first recursively and then with a "
          "loop, and explain the difference in running time.")
VARIANTS = ["own", "gemv", "gemv+head", "fused-nohead", "fused", "own+ngram", "fused+ngram"]


@contextlib.contextmanager
def variant(llm, plugin, runtime, proposer, name):
    eng, model = llm.engine, llm.engine.model
    patched = []
    eng.plugins = eng.kv.runner.plugins = runtime if name.startswith("fused") else None
    eng.proposer = proposer if name.endswith("ngram") else None
    if name.startswith("gemv"):
        for layer in model.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.forward = (lambda lin: lambda x: plugin.linear(x, lin.weight, lin.bias)
                               if x.shape[0] <= plugin.rows else F.linear(x, lin.weight, lin.bias))(lin)
                patched.append(lin)
    if name == "gemv+head":
        model.compute_logits = lambda h: plugin.compute_logits(None, model, h)
    if name == "fused-nohead":
        plugin.compute_logits = None  # the runtime then uses model.compute_logits
    try:
        yield
    finally:
        for lin in patched:
            del lin.forward
        model.__dict__.pop("compute_logits", None)
        plugin.__dict__.pop("compute_logits", None)
        eng.plugins = eng.kv.runner.plugins = runtime
        eng.proposer = proposer


def run_dtype(dtype: str, tokens: int, reps: int, threads: int) -> dict:
    from lanner import LLM, SamplingParams
    from lanner.plugins.lowlat import _ext

    t0 = time.perf_counter()
    llm = LLM(dtype=dtype, spec="ngram", spec_tokens=5, plugin="lowlat",
              plugin_options={"lowlat": {"threads": threads}}, kv_cache_memory="0.25GiB")
    load_s = time.perf_counter() - t0
    eng = llm.engine
    runtime, proposer = eng.plugins, eng.proposer
    plugin = runtime.plugins[0]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPT, params)  # warm-up (first-touch, caches)
    times = {v: [] for v in VARIANTS}
    outputs, accept = {}, {}
    for _ in range(reps):
        for v in VARIANTS:
            with variant(llm, plugin, runtime, proposer, v):
                before = dict(runtime.counts)
                t = time.perf_counter()
                out = llm.generate(PROMPT, params)[0]
                times[v].append(time.perf_counter() - t)
                outputs[v] = out.token_ids
                steps = {k[1]: c - before.get(k, 0) for k, c in runtime.counts.items() if k[0] == "lowlat"}
                if v == "fused+ngram":
                    accept[v] = steps
    own = statistics.median(times["own"])
    rows = []
    for v in VARIANTS:
        med = statistics.median(times[v])
        rows.append({"variant": v, "tok_s": tokens / med, "tok_s_runs": [tokens / t for t in times[v]],
                     "speedup_vs_own": own / med, "same_tokens_as_own": outputs[v] == outputs["own"]})
    gemv = gemv_bandwidth(eng.model, plugin)
    return {"dtype": dtype, "tokens": tokens, "reps": reps, "threads": threads, "load_s": load_s, "gemv_gb_s": gemv,
            "plugin_build_bytes": eng.plugin_bytes, "uses_avx512_bf16": plugin.uses_dot,
            "extension_load_s": _ext.compile_seconds, "fused_ngram_steps": accept.get("fused+ngram"), "rows": rows}


def gemv_bandwidth(model, plugin) -> dict:
    """GB/s of weights streamed by one linear on its own: all 30 layers' gate_up_proj (106 MB bf16, beyond the
    caches) at 1 / 6 activation rows, PyTorch's F.linear against lowlat's GEMV, interleaved, best of 5."""
    ws = [layer.mlp.gate_up_proj.weight for layer in model.layers]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    out = {}
    for m in (1, 6):
        x = torch.randn(m, ws[0].shape[1]).to(ws[0].dtype)
        best = {"torch": 0.0, "lowlat": 0.0}
        for _ in range(5):
            for name, f in (("torch", lambda w: F.linear(x, w)), ("lowlat", lambda w: plugin.linear(x, w))):
                t = time.perf_counter()
                for w in ws:
                    f(w)
                best[name] = max(best[name], nbytes / (time.perf_counter() - t) / 1e9)
        out[f"rows={m}"] = best
    return out


def shares(rows: dict) -> dict:
    """Each technique's share of the own -> fused speedup, as shares of the time saved per token."""
    t = {r["variant"]: 1 / r["tok_s"] for r in rows}
    saved = t["own"] - t["fused"]
    parts = {"C++ GEMV for the decoder linears": t["own"] - t["gemv"],
             "C++ GEMV for the LM head": t["gemv"] - t["gemv+head"],
             "one-call fused forward (attention, norms, RoPE, KV writes, no per-op dispatch)": t["gemv+head"] - t["fused"]}
    return {k: v / saved for k, v in parts.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/lowlat_ablation")
    ap.add_argument("--merge", default=None, help="an earlier JSON report whose other runs are kept")
    ap.add_argument("--note", default="", help="how the machine was shared during the run, for the report")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lanner.plugins.lowlat import _ext

    t = time.perf_counter()
    _ext.load()
    ext_s = time.perf_counter() - t
    runs = []
    if args.merge and os.path.exists(args.merge):
        runs = json.load(open(args.merge))["runs"]
    for dt in args.dtypes.split(","):
        r = run_dtype(dt, args.tokens, args.reps, args.threads)
        r["shares"] = shares(r["rows"])
        r["note"] = args.note
        r["extension_first_load_s"] = ext_s
        r["machine"] = {"cpu": platform.processor() or "", "torch": torch.__version__}
        runs = [x for x in runs if (x["threads"], x["dtype"]) != (r["threads"], r["dtype"])] + [r]
        print(json.dumps(r, indent=1))
    runs.sort(key=lambda x: (-x["threads"], x["dtype"]))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(render(runs))


def render(runs) -> str:
    lines = ["# lowlat ablation: single-stream greedy decode on the default model (SmolLM2-135M)", "",
             "Generated by `python -m lanner.plugins.lowlat.ablation`; variants are described in its docstring. "
             "Each run: one engine, variants switched between runs and interleaved, median tok/s of the "
             "interleaved repetitions (prefill included; the prompt is 31 tokens).", ""]
    for r in runs:
        lines += [f"## {r['dtype']}, {r['threads']} thread(s): {r['tokens']} tokens, median of {r['reps']} "
                  "interleaved runs", ""]
        if r.get("note"):
            lines += [r["note"], ""]
        lines += ["| variant | tok/s | x own | same tokens as own | runs (tok/s) |", "|---|---|---|---|---|"]
        for row in r["rows"]:
            runs_s = ", ".join(f"{x:.1f}" for x in row["tok_s_runs"])
            lines.append(f"| {row['variant']} | {row['tok_s']:.1f} | {row['speedup_vs_own']:.2f} | "
                         f"{'yes' if row['same_tokens_as_own'] else 'no'} | {runs_s} |")
        lines += ["", "Share of the own -> fused time saved per token:", ""]
        lines += [f"- {k}: {v:.0%}" for k, v in r["shares"].items()]
        g = r.get("gemv_gb_s")
        if g:
            lines += ["", "One linear alone (all layers' gate_up_proj, beyond the caches), weight GB/s: "
                      + "; ".join(f"{k}: PyTorch {v['torch']:.1f}, lowlat {v['lowlat']:.1f}" for k, v in g.items())
                      + "."]
        lines += ["", f"Plugin memory (activation buffers; no weight copies): {r['plugin_build_bytes'] / 2**20:.1f} "
                  f"MiB. AVX512_BF16 dot products: {r['uses_avx512_bf16']}. Steps lowlat ran in one fused+ngram "
                  f"run: {r['fused_ngram_steps']}.", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
