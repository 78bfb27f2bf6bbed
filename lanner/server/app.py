"""OpenAI-compatible HTTP server over an AsyncEngine.

Status codes: 400 for requests the engine refuses (the body's `param` names the field), 401 for a missing or
wrong API key (/v1 routes only), 404 for an unknown model (code "model_not_found"), 413 for a body over the
size limit, 500 when a request fails inside the engine, 503 (with Retry-After) when the waiting queue is full
(type "server_error", code "engine_overloaded": the official clients retry it), the engine loop is down or the
server is shutting down. Streams always end with a usage chunk (empty `choices`) and `data: [DONE]`.
Tokenizing and detokenizing never run on the event loop (worker threads and the engine thread do them).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from lanner.config import EngineConfig
from lanner.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
)
from lanner.engine.llm_engine import LLMEngine, RequestError
from lanner.engine.request import RequestOutput
from lanner.engine.sampling import SamplingParams
from lanner.server import chat_apis, messages, responses, tool_wire
from lanner.server import DEFAULT_MAX_BODY_BYTES, DEFAULT_SHUTDOWN_GRACE_S
from lanner.server.http import (
    RETRY_AFTER_S,
    APIError,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    GracefulServer,
    error_json,
    install_openapi,
    streaming,
    validation_message,
)
from lanner.server.protocol import (
    LEGACY_MAX_TOKENS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)

log = logging.getLogger("lanner.server")

_DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming handler checks whether its client left


class _TokenText:
    """Token id -> (text, exact bytes) for logprobs. Byte-level BPE pieces map back to their exact bytes,
    so a token holding half a UTF-8 character still reports the right bytes."""

    def __init__(self, tokenizer):
        self.hf = tokenizer.hf
        self.byte_level = type(self.hf.backend_tokenizer.decoder).__name__ == "ByteLevel"
        if self.byte_level:
            self.byte_decoder = _byte_decoder()
        self.get = functools.lru_cache(maxsize=1 << 16)(self._get)

    def _get(self, token_id: int) -> tuple[str, list[int]]:
        if self.byte_level:
            piece = self.hf.convert_ids_to_tokens(token_id)
            if all(c in self.byte_decoder for c in piece):
                raw = bytes(self.byte_decoder[c] for c in piece)
                return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.hf.decode([token_id])
        return text, list(text.encode())


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b], n = chr(256 + n), n + 1
    return {c: b for b, c in chars.items()}


def _lp(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -inf; OpenAI reports -9999.0 for impossible tokens


def _usage(out: RequestOutput) -> Usage:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    m = out.metrics
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=m.get("cached_prompt_tokens", 0)),
                 spec_accept_length=m.get("spec_accept_length"),
                 spec_accepted_per_position=m.get("spec_accepted_per_position") if m.get("spec_verify_steps") else None,
                 spec_draft_tokens=m.get("spec_draft_tokens") or None,
                 spec_accepted_tokens=m.get("spec_accepted_tokens") if m.get("spec_draft_tokens") else None)


def _sse(obj) -> str:
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


async def _until_disconnect(awaitable, request: Request):
    """Awaits `awaitable` in a task, cancelling it if the client disconnects meanwhile. Cancelling a task that
    iterates AsyncEngine.generate aborts the request on the engine thread. Returns (done, result)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return True, task.result()
            if await request.is_disconnected():
                return False, None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async for out in stream:
        pass
    return out


def build_app(engine: AsyncEngine, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="lanner", docs_url="/docs", redoc_url=None)
    app.state.engine = engine
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    tokens = _TokenText(engine.tokenizer)
    auth = (401,) if api_key else ()
    generate_errors = (400, *auth, 404, 413, 503)
    install_openapi(app, {"/v1/chat/completions": generate_errors, "/v1/completions": generate_errors,
                          "/v1/models": auth, "/health": (503,)})

    # ------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_json(e.status, e.message, e.param, e.type, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        errors = e.errors()
        if errors[0].get("type") == "json_invalid":
            return error_json(400, f"malformed JSON body: {errors[0].get('msg')}")
        return error_json(400, *validation_message(errors))

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        # e.headers: Allow on a 405
        return error_json(e.status_code, str(e.detail), type="invalid_request_error" if e.status_code < 500
                          else "server_error", headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(_, e: Exception):
        log.exception("unhandled error")
        return error_json(500, f"internal error: {type(e).__name__}: {e}", type="server_error")

    # ------------------------------------------------------------------ shared request handling
    def check_common(body):
        if body.model and body.model != engine.model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves "
                                f"{engine.model_name!r}", "model", code="model_not_found")
        if (field := body.unsupported_field()) is not None:
            raise APIError(400, f"{field}: not supported by this server", field, code="unsupported_parameter")

    def sampling_params(body, max_tokens, max_tokens_field: str, logprobs, logprobs_field: str):
        kw = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                     "frequency_penalty", "repetition_penalty", "seed")
              if getattr(body, name) is not None}
        if body.logit_bias:
            kw["logit_bias"] = {int(t): b for t, b in body.logit_bias.items()}
        try:
            return SamplingParams(max_tokens=max_tokens, stop=body.stop, stop_token_ids=body.stop_token_ids or [],
                                  ignore_eos=body.ignore_eos, logprobs=logprobs,
                                  skip_special_tokens=body.skip_special_tokens,
                                  include_stop_str_in_output=body.include_stop_str_in_output, user=body.user,
                                  session=body.prompt_cache_key or body.user or body.safety_identifier, **kw)
        except ValueError as e:  # SamplingParams names the field first: "top_p: must be in (0, 1]"
            param = str(e).split(":", 1)[0]
            param = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}.get(param, param)
            raise APIError(400, str(e), param) from None

    async def start(request: Request, params, prompt, prompt_ids, request_id, prompt_param, admitted=False):
        """Submits and waits for the first output (admitted: only until the engine has queued the request; the
        first output is then None), so refusals become proper HTTP errors before any streaming starts, and a
        stream's headers need not wait for a long prefill. Returns (stream, first output), or None if the client
        left meanwhile."""
        if session := request.headers.get("x-session-id"):  # every route comes here, so the header works on all
            params.session = session
        stream = engine.generate(prompt, params, prompt_ids=prompt_ids, request_id=request_id, admitted=admitted)
        try:
            done, first = await _until_disconnect(stream.__anext__(), request)
        except EngineOverloadedError as e:
            raise APIError(503, str(e), type="server_error", code="engine_overloaded") from None
        except RequestError as e:
            param = prompt_param if e.param in ("prompt", "messages") else e.param
            raise APIError(400, str(e), param) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error") from None
        if not done:
            await stream.aclose()
            return None
        return stream, first

    async def outputs(first: RequestOutput | None, stream) -> AsyncIterator[RequestOutput]:
        try:
            if first is not None:
                yield first
            if first is None or not first.finished:
                async for out in stream:
                    yield out
        finally:
            await stream.aclose()  # aborts the request unless it finished

    def engine_error(out: RequestOutput) -> APIError:
        return APIError(500, out.error or "the request failed inside the engine", type="server_error",
                        code="internal_error")

    def sse_error(out: RequestOutput) -> str:
        e = engine_error(out)
        return _sse(ErrorResponse(error=ErrorInfo(message=e.message, type=e.type, code=e.code)))

    async def finish(request: Request, first: RequestOutput, stream) -> RequestOutput | None:
        """The final output of a non-streaming request; None if the client left; raises on an engine error."""
        if first.finished:
            out = first
        else:
            done, out = await _until_disconnect(_last(outputs(first, stream)), request)
            if not done:
                return None
        if out.finish_reason == "error":
            raise engine_error(out)
        return out

    # ------------------------------------------------------------------ logprobs formatting
    def chat_logprobs(lps: list[dict] | None) -> ChatLogprobs | None:
        if lps is None:
            return None
        content = []
        for lp in lps:
            text, raw = tokens.get(lp["token_id"])
            top = [TopLogprob(token=t, logprob=_lp(v), bytes=b) for t, b, v in
                   ((*tokens.get(tid), v) for tid, v in lp["top"])]
            content.append(TokenLogprob(token=text, logprob=_lp(lp["logprob"]), bytes=raw, top_logprobs=top))
        return ChatLogprobs(content=content)

    def completion_logprobs(lps: list[dict] | None, offset: int) -> CompletionLogprobs | None:
        if lps is None:
            return None
        res = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in lps:
            text = tokens.get(lp["token_id"])[0]
            res.tokens.append(text)
            res.token_logprobs.append(_lp(lp["logprob"]))
            res.top_logprobs.append({tokens.get(tid)[0]: _lp(v) for tid, v in lp["top"]})
            res.text_offset.append(offset)
            offset += len(text)
        return res

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        error = engine.error
        if error is None:
            return {"status": "ok"}
        return JSONResponse({"status": "unhealthy", "error": error}, status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}})
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.model_name, created=int(time.time()),
                                         max_model_len=engine.max_model_len)])

    async def prepare_chat(body: ChatCompletionRequest) -> tuple[SamplingParams, list[int]]:
        """A chat request -> (sampling params with its tool / format constraint, prompt ids). The Responses and
        Messages routes convert their bodies to a ChatCompletionRequest and come through here too."""
        check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", "top_logprobs")
        max_tokens, field = ((body.max_completion_tokens, "max_completion_tokens")
                             if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens"))
        params = sampling_params(body, max_tokens, field, (body.top_logprobs or 0) if body.logprobs else None,
                                 "top_logprobs")
        try:  # off the event loop: a long conversation takes a while to tokenize, a schema to compile
            prompt_ids, params.structured = await asyncio.to_thread(tool_wire.chat_prompt, engine.tokenizer, body)
        except tool_wire.FieldError as e:
            raise APIError(400, str(e), e.param) from None
        except Exception as e:  # noqa: BLE001 - no template, or the template itself rejects the conversation
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
        return params, prompt_ids

    path = chat_apis.ChatPath(engine, prepare_chat, start, finish, outputs, engine_error)
    responses.register(app, path)
    messages.register(app, path)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        params, prompt_ids = await prepare_chat(body)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        started = await start(request, params, None, prompt_ids, rid, "messages", admitted=bool(body.stream))
        if started is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        stream, first = started

        if not body.stream:
            out = await finish(request, first, stream)
            if out is None:
                return Response(status_code=499)  # the client is gone; nobody reads this
            msg, reason = tool_wire.message(body, out, params.structured)
            return ChatCompletionResponse(
                id=rid, created=created, model=engine.model_name, usage=_usage(out),
                choices=[ChatChoice(message=msg, logprobs=chat_logprobs(out.logprobs), finish_reason=reason)])

        def chunk(choices, usage=None) -> str:
            return _sse(ChatCompletionChunk(id=rid, created=created, model=engine.model_name, choices=choices,
                                            usage=usage))

        calls = tool_wire.StreamedCalls(params.structured, body) if tool_wire.calls_tools(body) else None

        async def events():
            yield chunk([ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))])
            async for out in outputs(first, stream):
                if out.finish_reason == "error":
                    yield sse_error(out)
                    break
                text, call_deltas = out.delta_text, []
                if calls is not None:
                    text, call_deltas = calls.feed(text, out.finished)
                if text or out.delta_logprobs:
                    yield chunk([ChatChunkChoice(delta=DeltaMessage(content=text),
                                                 logprobs=chat_logprobs(out.delta_logprobs))])
                for delta in call_deltas:
                    yield chunk([ChatChunkChoice(delta=DeltaMessage(tool_calls=delta))])
                if out.finished:
                    reason = out.finish_reason if calls is None else calls.finish_reason(out.finish_reason)
                    yield chunk([ChatChunkChoice(delta=DeltaMessage(), finish_reason=reason)])
                    yield chunk([], _usage(out))
            yield "data: [DONE]\n\n"

        return streaming(events())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_common(body)
        prompt, prompt_ids = body.prompt, None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "prompt: only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        elif isinstance(prompt, list):
            prompt, prompt_ids = None, prompt
        max_tokens = LEGACY_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens, "max_tokens", body.logprobs, "logprobs")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        started = await start(request, params, prompt, prompt_ids, rid, "prompt", admitted=bool(body.stream))
        if started is None:
            return Response(status_code=499)
        stream, first = started

        if not body.stream:
            out = await finish(request, first, stream)
            if out is None:
                return Response(status_code=499)  # the client is gone; nobody reads this
            return CompletionResponse(
                id=rid, created=created, model=engine.model_name, usage=_usage(out),
                choices=[CompletionChoice(text=out.text, logprobs=completion_logprobs(out.logprobs, 0),
                                          finish_reason=out.finish_reason)])

        def chunk(choices, usage=None) -> str:
            return _sse(CompletionResponse(id=rid, created=created, model=engine.model_name, choices=choices,
                                           usage=usage))

        async def events():
            offset = 0
            async for out in outputs(first, stream):
                if out.finish_reason == "error":
                    yield sse_error(out)
                    break
                if out.delta_text or out.delta_logprobs:
                    lps = completion_logprobs(out.delta_logprobs, offset)
                    yield chunk([CompletionChoice(text=out.delta_text, logprobs=lps)])
                    offset += len(out.delta_text)
                if out.finished:
                    yield chunk([CompletionChoice(text="", finish_reason=out.finish_reason)])
                    yield chunk([], _usage(out))
            yield "data: [DONE]\n\n"

        return streaming(events())

    return app


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               log_level: str = "info", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S):
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(LLMEngine(config))
    try:
        app = build_app(engine, api_key, max_body_bytes)
        GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level), engine,
                       shutdown_grace_s).run()
    finally:
        engine.shutdown()
        engine.close_engine()  # stops tensor-parallel workers
