"""Agent session replay: recorded multi-turn sessions (lanner.bench.sessions) replayed turn by turn at several
concurrency levels, optionally on two systems (--plugin, --compare). The driver, metrics and output are in
lanner.bench.compare.

Each assistant turn sends the whole history so far through the chat template and generates that turn's
max_tokens (greedy, EOS ignored); the history then continues with the recorded reply, not the generated one,
so every run and every system sees the same contexts. The prefix cache makes later turns of a session cheap,
as in a real agent loop. Every level prepends its own tag ("[replay c=N] ") to each session's first message,
so a level does not find the previous level's turns in the prefix cache.
"""
from __future__ import annotations

import sys

from lanner.bench import compare
from lanner.bench import sessions as session_files

HELP = "Replay recorded agent sessions at several concurrency levels (per-user speed, TTFT)."
DESCRIPTION = (
    "Replay recorded multi-turn agent sessions (a JSONL session file; default: the shipped sample of 4 "
    "HumanEval coding-agent and 4 ShareGPT chat sessions, see 'lanner bench make-sessions'). Each assistant "
    "turn sends the whole history through the chat template and generates the turn's max_tokens, greedy with "
    "EOS ignored, then continues with the recorded reply; N sessions run at once for concurrency N. Reports "
    "per concurrency level the per-user decode speed of the turns (P50, and P10: the slow tail, the speed 90% "
    "of turns exceed), TTFT P50/P90 and wall time. With --compare PLUGIN the same replay runs again with "
    "--plugin PLUGIN in its own engine, and the ratios of the two systems are reported.")


def add_arguments(p):
    p.add_argument("--sessions", default=session_files.DEFAULT_SESSIONS,
                   help="session file (JSONL; default: the shipped sample lanner/bench/data/agent_sessions.jsonl)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N sessions")
    compare.add_arguments(p, "bench_replay", "1,2,4")


def build_workload(engine, sessions: list[dict], tag: str, max_tokens: int | None = None,
                   first_turn_only: bool = False) -> list[list[compare.Turn]]:
    out = []
    for s in sessions:
        turns = []
        for k, (ids, n, _) in enumerate(session_files.assistant_prompts(s, engine.tokenizer, tag)):
            n = max_tokens or n
            if len(ids) + n > engine.max_model_len:
                sys.exit(f"lanner: error: session {s['id']!r}, assistant turn {k + 1}: the {len(ids)}-token prompt "
                         f"plus max_tokens {n} exceeds the context of {engine.max_model_len} tokens")
            turns.append(compare.Turn(s["id"], k + 1, ids, n))
            if first_turn_only:
                break
        out.append(turns)
    return out


def run(args, engine_options: dict) -> dict:
    if args.limit is not None and args.limit < 1:
        sys.exit("lanner: error: --limit: expected a positive number of sessions")
    try:
        sessions = session_files.load_sessions(args.sessions, args.limit)
    except session_files.SessionFileError as e:
        sys.exit(f"lanner: error: {e}")

    def workload(engine, level):
        turns = build_workload(engine, sessions, f"replay c={level}")
        if "suffix_step_ms_8k" not in extra and getattr(args, "systems", None):
            # the suffix index's per-step cost at an 8k-token context, on this workload's text
            from lanner.spec.suffix import step_cost_ms

            extra["suffix_step_ms_8k"] = step_cost_ms([t for s in turns for t in s[-1].prompt_ids])
        return turns

    def warmup(engine, level):  # first-call overheads; its own tag keeps it out of the measured prefixes
        return build_workload(engine, sessions[:level], "warm-up", max_tokens=4, first_turn_only=True)

    assistant = [t for s in sessions for t in s["turns"] if t["role"] == "assistant"]
    extra = {"sessions_file": args.sessions, "num_sessions": len(sessions), "assistant_turns": len(assistant),
             "max_tokens_total": sum(t["max_tokens"] for t in assistant)}
    return compare.run_benchmark("bench_replay", args, engine_options, workload, warmup, "Agent session replay",
                                 extra)
