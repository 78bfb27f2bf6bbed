"""Coding-agent sessions over real source files that nobody on the project wrote: Python modules of packages
installed beside Lanner (site-packages), for `lanner bench make-sessions --source N`.

A session reads one module and edits three of its functions, as an agent does:

    system     an agent prompt naming the read_file tool
    user       "In <path>, add a docstring to `f` ..."
    assistant  the read_file call (Hermes <tool_call> JSON; recorded, so every run sees the same history)
    tool       the file's text (cut at --max-file-tokens of the model's tokenizer, on a line boundary)
    assistant  `f` rewritten with a docstring
    user       "Now add type hints to `g` ..."      assistant  `g` rewritten
    user       "Rename a local variable of `h` ..."  assistant  `h` rewritten

Recorded answers are the functions' own source (the docstring turn adds one line), so the histories are what
an agent's would be; the replay generates each answer with the served model and continues with the recorded one.
Files are picked (seeded) among modules of 150-1500 lines with at least three top-level functions of 5-40 lines,
one of them without a docstring.
"""
from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path

PACKAGES = ("click", "jinja2", "tqdm", "httpx", "starlette", "anyio", "pydantic", "uvicorn", "fastapi", "yaml",
            "urllib3", "requests", "packaging", "idna", "certifi", "markupsafe")  # lanner's dependency tree
SYSTEM = (
    "You are a coding agent working in a Python repository. You can call the tool read_file(path) to read a file; "
    "call it as <tool_call>{\"name\": \"read_file\", \"arguments\": {\"path\": \"...\"}}</tool_call>. When you "
    "change code, answer with the complete updated function in a ```python block and nothing else: the harness "
    "replaces the old function with it, so keep every line you do not change exactly as it is.")
ASKS = ("In {path}, add a docstring to `{name}` that says what it does. Read the file first.",
        "Now add type hints to the parameters and the return value of `{name}`.",
        "Rename the local variables of `{name}` to clearer names, changing nothing else.")


def candidate_files(root: str | None = None) -> list[Path]:
    base = Path(root or sysconfig.get_paths()["purelib"])
    files = [p for pkg in PACKAGES if (base / pkg).is_dir() for p in sorted((base / pkg).rglob("*.py"))]
    return [p for p in files if 150 <= p.read_text(errors="replace").count("\n") <= 1500]


def _functions(source: str) -> list[ast.FunctionDef]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and 5 <= n.end_lineno - n.lineno + 1 <= 40
            and not n.decorator_list]


def source_session(path: Path, rng: random.Random, tokenizer, max_file_tokens: int, rel: str) -> dict | None:
    """One session over `path` (shown as `rel`), or None if the file has too few functions within the cut."""
    text = path.read_text(errors="replace")
    lines = text.splitlines(keepends=True)
    shown, n = [], 0
    for line in lines:  # the tool's output: the file's head, on whole lines, within the token budget
        n += len(tokenizer.hf.encode(line, add_special_tokens=False))
        if n > max_file_tokens:
            break
        shown.append(line)
    funcs = [f for f in _functions(text) if f.end_lineno <= len(shown)]
    bare = [f for f in funcs if ast.get_docstring(f) is None]  # the docstring ask needs one without
    if len(funcs) < len(ASKS) or not bare:
        return None
    first = rng.choice(bare)
    picked = [first, *sorted(rng.sample([f for f in funcs if f is not first], len(ASKS) - 1), key=lambda f: f.lineno)]
    call = {"name": "read_file", "arguments": {"path": rel}}
    turns = [{"role": "system", "content": SYSTEM}]
    for i, (ask, f) in enumerate(zip(ASKS, picked)):
        code = "".join(lines[f.lineno - 1 : f.end_lineno])
        if i == 0:
            indent = " " * (f.body[0].col_offset if f.body else 4)
            head = "".join(lines[f.lineno - 1 : f.body[0].lineno - 1])  # the def line(s)
            code = head + f'{indent}"""{f.name.replace("_", " ").strip().capitalize()}."""\n' + \
                "".join(lines[f.body[0].lineno - 1 : f.end_lineno])
            turns += [{"role": "user", "content": ask.format(path=rel, name=f.name)},
                      {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"},
                      {"role": "tool", "content": "".join(shown)}]
        else:
            turns.append({"role": "user", "content": ask.format(name=f.name)})
        turns.append({"role": "assistant", "content": f"```python\n{code}```"})
    return {"id": f"source-{rel}", "turns": turns}


def source_sessions(tokenizer, count: int, seed: int, max_file_tokens: int, finish) -> list[dict]:
    """`count` sessions over seeded picks of candidate_files(); finish(session) sets max_tokens or drops it."""
    files = candidate_files()
    random.Random(seed).shuffle(files)
    base = Path(sysconfig.get_paths()["purelib"])
    out = []
    for p in files:
        s = source_session(p, random.Random(f"{seed}:{p.name}"), tokenizer, max_file_tokens,
                           str(p.relative_to(base)))
        s = s and finish(s)
        if s:
            out.append(s)
            if len(out) == count:
                return out
    raise ValueError(f"only {len(out)} source-file sessions fit the limits (asked for {count}; "
                     f"{len(files)} candidate files under {base})")
