"""lanner bench learn: the draft head's acceptance over a stream of agent sessions, served with --learn-draft
(the head keeps learning from the traffic) against the same head held fixed, in one run."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from tqdm import tqdm

from lanner.bench import report
from lanner.bench import sessions as session_files

HELP = "Continual learning: head acceptance over a stream of agent sessions, learning vs a fixed head."
DESCRIPTION = (
    "Replays agent sessions one after another (one user, greedy, each assistant turn with its recorded "
    "max_tokens, capped by --max-tokens) twice: with the draft head fixed, then with --learn-draft (the engine "
    "keeps the traffic's target features and a low-priority trainer process publishes better heads while the "
    "stream runs). Reports per session the live tau, output tok/s and the time per verify step (does training "
    "slow serving?), the served head version, and whether every output equals the fixed run's. Needs a draft "
    "head: --spec draft (or hybrid) --draft HEAD.")


def add_arguments(p):
    p.add_argument("--sessions", required=True, help="session file (lanner bench make-sessions)")
    p.add_argument("--limit", type=int, default=None, help="first N sessions")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on each assistant turn's max_tokens")
    p.add_argument("--learn-dir", default=None, help="the --learn-draft folder (default: a fresh temporary one)")
    p.add_argument("--learn-setting", action="append", default=[], metavar="KEY=VALUE",
                   help="a trainer setting written to the folder's learner.json (lanner.train.online.DEFAULTS)")
    p.add_argument("--no-fixed", action="store_true", help="skip the fixed-head run")
    p.add_argument("--window", type=int, default=20, help="sessions per row of the table and per plotted mean")
    p.add_argument("--json", default=None, help="result file (default: OUT_DIR/bench_learn.json)")
    p.add_argument("--out-dir", default="results")


def stream(llm, workload, label: str) -> list[dict]:
    """Runs the sessions one after another -> a row per session."""
    from lanner.engine.sampling import SamplingParams

    learner = llm.engine.spec.learner
    rows = []
    for turns in tqdm(workload, desc=label, unit="session"):
        steps = emitted = tokens = 0
        seconds, outputs = 0.0, []
        for t in turns:
            t0 = time.perf_counter()
            out = llm.generate(t.prompt_ids, SamplingParams(temperature=0, max_tokens=t.max_tokens))[0]
            seconds += time.perf_counter() - t0
            m = out.metrics
            steps += m["spec_verify_steps"]
            emitted += (m["spec_accept_length"] or 0) * m["spec_verify_steps"]
            tokens += len(out.token_ids)
            outputs.append(out.token_ids)
        rows.append({"session": turns[0].session, "turns": len(turns), "tokens": tokens, "seconds": seconds,
                     "steps": steps, "emitted": emitted, "tau": emitted / steps if steps else None,
                     "tok_s": tokens / seconds, "ms_per_step": 1000 * seconds / steps if steps else None,
                     "head_version": learner.version if learner is not None else 0, "outputs": outputs})
    return rows


def windows(rows: list[dict], size: int) -> list[dict]:
    """Means over consecutive groups of `size` sessions."""
    out = []
    for i in range(0, len(rows), size):
        w = rows[i : i + size]
        steps, seconds = sum(r["steps"] for r in w), sum(r["seconds"] for r in w)
        out.append({"sessions": i + len(w), "tau": sum(r["emitted"] for r in w) / steps if steps else None,
                    "tok_s": sum(r["tokens"] for r in w) / seconds,
                    "ms_per_step": 1000 * seconds / steps if steps else None, "head_version": w[-1]["head_version"]})
    return out


def run(args, engine_options: dict) -> dict:
    from lanner.bench.replay import build_workload
    from lanner.llm import LLM
    from lanner.train.online import DEFAULTS

    if engine_options.get("spec") not in ("draft", "hybrid") or not engine_options.get("draft"):
        sys.exit("lanner: error: bench learn needs a draft head: --spec draft --draft HEAD")
    settings = {}
    for item in args.learn_setting:
        key, _, value = item.partition("=")
        if key not in DEFAULTS:
            sys.exit(f"lanner: error: --learn-setting: unknown {key!r}; one of {', '.join(DEFAULTS)}")
        settings[key] = type(DEFAULTS[key])(value)
    try:
        sessions = session_files.load_sessions(args.sessions, args.limit)
    except session_files.SessionFileError as e:
        sys.exit(f"lanner: error: {e}")
    json_path, png_path = report.output_paths(args.json, args.out_dir, "bench_learn")
    folder = args.learn_dir or tempfile.mkdtemp(prefix="lanner-learn-")
    os.makedirs(folder, exist_ok=True)
    if settings:
        with open(os.path.join(folder, "learner.json"), "w") as f:
            json.dump(settings, f)

    runs = {}
    for label in (() if args.no_fixed else ("fixed",)) + ("learning",):
        llm = LLM(**{**engine_options, "learn_draft": folder if label == "learning" else None})
        workload = build_workload(llm.engine, sessions, "learn", args.max_tokens)
        env = report.environment(llm.engine.config)
        runs[label] = stream(llm, workload, label)
        llm.close()
    rounds = []
    if os.path.exists(os.path.join(folder, "rounds.jsonl")):
        rounds = [json.loads(line) for line in open(os.path.join(folder, "rounds.jsonl"))]
    identical = None
    if "fixed" in runs:
        identical = sum(a["outputs"] == b["outputs"] for a, b in zip(runs["fixed"], runs["learning"]))
    table = {label: windows(rows, args.window) for label, rows in runs.items()}
    result = {"bench": "learn", "sessions_file": args.sessions, "num_sessions": len(sessions),
              "max_tokens": args.max_tokens, "engine": {k: v for k, v in engine_options.items() if v is not None},
              "learn_dir": folder, "settings": {**DEFAULTS, **settings}, "environment": env,
              "identical_sessions": identical, "windows": table, "rounds": rounds,
              "runs": {label: [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
                       for label, rows in runs.items()}}
    report.write_json(json_path, result)
    plot(png_path, table, args.window)
    headers = ["sessions served"] + [f"{label} {col}" for label in table for col in ("tau", "tok/s", "ms/step")] + \
        ["head version"]
    rows = []
    for i, w in enumerate(table["learning"]):
        row = [w["sessions"]]
        for label in table:
            x = table[label][i]
            row += [report.fmt(x["tau"], 2), report.fmt(x["tok_s"]), report.fmt(x["ms_per_step"])]
        rows.append(row + [w["head_version"]])
    print(report.markdown_table(headers, rows))
    published = sum(r["published"] for r in rounds)
    print(f"\ntrainer: {len(rounds)} rounds, {published} heads published"
          + (f"; {identical}/{len(sessions)} sessions identical to the fixed head's outputs" if identical is not None
             else ""))
    print(f"wrote {json_path} and {png_path}")
    return result


def plot(path: str, table: dict, window: int):
    plt = report.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, ws in table.items():
        x = [w["sessions"] for w in ws]
        a.plot(x, [w["tau"] for w in ws], marker="o", label=label)
        b.plot(x, [w["tok_s"] for w in ws], marker="o", label=label)
    a.set(xlabel="sessions served", ylabel=f"tau (mean over {window} sessions)", title="draft acceptance")
    b.set(xlabel="sessions served", ylabel="output tok/s", title="served speed")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
