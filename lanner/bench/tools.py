"""Tool calls from a real model through the real server and the official openai client.

Twenty asks of a coding agent's kind, each needing one of five tools (get_weather, read_file, run_shell,
search_code, write_file), go to `lanner serve`'s /v1/chat/completions with all five tools and tool_choice left at
auto, greedy. An ask passes when the answer carries tool_calls, each naming a declared function with arguments
valid under its JSON Schema (jsonschema). Each ask runs again streamed: the calls assembled from the
delta.tool_calls chunks (names and arguments) and the finish reason must equal the non-streamed ones. Also
reported, not part of passing: whether the first call named the tool the ask was written for.

example: lanner bench tools --model qwen2.5-coder-1.5b
"""
from __future__ import annotations

import contextlib
import json
import sys
import threading
import time

from lanner.bench.report import environment, markdown_table, output_paths, write_json

HELP = "Tool calls of a real model under tool_choice=auto, through the server and the openai client."
DESCRIPTION = __doc__.split("\n\n", 1)[1]
SYSTEM = "You are a coding assistant working in the user's repository. Use the tools when they help."
# an agent's kind of system prompt (written after the first runs, in which the model twice explained instead of
# calling): the tools are its only way to the repository. --system agent picks it
AGENT_SYSTEM = ("You are a coding agent running in the user's repository. You can see files, run commands, search "
                "the code and write files only through the tools: when a request needs one of those, call the tool "
                "instead of explaining how the user could do it.")


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


_S = {"type": "string"}
TOOLS = [
    _fn("get_weather", "Current weather of a city", {"city": _S, "unit": {"enum": ["celsius", "fahrenheit"]}},
        ["city"]),
    _fn("read_file", "Read a file of the repository", {"path": _S}, ["path"]),
    _fn("run_shell", "Run a shell command in the repository and return its output", {"command": _S}, ["command"]),
    _fn("search_code", "Search the repository's code for a string or pattern", {"query": _S, "path": _S},
        ["query"]),
    _fn("write_file", "Write text to a file of the repository", {"path": _S, "content": _S}, ["path", "content"]),
]
# (the ask, the tool it was written for): written before the benchmark's first run and kept whatever the model did
# with them; four come from the and a first probe's asks (one of which the model answered in prose)
ASKS = [
    ("What's the weather in Paris?", "get_weather"),
    ("Is it raining in Tokyo right now? Give me the temperature in fahrenheit.", "get_weather"),
    ("How cold is it in Oslo today?", "get_weather"),
    ("Check the weather for Lima, Peru.", "get_weather"),
    ("Show me what is in src/main.py", "read_file"),
    ("Open README.md and tell me what the project does.", "read_file"),
    ("What does the config file setup.cfg contain?", "read_file"),
    ("Print the contents of tests/test_api.py", "read_file"),
    ("Run the test suite with pytest.", "run_shell"),
    ("What's the current git branch? Run git status.", "run_shell"),
    ("List the files in the current directory.", "run_shell"),
    ("Install the requests package with pip.", "run_shell"),
    ("Where is the function parse_args defined in this repository?", "search_code"),
    ("Find every place that calls connect_db in the code.", "search_code"),
    ("Search the src folder for TODO comments.", "search_code"),
    ("Which files import numpy? Search the code.", "search_code"),
    ("Create a file hello.txt containing 'hi'.", "write_file"),
    ("Write a .gitignore that ignores __pycache__ and .venv.", "write_file"),
    ("Save the text 'version = 2' into version.txt", "write_file"),
    ("Create notes/todo.md with a heading 'TODO' and one item 'fix tests'.", "write_file"),
]
# a second twenty, written and committed before their first run, after the runs of ASKS: --asks heldout
HELDOUT_ASKS = [
    ("Will I need an umbrella in London this afternoon?", "get_weather"),
    ("Give me the current temperature in Berlin in celsius.", "get_weather"),
    ("What's it like outside in New York right now?", "get_weather"),
    ("Tell me the weather in Sydney.", "get_weather"),
    ("Read the file docs/index.md.", "read_file"),
    ("What's in package.json?", "read_file"),
    ("Let me see the whole of src/utils/helpers.py.", "read_file"),
    ("Can you check what the Makefile in the root contains?", "read_file"),
    ("Run `ls -la` for me.", "run_shell"),
    ("How much disk space is free? Use df -h.", "run_shell"),
    ("Run the linter: ruff check .", "run_shell"),
    ("Show me the last five commits with git log.", "run_shell"),
    ("Find the definition of class UserModel in the codebase.", "search_code"),
    ("Search for uses of the deprecated function old_api across the repo.", "search_code"),
    ("Where do we read the DATABASE_URL environment variable?", "search_code"),
    ("Look for all occurrences of 'print(' in the tests folder.", "search_code"),
    ("Write 'print(\"hello\")' to a new file hello.py.", "write_file"),
    ("Create requirements.txt listing flask and requests.", "write_file"),
    ("Put the line 'DEBUG=true' into a file named .env.", "write_file"),
    ("Make a file CHANGELOG.md with the heading '# Changelog'.", "write_file"),
]


def add_arguments(p):
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--asks", choices=["dev", "heldout"], default="dev",
                   help="the first twenty asks (dev) or the second, never developed on (heldout)")
    p.add_argument("--limit", type=int, default=None, help="run only the first N asks")
    p.add_argument("--system", choices=["assistant", "agent"], default="assistant",
                   help="the system prompt: a plain assistant's (the default) or an agent's")
    p.add_argument("--out-dir", default="results")
    p.add_argument("--json", default=None, help="JSON output path (default: OUT_DIR/tool_calls_qwen.json)")


@contextlib.contextmanager
def serving(engine_options: dict):
    """`lanner serve` in this process on a free port: yields (base URL, AsyncEngine)."""
    import uvicorn

    from lanner.config import EngineConfig
    from lanner.engine.async_engine import AsyncEngine
    from lanner.engine.llm_engine import LLMEngine
    from lanner.server.app import build_app

    engine = AsyncEngine(LLMEngine(EngineConfig(**engine_options)))
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()


def check(calls: list[tuple[str, str]]) -> str | None:
    """Why these (name, arguments) calls fail, or None: each names a declared tool, with schema-valid arguments."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if not calls:
        return "no tool_calls"
    for name, arguments in calls:
        if name not in schemas:
            return f"undeclared function {name!r}"
        try:
            jsonschema.validate(json.loads(arguments), schemas[name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            return f"{name}: invalid arguments: {str(e).splitlines()[0]}"
    return None


def ask(client, model: str, system: str, question: str, max_tokens: int) -> dict:
    kw = dict(model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
              tools=TOOLS, temperature=0, max_tokens=max_tokens)
    t = time.perf_counter()
    full = client.chat.completions.create(**kw).choices[0]
    wall = time.perf_counter() - t
    calls = [(c.function.name, c.function.arguments) for c in full.message.tool_calls or []]
    streamed, content, reason = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                entry["arguments"] += d.function.arguments or ""
    streamed_calls = [(streamed[i]["name"], streamed[i]["arguments"]) for i in sorted(streamed)]
    same = streamed_calls == calls and reason == full.finish_reason and (content or None) == full.message.content
    return {"calls": calls, "content": full.message.content, "finish_reason": full.finish_reason,
            "failure": check(calls), "streamed_same": same, "streamed_calls": streamed_calls, "wall_s": wall}


def run(args, engine_options: dict) -> dict:
    import openai

    asks = HELDOUT_ASKS if args.asks == "heldout" else ASKS
    asks = asks[: args.limit] if args.limit else asks
    system = AGENT_SYSTEM if args.system == "agent" else SYSTEM
    results = []
    with serving(engine_options) as (base, engine):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=900)
        model = engine.model_name
        for question, want in asks:
            r = {"ask": question, "expected_tool": want, **ask(client, model, system, question, args.max_tokens)}
            r["expected_tool_called"] = bool(r["calls"]) and r["calls"][0][0] == want
            results.append(r)
            print(f"{'ok ' if r['failure'] is None else 'BAD'} {question!r}: {r['calls'] or r['content']!r} "
                  f"({r['wall_s']:.1f}s, streamed same: {r['streamed_same']})", file=sys.stderr, flush=True)
        config = engine.engine.config
    passed = sum(r["failure"] is None for r in results)
    same = sum(r["streamed_same"] for r in results)
    expected = sum(r["expected_tool_called"] for r in results)
    rows = [[i + 1, r["ask"][:48], r["expected_tool"], ", ".join(n for n, _ in r["calls"]) or "-",
             "yes" if r["failure"] is None else f"NO: {r['failure']}", "yes" if r["streamed_same"] else "NO"]
            for i, r in enumerate(results)]
    print(markdown_table(["#", "ask", "written for", "called", "valid call", "stream = full"], rows))
    print(f"\nvalid tool_calls: {passed}/{len(results)}; streamed = non-streamed: {same}/{len(results)}; "
          f"the tool the ask was written for: {expected}/{len(results)}")
    json_path, _ = output_paths(args.json, args.out_dir, "tool_calls_qwen")
    data = {"benchmark": "tools", "environment": environment(config), "model": config.model,
            "asks_set": args.asks, "tool_choice": "auto", "temperature": 0, "max_tokens": args.max_tokens,
            "passed": passed, "asks": len(results), "streamed_same": same, "expected_tool_called": expected, "system": system,
            "tools": TOOLS, "results": results}
    write_json(json_path, data)
    print(f"\nwrote {json_path}")
    return data
