"""The cost and the gain of constrained decoding (lanner.structured) on the engine's own model.

Workload: --num-requests chat prompts asking for a JSON person (a json_schema response format) and as many
asking for a tool call (tool_choice="required", two tools), greedy. Each runs in five modes, all in one engine:

- free: no constraint, no speculation, each request generating exactly as many tokens as its constrained run
  did (EOS ignored), so both sides do the same number of decode steps;
- masked: the constraint, no speculation (the cost of the masks);
- spec: the constraint with the engine's proposer (--spec), grammar-forced drafts off;
- spec+forced: the same with grammar-forced drafts on;
- forced only: the constraint, no proposer, grammar-forced drafts only.

Reports output tok/s of each mode at concurrency 1 and --batch, tau (tokens per verify step) and the mask
overhead per token, measured by replaying the generated outputs through a fresh matcher (bitmask fill + apply
to a logits row + advance), without the model.
"""
from __future__ import annotations

import sys
import time

import torch

from lanner.bench.report import bar_chart, environment, fmt, markdown_table, output_paths, write_json
from lanner.engine.sampling import SamplingParams
from lanner.llm import LLM
from lanner.structured import apply_bitmask, new_bitmask
from lanner.tool_calls import prepare_chat

HELP = "Constrained decoding: mask cost per token, tok/s with and without constraints, tau with forced drafts."
DESCRIPTION = __doc__.split("\n\n", 1)[1]

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 16}},
          "required": ["name", "age", "city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 24}},
                       "required": ["expression"], "additionalProperties": False}}}]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Accra", "Hanoi"]
MODES = ["free", "masked", "spec", "spec+forced", "forced only"]


def add_arguments(p):
    p.add_argument("--num-requests", type=int, default=8, help="prompts of each kind (JSON, tool call)")
    p.add_argument("--batch", type=int, default=4, help="the concurrency of the batched run")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out-dir", default="results")
    p.add_argument("--json", default=None, help="JSON output path (default: OUT_DIR/bench_structured.json)")


def workload(tok, n: int) -> list[tuple[str, list[int], object]]:
    """-> [(kind, prompt ids, StructuredOutput)]"""
    out = []
    for i in range(n):
        city = CITIES[i % len(CITIES)]
        msgs = [{"role": "user", "content": f"Invent person number {i} living in {city}, as JSON."}]
        fmt_ = {"type": "json_schema", "json_schema": {"schema": PERSON, "strict": True}}
        out.append(("json", *prepare_chat(tok, msgs, response_format=fmt_)))
        msgs = [{"role": "user", "content": f"What is the weather in {city}? Or compute {i} + {3 * i}."}]
        out.append(("tool", *prepare_chat(tok, msgs, TOOLS, "required", False)))
    return out


def run_mode(llm: LLM, work, mode: str, lengths: list[int] | None, max_tokens: int, concurrency: int) -> dict:
    engine = llm.engine
    engine.config.grammar_draft_tokens = 8 if "forced" in mode else 0
    saved = engine.proposer
    if mode == "forced only":
        engine.proposer = None
    try:
        params = []
        for i, (_, _, so) in enumerate(work):
            if mode == "free":
                params.append(SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True, speculative=False))
            else:
                params.append(SamplingParams(temperature=0, max_tokens=max_tokens, structured=so,
                                             speculative=mode != "masked"))
        outs, t0 = [], time.perf_counter()
        for start in range(0, len(work), concurrency):
            outs += llm.generate([w[1] for w in work[start : start + concurrency]],
                                 params[start : start + concurrency])
        wall = time.perf_counter() - t0
    finally:
        engine.proposer = saved
    steps = sum(o.metrics["spec_verify_steps"] for o in outs)
    emitted = sum(o.metrics["spec_accept_length"] * o.metrics["spec_verify_steps"] for o in outs if steps and
                  o.metrics["spec_accept_length"])
    tokens = sum(len(o.token_ids) for o in outs)
    return {"mode": mode, "concurrency": concurrency, "output_tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "tau": emitted / steps if steps else None,
            "lengths": [len(o.token_ids) for o in outs], "texts": [o.text for o in outs],
            "token_ids": [o.token_ids for o in outs],
            "finish": [o.finish_reason for o in outs]}


def mask_cost(llm: LLM, work, outs: list[list[int]]) -> dict:
    """Replays each output's tokens through a fresh matcher: per token, fill the bitmask, apply it to a
    logits row, accept the token. -> microseconds per token (total and the apply part)."""
    grammars = llm.engine.grammars
    vocab = grammars.vocab_size
    logits = torch.randn(1, vocab)
    n, fill_accept, apply = 0, 0.0, 0.0
    for (_, _, so), ids in zip(work, outs):
        state = grammars.state(so, 0)
        bitmask = new_bitmask(1, vocab)
        for tok in ids:
            t0 = time.perf_counter()
            state.fill(bitmask, 0)
            t1 = time.perf_counter()
            apply_bitmask(logits, bitmask)
            t2 = time.perf_counter()
            state.accept(tok)
            t3 = time.perf_counter()
            fill_accept += (t1 - t0) + (t3 - t2)
            apply += t2 - t1
            n += 1
    return {"tokens": n, "us_per_token": 1e6 * (fill_accept + apply) / n, "fill_accept_us": 1e6 * fill_accept / n,
            "apply_us": 1e6 * apply / n}


def run(args, engine_options: dict) -> dict:
    llm = LLM(**{**engine_options, "max_num_seqs": max(args.batch, 1)})
    config = llm.engine.config
    work = workload(llm.tokenizer, args.num_requests)
    results = []
    for conc in (1, args.batch):
        masked = run_mode(llm, work, "masked", None, args.max_tokens, conc)
        lengths = masked["lengths"]
        for mode in MODES:
            r = masked if mode == "masked" else run_mode(llm, work, mode, lengths, args.max_tokens, conc)
            # greedy: every constrained mode should write the masked run's text (exactly so in float32)
            r["same_text_as_masked"] = None if mode == "free" else r["texts"] == masked["texts"]
            results.append(r)
            print(f"concurrency {conc} {mode}: {r['output_tokens']} tokens in {r['wall_s']:.1f}s, tau "
                  f"{fmt(r['tau'], 2)}", file=sys.stderr, flush=True)
    cost = mask_cost(llm, work, results[1]["token_ids"])
    headers = ["mode", "concurrency", "output tokens", "tok/s", "x free", "tau", "text = masked"]
    rows = []
    for r in results:
        free = next(f for f in results if f["mode"] == "free" and f["concurrency"] == r["concurrency"])
        rows.append([r["mode"], r["concurrency"], r["output_tokens"], fmt(r["tok_s"]),
                     fmt(r["tok_s"] / free["tok_s"], 2), fmt(r["tau"], 2),
                     {None: "", True: "yes", False: "NO"}[r["same_text_as_masked"]]])
    print(markdown_table(headers, rows))
    print(f"\nmask overhead: {cost['us_per_token']:.0f} us per token (fill + advance {cost['fill_accept_us']:.0f}, "
          f"apply to a {llm.engine.grammars.vocab_size}-token row {cost['apply_us']:.0f}) over {cost['tokens']} "
          "tokens")
    json_path, png_path = output_paths(args.json, args.out_dir, "bench_structured")
    data = {"benchmark": "structured", "environment": environment(config), "spec": config.spec,
            "num_requests": 2 * args.num_requests, "max_tokens": args.max_tokens, "mask_cost": cost,
            "results": [{k: v for k, v in r.items() if k not in ("texts", "token_ids")} for r in results]}
    write_json(json_path, data)
    batch = [r for r in results if r["concurrency"] == args.batch]
    bar_chart(png_path, [r["mode"] for r in batch], [r["tok_s"] for r in batch],
              f"constrained decoding, concurrency {args.batch}", "output tok/s")
    print(f"\nwrote {json_path} and {png_path}")
    return data

