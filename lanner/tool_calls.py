"""Tool calling in the Hermes / Qwen2.5 format: the chat template for models whose own has no tool section, the
OpenAI request fields -> a StructuredOutput, and model text -> OpenAI tool_calls.

The model writes each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; tool results go
back as `<tool_response>` blocks in a user turn, as Qwen2.5 and SmolLM2-1.7B do.
"""
from __future__ import annotations

import json
import uuid

from lanner.structured import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, FieldError, StructuredOutput

# ChatML with a tool section (Qwen2.5's layout). Used for models whose own template cannot render tools.
TOOL_CHAT_TEMPLATE = """\
{%- if messages and messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}
{%- else %}{% set system = 'You are a helpful AI assistant.' %}{% set rest = messages %}{% endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
{{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}' }}
{{- '\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for m in rest %}
{%- if m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (m.content or '') }}
{%- for call in m.tool_calls or [] %}
{%- if m.content or not loop.first %}{{ '\\n' }}{% endif %}
{%- set args = call.function.arguments %}
{{- '<tool_call>\\n{"name": ' + (call.function.name | tojson) + ', "arguments": ' }}
{{- (args if args is string else (args | tojson)) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
{%- else %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""


def template_for(model_template: str | None, messages: list[dict], tools: list[dict] | None) -> str | None:
    """The template to render this conversation with: None (the model's own) unless tools or tool turns are
    involved and the model's template knows neither `tools` nor `tool_calls`."""
    uses_tools = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if not uses_tools or (model_template and "tools" in model_template and "tool_calls" in model_template):
        return None
    return TOOL_CHAT_TEMPLATE


def check_history(messages: list[dict]):
    """Every tool message answers a call an earlier assistant message made; raises FieldError."""
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = call.get("function") or {}
            if not isinstance(fn.get("name"), str):
                raise FieldError(f"messages[{i}].tool_calls[{j}].function.name: missing")
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    json.loads(args)
                except json.JSONDecodeError as e:
                    raise FieldError(f"messages[{i}].tool_calls[{j}].function.arguments: not JSON: {e}") from None
            call_ids.add(call.get("id"))
        if m.get("role") == "tool" and m.get("tool_call_id") not in call_ids:
            raise FieldError(f"messages[{i}].tool_call_id: {m.get('tool_call_id')!r} matches no tool call of an "
                             "earlier assistant message")


def structured_output(tools: list[dict] | None = None, tool_choice: str | dict | None = None,
                      parallel_tool_calls: bool | None = None,
                      response_format: dict | None = None) -> StructuredOutput | None:
    """OpenAI request fields -> the constraint (None: free text). tool_choice "none" leaves the output free.
    Raises FieldError."""
    tools = tools or []
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise FieldError('tool_choice: expected "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
        choice = f"function:{name}"
    elif choice not in ("none", "auto", "required"):
        raise FieldError(f'tool_choice: expected "none", "auto", "required" or a named function, got {choice!r}')
    if choice != "auto" and choice != "none" and not tools:
        raise FieldError("tool_choice: needs tools")
    fmt = response_format or {"type": "text"}
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise FieldError(f'response_format.type: expected "text", "json_object" or "json_schema", got {kind!r}')
    if tools and choice != "none":
        if kind != "text" and choice != "auto":
            raise FieldError("response_format: cannot be combined with a required or named tool_choice")
        if kind == "text":
            return StructuredOutput(tools=tools, tool_choice=choice, parallel_tool_calls=parallel_tool_calls
                                    is not False)
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise FieldError("response_format.json_schema: needs a name and a schema")
        return StructuredOutput(json_schema=spec["schema"], strict=bool(spec.get("strict", False)))
    return None


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Model output -> (the text outside the calls, stripped, or None; OpenAI tool_calls)."""
    content, calls = ToolCallStream().feed(text, final=True)
    return content or None, calls


class ToolCallStream:
    """Splits streamed model text into content and complete tool calls. Text that could still be the start of
    a call is held back, and so is whitespace at either end of the content, so the concatenated content deltas
    equal what parse_tool_calls returns for the whole text. A block that is not a JSON call object is content."""

    def __init__(self):
        self.buf = ""  # text not yet classified
        self.ws = ""  # whitespace held until more content follows it
        self.started = False  # some content was sent (leading whitespace is dropped before it)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """-> (content delta, calls completed by this delta)."""
        self.buf += delta
        content, calls = [], []
        while True:
            at = self.buf.find(TOOL_CALL_OPEN)
            if at < 0:
                keep = 0 if final else _partial_suffix(self.buf, TOOL_CALL_OPEN)
                content.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            end = self.buf.find(TOOL_CALL_CLOSE, at)
            if end < 0:
                if final:  # an unfinished call (length): plain text
                    content.append(self.buf)
                    self.buf = ""
                break
            block = self.buf[at : end + len(TOOL_CALL_CLOSE)]
            call = _call(block[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)])
            content.append(self.buf[:at] if call else self.buf[:at] + block)
            if call:
                calls.append(call)
            self.buf = self.buf[end + len(TOOL_CALL_CLOSE) :]
        return self._content("".join(content), final), calls

    def _content(self, text: str, final: bool) -> str:
        text = self.ws + text
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        self.ws = "" if final else text[len(body) :]
        self.started = self.started or bool(body)
        return body


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))}}


def prepare_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                 tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
                 response_format: dict | None = None) -> tuple[list[int], StructuredOutput | None]:
    """One chat request -> (prompt token ids, its constraint). Shared by LLM.chat and the server. Under
    tool_choice "none" the tools stay out of the prompt, so the model is not invited to call them.
    Raises FieldError."""
    check_history(messages)
    structured = structured_output(tools, tool_choice, parallel_tool_calls, response_format)
    shown = None if tool_choice == "none" else tools or None
    template = template_for(tokenizer.hf.chat_template, messages, shown)
    return tokenizer.apply_chat_template(messages, tools=shown, chat_template=template), structured
