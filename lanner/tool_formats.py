"""Tool calls as models write them: the format of each model family, one streaming parser for model text, and the
xgrammar structural tag that constrains a call once the model has started one.

Families (`family_of`: from the chat template the prompt was rendered with, else the architecture):

| family  | the model's own form                                                    | models                          |
|---------|-------------------------------------------------------------------------|---------------------------------|
| hermes  | `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`        | Qwen2.5, Hermes, Lanner's own   |
| llama3  | `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` if kept    | Llama 3.1-3.3                   |
| mistral | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `name[ARGS]{...}` | Mistral / Mixtral instruct      |
| gemma   | bare JSON `{"name": ..., "parameters" or "arguments": {...}}`           | Gemma (no template tool syntax) |

Every family also accepts the generic forms real models slip into: ```` ```json ```` fences and bare JSON objects
(or arrays of them) whose "name" is a declared tool, with the arguments under "arguments" or "parameters".
Qwen2.5-Coder, asked for `<tool_call>` tags, writes fenced, pretty-printed JSON. Generic forms must name a declared
tool, so JSON the user asked for (a package.json starts with "name" too) stays content; an explicit marker
(`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`) is a call whatever it names.
"""
from __future__ import annotations

import json
import uuid

FAMILIES = ("hermes", "llama3", "mistral", "gemma")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN, MISTRAL_ARGS, PYTHON_TAG = "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"
# explicit markers a family writes before its calls (the generic forms need none)
MARKERS = {"hermes": (HERMES_OPEN,), "llama3": (PYTHON_TAG,), "mistral": (MISTRAL_OPEN,), "gemma": ()}
ARG_KEYS = ("arguments", "parameters")
FENCE = "```json\n"
# the layouts of a bare call object the grammar arms on: (open, separator, close). Compact is what the templates
# show; Qwen2.5-Coder pretty-prints with two spaces, other models with four
LAYOUTS = (("{", ", ", "}"), ("{\n  ", ",\n  ", "\n}"), ("{\n    ", ",\n    ", "\n}"))


def family_of(chat_template: str | None, architecture: str | None = None) -> str:
    """The family whose form this chat template asks for; without a clue, the architecture, then hermes (the form
    lanner.tool_calls.TOOL_CHAT_TEMPLATE asks for)."""
    t = chat_template or ""
    if MISTRAL_OPEN in t:
        return "mistral"
    if PYTHON_TAG in t or ("ipython" in t and '"parameters"' in t):
        return "llama3"
    if HERMES_OPEN in t:
        return "hermes"
    if (architecture or "").startswith("gemma") or "<start_of_turn>" in t:
        return "gemma"
    return "hermes"


# ---------------------------------------------------------------------------------------------- parsing
class ToolCallParser:
    """Splits (streamed) model text into content and complete OpenAI tool calls.

    `feed(delta, final)` returns (content delta, calls completed by this delta). Text that could still start a
    call is held back until it is one or cannot be, and whitespace at either end of the content is held too, so
    the concatenated content deltas and calls equal what one `feed(text, final=True)` gives. A region that starts
    like a call but is not one (invalid JSON, an undeclared name in a generic form) is content.
    With parallel=False the first call ends the turn: later calls and text are dropped."""

    def __init__(self, tools: list[dict] | None = None, family: str = "hermes", parallel: bool = True):
        if family not in FAMILIES:
            raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
        self.names = [_tool_name(t) for t in tools or []]
        self.quoted = [json.dumps(n) for n in self.names]  # '"get_weather"': the generic openers end there
        self.markers = MARKERS[family]
        self.parallel = parallel
        self.buf = ""  # text not yet classified
        self.ws = ""  # whitespace held until more content follows it
        self.started = False  # some content was sent (leading whitespace is dropped before it)
        self.ended = False  # parallel=False and the call came: the rest is dropped
        self.scan = [-1]  # _json_end's state over the held call (indices into buf)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        if self.ended:
            return "", []
        self.buf += delta
        content, calls = [], []
        pos = 0
        while True:
            start, kind, opened = self._candidate(pos)
            if start < 0:
                content.append(self.buf[pos:])
                pos = len(self.buf)
                break
            content.append(self.buf[pos:start])
            pos = start
            if opened < 0:  # the text ends inside an opener
                if final:
                    content.append(self.buf[pos:])
                    pos = len(self.buf)
                break
            end, found = self._region(kind, start, opened, final)
            if end < 0:  # the call is not finished yet
                if final:  # cut by max_tokens: plain text
                    content.append(self.buf[pos:])
                    pos = len(self.buf)
                break
            if not found:
                content.append(self.buf[start:end])
            else:
                calls.extend(found)
                if not self.parallel:
                    calls, self.ended = calls[:1], True
                    pos = len(self.buf)
                    break
            pos = end
        self.buf = self.buf[pos:]
        if pos:  # the indices moved
            self.scan = [-1]
        return self._content("".join(content), final or self.ended), calls

    # the earliest place a call starts, or may start once more text comes
    def _candidate(self, pos: int) -> tuple[int, str, int]:
        """-> (start, kind, end of its opener: -1 = the text ends inside it), or (-1, "", -1)."""
        buf = self.buf
        for i in range(pos, len(buf)):
            c = buf[i]
            if c not in "<[`{":
                continue
            for m in self.markers:
                if buf.startswith(m, i):
                    return i, m, i + len(m)
                if m.startswith(buf[i:]):
                    return i, m, -1
            if not self.names:
                continue
            if c == "`":
                end = self._fence_opener(i)
                if end is not None:
                    return i, "fence", end
            elif c in "[{":
                end = self._bare_opener(i)
                if end is not None:
                    return i, "bare", end
        return -1, "", -1

    def _fence_opener(self, i: int) -> int | None:
        """```` ``` ```` [json] whitespace, then a bare opener: its end, -1 (partial) or None."""
        buf, j = self.buf, i + 3
        if not buf.startswith("```", i):
            return -1 if "```".startswith(buf[i:]) else None
        if buf.startswith("json", j):
            j += 4
        elif "json".startswith(buf[j:]):
            return -1
        j = _skip_ws(buf, j)
        if j == len(buf):
            return -1
        return self._bare_opener(j) if buf[j] in "[{" else None

    def _bare_opener(self, i: int) -> int | None:
        """[ { "name": "<declared>": its end (after the name), -1 (partial) or None."""
        buf, j = self.buf, i
        if buf[j] == "[":
            j = _skip_ws(buf, j + 1)
        for lit in ("{", '"name"', ":", None):
            j = _skip_ws(buf, j)
            if j == len(buf):
                return -1
            if lit is None:
                break
            if not buf.startswith(lit, j):
                return -1 if lit.startswith(buf[j:]) else None
            j += len(lit)
        rest = buf[j:]
        for q in self.quoted:
            if rest.startswith(q):
                return j + len(q)
        return -1 if any(q.startswith(rest) for q in self.quoted) else None

    def _region(self, kind: str, start: int, opened: int, final: bool) -> tuple[int, list[dict] | None]:
        """-> (end of the region that opened at `start`, its calls or None: content), or (-1, None) unfinished."""
        buf = self.buf
        if kind == HERMES_OPEN:
            close = buf.find(HERMES_CLOSE, opened)
            if close >= 0:
                return close + len(HERMES_CLOSE), self._calls(buf[opened:close], explicit=True)
            if final:  # a complete object without its closing tag (stopped right after it) still counts
                calls = self._calls(buf[opened:], explicit=True)
                return (len(buf), calls) if calls else (-1, None)
            return -1, None
        if kind == MISTRAL_OPEN:
            return self._mistral(opened)
        explicit = kind == PYTHON_TAG
        if explicit:
            value = _skip_ws(buf, opened)
        elif kind == "fence":
            value = _skip_ws(buf, start + 3 + (4 if buf.startswith("json", start + 3) else 0))
        else:  # bare: the opener starts with the value's [ or {
            value = start
        if value == len(buf):
            return -1, None
        end = _json_end(buf, value, self.scan)
        if end < 0:
            return -1, None
        calls = self._calls(buf[value:end], explicit)
        if kind == "fence":  # the closing fence belongs to the call; wait to see whether it comes
            j = _skip_ws(buf, end)
            if buf.startswith("```", j):
                end = j + 3
            elif "```".startswith(buf[j:]) and not final:
                return -1, None
        return end, calls

    def _mistral(self, opened: int) -> tuple[int, list[dict] | None]:
        """[TOOL_CALLS] then a JSON array / object, or name[ARGS]{...} (Mistral's newer templates)."""
        buf = self.buf
        j = _skip_ws(buf, opened)
        if j == len(buf):
            return -1, None
        if buf[j] in "[{":
            end = _json_end(buf, j)
            return (end, self._calls(buf[j:end], explicit=True)) if end >= 0 else (-1, None)
        brace = buf.find("{", j)
        if brace < 0:
            return -1, None
        name = buf[j:brace].removesuffix(MISTRAL_ARGS).strip()
        end = _json_end(buf, brace)
        if end < 0:
            return -1, None
        try:
            args = json.loads(buf[brace:end])
        except json.JSONDecodeError:
            return end, None
        return end, [_openai_call(name, args)] if name and isinstance(args, dict) else None

    def _calls(self, text: str, explicit: bool) -> list[dict] | None:
        """A JSON call object or array of them -> OpenAI calls; None when it is not that. Generic forms (not
        explicit) must name declared tools."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = []
        for obj in items:
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return None
            if not explicit and obj["name"] not in self.names:
                return None
            args = next((obj[k] for k in ARG_KEYS if k in obj), {})
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append(_openai_call(obj["name"], args))
        return calls or None

    def _content(self, text: str, final: bool) -> str:
        text = self.ws + text
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        self.ws = "" if final else text[len(body):]
        self.started = self.started or bool(body)
        return body


def _tool_name(tool) -> str:
    return tool if isinstance(tool, str) else tool["function"]["name"]


def _openai_call(name: str, args: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _json_end(s: str, i: int, state: list | None = None) -> int:
    """Just past the JSON object or array that starts at s[i] (brackets balanced outside strings), or -1 when s
    ends first. state ([start, scanned up to, depth, in string, escaped], updated) resumes an earlier scan of the
    same value: a long call streamed in small deltas is then scanned once, not once per delta."""
    if state is None:
        state = [-1]
    if state[0] != i:
        state[:] = [i, i, 0, False, False]
    _, start, depth, in_str, esc = state
    for j in range(start, len(s)):
        c = s[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    state[1:] = [len(s), depth, in_str, esc]
    return -1


# ---------------------------------------------------------------------------------------------- grammar
def structural_tag(tools: list[dict], tool_choice: str, parallel: bool, family: str):
    """The xgrammar structural tag for a tools request.

    auto: free text until a trigger, then the call is held to a declared tool and its schema until its end. The
    triggers, in each of LAYOUTS: the family's marker (hermes: `<tool_call>`); for every family a ```` ```json ````
    fence opening an object on `"name": "`, and a bare object's opening up to a declared tool's name (`{"name":
    "get_weather"`), so other JSON stays free. required / named: only calls, in the family's own form, from the
    first token."""
    from xgrammar.structural_tag import (
        JSONSchemaFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    if tool_choice.startswith("function:"):
        tools = [t for t in tools if t["function"]["name"] == tool_choice.removeprefix("function:")]
    one = not parallel

    def tag(begin: str, tool: dict, end: str) -> TagFormat:
        # bounded whitespace runs: room for pretty-printed nesting, none for the endless padding a small model can
        # fall into; the tightest bound (1) pushed the bundled model off its "{\n    \"key\"" habit into garbage
        return TagFormat(begin=begin, content=JSONSchemaFormat(json_schema=_parameters(tool), max_whitespace_cnt=12),
                         end=end)

    def hermes(t: dict) -> TagFormat:
        return tag(f'{HERMES_OPEN}\n{{"name": {json.dumps(t["function"]["name"])}, "arguments": ', t,
                   f"}}\n{HERMES_CLOSE}")

    def bare(t: dict, layout, key: str, fence: str = "") -> TagFormat:
        open_, sep, close = layout
        return tag(f'{fence}{open_}"name": {json.dumps(t["function"]["name"])}{sep}"{key}": ', t,
                   close + ("\n```" if fence else ""))

    if tool_choice == "auto":
        triggers, tags = [], []
        if family == "hermes":
            triggers.append(HERMES_OPEN)
            tags += [hermes(t) for t in tools]
        for layout in LAYOUTS:
            # a ```json fence opening an object on "name" is a call attempt: the name is held to a declared tool
            # (Qwen2.5-Coder otherwise invents one, "install_package")
            triggers.append(f'{FENCE}{layout[0]}"name": "')
            tags += [bare(t, layout, key, FENCE) for t in tools for key in ARG_KEYS]
            for t in tools:  # bare JSON arms only on a declared name: other JSON stays free
                triggers.append(f'{layout[0]}"name": {json.dumps(t["function"]["name"])}')
                tags += [bare(t, layout, key) for key in ARG_KEYS]
        return StructuralTag(format=TriggeredTagsFormat(triggers=triggers, tags=tags, stop_after_first=one))
    # [TOOL_CALLS] and <|python_tag|> are control tokens that xgrammar's text matching cannot produce: mistral
    # and llama3 are held to their bare JSON form
    tags = [hermes(t) for t in tools] if family == "hermes" else \
        [bare(t, LAYOUTS[0], key) for t in tools for key in (ARG_KEYS[::-1] if family == "llama3" else ARG_KEYS)]
    return StructuralTag(format=TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True,
                                                        stop_after_first=one))


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}
