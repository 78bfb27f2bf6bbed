"""Tool calling: the chat template for models whose own has no tool section (the Hermes / Qwen2.5 layout), the
OpenAI request fields -> a StructuredOutput, and model text -> OpenAI tool_calls.

Lanner's template asks for `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, with tool results
back as `<tool_response>` blocks in a user turn, as Qwen2.5 and SmolLM2-1.7B do. What models actually write, per
family, is lanner.tool_formats': `call_parser` / `parse_tool_calls` are the one way from text to calls.
"""
from __future__ import annotations

import json

from lanner.structured import FieldError, StructuredOutput
from lanner.tool_formats import ToolCallParser, family_of

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
                      response_format: dict | None = None, family: str = "hermes") -> StructuredOutput | None:
    """OpenAI request fields -> the constraint (None: free text). tool_choice "none" leaves the output free;
    family is the tool-call format the model writes (lanner.tool_formats). Raises FieldError."""
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
                                    is not False, family=family)
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise FieldError("response_format.json_schema: needs a name and a schema")
        return StructuredOutput(json_schema=spec["schema"], strict=bool(spec.get("strict", False)))
    return None


def parse_tool_calls(text: str, structured: StructuredOutput | None = None,
                     tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
    """Model output -> (the text outside the calls, stripped, or None; OpenAI tool_calls)."""
    content, calls = call_parser(structured, tools).feed(text, final=True)
    return content or None, calls


def call_parser(structured: StructuredOutput | None, tools: list[dict] | None = None) -> ToolCallParser:
    """The parser of a request's output: its constraint's family, tools and parallel_tool_calls when it constrains
    tools; else (a response_format beside tool_choice auto) the hermes forms and the given tools."""
    if structured is not None and structured.tools:
        return structured.tool_parser()
    return ToolCallParser(tools)


ToolCallStream = ToolCallParser  # (its earlier name)


def prepare_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                 tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
                 response_format: dict | None = None) -> tuple[list[int], StructuredOutput | None]:
    """One chat request -> (prompt token ids, its constraint). Shared by LLM.chat and the server. Under
    tool_choice "none" the tools stay out of the prompt, so the model is not invited to call them.
    Raises FieldError."""
    check_history(messages)
    shown = None if tool_choice == "none" else tools or None
    template = template_for(tokenizer.hf.chat_template, messages, shown)
    # the calls come in the form the rendered template asks for
    family = family_of(template or tokenizer.hf.chat_template, getattr(tokenizer, "architecture", None))
    structured = structured_output(tools, tool_choice, parallel_tool_calls, response_format, family)
    return tokenizer.apply_chat_template(messages, tools=shown, chat_template=template), structured
