"""The Anthropic Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A request becomes a ChatCompletionRequest (system -> a system message, text blocks -> message text, tool_use
blocks -> an assistant message's tool_calls, tool_result blocks -> tool messages; thinking blocks are dropped)
and runs through chat_apis.ChatPath, the chat route's own path. Errors on these routes, 401s and 413s included,
leave in Anthropic's shape, {"type": "error", "error": {"type": ..., "message": ...}}: AnthropicErrors rewrites
the OpenAI-shaped bodies the rest of the server writes.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from lanner.server.chat_apis import (
    ChatPath,
    Turn,
    arguments_object,
    chat_request,
    parse_as,
    patch_openapi,
    renamer,
    usage,
)
from lanner.server.http import APIError, streaming
from lanner.server.protocol import INT64_MAX, MAX_STOP, Text, _Request

RENAME = renamer([(r"stop", "stop_sequences"), (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
                  (r"tools\[(\d+)\]\.function", r"tools[\1]")])
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}  # others: end_turn or stop_sequence


# ---------------------------------------------------------------------------------------------- requests
class TextBlock(_Request):
    type: Literal["text"]
    text: Text


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] | None = None
    is_error: bool | None = None


BLOCKS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
          "thinking": None, "redacted_thinking": None}  # thinking: accepted and dropped (no reasoning model here)


class InputMessage(_Request):
    role: Literal["user", "assistant", "system"]  # system: Claude Code sends its environment mid-conversation
    content: Text | list[dict[str, Any]]  # blocks are checked one by one, so errors name the block


class ToolDef(_Request):
    type: Literal["custom"] | None = None
    name: Text = Field(min_length=1)
    description: Text | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_Request):
    model: Text
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT64_MAX)  # required, as Anthropic requires it
    stop_sequences: list[Text] | None = Field(None, max_length=MAX_STOP)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    stream: bool = False
    metadata: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------------- responses
class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int = 0


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


# ---------------------------------------------------------------------------------------------- conversion
def _joined(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content)


def chat_messages(body: CountTokensRequest) -> list[dict]:
    messages = [{"role": "system", "content": _joined(body.system)}] if body.system else []
    call_ids = set()
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        texts, calls = [], []
        for j, raw in enumerate(m.content):
            kind, where = raw.get("type"), f"messages[{i}].content[{j}]"
            if not isinstance(kind, str) or kind not in BLOCKS:
                raise APIError(400, f"{where}.type: unknown block type {kind!r}; this server takes "
                                    f"{', '.join(BLOCKS)}", f"{where}.type")
            if BLOCKS[kind] is None:
                continue
            block = parse_as(BLOCKS[kind], raw, ("messages", i, "content", j))
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif m.role != "assistant" and isinstance(block, ToolUseBlock) or \
                    m.role != "user" and isinstance(block, ToolResultBlock):
                raise APIError(400, f"{where}.type: a {kind} block cannot be in a {m.role} message", f"{where}.type")
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
                call_ids.add(block.id)
            else:
                if block.tool_use_id not in call_ids:
                    raise APIError(400, f"{where}.tool_use_id: {block.tool_use_id!r} matches no tool_use block of "
                                        "an earlier assistant message", f"{where}.tool_use_id")
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": _joined(block.content)})
        if m.role == "assistant":
            messages.append({"role": "assistant", "content": "\n".join(texts) or None, **({"tool_calls": calls}
                                                                                         if calls else {})})
        elif texts:
            messages.append({"role": m.role, "content": "\n".join(texts)})
    return messages


def chat_fields(body: CountTokensRequest) -> dict:
    fields = {"model": body.model, "messages": chat_messages(body)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                             **({"description": t.description}
                                                                if t.description is not None else {})}}
                           for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and choice.name is None:
            raise APIError(400, "tool_choice.name: required when the type is tool", "tool_choice.name")
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        fields.update({k: v for k, v in (("max_tokens", body.max_tokens), ("stop", body.stop_sequences),
                                         ("temperature", body.temperature), ("top_p", body.top_p),
                                         ("top_k", body.top_k)) if v is not None})
        user = (body.metadata or {}).get("user_id")
        if isinstance(user, str):
            fields["user"] = user
    return fields


# ---------------------------------------------------------------------------------------------- output
def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class Blocks:
    """Turns ChatPath events into content blocks, and for a stream into Anthropic's SSE events. Streaming and
    not share it, so both give the same message."""

    def __init__(self):
        self.blocks: list[TextOut | ToolUseOut] = []
        self.args: dict[int, str] = {}  # block index -> a tool_use's arguments text so far
        self.open = False

    def feed(self, ev: tuple) -> list[str]:
        out = []
        if ev[0] == "text":
            if not (self.open and isinstance(self.blocks[-1], TextOut)):
                out += self._start(TextOut(text=""))
            self.blocks[-1].text += ev[1]
            out.append(_sse("content_block_delta", {"index": len(self.blocks) - 1,
                                                    "delta": {"type": "text_delta", "text": ev[1]}}))
        elif ev[0] == "call":
            out += self._start(ToolUseOut(id=ev[2], name=ev[3], input={}))
            self.args[len(self.blocks) - 1] = ""
        elif ev[0] == "args":
            self.args[len(self.blocks) - 1] += ev[2]
            out.append(_sse("content_block_delta", {"index": len(self.blocks) - 1,
                                                    "delta": {"type": "input_json_delta", "partial_json": ev[2]}}))
        return out

    def _start(self, block) -> list[str]:
        out = self.close()
        self.blocks.append(block)
        self.open = True
        return out + [_sse("content_block_start", {"index": len(self.blocks) - 1, "content_block": block.model_dump()})]

    def close(self) -> list[str]:
        if not self.open:
            return []
        self.open = False
        i = len(self.blocks) - 1
        if i in self.args:
            self.blocks[i].input = arguments_object(self.args[i])
        return [_sse("content_block_stop", {"index": i})]


def message_usage(out) -> MessageUsage:
    u = usage(out)
    # Anthropic counts input_tokens after the cache: the prompt is input_tokens + cache_read_input_tokens
    return MessageUsage(input_tokens=u.input - u.cached, output_tokens=u.output, cache_read_input_tokens=u.cached)


# ---------------------------------------------------------------------------------------------- routes
def register(app, path: ChatPath):
    app.add_middleware(AnthropicErrors)

    async def stop_reason(turn: Turn, body: MessagesRequest) -> tuple[str, str | None]:
        if turn.reason in STOP_REASONS:
            return STOP_REASONS[turn.reason], None
        matched = await path.stop_sequence(turn.out, body.stop_sequences)
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    @app.post("/v1/messages", response_model=MessageObject)
    async def create_message(body: MessagesRequest, request: Request):
        chat = chat_request(chat_fields(body), "messages")
        mid = f"msg_{uuid.uuid4().hex}"
        started = await path.open(chat, request, mid, RENAME, body.stream)
        if started is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        blocks = Blocks()

        if not body.stream:
            turn = await path.turn(chat, request, started)
            if turn is None:
                return Response(status_code=499)
            for ev in turn.events():
                blocks.feed(ev)
            blocks.close()
            reason, matched = await stop_reason(turn, body)
            return MessageObject(id=mid, model=path.engine.model_name, content=blocks.blocks, stop_reason=reason,
                                 stop_sequence=matched, usage=message_usage(turn.out))

        async def events():
            # sent before the prefill: what the prompt cache saves is known at the end (message_delta's usage)
            start = MessageObject(id=mid, model=path.engine.model_name, content=[], stop_reason=None,
                                  stop_sequence=None, usage=MessageUsage(input_tokens=started.prompt_tokens,
                                                                         output_tokens=0, cache_read_input_tokens=0))
            yield _sse("message_start", {"message": start.model_dump()})
            yield _sse("ping", {})
            async for ev in path.events(chat, started):
                if ev[0] == "error":
                    yield _sse("error", {"error": {"type": "api_error", "message": ev[1].message}})
                    return
                if ev[0] == "done":
                    for chunk in blocks.close():
                        yield chunk
                    reason, matched = await stop_reason(ev[1], body)
                    yield _sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": matched},
                                                 "usage": message_usage(ev[1].out).model_dump()})
                    yield _sse("message_stop", {})
                    return
                for chunk in blocks.feed(ev):
                    yield chunk

        return streaming(events(), keepalive=_sse("ping", {}))  # Anthropic's own keep-alive event

    @app.post("/v1/messages/count_tokens", response_model=TokenCount)
    async def count_tokens(body: CountTokensRequest):
        _, prompt_ids = await path.prompt(chat_request(chat_fields(body), "messages"), RENAME)
        return TokenCount(input_tokens=len(prompt_ids))

    errors = (400, 401, 404, 413, 503)
    patch_openapi(app, {"/v1/messages": {"errors": errors, "error_model": AnthropicError, "sse": True},
                        "/v1/messages/count_tokens": {"errors": errors, "error_model": AnthropicError}})


# ---------------------------------------------------------------------------------------------- errors
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class AnthropicErrors:
    """Plain ASGI (streams pass untouched): on /v1/messages*, an error body in OpenAI's shape is rewritten in
    Anthropic's. The OpenAI error's field name stays in the message, which starts with it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/messages"):
            await self.app(scope, receive, send)
            return
        start, body = None, []

        async def reshaping_send(message):
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            new = _reshape(b"".join(body), start["status"])
            headers = [(k, v) for k, v in start["headers"] if k.lower() not in (b"content-length", b"content-type")]
            await send({**start, "headers": [*headers, (b"content-length", str(len(new)).encode()),
                                             (b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": new})

        await self.app(scope, receive, reshaping_send)


def _reshape(raw: bytes, status: int) -> bytes:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode("utf-8", "replace") or f"HTTP {status}"
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return AnthropicError(error=AnthropicErrorInfo(type=kind, message=message)).model_dump_json().encode()
