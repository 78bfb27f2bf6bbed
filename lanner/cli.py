"""The `lanner` command line: serve, generate, chat, bench.

A subcommand is one function decorated with @subcommand that adds its parser to the subparsers and sets
`run` (a function of the parsed args returning an exit code or None). Heavy imports stay inside the `run`
functions so that `--help` answers quickly.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys

from lanner.config import GROUPS, EngineConfig
from lanner.server import DEFAULT_MAX_BODY_BYTES, DEFAULT_SHUTDOWN_GRACE_S

SUBCOMMANDS = []


def subcommand(add_parser):
    SUBCOMMANDS.append(add_parser)
    return add_parser


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows defaults that say something: not None/False, and not where the help already explains it."""

    def _get_help_string(self, action):
        help = action.help or ""
        if "default" in help or action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings \
                or action.nargs == 0:  # an on/off flag: its help says what it does
            return help
        return f"{help} (default: %(default)s)"


def new_parser(sub, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description or help, formatter_class=_Formatter)


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
    """EngineConfig's options (`names`, or every field with cli=True, plus `also`), grouped as lanner.config.GROUPS; flags,
    defaults and help come from the fields, so each is stated once. tp_sweep: --tp takes a comma list of sizes to
    compare (benchmarks)."""
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


def engine_kwargs(args) -> dict:
    """EngineConfig keyword arguments from parsed args. Validates them (and that the model exists) now, so a
    bad option fails with its message before any model loading."""
    from lanner.models.loader import ModelSource

    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.metadata["cli"]}
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


# ------------------------------------------------------------------ serve

@subcommand
def add_serve(sub):
    p = new_parser(sub, "serve", "Run the OpenAI-compatible HTTP server.",
                   "Run the OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, "
                   "/health, /metrics).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("LANNER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $LANNER_API_KEY; unset: no auth)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--max-body-size", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help="largest request body accepted; bigger ones get 413 (default: %(default)s)")
    p.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE_S, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may run before they are aborted "
                        "(default: %(default)s)")
    add_config_args(p, also=("served_model_name",))
    p.set_defaults(run=run_serve)


def run_serve(args):
    from lanner.server.app import run_server

    config = EngineConfig(**engine_kwargs(args), served_model_name=args.served_model_name)
    run_server(config, host=args.host, port=args.port, api_key=args.api_key, log_level=args.log_level,
               max_body_bytes=args.max_body_size, shutdown_grace_s=args.shutdown_grace)


# ------------------------------------------------------------------ generate

@subcommand
def add_generate(sub):
    p = new_parser(sub, "generate", "Complete one prompt and print the result.",
                   "Complete one prompt and print the result to stdout.\n\n"
                   "example: lanner generate \"The capital of France is\" --max-tokens 16 --temperature 0")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    add_sampling_args(p, max_tokens=256, temperature=1.0)  # 1.0: the API's default
    add_config_args(p)
    p.set_defaults(run=run_generate)


def run_generate(args):
    from lanner.engine.llm_engine import RequestError

    params = sampling_params(args)
    llm = load_llm(args)
    prompt = args.prompt
    if args.chat:  # token ids: the template is applied once, here
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    try:
        if args.stream:
            print_stream(stream(llm.engine, params, prompt))
            return 0
        out = llm.generate(prompt, params)[0]
    except RequestError as e:
        sys.exit(f"lanner: error: {e}")
    if out.error:
        sys.exit(f"lanner: error: {out.error}")
    print(out.text)


# ------------------------------------------------------------------ chat

@subcommand
def add_chat(sub):
    p = new_parser(sub, "chat", "Chat interactively in the terminal.",
                   "Chat interactively in the terminal. The conversation is kept and sent through the model's "
                   "chat template; replies stream as they are generated.\n\n"
                   "commands: /reset clears the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply.")
    p.add_argument("--system", default=None, help="system message for the conversation")
    add_sampling_args(p, max_tokens=512, temperature=0.7)
    add_config_args(p)
    p.set_defaults(run=run_chat)


def run_chat(args):
    from lanner.engine.llm_engine import RequestError

    params = sampling_params(args)
    llm = load_llm(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    print(f"lanner chat with {llm.engine.model_name}. /reset clears the conversation, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = list(start)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = print_stream(stream(llm.engine, params, llm.tokenizer.apply_chat_template(history)))
        except RequestError as e:  # usually the conversation outgrew the context
            print(f"error: {e} (try /reset)", file=sys.stderr)
            history.pop()
            continue
        except KeyboardInterrupt:  # drop the interrupted turn so the history stays well-formed
            print("\n(reply stopped)", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})


# ------------------------------------------------------------------ bench

@subcommand
def add_bench(sub):
    from lanner.bench import fixed, kv, latency, memory, quant, replay, sessions, structured, throughput

    p = new_parser(sub, "bench", "Measure latency and throughput.",
                   "Measure Lanner's speed. Each benchmark prints a markdown table and writes a JSON file and "
                   "a PNG chart.")
    bench = p.add_subparsers(dest="benchmark",
                             metavar="{latency,throughput,replay,fixed,make-sessions,kv,memory,structured,quant}",
                             required=True)
    for module, name in ((latency, "latency"), (throughput, "throughput"), (replay, "replay"), (fixed, "fixed"),
                         (sessions, "make-sessions"), (kv, "kv"), (memory, "memory"), (structured, "structured"),
                         (quant, "quant")):
        b = new_parser(bench, name, module.HELP, module.DESCRIPTION)
        module.add_arguments(b)
        sweep = name in ("latency", "memory")  # these compare tensor-parallel sizes: --tp 1,2
        add_config_args(b, tp_sweep=sweep)
        b.set_defaults(run=_bench_runner(module), tp_sweep=sweep)


def _bench_runner(module):
    def run(args):
        module.run(args, engine_kwargs(args))  # its result dict is for Python callers, not an exit code
    return run


# ------------------------------------------------------------------ eval-accept, eval-head

def _eval_command(sub, name: str, module: str):
    """A command of lanner.train.<module>: HELP, DESCRIPTION, add_arguments(p), run(args, engine_options). It holds
    two engines at once, so it runs in one process. conflict_handler="resolve": the command's own --draft (which
    takes 'default'/'hass'/...) replaces the engine option of that name."""
    mod = importlib.import_module(f"lanner.train.{module}")
    p = sub.add_parser(name, help=mod.HELP, description=mod.DESCRIPTION, formatter_class=_Formatter,
                       conflict_handler="resolve")
    add_config_args(p)
    mod.add_arguments(p)

    def run(args):  # the result dict is written to a file; the command's exit status is 0
        mod.run(args, single_process(engine_kwargs(args), name))

    p.set_defaults(run=run)


@subcommand
def add_eval_accept(sub):
    _eval_command(sub, "eval-accept", "eval_accept")


@subcommand
def add_eval_head(sub):
    _eval_command(sub, "eval-head", "eval_head")


# ------------------------------------------------------------------ train-draft

@subcommand
def add_train_draft(sub):
    from lanner.train.hass import TrainConfig

    p = new_parser(sub, "train-draft", "Train an EAGLE-3-style draft head (HASS-style distillation).",
                   "Regenerates ShareGPT (90% split) responses with the target through Lanner's engine (cached in "
                   "--data, resumable), then trains a draft head with training-time test over --ttt-steps chained "
                   "steps, top-K distillation and harmonized context alignment. Writes the head (config.json + "
                   "model.safetensors), training.json (cost, loss history) and loss.png to --out.")
    add_config_args(p)
    p.add_argument("--out", required=True, help="output folder for the head")
    p.add_argument("--data", default="data/train-draft", help="folder of the regenerated training data")
    p.add_argument("--num-prompts", type=int, default=400, help="ShareGPT training prompts to use")
    p.add_argument("--max-new-tokens", type=int, default=192, help="response length cap when regenerating")
    p.add_argument("--gen-temperature", type=float, default=0.0, help="0: greedy regeneration")
    p.add_argument("--original-responses", type=int, default=0, metavar="N",
                   help="also train on the next N ShareGPT training prompts with ShareGPT's own replies (cheap: "
                        "no regeneration; the loss is still on the target's distribution)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the ShareGPT 90/10 split")
    p.add_argument("--no-resume", action="store_true", help="start training from scratch")
    p.add_argument("--init", default=None, metavar="HEAD",
                   help="continue training this head ('hass', 'default' or a folder; its draft vocabulary is kept) "
                        "instead of starting a new one")
    defaults = TrainConfig()
    for name, help_text in [("ttt_steps", "chained steps trained (training-time test)"),
                            ("topk", "target top-K probabilities distilled"),
                            ("draft_vocab_size", "reduced draft vocabulary (most frequent target tokens)"),
                            ("max_len", "tokens per training sequence"), ("epochs", "passes over the data"),
                            ("lr", "peak AdamW learning rate"), ("warmup_steps", "linear warmup steps"),
                            ("grad_accum", "sequences per optimizer step"), ("grad_clip", "gradient norm clip"),
                            ("checkpoint_every", "optimizer steps between resumable checkpoints"),
                            ("seed", "training seed")]:
        value = getattr(defaults, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value, help=help_text)
    p.set_defaults(run=run_train_draft)


def run_train_draft(args):
    from lanner.llm import LLM
    from lanner.spec.drafts import resolve_draft
    from lanner.train.data import (
        generate_responses,
        load_training_data,
        original_responses,
        split_sharegpt,
    )
    from lanner.train.hass import TrainConfig, train_draft_head

    # the data is the target's own decoding: no draft head (speculation would be lossless, but costs a load)
    kwargs = engine_kwargs(args) | ({"spec": None} if args.spec == "auto" else {})
    llm = LLM(**single_process(kwargs, "train-draft"))
    train, _ = split_sharegpt(args.split_seed)
    path = generate_responses(llm, train[: args.num_prompts], args.data, max_new_tokens=args.max_new_tokens,
                              temperature=args.gen_temperature, split_seed=args.split_seed, train_frac=0.9)
    sequences = load_training_data(path)
    if args.original_responses:
        tok = llm.engine.tokenizer
        extra = train[args.num_prompts : args.num_prompts + args.original_responses]
        sequences += original_responses(tok, extra, tok.eos_token_ids[0] if tok.eos_token_ids else None)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    init = resolve_draft(args.init) if args.init else None
    train_draft_head(llm.engine.model, sequences, args.out, cfg, resume=not args.no_resume, init=init)
    print(f"wrote the draft head to {args.out} (training.json, loss.png beside it)")


# ------------------------------------------------------------------ rcsd

@subcommand
def add_rcsd(sub):
    from lanner.train.rcsd import RCSDConfig

    p = new_parser(sub, "rcsd", "Continue training a draft head with DPO or GRPO for acceptance length (RCSD).",
                   "Generates, through Lanner's engine with the --init head as draft, per ShareGPT training prompt "
                   "a target-only sequence and sequences where the draft writes k tokens after each target token "
                   "without verification (cached in --data, resumable); then continues training the head with DPO "
                   "or GRPO against the frozen --init head as reference. Writes the head, training.json (cost, "
                   "history) and curves.png to --out.")
    add_config_args(p)
    p.add_argument("--method", choices=["dpo", "grpo"], required=True)
    p.add_argument("--init", default="hass", help="the HASS head to start from: 'hass', 'default' or a folder")
    p.add_argument("--out", required=True, help="output folder for the trained head")
    p.add_argument("--data", default="data/rcsd/sequences.jsonl", help="cache of the generated sequences")
    p.add_argument("--num-prompts", type=int, default=200, help="ShareGPT training prompts (90%% split)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per generated sequence")
    p.add_argument("--gen-batch", type=int, default=16, help="sequences generated per engine batch")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the ShareGPT 90/10 split")
    p.add_argument("--no-resume", action="store_true", help="start training from scratch")
    p.add_argument("--ks", default="1,2,3", help="GRPO: draft lengths of the draft-alternating group members")
    defaults = RCSDConfig()
    for name, help_text in [("k", "DPO: draft tokens per target token in the bad sequence (serving depth)"),
                            ("beta", "DPO temperature / GRPO KL weight"), ("epsilon", "GRPO ratio clip"),
                            ("epochs", "passes over the prompts"), ("lr", "peak AdamW learning rate"),
                            ("warmup_steps", "linear warmup steps"), ("grad_accum", "prompts per optimizer step"),
                            ("max_len", "tokens per sequence"), ("seed", "training seed"),
                            ("checkpoint_every", "optimizer steps between resumable checkpoints")]:
        value = getattr(defaults, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value, help=help_text)
    p.set_defaults(run=run_rcsd)


def run_rcsd(args):
    from lanner.llm import LLM
    from lanner.spec.drafts import resolve_draft
    from lanner.train.data import split_sharegpt
    from lanner.train.rcsd import RCSDConfig, generate_sequences, train_rcsd

    try:
        cfg = RCSDConfig(method=args.method, k=args.k, ks=tuple(int(x) for x in args.ks.split(",")),
                         beta=args.beta, epsilon=args.epsilon, epochs=args.epochs, lr=args.lr,
                         warmup_steps=args.warmup_steps, grad_accum=args.grad_accum, max_len=args.max_len,
                         checkpoint_every=args.checkpoint_every, seed=args.seed)
        init = resolve_draft(args.init)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"lanner: error: {e}")
    kwargs = single_process(engine_kwargs(args), "rcsd") | {
        "spec": "draft", "draft": init, "spec_tokens": max(cfg.draft_lengths), "spec_max_batch": args.gen_batch,
        "max_num_seqs": args.gen_batch}
    llm = LLM(**kwargs)
    train, _ = split_sharegpt(args.split_seed)
    rows = generate_sequences(llm, train[: args.num_prompts], args.data, cfg.draft_lengths, args.max_new_tokens,
                              args.gen_batch)
    train_rcsd(llm.engine.model, init, rows, args.out, cfg, resume=not args.no_resume)
    print(f"wrote the {args.method} head to {args.out} (training.json, curves.png beside it)")


# ------------------------------------------------------------------ plugins

@subcommand
def add_plugins(sub):
    p = new_parser(sub, "plugins", "List installed kernel plugins and check them against a model.",
                   "Kernel plugins are packages registered under the entry-point group 'lanner.plugins'. "
                   "'list' shows them; 'check' runs each one's register and check hooks for a model, device and "
                   "dtype (no weights are loaded).")
    cmd = p.add_subparsers(dest="plugins_command", metavar="{list,check}", required=True)
    new_parser(cmd, "list", "List installed plugins.").set_defaults(run=run_plugins_list)
    c = new_parser(cmd, "check", "Check which plugins fit a model, device and dtype.")
    add_config_args(c, ["model", "device", "dtype", "plugin_options"])
    c.set_defaults(run=run_plugins_check)


def run_plugins_list(args):
    from lanner.plugins import discover

    eps = discover()
    if not eps:
        print("no plugins installed (entry-point group 'lanner.plugins')")
        return 0
    print("| plugin | entry point | package | architectures |\n|---|---|---|---|")
    for name, ep in sorted(eps.items()):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "?"
        try:
            archs = ", ".join(ep.load().architectures) or "(predicate)"
        except Exception as e:  # list what is installed even when it cannot be imported
            archs = f"cannot load: {type(e).__name__}: {e}"
        print(f"| {name} | {ep.value} | {dist} | {archs} |")
    return 0


def run_plugins_check(args):
    from lanner.models.loader import ModelSource, load_config
    from lanner.plugins import Hardware, PluginMismatch, discover, select_plugins

    try:
        config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype)
        model_config = load_config(ModelSource.resolve(args.model))[0]
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"lanner: error: {e}")
    hw = Hardware.detect(config.device, config.torch_dtype)
    options = plugin_options(args.plugin_options)
    print(f"model {model_config.architecture} ({args.model or 'bundled default'}), {hw.device} "
          f"({hw.device_name}), {args.dtype}\n")
    print("| plugin | result |\n|---|---|")
    fits = 0
    for name in sorted(discover()):
        try:
            select_plugins(name, model_config, hw, {name: options[name]} if name in options else None)
            result, fits = "fits", fits + 1
        except PluginMismatch as e:
            result = f"does not fit: {e}"
        print(f"| {name} | {result} |")
    return 0 if fits else 1


# ------------------------------------------------------------------ entry point

def build_parser() -> argparse.ArgumentParser:
    from lanner import __version__

    parser = argparse.ArgumentParser(prog="lanner", formatter_class=_Formatter,
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
        from lanner.engine.llm_engine import LLMEngine
        from lanner.engine.ula_engine import UlaEngine

        config = EngineConfig(**engine_kwargs(args))
        run_worker(config, (UlaEngine if config.kv_tier is not None else LLMEngine).tp_worker)
        return 0
    try:
        return args.run(args) or 0
    except UnsupportedModelError as e:
        sys.exit(f"lanner: error: {e}")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
