"""The OpenAI Responses API: POST /v1/responses and GET /v1/responses/{id}.

A request becomes a ChatCompletionRequest (instructions -> a system message, message items -> chat messages,
function_call items -> an assistant message's tool_calls, function_call_output items -> tool messages;
reasoning items are dropped) and runs through chat_apis.ChatPath, the chat route's own path. Responses with
`store` (the default) keep their conversation in a bounded in-memory store, so a later request can continue it
by `previous_response_id`.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from lanner.server.chat_apis import ChatPath, Turn, chat_request, parse_as, patch_openapi, renamer, usage
from lanner.server.http import APIError, streaming
from lanner.server.protocol import INT64_MAX, ErrorResponse, Text, _Request

MAX_STORED = 512  # responses kept for previous_response_id / GET; the oldest go first
RENAME = renamer([(r"messages", "input"), (r"max_tokens", "max_output_tokens"),
                  (r"tools\[(\d+)\]\.function\.", r"tools[\1]."), (r"tools\[(\d+)\]\.function", r"tools[\1]"),
                  (r"response_format\.json_schema\.schema", "text.format.schema"),
                  (r"response_format(\.json_schema)?", "text.format")])


# ---------------------------------------------------------------------------------------------- requests
class FunctionTool(_Request):
    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Request):
    type: Literal["function"]
    name: Text


class TextFormat(_Request):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: Text | None = None
    input: Text | list[dict[str, Any]]  # items are checked one by one (parse_items), so errors name the item
    instructions: Text | None = None
    tools: list[dict[str, Any]] | None = None  # function tools are offered; hosted ones (web_search, namespace, ...)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None


class ContentPart(_Request):
    type: Literal["input_text", "output_text", "refusal"]  # images and files are not served
    text: Text | None = None
    refusal: Text | None = None


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ContentPart]


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[ContentPart]


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": None}  # reasoning: accepted and ignored (the model here does not reason)


# ---------------------------------------------------------------------------------------------- responses
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []
    logprobs: list = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "cancelled"]
    model: str
    output: list[OutputMessage | OutputCall]
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    previous_response_id: str | None
    text: dict[str, Any]
    store: bool
    metadata: dict[str, str]
    usage: ResponseUsage | None = None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------------- conversion
def function_tools(raw: list[dict] | None) -> list[FunctionTool]:
    """The function tools of `tools`. Others (web_search, namespace, local_shell, ...: Codex CLI sends them) are
    tools a hosted model runs itself; this server has none, so they are not offered to the model."""
    return [parse_as(FunctionTool, t, ("tools", i)) for i, t in enumerate(raw or [])
            if not isinstance(t, dict) or t.get("type") == "function"]


def parse_items(raw: str | list[dict]) -> list[BaseModel]:
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    items = []
    for i, obj in enumerate(raw):
        kind = obj.get("type", "message")  # a message may omit its type (EasyInputMessage)
        if not isinstance(kind, str) or kind not in ITEMS:
            raise APIError(400, f"input[{i}].type: unknown item type {kind!r}; this server takes "
                                f"{', '.join(ITEMS)}", f"input[{i}].type")
        if ITEMS[kind] is not None:
            items.append(parse_as(ITEMS[kind], obj, ("input", i)))
    return items


def _text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text if p.text is not None else p.refusal or "" for p in content)


def chat_messages(instructions: str | None, items: list[BaseModel], first: int) -> list[dict]:
    """Items (a stored history, then this request's from index `first`) -> chat messages."""
    messages = [{"role": "system", "content": instructions}] if instructions is not None else []
    call_ids = set()
    for i, item in enumerate(items):
        where = f"input[{i - first}]"
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except json.JSONDecodeError as e:
                raise APIError(400, f"{where}.arguments: not JSON: {e}", f"{where}.arguments") from None
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":  # a message, then the calls of the same turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            call_ids.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in call_ids:
                raise APIError(400, f"{where}.call_id: {item.call_id!r} matches no function_call before it",
                               f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def chat_fields(body: ResponsesRequest, messages: list[dict], tools: list[FunctionTool]) -> dict:
    fields = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "user": body.user,
              "prompt_cache_key": body.prompt_cache_key, "safety_identifier": body.safety_identifier,
              "parallel_tool_calls": body.parallel_tool_calls}
    if tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for t in tools]
    if isinstance(body.tool_choice, NamedFunction):
        fields["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    else:
        fields["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format.schema: required when the type is json_schema", "text.format.schema")
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None:
        fields["response_format"] = {"type": fmt.type}
    return {k: v for k, v in fields.items() if v is not None}


# ---------------------------------------------------------------------------------------------- output
class Builder:
    """Turns ChatPath events into output items, and for a stream into the typed SSE events as OpenAI sends
    them. Streaming and not share it, so both give the same response."""

    def __init__(self, skeleton: ResponseObject):
        self.resp, self.items, self.seq, self.open = skeleton, [], 0, None

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def feed(self, ev: tuple) -> list[str]:
        out = []
        if ev[0] == "text":
            if not isinstance(self.open, OutputMessage):
                out += self.close()
                self.open = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[])
                out += self._added()
                out.append(self.event("response.content_part.added", item_id=self.open.id, output_index=self.index,
                                      content_index=0, part=OutputText(text="").model_dump()))
                self.open.content.append(OutputText(text=""))
            self.open.content[0].text += ev[1]
            out.append(self.event("response.output_text.delta", item_id=self.open.id, output_index=self.index,
                                  content_index=0, delta=ev[1], logprobs=[]))
        elif ev[0] == "call":
            out += self.close()
            self.open = OutputCall(id=f"fc_{uuid.uuid4().hex}", call_id=ev[2], name=ev[3], arguments="",
                                   status="in_progress")
            out += self._added()
        elif ev[0] == "args":
            self.open.arguments += ev[2]
            out.append(self.event("response.function_call_arguments.delta", item_id=self.open.id,
                                  output_index=self.index, delta=ev[2]))
        return out

    def _added(self) -> list[str]:
        self.items.append(self.open)
        return [self.event("response.output_item.added", output_index=self.index, item=self.open.model_dump())]

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def close(self, status: str = "completed") -> list[str]:
        item, self.open, out = self.open, None, []
        if item is None:
            return out
        item.status = status
        if isinstance(item, OutputMessage):
            part = item.content[0]
            out.append(self.event("response.output_text.done", item_id=item.id, output_index=self.index,
                                  content_index=0, text=part.text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item.id, output_index=self.index,
                                  content_index=0, part=part.model_dump()))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item.id,
                                  output_index=self.index, name=item.name, arguments=item.arguments))
        out.append(self.event("response.output_item.done", output_index=self.index, item=item.model_dump()))
        return out

    def finish(self, turn: Turn) -> list[str]:
        out = self.close("incomplete" if turn.reason == "length" else "completed")
        u = usage(turn.out)
        self.resp.output = self.items
        self.resp.usage = ResponseUsage(input_tokens=u.input, output_tokens=u.output, total_tokens=u.input + u.output,
                                        input_tokens_details=InputTokensDetails(cached_tokens=u.cached))
        self.resp.status = {"length": "incomplete", "abort": "cancelled"}.get(turn.reason, "completed")
        if turn.reason == "length":
            self.resp.incomplete_details = {"reason": "max_output_tokens"}
        return out


# ---------------------------------------------------------------------------------------------- routes
def register(app, path: ChatPath):
    stored: OrderedDict[str, tuple[ResponseObject, list[BaseModel]]] = OrderedDict()

    def save(resp: ResponseObject, history: list[BaseModel]):
        items = [parse_as(ITEMS[i.type], i.model_dump(), ("output",)) for i in resp.output]
        stored[resp.id] = (resp, history + items)
        while len(stored) > MAX_STORED:
            stored.popitem(last=False)

    def lookup(rid: str, param: str | None) -> tuple[ResponseObject, list[BaseModel]]:
        if rid not in stored:
            what = f"{param}: " if param else ""
            raise APIError(404, f"{what}no stored response with id {rid!r}", param, code="not_found")
        stored.move_to_end(rid)
        return stored[rid]

    @app.post("/v1/responses", response_model=ResponseObject)
    async def create_response(body: ResponsesRequest, request: Request):
        history = [] if body.previous_response_id is None else \
            lookup(body.previous_response_id, "previous_response_id")[1]
        items = history + parse_items(body.input)
        messages = chat_messages(body.instructions, items, len(history))
        if not messages:
            raise APIError(400, "input: holds no message (and there are no instructions)", "input")
        tools = function_tools(body.tools)
        chat = chat_request(chat_fields(body, messages, tools), "input")
        rid = f"resp_{uuid.uuid4().hex}"
        started = await path.open(chat, request, rid, RENAME, bool(body.stream))
        if started is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else \
            body.tool_choice or "auto"
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
            else {"type": "text"}
        builder = Builder(ResponseObject(
            id=rid, created_at=int(time.time()), status="in_progress", model=path.engine.model_name, output=[],
            instructions=body.instructions, tools=[t.model_dump(exclude_none=True) for t in tools],
            tool_choice=tool_choice, parallel_tool_calls=body.parallel_tool_calls is not False,
            temperature=body.temperature, top_p=body.top_p, max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id, text={"format": fmt}, store=body.store,
            metadata=body.metadata or {}))

        if not body.stream:
            turn = await path.turn(chat, request, started)
            if turn is None:
                return Response(status_code=499)
            for ev in turn.events():
                builder.feed(ev)
            builder.finish(turn)
            if body.store:
                save(builder.resp, items)
            return builder.resp

        async def events():
            yield builder.event("response.created", response=builder.resp.model_dump())
            yield builder.event("response.in_progress", response=builder.resp.model_dump())
            async for ev in path.events(chat, started):
                if ev[0] == "error":
                    e = ev[1]
                    yield builder.event("error", code=e.code, message=e.message, param=e.param)
                    return
                if ev[0] == "done":
                    for chunk in builder.finish(ev[1]):
                        yield chunk
                    if body.store:
                        save(builder.resp, items)
                    yield builder.event("response.completed", response=builder.resp.model_dump())
                    return
                for chunk in builder.feed(ev):
                    yield chunk

        return streaming(events())

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject)
    async def get_response(response_id: str):
        return lookup(response_id, None)[0]

    errors = (400, 401, 404, 413, 503)
    patch_openapi(app, {"/v1/responses": {"errors": errors, "error_model": ErrorResponse, "sse": True},
                        "/v1/responses/{response_id}": {"errors": (401, 404), "error_model": ErrorResponse}})
