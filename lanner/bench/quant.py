"""GGUF weights as stored (EngineConfig.weights="stored") against llama.cpp on the same file, single stream, at each
thread count: Lanner + lowlat with q8 activations (llama.cpp's), with q16 (Lanner's default for stored blocks), with
float activations, Lanner + lowlat on bf16-dequantized weights, and llama.cpp in its own process. Same
chat-templated prompts, greedy, EOS ignored.
Also: where each system's greedy tokens part from llama.cpp's (and llama.cpp's top-2 logit gap there; llama.cpp
with a float32 KV cache is measured as a reference for how far its own tokens move with precision), and lowlat's
per-token time split (GEMVs, LM head, attention, barrier waits, the rest) from thread 0's clock.
"""
from __future__ import annotations

import gc
import sys

import torch

from lanner.bench import latency, report
from lanner.bench.llamacpp import available, run_peer

HELP = "GGUF stored-type kernels vs llama.cpp (own process) on the same file, per thread count."
DESCRIPTION = __doc__
PHASES = ("gemv", "attention", "barrier", "other", "lm_head")
# llama.cpp as the peer (its default float16 KV cache), and with a float32 KV cache: where llama.cpp's own greedy
# tokens part when only its KV precision changes is the scale against which Lanner's first differences are read
PEERS = {"llama.cpp": False, "llama.cpp f32 KV": True}


def add_arguments(p):
    p.add_argument("--threads", default="1,2", help="thread counts to compare (comma list)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (EOS ignored)")
    p.add_argument("--prompts", type=int, default=len(latency.PROMPTS), choices=range(1, len(latency.PROMPTS) + 1))
    p.add_argument("--json", default=None, help="result file (default: OUT_DIR/bench_quant.json)")
    p.add_argument("--out-dir", default="results")


def _systems(threads: int) -> dict[str, dict]:
    low = {"threads": threads}
    stored = {f"lanner stored {act}": {"dtype": "float32", "weights": "stored",
                                       "plugin_options": {"lowlat": low | {"act": act}}} for act in ("q8", "q16", "float")}
    return stored | {"lanner bf16 dequantized": {"dtype": "bfloat16", "weights": "dequantize",
                                                 "plugin_options": {"lowlat": low}}}


def _first_difference(a: list[int], b: list[int], gaps: list[float]) -> dict:
    n = latency.matched_prefix(a, b)
    return {"matched": n, "tokens": len(b), "identical": a == b,
            "llama_top2_gap": gaps[n] if n < min(len(a), len(b)) else None}


def run(args, engine_options: dict) -> dict:
    from lanner.llm import LLM

    json_path, png_path = report.output_paths(args.json, args.out_dir, "bench_quant")
    thread_counts = [int(t) for t in str(args.threads).split(",")]
    base = engine_options | {"plugin": "lowlat", "spec": None, "draft": None}
    why_not = available()
    if why_not:
        print(f"\n*** llama.cpp SKIPPED: {why_not} ***\n", file=sys.stderr, flush=True)
    saved_threads, results, config = torch.get_num_threads(), {}, None
    for th in thread_counts:
        torch.set_num_threads(th)
        row, runs, prompt_ids = {}, {}, None
        for name, opts in _systems(th).items():
            llm = LLM(**base | opts)
            config, source = llm.engine.config, llm.engine.source
            if prompt_ids is None:
                prompt_ids = [latency.encode_prompt(llm.tokenizer, p) for p in latency.PROMPTS[: args.prompts]]
                warm_ids = latency.encode_prompt(llm.tokenizer, latency.WARMUP_PROMPT)
            kernel = llm.engine.plugins.plugins[0].kernel if llm.engine.plugins else None
            if kernel is not None:
                kernel.profile = True
            runs[name] = latency.bench_lanner(llm, prompt_ids, args.max_tokens)
            row[name] = latency.summary(runs[name]) | {"weight_mib": llm.engine.weight_bytes / 2**20}
            if kernel is not None and kernel.prof_calls:
                row[name]["ms_per_forward"] = {k: 1000 * v / kernel.prof_calls for k, v in zip(PHASES, kernel.prof)}
            llm.close()
            del llm
            gc.collect()
        if source.kind == "gguf" and not why_not:
            try:
                for peer_name, f32_kv in PEERS.items():
                    runs[peer_name] = run_peer(source.path, prompt_ids, warm_ids, args.max_tokens, th, f32_kv=f32_kv)
                    row[peer_name] = latency.summary([latency.run_record(r["token_ids"], r["total_s"], r["ttft_s"])
                                                       for r in runs[peer_name]])
                peer = row["llama.cpp"]["decode_tok_s"]
                for name in [*_systems(th), "llama.cpp f32 KV"]:
                    row[name]["decode_vs_llama_cpp"] = row[name]["decode_tok_s"] / peer
                    row[name]["greedy_vs_llama_cpp"] = [
                        _first_difference(a["token_ids"], b["token_ids"], b["top2_gap"])
                        for a, b in zip(runs[name], runs["llama.cpp"])]
            except Exception as e:  # noqa: BLE001 (a broken peer must not lose Lanner's results)
                row["llama.cpp"] = {"skipped": f"llama.cpp failed: {type(e).__name__}: {e}"}
        results[th] = row
    torch.set_num_threads(saved_threads)
    result = {"benchmark": "quant", "model": source.name, "model_path": source.path, "max_tokens": args.max_tokens,
              "prompts": latency.PROMPTS[: args.prompts], "env": report.environment(config),
              "threads": {str(k): v for k, v in results.items()}}
    report.write_json(json_path, result)
    labels, values = [], []
    for th, row in results.items():
        for name, s in row.items():
            if "skipped" not in s:
                labels.append(f"{name} ({th}t)")
                values.append(s["decode_tok_s"])
    report.bar_chart(png_path, labels, values, f"Decode speed on {source.name}: stored GGUF blocks vs llama.cpp",
                     "decode tok/s (median over prompts)")
    print(format_table(result))
    print(f"\nwrote {json_path} and {png_path}")
    return result


def format_table(result: dict) -> str:
    rows, split = [], []
    for th, row in result["threads"].items():
        for name, s in row.items():
            if "skipped" in s:
                rows.append([th, name, "skipped", "", "", "", "", s["skipped"]])
                continue
            greedy = s.get("greedy_vs_llama_cpp")
            match = ", ".join("=" if g["identical"] else f"{g['matched']} (gap {report.fmt(g['llama_top2_gap'], 3)})"
                              for g in greedy) if greedy else ""
            ratio = s.get("decode_vs_llama_cpp")
            rows.append([th, name, report.fmt(s["decode_tok_s"]), report.fmt(s["tok_s"]),
                         report.fmt(s["ttft_s"] * 1000), f"{ratio:.2f}x" if ratio else "",
                         report.fmt(s.get("weight_mib")), match])
            if "ms_per_forward" in s:
                split.append([th, name, *(report.fmt(s["ms_per_forward"][k], 3) for k in PHASES)])
    text = report.markdown_table(["threads", "system", "decode tok/s", "tok/s", "TTFT ms", "decode vs llama.cpp",
                                  "weights MiB", "greedy vs llama.cpp: same tokens before the first difference"],
                                 rows)
    text += ("\n\n(medians over prompts; tok/s includes prefill; '=' identical tokens; gap: llama.cpp's top-2 logit "
             "gap where the tokens part)\n\nlowlat time per forward (ms, thread 0; LM head per call):\n\n")
    text += report.markdown_table(["threads", "system", *PHASES], split)
    return text
