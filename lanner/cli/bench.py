"""lanner bench: each benchmark module (lanner.bench) adds its own options; the engine options are shared."""
from __future__ import annotations

import sys

from lanner.cli.options import (
    add_config_args,
    engine_kwargs,
    new_parser,
)

# ------------------------------------------------------------------ bench

def add_bench(sub):
    from lanner.bench import (
        agent_cache,
        fixed,
        kv,
        latency,
        learn,
        memory,
        quant,
        replay,
        sessions,
        structured,
        throughput,
        tools,
    )

    p = new_parser(sub, "bench", "Measure latency and throughput.",
                   "Measure Lanner's speed. Each benchmark prints a markdown table and writes a JSON file and "
                   "a PNG chart.")
    bench = p.add_subparsers(dest="benchmark",
                             metavar="{latency,throughput,replay,fixed,make-sessions,kv,memory,structured,quant,learn,tools,agent-cache}",
                             required=True)
    for module, name in ((latency, "latency"), (throughput, "throughput"), (replay, "replay"), (fixed, "fixed"),
                         (sessions, "make-sessions"), (kv, "kv"), (memory, "memory"), (structured, "structured"),
                         (quant, "quant"), (learn, "learn"), (tools, "tools"),
                         (agent_cache, "agent-cache")):
        b = new_parser(bench, name, module.HELP, module.DESCRIPTION)
        module.add_arguments(b)
        sweep = name in ("latency", "memory")  # these compare tensor-parallel sizes: --tp 1,2
        add_config_args(b, tp_sweep=sweep)
        b.set_defaults(run=_bench_runner(module), tp_sweep=sweep)


def _bench_runner(module):
    def run(args):
        from lanner.bench.report import charts_missing

        # before any model loads: a run of minutes must not fail at its chart
        missing = charts_missing()
        if missing:
            sys.exit(f"lanner: error: lanner bench: {missing}")
        module.run(args, engine_kwargs(args))  # its result dict is for Python callers, not an exit code
    return run
