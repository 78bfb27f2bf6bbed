"""Throughput under concurrency: for each level c, a fixed pool of chat requests runs with c of them in flight
at a time (a new one is submitted as soon as one finishes, like c clients each waiting for its answer)."""
from __future__ import annotations

import sys
import time
from collections import deque
from statistics import mean, median, quantiles

from lanner.bench import report

HELP = "Aggregate throughput at several concurrency levels."
DESCRIPTION = (
    "Aggregate throughput at several concurrency levels. For each level c, a pool of max(16, 2c) varied chat "
    "requests (greedy, EOS ignored, --max-tokens each) runs with c requests in flight at a time. Reports "
    "aggregate output tok/s, mean per-request decode tok/s, TTFT p50, and each level's aggregate relative to "
    "the lowest level.")

TASKS = ["Write a short poem about {}.", "Explain how {} works, in simple terms.",
         "List five interesting facts about {}.", "Write a short story that involves {}."]
TOPICS = ["the ocean", "volcanoes", "the internet", "honey bees", "black holes", "bread baking", "electric cars",
          "chess"]


def add_arguments(p):
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (EOS ignored)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per level (default: max(16, 2c))")
    p.add_argument("--json", default=None, help="result file (default: OUT_DIR/bench_throughput.json); "
                                               "the PNG chart is written next to it")
    p.add_argument("--out-dir", default="results", help="folder for the result files when --json is not given")


def parse_levels(text: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        sys.exit(f"lanner: error: --concurrency: expected positive integers like 1,4,16, got {text!r}")
    return levels


def prompt_pool(level: int, n: int) -> list[str]:
    # the level number leads each prompt so no level reuses another's prompts through the prefix cache;
    # all levels share only the chat template's system prompt
    return [f"(request {level}-{i}) " + TASKS[i % len(TASKS)].format(TOPICS[i // len(TASKS) % len(TOPICS)])
            for i in range(n)]


def run_level(engine, prompts_ids: list[list[int]], concurrency: int, max_tokens: int, desc: str) -> tuple:
    """Returns (finished outputs, wall seconds)."""
    from tqdm import tqdm

    from lanner.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pending, in_flight, done = deque(prompts_ids), 0, []
    with tqdm(total=len(prompts_ids), desc=desc, unit="req", leave=False, file=sys.stderr) as bar:
        t0 = time.perf_counter()
        while pending or in_flight:
            while pending and in_flight < concurrency:
                engine.add_request(pending.popleft(), params)
                in_flight += 1
            for out in engine.step():
                if out.finished:
                    if out.error:
                        raise RuntimeError(f"request failed: {out.error}")
                    in_flight -= 1
                    done.append(out)
                    bar.update(1)
        return done, time.perf_counter() - t0


def run(args, engine_options: dict) -> dict:
    from lanner.llm import LLM

    levels = parse_levels(args.concurrency)
    json_path, png_path = report.output_paths(args.json, args.out_dir, "bench_throughput")
    # the engine must not cap concurrency below the level being measured
    engine_options = engine_options | {"max_num_seqs": max(engine_options["max_num_seqs"], levels[-1])}
    llm = LLM(**engine_options)
    engine, config = llm.engine, llm.engine.config
    # with speculative decoding, plain decoding runs the same levels in the same run: the ratio per level shows
    # the batch size where drafting stops paying (what --spec-max-batch should be)
    systems = {f"spec-{config.spec}": engine, "plain": LLM(**engine_options | {"spec": None, "draft": None}).engine} \
        if config.spec else {"plain": engine}

    def chat_ids(prompts):
        return [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]

    print(f"throughput: {engine.source.name} ({config.dtype}, {config.device}), concurrency {levels}, "
          f"{args.max_tokens} tokens per request", file=sys.stderr, flush=True)

    # warm-up at the highest level: first-call overheads, and the shared system prompt enters the prefix cache
    # for every level alike
    for eng in systems.values():
        run_level(eng, chat_ids(prompt_pool(0, levels[-1])), levels[-1], 4, "warm-up")

    rows = []
    for c in levels:
        n = args.num_requests or max(16, 2 * c)
        for name, eng in systems.items():
            outs, wall = run_level(eng, chat_ids(prompt_pool(c, n)), c, args.max_tokens, f"{name} c={c}")
            ttfts = [o.metrics["ttft_s"] for o in outs]
            decode = [o.metrics["decode_tok_s"] for o in outs if o.metrics["decode_tok_s"] is not None]
            taus = [o.metrics["spec_accept_length"] for o in outs if o.metrics["spec_accept_length"] is not None]
            tokens = sum(len(o.token_ids) for o in outs)
            rows.append({"system": name, "concurrency": c, "requests": n, "output_tokens": tokens, "wall_s": wall,
                         "output_tok_s": tokens / wall,
                         "mean_request_decode_tok_s": mean(decode) if decode else None,
                         "ttft_p50_s": median(ttfts),
                         "ttft_p90_s": quantiles(ttfts, n=10)[-1] if len(ttfts) > 1 else ttfts[0],
                         "tau": mean(taus) if taus else None})
    for name in systems:
        base = next(r["output_tok_s"] for r in rows if r["system"] == name)
        for r in rows:
            if r["system"] == name:
                r["ratio_vs_lowest"] = r["output_tok_s"] / base
    if config.spec:
        plain = {r["concurrency"]: r["output_tok_s"] for r in rows if r["system"] == "plain"}
        for r in rows:
            r["ratio_vs_plain"] = r["output_tok_s"] / plain[r["concurrency"]]

    result = {"benchmark": "throughput", "model": engine.source.name, "model_path": engine.source.path,
              "max_tokens": args.max_tokens, "lowest_concurrency": levels[0], "env": report.environment(config),
              "engine": {k: v for k, v in engine_options.items() if k != "model"}, "levels": rows}
    report.write_json(json_path, result)
    series = {}
    for name in systems:
        mine = [r for r in rows if r["system"] == name]
        series[f"{name}: aggregate output tok/s"] = [r["output_tok_s"] for r in mine]
        series[f"{name}: mean per-request decode tok/s"] = [r["mean_request_decode_tok_s"] or 0 for r in mine]
    report.line_chart(png_path, levels, series,
        f"Throughput: {engine.source.name}, {config.dtype}, {config.device}", "concurrent requests", "tok/s")
    print(format_table(result))
    print(f"\nwrote {json_path} and {png_path}")
    return result


def format_table(result: dict) -> str:
    rows = [[r["system"], r["concurrency"], r["requests"], report.fmt(r["output_tok_s"]),
             report.fmt(r["mean_request_decode_tok_s"]), report.fmt(r["ttft_p50_s"] * 1000), report.fmt(r["tau"], 2),
             f"{r['ratio_vs_lowest']:.2f}x", f"{r['ratio_vs_plain']:.2f}x" if "ratio_vs_plain" in r else ""]
            for r in result["levels"]]
    return report.markdown_table(["system", "concurrency", "requests", "output tok/s", "per-request decode tok/s",
                                  "TTFT p50 ms", "tau", f"vs c={result['lowest_concurrency']}", "vs plain"], rows)
