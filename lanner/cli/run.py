"""lanner serve, generate, chat and plugins: running the model."""
from __future__ import annotations

import os
import sys

from lanner.cli.options import (
    add_config_args,
    add_sampling_args,
    engine_kwargs,
    load_llm,
    new_parser,
    plugin_options,
    print_stream,
    sampling_params,
    stream,
)
from lanner.config import EngineConfig
from lanner.server import DEFAULT_MAX_BODY_BYTES, DEFAULT_SHUTDOWN_GRACE_S

# ------------------------------------------------------------------ serve

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



# ------------------------------------------------------------------ plugins

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
