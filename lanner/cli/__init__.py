"""The `lanner` command line: serve, generate, chat, bench, eval-accept, eval-head, train-draft, train-curve,
train-base, rcsd, plugins.

A subcommand is one function in SUBCOMMANDS that adds its parser to the subparsers and sets `run` (a function of
the parsed args returning an exit code or None). Heavy imports stay inside the `run` functions so that `--help`
answers quickly. The engine options every command shares are generated from EngineConfig's fields
(lanner.cli.options.add_config_args).
"""
from __future__ import annotations

import argparse
import os
import sys

from lanner.cli.bench import add_bench
from lanner.cli.options import HelpFormatter, engine_kwargs
from lanner.cli.run import add_chat, add_generate, add_plugins, add_serve
from lanner.cli.train import (
    add_eval_accept,
    add_eval_head,
    add_rcsd,
    add_train_base,
    add_train_curve,
    add_train_draft,
)
from lanner.config import EngineConfig

__all__ = ["build_parser", "engine_kwargs", "main"]

SUBCOMMANDS = [add_serve, add_generate, add_chat, add_bench, add_eval_accept, add_eval_head, add_train_draft,
               add_train_curve, add_train_base, add_rcsd, add_plugins]


def build_parser() -> argparse.ArgumentParser:
    from lanner import __version__

    parser = argparse.ArgumentParser(prog="lanner", formatter_class=HelpFormatter,
                                     description="Lanner: a low-latency LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"lanner {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from lanner.models.config import UnsupportedModelError

    args = build_parser().parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and rank > 0 and hasattr(args, "tp_timeout_s"):
        # torchrun: ranks > 0 serve rank 0's engine instead of running the command
        from lanner.distributed.worker import run_worker
        from lanner.engine.llm_engine import kv_system

        config = EngineConfig(**engine_kwargs(args))
        run_worker(config, kv_system(config).worker)
        return 0
    try:
        return args.run(args) or 0
    except UnsupportedModelError as e:
        sys.exit(f"lanner: error: {e}")
    except KeyboardInterrupt:
        return 130

