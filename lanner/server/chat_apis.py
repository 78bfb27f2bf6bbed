"""The one path the chat-shaped APIs share: /v1/chat/completions, the OpenAI Responses API (responses.py) and the
Anthropic Messages API (messages.py).

The newer APIs convert their bodies to a ChatCompletionRequest and run it through the chat route's own
preparation (chat template, tool / format grammar, sampling checks), submission and tool-call parsing. This
module is the only place they touch that machinery: the parsed answer comes back as a `Turn`, a stream as
neutral events, so a change in how tool calls are parsed reaches all three APIs at once.
"""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from lanner.engine.request import RequestOutput
from lanner.server import tool_wire
from lanner.server.http import APIError
from lanner.server.protocol import ChatCompletionRequest


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # a JSON object as text


@dataclass
class Turn:
    """A finished chat request: the text outside tool calls, the calls, and the chat API's finish reason
    ("stop", "length", "tool_calls", "abort")."""
    content: str
    calls: list[Call]
    reason: str | None
    out: RequestOutput

    def events(self) -> list[tuple]:
        """The whole answer as the events its stream would have given (see ChatPath.events)."""
        events = [("text", self.content)] if self.content else []
        for i, call in enumerate(self.calls):
            events += [("call", i, call.id, call.name), ("args", i, call.arguments)]
        return events


@dataclass
class Usage:
    input: int
    output: int
    cached: int


def usage(out: RequestOutput) -> Usage:
    return Usage(len(out.prompt_token_ids), len(out.token_ids), out.metrics.get("cached_prompt_tokens", 0))


# Stream events: ("text", delta) | ("call", index, id, name) | ("args", index, delta) | ("done", Turn)
# | ("error", APIError). A call's arguments may come in one delta or several.
Event = tuple


def renamer(rules: list[tuple[str, str]]) -> Callable[[str], str]:
    """Chat field names -> this API's (regex, replacement) applied to the start of the name."""
    def rename(param: str) -> str:
        for pattern, repl in rules:
            new = re.sub(f"^{pattern}", repl, param)
            if new != param:
                return new
        return param
    return rename


@dataclass
class Started:
    """A submitted request: the engine's stream, its first output and the tool / format constraint (which names
    the model family's call format for the parser)."""
    stream: Any
    first: Any  # None for a stream: it starts when the engine has queued the request
    structured: Any
    prompt_tokens: int


@dataclass
class ChatPath:
    engine: Any  # AsyncEngine
    prepare: Callable  # async ChatCompletionRequest -> (SamplingParams, prompt ids); raises APIError
    start: Callable  # async (request, params, prompt, prompt_ids, request_id, prompt_param) -> (stream, first) | None
    finish: Callable  # async (request, first, stream) -> RequestOutput | None
    outputs: Callable  # (first, stream) -> async iterator of RequestOutput
    engine_error: Callable  # RequestOutput -> APIError

    async def prompt(self, body: ChatCompletionRequest, rename: Callable[[str], str]):
        """-> (params, prompt ids), with 400s naming this API's fields."""
        try:
            return await self.prepare(body)
        except APIError as e:
            raise _renamed(e, rename) from None

    async def open(self, body: ChatCompletionRequest, request: Request, rid: str,
                   rename: Callable[[str], str], stream: bool) -> Started | None:
        """Prepares and submits; None if the client left meanwhile. A stream starts as soon as the engine has
        queued the request (Started.first is None). A max_tokens past the context is cut to what fits: it is an
        upper bound, and agents send their own model's (Claude Code: 32000)."""
        params, prompt_ids = await self.prompt(body, rename)
        room = self.engine.max_model_len - len(prompt_ids)
        if params.max_tokens is not None and room > 0:
            params.max_tokens = min(params.max_tokens, room)
        try:
            started = await self.start(request, params, None, prompt_ids, rid, "messages", admitted=stream)
        except APIError as e:
            raise _renamed(e, rename) from None
        return None if started is None else Started(*started, params.structured, len(prompt_ids))

    async def turn(self, body: ChatCompletionRequest, request: Request, started: Started) -> Turn | None:
        """The whole answer of a non-streaming request, parsed as the chat route parses it; None if the client
        left."""
        out = await self.finish(request, started.first, started.stream)
        if out is None:
            return None
        msg, reason = tool_wire.message(body, out, started.structured)
        return Turn(msg.get("content") or "", [_call(c) for c in msg.get("tool_calls") or []], reason, out)

    async def events(self, body: ChatCompletionRequest, started: Started) -> AsyncIterator[Event]:
        """The streamed answer as neutral events, parsed as the chat route's stream is."""
        calls = tool_wire.StreamedCalls(started.structured, body) if tool_wire.calls_tools(body) else None
        content, made = [], {}
        async for out in self.outputs(started.first, started.stream):
            if out.finish_reason == "error":
                yield ("error", self.engine_error(out))
                return
            text, deltas = out.delta_text, []
            if calls is not None:
                text, deltas = calls.feed(text, out.finished)
            if text:
                content.append(text)
                yield ("text", text)
            for delta in deltas:
                for d in delta:
                    d = d.model_dump() if hasattr(d, "model_dump") else d
                    fn = d.get("function") or {}
                    if d.get("id"):
                        made[d["index"]] = Call(d["id"], fn.get("name") or "", "")
                        yield ("call", d["index"], d["id"], made[d["index"]].name)
                    if fn.get("arguments"):
                        made[d["index"]].arguments += fn["arguments"]
                        yield ("args", d["index"], fn["arguments"])
            if out.finished:
                reason = out.finish_reason if calls is None else calls.finish_reason(out.finish_reason)
                yield ("done", Turn("".join(content), [made[i] for i in sorted(made)], reason, out))

    async def stop_sequence(self, out: RequestOutput, stops: list[str] | None) -> str | None:
        """The stop string that ended `out`, if one did. The engine cuts it from the text; the tokens still hold
        it."""
        if not stops or out.finish_reason != "stop":
            return None
        full = await asyncio.to_thread(self.engine.tokenizer.decode, out.token_ids)
        tail = full[max(0, len(out.text) - 1):]
        return next((s for s in stops if s in tail), None)


def _call(c) -> Call:
    c = c.model_dump() if hasattr(c, "model_dump") else c
    return Call(c["id"], c["function"]["name"], c["function"]["arguments"])


def _renamed(e: APIError, rename: Callable[[str], str]) -> APIError:
    if e.param is None:
        return e
    new = rename(e.param)
    message = new + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return APIError(e.status, message, new, e.type, e.code)


def arguments_object(arguments: str) -> dict:
    """A call's arguments text -> the object Anthropic's tool_use.input carries ({} if the model wrote none)."""
    try:
        obj = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return obj if isinstance(obj, dict) else {}


def parse_as(model, obj, loc: tuple):
    """Validates one item of a loosely typed list (Responses items, Messages content blocks) as `model`; a 400
    names the field under `loc`, e.g. input[3].call_id."""
    from pydantic import ValidationError

    from lanner.server.http import validation_message

    try:
        return model.model_validate(obj)
    except ValidationError as e:
        message, param = validation_message([{**err, "loc": (*loc, *err["loc"])} for err in e.errors()])
        raise APIError(400, message, param) from None


def chat_request(fields: dict, where: str) -> ChatCompletionRequest:
    """Builds the internal chat request. Our own conversion made `fields`, so a failure here is a value the
    API's own model let through; it is reported against the API's field name `where`."""
    from pydantic import ValidationError

    from lanner.server.http import validation_message

    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise APIError(400, f"{where}: {message}", where) from None




def patch_openapi(app, routes: dict[str, dict]):
    """Adds to the app's OpenAPI spec, per path: error statuses with their body schema, and SSE as a second 200
    content type. routes: path -> {"errors": (400, ...), "error_model": a pydantic model, "sse": bool}."""
    base = app.openapi

    def openapi():
        spec = base()
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for path, how in routes.items():
            model = how["error_model"]
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}), **{model.__name__: schema})
            content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
            for op in spec["paths"].get(path, {}).values():
                for status in how["errors"]:
                    op["responses"][str(status)] = {"description": _DESCRIPTIONS[status], "content": content}
                if 503 in how["errors"]:
                    op["responses"]["503"]["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                                                         "description": "seconds"}}
                if how.get("sse"):
                    op["responses"]["200"]["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
        return spec

    app.openapi = openapi


_DESCRIPTIONS = {400: "Invalid request: the error names the field", 401: "Missing or wrong API key",
                 404: "Unknown model or response id", 413: "Request body too large",
                 503: "Queue full, engine down or shutting down"}
_SSE_EVENT = {"type": "object", "required": ["data"], "description": "with `stream: true`: one typed event each",
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
