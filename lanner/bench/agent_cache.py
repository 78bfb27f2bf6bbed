"""An agent's main session interleaved with its subagents on a KV pool too small for all three, replayed twice in one
run: with the requests' sessions named (the prefix cache evicts by session, lanner.kvcache.block_manager) and
without (plain LRU). Reports each agent's prefix-cache hit tokens and TTFT.

The workload is a coding agent's shape: each round the main agent takes a turn, then two subagents (an explorer
and a tester, started fresh each round, as an agent spawns them per task) take turns in alternation while the main
session waits for their results; the main session's next turn carries their answers. Every agent has its own long
system prompt (instructions, the five tools of lanner.bench.tools as JSON, repository notes), and each turn's user
message is a tool result: a slice of one of Lanner's own source files. Turns are sent one at a time through the
chat template, greedy with EOS ignored; the history continues with the generated reply. The pool holds the main
session's and one subagent's contexts, not all three.

example: lanner bench agent-cache
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from lanner.bench.report import bar_chart, environment, fmt, markdown_table, output_paths, write_json
from lanner.bench.tools import AGENT_SYSTEM, TOOLS

HELP = "A main agent session beside two subagents on a small KV pool: session-aware prefix cache vs plain LRU."
DESCRIPTION = __doc__.split("\n\n", 1)[1]
ROLES = {"main": "You plan the task, split it among subagents and merge their findings.",
         "explorer": "You are a subagent: explore the code the main agent points you to and report what it does.",
         "tester": "You are a subagent: find how the code the main agent points you to is tested and what is missing."}


def add_arguments(p):
    p.add_argument("--rounds", type=int, default=3, help="main-session turns (each followed by the subagents')")
    p.add_argument("--sub-turns", type=int, default=3, help="turns of each subagent per round")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per turn")
    p.add_argument("--pool-tokens", type=int, default=3840, help="KV pool size in tokens")
    p.add_argument("--out-dir", default="results")
    p.add_argument("--json", default=None, help="JSON output path (default: OUT_DIR/bench_agent_cache.json)")


def _sources() -> list[str]:
    import lanner

    root = Path(lanner.__file__).parent
    return [p.read_text() for p in sorted(root.rglob("*.py")) if p.stat().st_size > 4000]


def system_prompt(role: str, notes: str) -> str:
    return (f"{AGENT_SYSTEM} {ROLES[role]}\n\n# Tools\n{json.dumps(TOOLS, indent=1)}\n\n# Repository notes\n{notes}")


def schedule(rounds: int, sub_turns: int) -> list[tuple[str, str]]:
    """(session, role) per turn, in the order they are sent."""
    turns = []
    for r in range(rounds):
        turns.append(("main", "main"))
        for _ in range(sub_turns):
            turns += [(f"explorer-{r}", "explorer"), (f"tester-{r}", "tester")]
    return turns


def replay(llm, turns, max_tokens: int, named: bool) -> list[dict]:
    from lanner import SamplingParams

    src = _sources()
    chunk = lambda i, n: src[i % len(src)][(i * 997) % 3000:][:n]
    notes = {role: "".join(chunk(7 * k + j, 700) for j in range(3)) for k, role in enumerate(ROLES)}
    convs: dict[str, list[dict]] = {}
    pending: list[str] = []  # the subagents' last answers, for the main session's next turn
    records = []
    for i, (session, role) in enumerate(turns):
        conv = convs.get(session)
        if conv is None:
            conv = convs[session] = [{"role": "system", "content": system_prompt(role, notes[role])},
                                     {"role": "user", "content": f"Task {i}: look at this code.\n{chunk(i, 600)}"}]
        elif role == "main":
            conv.append({"role": "user", "content": "Subagent results:\n" + "\n".join(pending) + chunk(i, 300)})
            pending = []
        else:
            conv.append({"role": "user", "content": f"Tool result (read_file):\n{chunk(i, 600)}"})
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                session=session if named else None)
        out = llm.chat(conv, params)[0]
        conv.append({"role": "assistant", "content": out.text})
        if role != "main":
            pending.append(f"{session}: {out.text}")
        m = out.metrics
        records.append({"turn": i, "session": session, "agent": role, "prompt_tokens": m["prompt_tokens"],
                        "cached_tokens": m["cached_prompt_tokens"], "ttft_s": m["ttft_s"]})
    return records


def summarize(records: list[dict]) -> dict:
    out = {}
    for agent in ("main", "subagents"):
        # the main session's first turn is cold under any policy: its later turns are what a cache can keep
        rs = [r for r in records if (r["agent"] == "main") == (agent == "main")]
        if agent == "main":
            rs = [r for r in rs if r["turn"] > 0]
        out[agent] = {"turns": len(rs), "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
                      "hit_tokens": sum(r["cached_tokens"] for r in rs),
                      "ttft_mean_s": statistics.mean(r["ttft_s"] for r in rs) if rs else None,
                      "ttft_max_s": max(r["ttft_s"] for r in rs) if rs else None,
                      "ttft_sum_s": sum(r["ttft_s"] for r in rs)}
    return out


def engine_for(engine_options: dict, pool_tokens: int):
    """An LLM whose paged pool holds pool_tokens (in whole blocks), sized from a probe engine's bytes per token."""
    from lanner import LLM

    with LLM(**{**engine_options, "kv_cache_memory": "0.25GiB"}) as probe:
        kv, bs = probe.engine.kv, probe.engine.config.block_size
        per_block = kv.bytes_per_token * bs
        plugin = kv.plugin_bytes
    blocks = pool_tokens // bs
    llm = LLM(**{**engine_options, "kv_cache_memory": f"{(plugin + blocks * per_block + per_block // 2) / 2**30:.12f}GiB"})
    if llm.engine.kv.num_blocks != blocks:
        sys.exit(f"lanner: error: sized the pool for {blocks} blocks, got {llm.engine.kv.num_blocks}")
    return llm


def run(args, engine_options: dict) -> dict:
    if min(args.rounds, args.sub_turns, args.max_tokens, args.pool_tokens) < 1:
        sys.exit("lanner: error: --rounds, --sub-turns, --max-tokens and --pool-tokens must be positive")
    if engine_options.get("kv_tier"):
        sys.exit("lanner: error: this benchmark measures the paged KV's prefix cache; kv_tier has none")
    turns = schedule(args.rounds, args.sub_turns)
    arms, env = {}, None
    for name, named in (("lru", False), ("session", True)):
        llm = engine_for(engine_options, args.pool_tokens)
        env = env or environment(llm.engine.config)
        llm.generate("Warm up.", None)  # first-call overheads stay out of the measured turns
        t0 = time.perf_counter()
        records = replay(llm, turns, args.max_tokens, named)
        arms[name] = {"wall_s": time.perf_counter() - t0, "summary": summarize(records), "turns": records}
        llm.close()
    peak = {}
    for r in arms["lru"]["turns"]:
        peak[r["agent"]] = max(peak.get(r["agent"], 0), r["prompt_tokens"] + args.max_tokens)
    rows = []
    for name, arm in arms.items():
        for agent, s in arm["summary"].items():
            rows.append([name, agent, s["turns"], s["prompt_tokens"], s["hit_tokens"],
                         fmt(100 * s["hit_tokens"] / max(1, s["prompt_tokens"])), fmt(1000 * s["ttft_mean_s"], 0),
                         fmt(1000 * s["ttft_max_s"], 0)])
    table = markdown_table(["policy", "agent", "turns", "prompt tok", "hit tok", "hit %", "TTFT mean ms",
                            "TTFT max ms"], rows)
    main = {k: arms[k]["summary"]["main"] for k in arms}
    print(f"\n## Agent session cache: 1 main agent + 2 subagents, {args.pool_tokens}-token KV pool "
          f"(peak contexts: main {peak['main']}, explorer {peak['explorer']}, tester {peak['tester']})\n")
    print(table)
    print(f"\nmain session (turns 2..{args.rounds}): hits {main['session']['hit_tokens']} vs "
          f"{main['lru']['hit_tokens']} tokens, TTFT mean {1000 * main['session']['ttft_mean_s']:.0f} vs "
          f"{1000 * main['lru']['ttft_mean_s']:.0f} ms (session-aware vs LRU); wall "
          f"{arms['session']['wall_s']:.1f} vs {arms['lru']['wall_s']:.1f} s")
    result = {"benchmark": "agent_cache", "environment": env, "engine_options": engine_options,
              "workload": {"rounds": args.rounds, "sub_turns": args.sub_turns, "max_tokens": args.max_tokens,
                           "pool_tokens": args.pool_tokens, "peak_context_tokens": peak, "schedule": turns},
              "arms": arms}
    json_path, png_path = output_paths(args.json, args.out_dir, "bench_agent_cache")
    write_json(json_path, result)
    bar_chart(png_path, [f"main {k}" for k in arms] + [f"subagents {k}" for k in arms],
              [1000 * arms[k]["summary"][a]["ttft_mean_s"] for a in ("main", "subagents") for k in arms],
              "Agent turns' mean TTFT: LRU vs session-aware cache", "TTFT ms")
    print(f"\nwrote {json_path} and {png_path}")
    return result
