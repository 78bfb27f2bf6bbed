"""The server's HTTP plumbing: OpenAI-style errors, API-key checking, the OpenAPI spec, graceful shutdown."""
from __future__ import annotations

import asyncio
import logging
import re
import secrets

import uvicorn
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from lanner.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("lanner.server")

RETRY_AFTER_S = 1  # sent with every 503: the queue drains in about a request's time
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union-member loc entries


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code


def error_json(status: int, message: str, param=None, type="invalid_request_error", code=None,
               headers: dict | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    headers = dict(headers or {})
    if status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def param_from_loc(loc) -> str | None:
    """("body", "messages", 0, "content", "list[TextPart]", 0, "text") -> "messages[0].content[0].text"."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors -> (message, param) for one failing field. A union field fails once per member
    ("a valid string", "a valid list"); when a member had the right type and failed on its value, that
    complaint is the one reported."""
    valued = [e for e in errors if not e.get("type", "").endswith("_type")]
    param = param_from_loc((valued or errors)[0].get("loc", ()))
    mine = [e for e in valued or errors if param_from_loc(e.get("loc", ())) == param]
    msgs = dict.fromkeys(e.get("msg", "").removeprefix("Value error, ") for e in mine)
    return f"{param or 'body'}: {'; or '.join(msgs)}", param


class ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which interferes with streaming and disconnect detection); runs
    before body parsing, so an unauthenticated request never reaches validation. The key comes as
    `Authorization: Bearer KEY` (the scheme matched case-insensitively, RFC 9110) or `x-api-key: KEY`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            got = headers.get(b"authorization", b"")
            scheme, _, key = got.strip().partition(b" ")
            ok = scheme.lower() == b"bearer" and secrets.compare_digest(key.strip(), self.expected)
            if not ok and b"x-api-key" in headers:  # Anthropic's clients send the key this way
                got = headers[b"x-api-key"]
                ok = secrets.compare_digest(got.strip(), self.expected)
            if not ok:
                msg = "missing API key" if not got else "incorrect API key"
                await error_json(401, msg, code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes: at once when Content-Length says so, else as soon as the chunks
    read pass it (the HTTPException reaches the app's handler, which writes the OpenAI-style body)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def _too_large(self) -> HTTPException:
        return HTTPException(413, f"request body too large: the limit is {self.limit} bytes (--max-body-size)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            e = self._too_large()
            await error_json(413, e.detail)(scope, receive, send)
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)


# ---------------------------------------------------------------------------------------------- OpenAPI
_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
_ERRORS = {400: "Invalid request: the error's `param` names the field",
           401: "Missing or wrong API key (only with --api-key)",
           404: "Unknown model (code `model_not_found`)",
           413: "Request body larger than --max-body-size",
           503: "Queue full (code `engine_overloaded`), engine down or shutting down; carries Retry-After"}


# OpenAPI 3.1 reads a text/event-stream schema as the schema of each event
_SSE_EVENT = {"type": "object", "required": ["data"], "description": "with `stream: true`: one event per chunk",
              "properties": {"data": {"type": "string", "description": "a JSON chunk; the last event is [DONE]"},
                             "event": {"type": "string"}}}


def install_openapi(app: FastAPI, error_routes: dict[str, tuple[int, ...]]):
    """Makes /openapi.json say what the server does: 400 (never 422) for invalid bodies, the other error
    statuses each route can answer with their OpenAI-style body, and SSE as a second 200 content type for
    the streaming routes."""

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        err = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(err.pop("$defs", {}), ErrorResponse=err)
        for path, methods in spec["paths"].items():
            for op in methods.values():
                op["responses"].pop("422", None)
                for status in error_routes.get(path, ()):
                    op["responses"][str(status)] = {"description": _ERRORS[status], "content": _ERROR_CONTENT}
                if 503 in error_routes.get(path, ()):
                    op["responses"]["503"]["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                                                         "description": "seconds"}}
                if path in ("/v1/chat/completions", "/v1/completions"):
                    op["responses"]["200"]["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
        app.openapi_schema = spec
        return spec

    app.openapi = openapi


# ---------------------------------------------------------------------------------------------- shutdown
class GracefulServer(uvicorn.Server):
    """On SIGTERM / SIGINT uvicorn stops accepting connections and waits for the open ones. This bounds that
    wait: after `grace_s` every request still in flight is aborted, so each stream ends cleanly (a finish
    chunk with finish_reason "abort", the usage chunk, [DONE]) and the process exits."""

    def __init__(self, config: uvicorn.Config, engine, grace_s: float):
        # uvicorn's own timeout is the backstop should a response not end after the abort
        config.timeout_graceful_shutdown = grace_s + 5
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    async def shutdown(self, sockets=None):
        log.info("shutting down: in-flight requests have %.1f s to finish", self.grace_s)
        timer = asyncio.get_running_loop().call_later(self.grace_s, self._abort_rest)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort_rest(self):
        log.warning("shutdown grace period over: aborting the requests still running")
        self.engine.abort_all(refuse_new=True)


KEEPALIVE_S = 10.0


def streaming(events, keepalive: str = ": keep-alive\n\n", keepalive_s: float | None = None) -> StreamingResponse:
    """An SSE response. Starlette cancels the body iterator when the client disconnects; the cancellation reaches
    AsyncEngine.generate, whose cleanup aborts the request and frees its KV blocks. While `events` is silent (a
    long prompt prefilling, a request waiting its turn), `keepalive` goes out every keepalive_s seconds (an SSE
    comment, which clients skip, or an API's own ping event): agents' HTTP stacks give up on a silent stream
    (Claude Code did after minutes of prefill)."""
    return StreamingResponse(_with_keepalive(events, keepalive, KEEPALIVE_S if keepalive_s is None else keepalive_s),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _with_keepalive(events, keepalive: str, every: float):
    it = events.__aiter__()
    nxt = None
    try:
        while True:
            nxt = nxt or asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({nxt}, timeout=every)  # the pending __anext__ survives the timeout
            if not done:
                yield keepalive
                continue
            try:
                chunk = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield chunk
    finally:
        if nxt is not None and not nxt.done():  # the client left mid-wait: cancel into the generator (aborts)
            nxt.cancel()
            try:
                await nxt
            except (asyncio.CancelledError, StopAsyncIteration):
                pass
        await it.aclose()
