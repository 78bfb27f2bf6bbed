"""Acceptance length (tau) of a draft through the engine's real speculative path.

Prompts run one at a time (single stream, greedy, EOS respected) on a speculative engine and on a plain one.
tau per (dataset, k) = tokens emitted by verify steps / verify steps, summed over prompts. MT-Bench's second
turn follows the engine's own first answer, on both engines. Each engine also reports decode tok/s
((output tokens - 1) / decode time: prefill, and so the prefix cache that later runs of a prompt hit, is left
out), and the greedy outputs of every k are checked token for token against plain decoding.
"""
from __future__ import annotations

import gc
import os
import sys
import time

from lanner.bench import report
from lanner.train.data import EVAL_SETS, load_eval_set, load_prompts_file

HELP = "Measure a draft's acceptance length (tau) on evaluation sets."
DESCRIPTION = (
    "Measure a draft's acceptance length tau through the engine's speculative path, single stream and greedy, "
    "for each number of draft tokens k (--steps), on HumanEval, MT-Bench (both turns), GSM8K and held-out "
    "ShareGPT. Also reports decode tok/s against plain decoding measured in the same run and checks that "
    "greedy outputs are token-identical to it. Prints a markdown table and writes a JSON file and a PNG chart.")
WARMUP_PROMPT = "Say hello in three languages."


def add_arguments(p):
    """Options of `lanner eval-accept`; added after the engine options (the parser resolves conflicts), so
    --draft here replaces the engine's and the speculative options this command sets itself are hidden."""
    import argparse

    p.add_argument("--draft", default="default",
                   help="draft head: 'default', 'hass', a folder, or 'ngram' for n-gram prompt lookup; several, "
                        "comma-separated, are compared side by side (gains relative to the first)")
    p.add_argument("--datasets", default=None,
                   help=f"comma-separated, from {','.join(EVAL_SETS)} (default: all; only --prompts when given)")
    p.add_argument("--prompts", default=None, help='extra JSONL file of {"turns": [str, ...]} lines')
    p.add_argument("--steps", default="3,4,5,6", help="comma-separated draft lengths k to measure (1..8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens generated per turn")
    p.add_argument("--limit", type=int, default=20, help="prompts per dataset (the first N, fixed order)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the ShareGPT train/held-out split")
    p.add_argument("--json", default=None, help="result file (default: OUT_DIR/eval_accept.json); "
                                               "the PNG chart is written next to it")
    p.add_argument("--out-dir", default="results", help="folder for the result files when --json is not given")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the --json file, running nothing")
    for flag, default, type_ in (("--spec", None, str), ("--spec-tokens", 5, int), ("--spec-max-batch", 1, int)):
        p.add_argument(flag, default=default, type=type_, help=argparse.SUPPRESS)
    # float32: only then are spec and plain greedy outputs expected to match exactly
    p.set_defaults(dtype="float32")


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sys.exit(f"lanner: error: --{name}: expected comma-separated integers, got {text!r}")
    if not values:
        sys.exit(f"lanner: error: --{name}: empty")
    return values


def _run_item(llm, item: dict, params) -> list[tuple]:
    """Runs an item's turns in order, each turn seeing the engine's own earlier answers.
    Returns (RequestOutput, wall seconds) per turn."""
    from lanner.engine.llm_engine import RequestError

    conv, outs = [], []
    for turn in item["turns"]:
        conv.append({"role": "user", "content": turn})
        ids = llm.tokenizer.apply_chat_template(conv)
        t0 = time.perf_counter()
        out = llm.generate(ids, params)[0]
        wall = time.perf_counter() - t0
        if out.error:
            raise RequestError(f"{item['id']}: {out.error}")
        outs.append((out, wall))
        conv.append({"role": "assistant", "content": out.text})
    return outs


def _measure(llm, items: list[dict], params, desc: str) -> dict:
    from tqdm import tqdm

    s = {"token_ids": [], "emitted": 0, "verify_steps": 0, "accepted_at": [], "decode_tokens": 0,
         "decode_s": 0.0, "output_tokens": 0, "wall_s": 0.0, "requests": 0}
    for item in tqdm(items, desc=desc, unit="prompt", leave=False):
        turns = _run_item(llm, item, params)
        s["token_ids"].append([out.token_ids for out, _ in turns])
        for out, wall in turns:
            m = out.metrics
            if m["spec_verify_steps"]:
                s["emitted"] += round(m["spec_accept_length"] * m["spec_verify_steps"])
                s["verify_steps"] += m["spec_verify_steps"]
                acc, total = m["spec_accepted_per_position"], s["accepted_at"]
                total += [0] * (len(acc) - len(total))
                for i, a in enumerate(acc):
                    total[i] += a
            s["decode_tokens"] += max(m["output_tokens"] - 1, 0)
            s["decode_s"] += m["decode_s"]
            s["output_tokens"] += m["output_tokens"]
            s["wall_s"] += wall
            s["requests"] += 1
    return s


def _rate(tokens, seconds):
    return tokens / seconds if seconds > 0 else None


def evaluate(llm_spec, llm_plain, datasets, steps: list[int], max_new_tokens: int = 128, limit: int | None = 20,
             split_seed: int = 0, draft: str | None = None, plain_cache: dict | None = None) -> list[dict]:
    """llm_spec: a lanner.LLM with speculative decoding on (spec_max_batch >= 1); llm_plain: one without.
    datasets: eval-set names (see data.EVAL_SETS) or a {name: [{"id", "turns"}, ...]} dict. Returns one row
    per (dataset, k). Leaves llm_spec's spec_tokens as it found it. plain_cache: {dataset: plain measurement},
    filled and reused, so several drafts are compared against one plain run."""
    from lanner.engine.sampling import SamplingParams

    if llm_spec.engine.proposer is None:
        raise ValueError("llm_spec has no speculative decoding (spec=None)")
    if not isinstance(datasets, dict):
        datasets = {name: load_eval_set(name, limit, split_seed) for name in datasets}
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    cfg = llm_spec.engine.config
    draft = draft or cfg.draft or cfg.spec
    plain_cache = {} if plain_cache is None else plain_cache
    for llm in (llm_spec, llm_plain):  # first-call costs (allocator, lazy init) would land on the first prompt
        llm.generate(llm.tokenizer.apply_chat_template([{"role": "user", "content": WARMUP_PROMPT}]),
                     SamplingParams(temperature=0, max_tokens=16))
    rows, k_before = [], cfg.spec_tokens
    try:
        for name, items in datasets.items():
            if name not in plain_cache:
                plain_cache[name] = _measure(llm_plain, items, params, f"{name} plain")
            plain = plain_cache[name]
            plain_tok_s = _rate(plain["decode_tokens"], plain["decode_s"])
            for k in steps:
                cfg.spec_tokens = k  # read every step, so one engine serves every k
                s = _measure(llm_spec, items, params, f"{name} k={k}")
                tok_s = _rate(s["decode_tokens"], s["decode_s"])
                rows.append({
                    "draft": draft, "dataset": name, "steps": k,
                    "tau": s["emitted"] / s["verify_steps"] if s["verify_steps"] else None,
                    "tok_s": tok_s, "plain_tok_s": plain_tok_s,
                    "speedup": tok_s / plain_tok_s if tok_s and plain_tok_s else None,
                    "identical": s["token_ids"] == plain["token_ids"],
                    "prompts": len(items), "requests": s["requests"], "verify_steps": s["verify_steps"],
                    "accept_rate_at": [a / s["verify_steps"] for a in s["accepted_at"]] if s["verify_steps"] else [],
                    "e2e_tok_s": _rate(s["output_tokens"], s["wall_s"]),
                    "plain_e2e_tok_s": _rate(plain["output_tokens"], plain["wall_s"]),
                })
    finally:
        cfg.spec_tokens = k_before
    return rows


def format_table(rows: list[dict]) -> str:
    drafts = list(dict.fromkeys(r["draft"] for r in rows))
    base = {(r["dataset"], r["steps"]): r["tau"] for r in rows if r["draft"] == drafts[0]}

    def gain(r):
        b = base.get((r["dataset"], r["steps"]))
        return f"{r['tau'] / b - 1:+.0%}" if r["draft"] != drafts[0] and r["tau"] and b else ""

    table = report.markdown_table(
        ["draft", "dataset", "k", "tau", f"tau vs {drafts[0]}", "tok/s", "plain tok/s", "speedup", "identical"],
        [[r["draft"], r["dataset"], r["steps"], report.fmt(r["tau"], 2), gain(r), report.fmt(r["tok_s"]),
          report.fmt(r["plain_tok_s"]), "n/a" if r["speedup"] is None else f"{r['speedup']:.2f}x",
          "yes" if r["identical"] else "NO"] for r in rows])
    return table + "\n\n(tau = emitted tokens per verify step; tok/s = decode tok/s, prefill excluded)"


def short_labels(paths: list[str]) -> list[str]:
    """The shortest trailing path parts that tell the drafts apart (folders of several runs share a name)."""
    parts = [p.rstrip("/").split("/") for p in paths]
    for n in range(1, max(map(len, parts)) + 1):
        labels = ["/".join(x[-n:]) for x in parts]
        if len(set(labels)) == len(labels):
            return labels
    return paths


def chart(result: dict, png_path: str):
    """One draft: tau against k per dataset. Several: per k, tau per dataset as bars, one per draft."""
    rows, drafts, steps, datasets = result["rows"], list(result["drafts"]), result["steps"], result["datasets"]
    tau = {(r["draft"], r["dataset"], r["steps"]): r["tau"] or 0.0 for r in rows}
    title = f"Acceptance length, {result['model']}"
    if len(drafts) == 1:
        series = {name: [tau[drafts[0], name, k] for k in steps] for name in datasets}
        report.line_chart(png_path, steps, series, f"{title}: {drafts[0]}", "draft tokens per step (k)",
                          "tau (tokens per verify step)")
        return
    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(steps), figsize=(5 * len(steps), 4.5), sharey=True, squeeze=False)
    width = 0.8 / len(drafts)
    labels = short_labels(drafts)
    for ax, k in zip(axes[0], steps):
        for i, d in enumerate(drafts):
            xs = [j + (i - (len(drafts) - 1) / 2) * width for j in range(len(datasets))]
            ax.bar(xs, [tau[d, name, k] for name in datasets], width, label=labels[i] if ax is axes[0][0] else None)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_title(f"k = {k}")
        ax.set_ylim(1.0, None)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("tau (tokens per verify step)")
    fig.suptitle(title)
    fig.legend(fontsize=8, loc="lower center", ncol=min(3, len(drafts)))
    fig.tight_layout(rect=(0, 0.06 * -(-len(drafts) // 3), 1, 1))  # room below the axes for the legend
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def run(args, engine_options: dict) -> dict:
    import json

    from lanner.llm import LLM
    from lanner.spec.drafts import resolve_draft

    if args.replot:
        json_path, png_path = report.output_paths(args.json, args.out_dir, "eval_accept")
        with open(json_path) as f:
            result = json.load(f)
        chart(result, png_path)
        print(f"wrote {png_path}")
        return result
    steps = sorted(set(_int_list(args.steps, "steps")))
    if not all(1 <= k <= 8 for k in steps):
        sys.exit(f"lanner: error: --steps: each k must be in 1..8, got {args.steps!r}")
    names = [d.strip() for d in args.datasets.split(",") if d.strip()] if args.datasets else \
        ([] if args.prompts else list(EVAL_SETS))
    bad = [d for d in names if d not in EVAL_SETS]
    if bad:
        sys.exit(f"lanner: error: --datasets: unknown {', '.join(bad)}; choose from {', '.join(EVAL_SETS)}")
    try:
        datasets = {d: load_eval_set(d, args.limit, args.split_seed) for d in names}
        if args.prompts:
            name = os.path.splitext(os.path.basename(args.prompts))[0]
            datasets[name] = load_prompts_file(args.prompts)[: args.limit]
        drafts = [d.strip() for d in args.draft.split(",") if d.strip()]
        paths = {d: None if d == "ngram" else resolve_draft(d) for d in drafts}
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"lanner: error: {e}")
    if not drafts:
        sys.exit("lanner: error: --draft: empty")

    json_path, png_path = report.output_paths(args.json, args.out_dir, "eval_accept")
    llm_plain = LLM(**{**engine_options, "spec": None, "draft": None})
    config, source = llm_plain.engine.config, llm_plain.engine.source
    print(f"eval-accept: {source.name} ({config.dtype}, {config.device}), drafts {', '.join(drafts)}, k {steps}, "
          f"{', '.join(f'{n} x{len(v)}' for n, v in datasets.items())}", file=sys.stderr, flush=True)
    rows, plain_cache = [], {}
    for d in drafts:
        spec = "ngram" if d == "ngram" else "draft"
        llm_spec = LLM(**{**engine_options, "spec": spec, "draft": paths[d], "spec_max_batch": 1})
        rows += evaluate(llm_spec, llm_plain, datasets, steps, args.max_new_tokens, draft=d, plain_cache=plain_cache)
        del llm_spec
        gc.collect()
    result = {"eval": "accept", "model": source.name, "model_path": source.path, "draft": args.draft,
              "drafts": {d: paths[d] for d in drafts}, "steps": steps, "datasets": list(datasets),
              "limit": args.limit, "max_new_tokens": args.max_new_tokens, "split_seed": args.split_seed,
              "env": report.environment(config), "rows": rows}
    del llm_plain
    gc.collect()
    report.write_json(json_path, result)
    chart(result, png_path)
    print(format_table(rows))
    print(f"\nwrote {json_path} and {png_path}")
    return result
