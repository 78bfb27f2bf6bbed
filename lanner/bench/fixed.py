"""Fixed-length synthetic requests at several concurrency levels, optionally on two systems (--plugin,
--compare). The driver, metrics and output are in lanner.bench.compare.

Prompts are --input random token ids (seeded; special tokens left out), different for every request and every
level, so the prefix cache finds nothing to reuse. Each request generates exactly --output tokens (greedy, EOS
ignored). For concurrency c, c requests are in flight at a time.
"""
from __future__ import annotations

import random
import sys

from lanner.bench import compare, report

HELP = "Fixed-length random-token requests at several concurrency levels (per-user speed, TTFT)."
DESCRIPTION = (
    "Fixed-length synthetic requests: --input random token ids (seeded, different for every request, so the "
    "prefix cache cannot help) and exactly --output generated tokens, greedy with EOS ignored. For each "
    "concurrency level c, --num-requests requests (default max(4, 2c)) run with c in flight at a time. Reports "
    "TTFT P50/P90, per-user decode speed P50 and P10 (the slow tail, the speed 90% of requests exceed) and "
    "aggregate output tok/s. With --compare PLUGIN the same requests run again with --plugin PLUGIN in its own "
    "engine, and the ratios of the two systems are reported.")


def add_arguments(p):
    p.add_argument("--input", type=int, default=2048, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=256, help="generated tokens per request (EOS ignored)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per level (default: max(4, 2c))")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    compare.add_arguments(p, "bench_fixed", "1,2,4,8")


def random_prompts(engine, n: int, length: int, seed: str) -> list[list[int]]:
    special = set(engine.tokenizer.hf.all_special_ids) if engine.tokenizer is not None else set()
    pool = [t for t in range(engine.model_config.vocab_size) if t not in special]
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(length)] for _ in range(n)]


def run(args, engine_options: dict) -> dict:
    if args.input < 1 or args.output < 1:
        sys.exit("lanner: error: --input and --output: expected positive token counts")
    if args.num_requests is not None and args.num_requests < 1:
        sys.exit("lanner: error: --num-requests: expected a positive number")

    def sessions(engine, n, length, max_tokens, seed):
        if length + max_tokens > engine.max_model_len:
            sys.exit(f"lanner: error: --input {length} plus --output {max_tokens} exceeds the context of "
                     f"{engine.max_model_len} tokens")
        return [[compare.Turn(f"request {i}", 1, ids, max_tokens)]
                for i, ids in enumerate(random_prompts(engine, n, length, seed))]

    def workload(engine, level):  # seeded per level: no level reuses another's prompts
        return sessions(engine, args.num_requests or max(4, 2 * level), args.input, args.output,
                        f"fixed:{args.seed}:{level}")

    def warmup(engine, level):  # first-call overheads, at the highest level's batch size
        return sessions(engine, level, min(args.input, 64), 4, f"fixed:{args.seed}:warm-up")

    threads = ((engine_options.get("plugin_options") or {}).get("lowlat") or {}).get("threads")
    extra = {"input_tokens": args.input, "output_tokens": args.output, "seed": args.seed,
             "read_gb_s": read_bandwidth_gb_s(threads)}  # before any system loads: an idle machine's figure
    result = compare.run_benchmark("bench_fixed", args, engine_options, workload, warmup, "Fixed-length requests",
                                   extra)
    per_token = decode_bytes_per_token(result["model_path"])
    if per_token:
        result["decode_bytes_per_token"] = per_token
        for row in result["levels"]:
            if row["concurrency"] == 1 and row.get("speed_p50_tok_s"):
                row["decode_read_gb_s"] = row["speed_p50_tok_s"] * per_token / 1e9
                row["decode_read_fraction"] = row["decode_read_gb_s"] / extra["read_gb_s"]
        report.write_json(report.output_paths(args.json, args.out_dir, "bench_fixed")[0], result)
        print(f"\nread bandwidth {extra['read_gb_s']:.1f} GB/s; weights read per decoded token "
              f"{per_token / 1e9:.3f} GB; at one stream, P50: " + ", ".join(
                  f"{r['system']} {r['decode_read_gb_s']:.1f} GB/s ({100 * r['decode_read_fraction']:.0f}%)"
                  for r in result["levels"] if "decode_read_gb_s" in r))
    return result


def read_bandwidth_gb_s(threads: int | None, gib: float = 1.0) -> float:
    """What this machine's cores read per second: the best of 5 sums over a 1 GiB float32 tensor at `threads`
    (None: torch's count) threads."""
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        x = torch.ones(int(gib * 2**30) // 4)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return x.numel() * 4 / best / 1e9


def decode_bytes_per_token(path: str) -> int | None:
    """Bytes of a GGUF's weights one decoded token reads: every tensor but the embedding, which it reads one row
    of (unless the output matrix is the embedding itself); None for other formats."""
    if not path.endswith(".gguf"):
        return None
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))
