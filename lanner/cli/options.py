"""What the subcommands share: the help formatter, the engine options generated from EngineConfig's fields,
sampling options, and driving one request through the engine."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from lanner.config import GROUPS, EngineConfig


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows defaults that say something: not None/False, and not where the help already explains it."""

    def _get_help_string(self, action):
        help = action.help or ""
        if "default" in help or action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings \
                or action.nargs == 0:  # an on/off flag: its help says what it does
            return help
        return f"{help} (default: %(default)s)"


def new_parser(sub, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description or help, formatter_class=HelpFormatter)


# ------------------------------------------------------------------ shared options

def tp_sizes(text: str) -> list[int]:
    """'2' or '1,2' -> [2] / [1, 2] (argparse type of --tp)."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or a comma list like 1,2; got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"tensor-parallel sizes must be >= 1, got {text!r}")
    return sizes


def _flag_args(f: dataclasses.Field) -> tuple[list[str], dict]:
    """The argparse flags and keywords of an EngineConfig field, from its metadata (lanner.config.option)."""
    meta = f.metadata
    flags = list(meta["flags"]) or ["--" + f.name.replace("_", "-")]
    kw = {"dest": f.name, "help": meta["help"], **meta["argparse"]}
    if f.type == "bool":  # a flag that flips the default
        kw["action"] = "store_false" if f.default else "store_true"
    elif kw.get("action") == "append":
        kw["default"] = []
    else:
        kw["default"] = f.default
        kind = f.type.replace(" ", "").split("|")[0]
        if kind in ("int", "float") and "choices" not in kw:
            kw["type"] = int if kind == "int" else float
    return flags, kw


def add_config_args(p: argparse.ArgumentParser, names: list[str] | None = None, tp_sweep: bool = False,
                    also: tuple[str, ...] = ()):
    """EngineConfig's options (`names`, or every field with cli=True, plus `also`), grouped as lanner.config.GROUPS;
    flags, defaults and help come from the fields, so each is stated once. tp_sweep: --tp takes a comma list of
    sizes to compare (benchmarks)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(EngineConfig):
        if not (f.name in names if names is not None else f.metadata["cli"] or f.name in also):
            continue
        group = f.metadata["group"]
        g = groups.get(group) or groups.setdefault(group, p.add_argument_group(GROUPS[group]))
        flags, kw = _flag_args(f)
        if f.name == "tp":  # a size, or WORLD_SIZE under torchrun, or a list to sweep (tp_size_arg)
            kw.update(type=tp_sizes, default=None, metavar="N[,N]" if tp_sweep else "N",
                      help=("tensor-parallel sizes to run and compare, e.g. 1,2" if tp_sweep else kw["help"]) +
                      " (default: 1, or WORLD_SIZE under torchrun)")
        g.add_argument(*flags, **kw)
        if f.name == "spec":
            g.add_argument("--no-spec", dest="spec", action="store_const", const="none",
                           help="plain decoding (same as --spec none)")


def engine_kwargs(args, exclude: tuple[str, ...] = ()) -> dict:
    """EngineConfig keyword arguments from parsed args (less `exclude`: options a command sets itself). Validates
    them (and that the model exists) now, so a bad option fails with its message before any model loading."""
    from lanner.models.loader import ModelSource

    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.metadata["cli"] and f.name not in exclude}
    kwargs.update(plugin_options=plugin_options(args.plugin_options) or None, tp=tp_size_arg(args))
    try:
        EngineConfig(**kwargs)
        ModelSource.resolve(args.model)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"lanner: error: {e}")
    return kwargs


def tp_size_arg(args) -> int:
    """The single tensor-parallel size of a command (the first of a benchmark's list): --tp, else torchrun's
    WORLD_SIZE, else 1. Under torchrun --tp must equal WORLD_SIZE."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = args.tp or [world]
    if len(sizes) > 1 and not getattr(args, "tp_sweep", False):
        sys.exit("lanner: error: --tp takes one size here (a list is for 'bench latency' and 'bench memory')")
    if world > 1 and sizes != [world]:
        sys.exit(f"lanner: error: under torchrun (WORLD_SIZE={world}) --tp must be {world}, got "
                 f"{','.join(map(str, sizes))}")
    return sizes[0]


def single_process(kwargs: dict, command: str) -> dict:
    """Commands that run the model outside the engine's step loop (training) or hold two engines at once cannot
    use tensor parallelism (one group per process, driven by the step loop)."""
    if kwargs["tp"] != 1:
        sys.exit(f"lanner: error: {command} does not support tensor parallelism (--tp {kwargs['tp']})")
    return kwargs


def plugin_options(items: list[str]) -> dict:
    """["lowlat.threads=2", ...] -> {"lowlat": {"threads": 2}}."""
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        name, dot, opt = key.partition(".")
        if not (sep and dot and name and opt):
            sys.exit(f"lanner: error: --plugin-option expects NAME.KEY=VALUE, got {item!r}")
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
        out.setdefault(name, {})[opt] = value
    return out


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, temperature: float):
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (<= 0: off)")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")


def sampling_params(args):
    from lanner.engine.sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              max_tokens=args.max_tokens)
    except ValueError as e:
        sys.exit(f"lanner: error: {e}")


def load_llm(args):
    from lanner.llm import LLM

    return LLM(**engine_kwargs(args))


def stream(engine, params, prompt):
    """Yields the outputs of one request (prompt: text or token ids) as the engine produces them, driving the
    engine's step loop."""
    req = engine.add_request(prompt, params)
    try:
        while True:
            for out in engine.step():
                if out.request_id == req.request_id:
                    yield out
                    if out.finished:
                        return
    finally:  # the consumer stopped early (Ctrl-C): free the request's KV blocks
        engine.abort(req.request_id)


def print_stream(outputs) -> str:
    """Prints each text delta as it arrives; returns the full text."""
    text = ""
    for out in outputs:
        print(out.delta_text, end="", flush=True)
        text = out.text
        if out.error:
            print(f"\nlanner: error: {out.error}", file=sys.stderr)
    print()
    return text
