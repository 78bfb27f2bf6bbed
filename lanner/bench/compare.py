"""What `bench replay` and `bench fixed` share: the session driver, per-level metrics, running the same
workload on two systems (--plugin and --compare) one after the other, and the table, JSON and chart.

A workload is a list of sessions, each a list of Turns sent one after the other (a fixed-length request is a
one-turn session). For a concurrency level c, c sessions run at a time: a session's next turn is sent as soon
as its previous one finishes (no think time), and a new session starts as soon as one ends. The driver steps
the LLMEngine itself: scheduling then depends only on the workload, never on timing, so two systems with the
same numerics produce the same greedy tokens (checked when they are compared).

Per-user speed of a turn = (output tokens - 1) / (time of its last token - time of its first token). P10 of
speed is the slow tail: the speed 90% of turns exceed.
"""
from __future__ import annotations

import gc
import math
import sys
import time
from collections import deque
from dataclasses import dataclass

from lanner.bench import report
from lanner.bench.llamacpp import available as peer_missing

PEER = "llama.cpp"  # --systems name of the llama.cpp peer (lanner.bench.llamacpp, its own process)
PEERS = {PEER: False, "llama.cpp-fa": True}  # peer system -> llama.cpp's flash attention (llama-cpp-python: off)


@dataclass
class Turn:
    session: str  # session id
    index: int  # assistant turn number within the session
    prompt_ids: list[int]
    max_tokens: int


def add_arguments(p, name: str, concurrency: str):
    p.add_argument("--concurrency", default=concurrency, help="comma-separated concurrency levels")
    p.add_argument("--compare", default=None, metavar="PLUGIN",
                   help="also run the benchmark with --plugin PLUGIN (e.g. 'none') in its own engine, loaded "
                        "after the first is freed, and report the ratios of the two")
    p.add_argument("--systems", default=None, metavar="SPEC[,SPEC...]",
                   help="speculation systems to run one after the other, each in its own engine, with ratios "
                        "against the first: none (plain), auto (the engine's default), ngram, suffix, draft, hybrid, "
                        "suffix-tree, draft-tree, "
                        "hybrid-tree, llama.cpp (e.g. 'none,ngram,suffix,draft,hybrid'); 'draft' and 'hybrid' use "
                        "--draft or the shipped head; '-tree': draft trees of --spec-tree nodes (default 12; "
                        "hybrid-tree: the suffix index's and the head's); 'llama.cpp': llama-cpp-python (make peers) "
                        "on the same GGUF in its own process, one stream, lowlat's thread count; 'llama.cpp-fa': "
                        "the same with llama.cpp's flash attention on")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the systems this many times, alternating, and report each number as its median over "
                        "the rounds (each round's own numbers and ratios are kept in the JSON): on a shared, noisy "
                        "machine one run's ratio moves by several percent")
    p.add_argument("--json", default=None, help=f"result file (default: OUT_DIR/{name}.json)")
    p.add_argument("--png", default=None, help="chart file (default: the --json path with .png)")
    p.add_argument("--out-dir", default="results", help="folder for the result files when --json is not given")


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ------------------------------------------------------------------ the driver

def run_sessions(engine, sessions: list[list[Turn]], concurrency: int, desc: str) -> tuple[list[dict], float]:
    """Runs the sessions, `concurrency` at a time, greedy with EOS ignored. Returns (one record per turn, wall
    seconds). Records keep the generated token ids under "token_ids"."""
    from tqdm import tqdm

    from lanner.engine.sampling import SamplingParams

    pending, active, records = deque(range(len(sessions))), {}, []

    def send(s: int, k: int):
        turn = sessions[s][k]
        params = SamplingParams(temperature=0, max_tokens=turn.max_tokens, ignore_eos=True)
        req = engine.add_request(None, params, prompt_ids=turn.prompt_ids)
        active[req.request_id] = (s, k)

    n_turns = sum(len(s) for s in sessions)
    with tqdm(total=n_turns, desc=desc, unit="turn", leave=False, file=sys.stderr) as bar:
        t0 = time.perf_counter()
        while pending or active:
            while pending and len(active) < concurrency:
                send(pending.popleft(), 0)
            for out in engine.step():
                if not out.finished:
                    continue
                s, k = active.pop(out.request_id)
                if out.error:
                    raise RuntimeError(f"session {sessions[s][k].session!r} turn {k + 1}: {out.error}")
                m, turn = out.metrics, sessions[s][k]
                records.append({"session": turn.session, "turn": turn.index, "prompt_tokens": m["prompt_tokens"],
                                "cached_prompt_tokens": m["cached_prompt_tokens"], "max_tokens": turn.max_tokens,
                                "output_tokens": len(out.token_ids), "ttft_s": m["ttft_s"],
                                "speed_tok_s": m["decode_tok_s"], "token_ids": list(out.token_ids)})
                bar.update(1)
                if k + 1 < len(sessions[s]):
                    send(s, k + 1)
        wall = time.perf_counter() - t0
    return records, wall


def summarize(system: str, concurrency: int, records: list[dict], wall: float) -> dict:
    speeds = [r["speed_tok_s"] for r in records if r["speed_tok_s"] is not None]
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    tokens = sum(r["output_tokens"] for r in records)
    prompt = sum(r["prompt_tokens"] for r in records)
    return {"system": system, "concurrency": concurrency, "turns": len(records), "output_tokens": tokens,
            "wall_s": wall, "output_tok_s": tokens / wall if wall > 0 else None,
            "speed_p50_tok_s": percentile(speeds, 50), "speed_p10_tok_s": percentile(speeds, 10),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "prompt_tokens": prompt,
            "cached_prompt_frac": sum(r["cached_prompt_tokens"] for r in records) / prompt if prompt else None,
            "requests": [{k: v for k, v in r.items() if k != "token_ids"} for r in records]}


# ------------------------------------------------------------------ systems

def systems(engine_options: dict, compare: str | None, spec_systems: str | None = None) -> list[tuple[str, dict]]:
    """[(name, engine options)]: the --plugin system, then the --compare one. Plugin options stay with the
    plugins they name, so the compare system gets only those for its own plugins. With --systems: one system per
    speculation kind instead, all with the --plugin options."""
    from lanner.config import EngineConfig

    if spec_systems is not None:
        if compare is not None:
            sys.exit("lanner: error: --systems and --compare: give one of them")
        out = []
        for name in (n.strip() for n in spec_systems.split(",")):
            if name in PEERS:
                if not out:
                    sys.exit(f"lanner: error: --systems: {name} cannot come first (the workload is built on the "
                             "first system's engine)")
                out.append((name, {"peer": PEER, "flash_attn": PEERS[name]}))
                continue
            spec = None if name == "none" else name.removesuffix("-tree")
            draft = (engine_options.get("draft") or "default") if spec in ("draft", "hybrid") else \
                engine_options.get("draft") if spec == "auto" else None
            tree = (engine_options.get("spec_tree") or 12) if name.endswith("-tree") else 0
            options = engine_options | {"spec": spec, "draft": draft, "spec_tree": tree}
            try:
                EngineConfig(**options)
            except ValueError as e:
                sys.exit(f"lanner: error: --systems: {name}: {e}")
            out.append((name, options))
        if len({n for n, _ in out}) != len(out):
            sys.exit("lanner: error: --systems: a system is named twice")
        return out
    first = engine_options.get("plugin") or "none"
    out = [(first, engine_options)]
    if compare is not None:
        names = {n.strip() for n in compare.split(",")}
        opts = {k: v for k, v in (engine_options.get("plugin_options") or {}).items()
                if compare == "auto" or k in names}
        other = engine_options | {"plugin": compare, "plugin_options": opts or None}
        try:
            EngineConfig(**other)
        except ValueError as e:
            sys.exit(f"lanner: error: --compare: {e}")
        out.append((compare if compare != first else f"{compare} #2", other))
    return out


def run_peer_sessions(model_path: str, sessions: list[list[Turn]], warm: list[list[Turn]], threads: int,
                      desc: str, flash_attn: bool = False) -> tuple[list[dict], float]:
    """llama.cpp (its own process, lanner.bench.llamacpp) over the same turns one at a time, keeping the shared
    history's KV between turns. -> (records as run_sessions gives them, wall seconds)."""
    from lanner.bench.llamacpp import run_peer

    turns = [t for s in sessions for t in s]
    print(f"{desc}: {len(turns)} turns in llama.cpp's process", file=sys.stderr, flush=True)
    runs = run_peer(model_path, [t.prompt_ids for t in turns], warm[0][0].prompt_ids, [t.max_tokens for t in turns],
                    threads, flash_attn=flash_attn)
    records = [{"session": t.session, "turn": t.index, "prompt_tokens": len(t.prompt_ids), "cached_prompt_tokens": 0,
                "max_tokens": t.max_tokens, "output_tokens": len(r["token_ids"]), "ttft_s": r["ttft_s"],
                "speed_tok_s": (len(r["token_ids"]) - 1) / (r["total_s"] - r["ttft_s"])
                if len(r["token_ids"]) > 1 else None, "token_ids": r["token_ids"]} for t, r in zip(turns, runs)]
    return records, sum(r["total_s"] for r in runs)


def _load(name: str, options: dict):
    from lanner.llm import LLM
    from lanner.plugins import PluginMismatch

    try:
        return LLM(**options)
    except PluginMismatch as e:
        sys.exit(f"lanner: error: system {name!r}: {e}")


def _plugin_state(engine) -> dict:
    rt = engine.plugins
    if rt is None:
        return {"active": [], "disabled": {}}
    return {"active": [p.name for p in getattr(rt, "active", getattr(rt, "plugins", []))],
            "disabled": dict(getattr(rt, "disabled", {}))}


def run_benchmark(name: str, args, engine_options: dict, workload, warmup, title: str, extra: dict) -> dict:
    """Runs workload(engine, level) -> sessions at each --concurrency level on each system, after one warm-up
    run of warmup(engine, highest level) -> sessions at the highest level. Workloads are built once, on the
    first system's engine (same model, same tokenizer), so both systems get identical prompts. Writes JSON and
    PNG, prints the table, returns the result."""
    import torch

    from lanner.bench.throughput import parse_levels

    levels = parse_levels(args.concurrency)
    rounds = getattr(args, "rounds", 1)
    if rounds < 1:
        sys.exit("lanner: error: --rounds: expected a positive number")
    json_path, png_path = report.output_paths(args.json, args.out_dir, name)
    png_path = args.png or png_path
    # the engine must not cap concurrency below the level being measured
    engine_options = engine_options | {"max_num_seqs": max(engine_options["max_num_seqs"], levels[-1])}
    configs = systems(engine_options, args.compare, getattr(args, "systems", None))
    rows, tokens, infos, work, warm, meta = [], {}, [], None, None, {}
    for rnd, (sys_name, options) in ((r, c) for r in range(rounds) for c in configs):
        if options.get("peer"):
            if not meta["model_path"].endswith(".gguf"):
                sys.exit(f"lanner: error: --systems: {PEER} runs GGUF files, not {meta['model_path']}")
            why_not = peer_missing()
            if why_not:
                print(f"\n*** {PEER} SKIPPED: {why_not} ***\n", file=sys.stderr, flush=True)
                continue
            threads = ((engine_options.get("plugin_options") or {}).get("lowlat") or {}).get("threads") \
                or torch.get_num_threads()
            tokens[sys_name] = {}
            for c in levels[:1]:  # one stream: llama.cpp serves one sequence at a time here
                records, wall = run_peer_sessions(meta["model_path"], work[c], warm, threads,
                                                  f"{sys_name} c={c}" + (f" round {rnd + 1}" if rounds > 1 else ""),
                                                  options["flash_attn"])
                tokens[sys_name][c] = {(r["session"], r["turn"]): r["token_ids"] for r in records}
                rows.append(summarize(sys_name, c, records, wall) | {"round": rnd})
            if rnd == 0:
                infos.append({"name": sys_name, "peer": PEER, "flash_attn": options["flash_attn"], "threads": threads,
                              "concurrency": levels[:1]})
            continue
        llm = _load(sys_name, options)
        engine = llm.engine
        if work is None:
            work = {c: workload(engine, c) for c in levels}
            warm = warmup(engine, levels[-1])
            meta = {"model": engine.source.name, "model_path": engine.source.path,
                    "env": report.environment(engine.config)}
            print(f"{name}: {engine.source.name} ({engine.config.dtype}, {engine.config.device}), concurrency "
                  f"{levels}, systems {[n for n, _ in configs]}", file=sys.stderr, flush=True)
        run_sessions(engine, warm, levels[-1], f"{sys_name} warm-up")
        tokens[sys_name] = {}
        for c in levels:
            if engine.proposer is not None:  # the same turns again: the suffix index must not hold their outputs
                engine.proposer.forget()
            before = spec_counters(engine)
            records, wall = run_sessions(engine, work[c], c,
                                         f"{sys_name} c={c}" + (f" round {rnd + 1}" if rounds > 1 else ""))
            tokens[sys_name][c] = {(r["session"], r["turn"]): r["token_ids"] for r in records}
            rows.append(summarize(sys_name, c, records, wall) | spec_summary(before, spec_counters(engine)) |
                        {"round": rnd})
        if rnd == 0:
            infos.append({"name": sys_name, "plugin": options.get("plugin"),
                          "plugin_options": options.get("plugin_options"), "plugins": _plugin_state(engine)})
        device = engine.config.device
        del llm, engine  # free this system before the next one loads
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    by_round = [[r for r in rows if r["round"] == k] for k in range(rounds)]
    rows = merge_rounds(by_round)
    result = {"benchmark": name.removeprefix("bench_"), **meta, **extra, "levels_concurrency": levels,
              "engine": {k: v for k, v in engine_options.items() if k not in ("model", "plugin", "plugin_options")},
              "rounds": rounds, "systems": infos, "levels": rows}
    if len(configs) >= 2:  # every system against the first (--systems) / the --plugin system against --compare
        names = [n for n, _ in configs]
        pairs = [(n, names[0]) for n in names[1:]] if getattr(args, "systems", None) else [(names[0], names[1])]
        result["comparison"] = [c for a, b in pairs for c in comparison(rows, a, b, tokens)]
        if rounds > 1:  # each round's own ratios next to the ratio of the medians
            for c in result["comparison"]:
                c["speed_p50_tok_s_ratio_by_round"] = [
                    x["speed_p50_tok_s_ratio"] for rr in by_round
                    for x in comparison(rr, c["system"], c["baseline"], tokens) if x["concurrency"] == c["concurrency"]]
    report.write_json(json_path, result)
    env = meta["env"]
    speed_chart(png_path, rows, [n for n, _ in configs], levels,
                f"{title}: {meta['model']}, {env['dtype']}, {env['device']}")
    print(format_tables(result))
    for info in infos:
        if info.get("plugins", {}).get("disabled"):
            print(f"\nWARNING: system {info['name']!r}: plugins disabled during the run (their steps fell back "
                  f"to the engine's own forward): {info['plugins']['disabled']}", file=sys.stderr)
    print(f"\nwrote {json_path} and {png_path}")
    return result


MERGED = ("speed_p50_tok_s", "speed_p10_tok_s", "ttft_p50_s", "ttft_p90_s", "output_tok_s", "wall_s", "spec_tau",
          "spec_propose_ms_per_step")


def merge_rounds(by_round: list[list[dict]]) -> list[dict]:
    """One row per (system, level) over the rounds' rows: the first round's, with each MERGED number replaced by
    its median over the rounds and every round's value under round_values (one round: its rows unchanged)."""
    if len(by_round) == 1:
        return by_round[0]
    out = []
    for first in by_round[0]:
        same = [r for rr in by_round for r in rr if (r["system"], r["concurrency"]) ==
                (first["system"], first["concurrency"])]
        row = dict(first)
        row["round_values"] = {}
        for k in MERGED:
            values = [r.get(k) for r in same]
            if all(v is not None for v in values):
                row[k] = percentile(values, 50)
                row["round_values"][k] = values
        out.append(row)
    return out


def spec_counters(engine) -> dict:
    """The engine's speculation counters now, per proposer label."""
    reg, out = engine.metrics.registry, {}
    for metric in reg.collect():
        if metric.name.startswith(("lanner_spec_proposer_", "lanner_spec_propose_")):
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[(s.name.removesuffix("_total"), s.labels["proposer"])] = s.value
    return out


def spec_summary(before: dict, after: dict) -> dict:
    """Speculation over one level: tau (tokens per verify step, bonus included), drafting ms per engine step
    that drafted, and per proposer the verify steps, drafted and accepted tokens."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    per: dict = {}
    for (name, proposer), v in delta.items():
        if name.startswith("lanner_spec_proposer_") and v:
            per.setdefault(proposer, {})[name.removeprefix("lanner_spec_proposer_")] = int(v)
    steps = sum(p.get("verify_steps", 0) for p in per.values())
    accepted = sum(p.get("accepted_tokens", 0) for p in per.values())
    secs = sum(v for (n, _), v in delta.items() if n == "lanner_spec_propose_seconds")
    calls = sum(v for (n, _), v in delta.items() if n == "lanner_spec_propose_steps")
    return {"spec_tau": (accepted + steps) / steps if steps else None,
            "spec_propose_ms_per_step": 1000 * secs / calls if calls else None, "spec_by_proposer": per}


def comparison(rows: list[dict], a: str, b: str, tokens: dict) -> list[dict]:
    """Per level: a's metrics over b's (a = the --plugin system, b = --compare), and how many turns produced
    the same greedy token ids on both."""
    def ratio(x, y):
        return x / y if x is not None and y else None

    by = {(r["system"], r["concurrency"]): r for r in rows}
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        if (a, c) not in by or (b, c) not in by:  # a peer measured at one level only
            continue
        ra, rb = by[(a, c)], by[(b, c)]
        ta, tb = tokens[a][c], tokens[b][c]
        out.append({"concurrency": c, "system": a, "baseline": b,
                    **{f"{k}_ratio": ratio(ra[k], rb[k]) for k in
                       ("speed_p50_tok_s", "speed_p10_tok_s", "ttft_p50_s", "ttft_p90_s", "output_tok_s")},
                    "greedy_identical_turns": sum(ta[k] == tb.get(k) for k in ta), "turns": len(ta)})
    return out


def format_tables(result: dict) -> str:
    f = report.fmt
    rows = [[r["system"], r["concurrency"], r["turns"], f(r["speed_p50_tok_s"]), f(r["speed_p10_tok_s"]),
             f(r.get("spec_tau"), 2), f(r.get("spec_propose_ms_per_step"), 3),
             f(r["ttft_p50_s"] and r["ttft_p50_s"] * 1000), f(r["ttft_p90_s"] and r["ttft_p90_s"] * 1000),
             f(r["output_tok_s"]), f(r["wall_s"]),
             f(r["cached_prompt_frac"] and 100 * r["cached_prompt_frac"], 0)] for r in result["levels"]]
    text = report.markdown_table(["system", "concurrency", "requests", "speed P50 tok/s", "speed P10 tok/s", "tau",
                                  "draft ms/step", "TTFT P50 ms", "TTFT P90 ms", "output tok/s", "wall s",
                                  "prompt cached %"], rows)
    if result.get("suffix_step_ms_8k") is not None:
        text += (f"\n\nsuffix drafting per step at an 8k-token context (index 4 new tokens, draft up to 16): "
                 f"{result['suffix_step_ms_8k']:.3f} ms")
    text += ("\n\n(speed: per-user decode speed of each request, (tokens - 1) / (last token - first token); "
             "P10 = the slow tail, the speed 90% of requests exceed)")
    if "comparison" in result:
        c0 = result["comparison"][0]
        rows = [[c["system"], c["concurrency"], f(c["speed_p50_tok_s_ratio"], 2), f(c["speed_p10_tok_s_ratio"], 2),
                 f(c["ttft_p50_s_ratio"], 2), f(c["output_tok_s_ratio"], 2),
                 f"{c['greedy_identical_turns']}/{c['turns']}"] for c in result["comparison"]]
        text += f"\n\nagainst {c0['baseline']}:\n\n" + report.markdown_table(
            ["system", "concurrency", "speed P50 ratio", "speed P10 ratio", "TTFT P50 ratio", "output tok/s ratio",
             "greedy identical"], rows)
        if result.get("rounds", 1) > 1:
            text += (f"\n\n(numbers: medians over {result['rounds']} rounds; speed P50 ratio per round: " +
                     "; ".join(f"{c['system']} c={c['concurrency']} " +
                               ", ".join(f(x, 2) for x in c["speed_p50_tok_s_ratio_by_round"])
                               for c in result["comparison"]) + ")")
    return text


def speed_chart(path: str, rows: list[dict], system_names: list[str], levels: list[int], title: str):
    """Per-user speed vs concurrency: one color per system, P50 solid, P10 dashed."""
    import os

    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colors = ["#3b6ea8", "#e0873a", "#5a9e5a", "#9467bd", "#c44e52", "#8c8c8c"]
    for i, name in enumerate(system_names):
        mine = sorted((r for r in rows if r["system"] == name), key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in mine]
        color = colors[i % len(colors)]
        ax.plot(x, [r["speed_p50_tok_s"] or 0 for r in mine], marker="o", color=color, label=f"{name} P50")
        ax.plot(x, [r["speed_p10_tok_s"] or 0 for r in mine], marker="o", color=color, linestyle="--",
                label=f"{name} P10 (slow tail)")
    ax.set_xscale("log", base=2)  # concurrency levels are usually powers of two
    ax.set_xticks(levels, [str(v) for v in levels])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("per-user decode tok/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
