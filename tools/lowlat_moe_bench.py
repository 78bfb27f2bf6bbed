"""lowlat on an MoE model: single-stream greedy decode tok/s with the plugin against the engine's own forward.

    OMP_NUM_THREADS=1 python tools/lowlat_moe_bench.py [--dtypes bfloat16,float32] [--tokens 128] [--reps 5]
        [--threads 1] [--hidden 512] [--experts 16] [--top-k 2] [--layers 4] [--moe-inter 512] [--vocab 8192]
        [--out results/lowlat_moe_bench.json]

A random Qwen3-MoE checkpoint (transformers' Qwen3MoeForCausalLM, saved to a temporary folder; every layer MoE,
norm_topk_prob) is loaded once per dtype as LLM(plugin="lowlat", spec=None); the runs switch the plugin runtime
on and off on that one engine (same weights, same KV pool: "none" is what plugin=None runs) and interleave
(lowlat, none, lowlat, none, ...) so that a shared machine slows both alike. Each run: one 16-token prompt,
`--tokens` greedy tokens (prefill included in the time); reported: median tok/s over the repetitions, each run's
tok/s, and whether both give the same tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from lanner.bench.report import bar_chart, markdown_table


def make_checkpoint(folder: str, a) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64, num_key_value_heads=max(1, a.hidden // 128), head_dim=64,
        intermediate_size=4 * a.hidden, moe_intermediate_size=a.moe_inter, num_experts=a.experts,
        num_experts_per_tok=a.top_k, norm_topk_prob=True, max_position_embeddings=4096, initializer_range=0.05,
        tie_word_embeddings=False)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    hf = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()
    with torch.no_grad():  # non-trivial norms; a router spread enough that the experts vary token to token
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.2 + 1.0)
            elif n.endswith("gate.weight"):
                p.copy_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(folder)


def run_dtype(folder: str, dtype: str, a) -> dict:
    from lanner import LLM, SamplingParams

    llm = LLM(model=folder, dtype=dtype, skip_tokenizer=True, spec=None, plugin="lowlat",
              plugin_options={"lowlat": {"threads": a.threads}}, kv_cache_memory="0.25GiB")
    eng = llm.engine
    runtime = eng.plugins
    prompt = torch.randint(0, a.vocab, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    times, tokens = {"lowlat": [], "none": []}, {}
    for v in ("lowlat", "none"):  # warm-up (first touch, caches)
        eng.plugins = eng.runner.plugins = runtime if v == "lowlat" else None
        llm.generate(prompt, params)
    for _ in range(a.reps):
        for v in ("lowlat", "none"):
            eng.plugins = eng.runner.plugins = runtime if v == "lowlat" else None
            t = time.perf_counter()
            tokens[v] = llm.generate(prompt, params)[0].token_ids
            times[v].append(time.perf_counter() - t)
    eng.plugins = eng.runner.plugins = runtime
    steps = {k[1]: n for k, n in runtime.counts.items() if k[0] == "lowlat"}
    out = {"dtype": dtype, "threads": a.threads, "tokens": a.tokens, "reps": a.reps, "lowlat_steps": steps,
           "plugin_bytes": eng.plugin_bytes, "uses_avx512_bf16": runtime.plugins[0].uses_dot,
           "same_tokens": tokens["lowlat"] == tokens["none"]}
    for v, ts in times.items():
        out[v] = {"tok_s": a.tokens / statistics.median(ts), "tok_s_runs": [a.tokens / t for t in ts]}
    out["speedup"] = out["lowlat"]["tok_s"] / out["none"]["tok_s"]
    llm.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--moe-inter", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", default=None, help="a JSON report (default: print only)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        make_checkpoint(folder, a)
        for dt in a.dtypes.split(","):
            r = run_dtype(folder, dt, a)
            runs.append(r)
            print(f"{dt}: lowlat {r['lowlat']['tok_s']:.1f} tok/s, none {r['none']['tok_s']:.1f} tok/s, "
                  f"x{r['speedup']:.2f}, same tokens: {r['same_tokens']}", flush=True)
    report = {"model": {k: getattr(a, k) for k in ("hidden", "experts", "top_k", "layers", "moe_inter", "vocab")},
              "torch": torch.__version__, "runs": runs}
    print(markdown_table(["dtype", "lowlat tok/s", "without lowlat tok/s", "speedup", "same tokens"],
                         [[r["dtype"], f"{r['lowlat']['tok_s']:.1f}", f"{r['none']['tok_s']:.1f}",
                           f"{r['speedup']:.2f}x", "yes" if r["same_tokens"] else "no"] for r in runs]))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        png = os.path.splitext(a.out)[0] + ".png"
        bar_chart(png, [f"{r['dtype']}\n{v}" for r in runs for v in ("lowlat", "none")],
                  [r[v]["tok_s"] for r in runs for v in ("lowlat", "none")],
                  f"random Qwen3-MoE ({a.experts} experts, top-{a.top_k}), single-stream decode, {a.threads} thread",
                  "tokens / s")
        print(f"results: {a.out}, {png}")


if __name__ == "__main__":
    main()
