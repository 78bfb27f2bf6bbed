"""The chat API's tools and structured output: request models for `tools` / `tool_calls` / `response_format`,
the prompt and constraint of a request, and the assistant message (or stream deltas) it answers with.

The work is lanner.tool_calls' (shared with LLM.chat); this module maps it onto the OpenAI wire format."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from lanner.engine.request import RequestOutput
from lanner.structured import FieldError
from lanner.tool_calls import call_parser, prepare_chat


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------------------------- requests
class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Model):
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class JsonSchemaFormat(_Model):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # "schema" would shadow a BaseModel method
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ToolFields(_Model):
    """Mixed into ChatCompletionRequest."""
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


# ---------------------------------------------------------------------------------------------- responses
class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


# ---------------------------------------------------------------------------------------------- handling
def chat_prompt(tokenizer, body) -> tuple[list[int], Any]:
    """ChatCompletionRequest -> (prompt ids, StructuredOutput or None). Raises FieldError."""
    messages = []
    for m in body.messages:
        msg = {"role": m.template_role(), "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    fmt = body.response_format
    if fmt is not None:
        schema = fmt.json_schema
        if fmt.type == "json_schema" and (schema is None or schema.schema_ is None):
            raise FieldError("response_format.json_schema: needs a name and a schema")
        fmt = {"type": fmt.type} if schema is None else \
            {"type": fmt.type, "json_schema": {"schema": schema.schema_, "strict": schema.strict}}
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else body.tool_choice
    return prepare_chat(tokenizer, messages, tools, choice, body.parallel_tool_calls, fmt)


def calls_tools(body) -> bool:
    """Whether the answer's text is parsed for tool calls."""
    return bool(body.tools) and body.tool_choice != "none"


def message(body, out: RequestOutput, structured=None) -> tuple[dict, str | None]:
    """-> (the assistant message, the finish reason): "tool_calls" whenever the model made calls. structured:
    the request's StructuredOutput (its tool-call family and tools)."""
    if not calls_tools(body):
        return {"content": out.text}, out.finish_reason
    content, calls = call_parser(structured, _tools(body)).feed(out.text, final=True)
    return {"content": content or None, "tool_calls": calls or None}, finish_reason(out.finish_reason, bool(calls))


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's: "tool_calls" when calls were made, also when max_tokens cut text after them."""
    return "tool_calls" if called and reason in ("stop", "length") else reason


def _tools(body) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


class StreamedCalls:
    """Per stream: turns text deltas into (content delta, delta.tool_calls) as OpenAI streams them: each call
    opens with a chunk carrying its index, id and name (arguments ""), then one with its arguments."""

    def __init__(self, structured=None, body=None):
        self.parser = call_parser(structured, _tools(body) if body is not None else None)
        self.count = 0

    def feed(self, delta_text: str, final: bool) -> tuple[str, list[list[DeltaToolCall]]]:
        content, calls = self.parser.feed(delta_text, final)
        deltas = []
        for call in calls:
            fn = call["function"]
            deltas.append([DeltaToolCall(index=self.count, id=call["id"], type="function",
                                         function=DeltaFunction(name=fn["name"], arguments=""))])
            deltas.append([DeltaToolCall(index=self.count, function=DeltaFunction(arguments=fn["arguments"]))])
            self.count += 1
        return content, deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(reason, bool(self.count))
