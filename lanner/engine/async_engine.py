"""Asyncio front end of the synchronous engine.

One daemon thread owns the LLMEngine (which is not thread-safe): it drains an inbox of add/abort commands,
steps while there is work and sleeps on a condition variable when idle. Other threads only touch the inbox and
make requests (LLMEngine.make_request: validation, tokenization, grammar compilation, safe beside the loop);
outputs go back to each request's asyncio.Queue through its event loop's call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator

from lanner.distributed import TPError
from lanner.engine.llm_engine import LLMEngine, RequestError
from lanner.engine.request import RequestOutput
from lanner.engine.sampling import SamplingParams
from lanner.engine.scheduler import QueueFullError

log = logging.getLogger("lanner")


# the engine thread's note that a request passed the queue: a stream may start before its first token
ADMITTED = object()


class EngineOverloadedError(RequestError):
    """The engine's waiting queue is full; the client should retry later (the server answers 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or its thread died)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cv = threading.Condition()
        # ("add", Request, loop, queue) | ("abort", request_id) | ("abort_all",)
        self._inbox: deque[tuple] = deque()
        self._stop = False
        self._refusing = False  # set by abort_all(refuse_new=True)
        # request_id -> (loop, queue); touched only by the loop thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="lanner-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API (any thread)
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def metrics(self):
        return self.engine.metrics

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def close_engine(self):
        """Stops the engine's tensor-parallel workers (after the loop has stopped)."""
        self.engine.close()

    @property
    def is_healthy(self) -> bool:
        return self.error is None

    @property
    def error(self) -> str | None:
        """Why the engine cannot take requests (a failed tensor-parallel rank, a stopped loop), or None."""
        if self.engine.failed is not None:
            return str(self.engine.failed)
        if not self._thread.is_alive() or self._stop:
            return "the engine loop is not running"
        return None

    async def generate(self, prompt: str | None, params: SamplingParams | None = None,
                       prompt_ids: list[int] | None = None,
                       request_id: str | None = None, admitted: bool = False) -> AsyncIterator[RequestOutput | None]:
        """Yields one RequestOutput per engine step that advanced the request; the last has finished=True.
        Raises RequestError (validation, or EngineOverloadedError when the queue is full) at the first
        iteration. admitted: first yield None as soon as the engine has queued the request, so a server can
        answer a stream's headers while a long prompt waits or prefills. Leaving early aborts the request: at
        once on cancellation or aclose(); after a bare `break`, only when the event loop finalizes the abandoned
        generator, so call aclose() there."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        # validation and tokenization happen here, before anything is queued, on a worker thread: a long prompt
        # must not stall the event loop (the fast tokenizer releases the GIL); a uuid id cannot collide
        req = await asyncio.to_thread(self.engine.make_request, prompt, params,
                                      request_id or f"req-{uuid.uuid4().hex}", prompt_ids)
        queue: asyncio.Queue = asyncio.Queue()
        if self._refusing:
            raise EngineDeadError("the server is shutting down")
        if not self._send(("add", req, asyncio.get_running_loop(), queue)):
            raise EngineDeadError("the engine loop is not running")
        done = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True  # the engine thread already dropped this request
                    raise item
                if item is ADMITTED:
                    if admitted:
                        yield None
                    continue
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(req.request_id)

    def abort(self, request_id: str):
        """Aborts on the engine thread (which frees its KV blocks); a no-op for unknown or finished ids."""
        self._send(("abort", request_id))

    def abort_all(self, refuse_new: bool = False):
        """Aborts every request in flight; each stream gets its final output (finish_reason "abort").
        refuse_new: requests submitted from now on fail with EngineDeadError (a server shutting down)."""
        self._refusing = self._refusing or refuse_new
        self._send(("abort_all",))

    def shutdown(self, timeout: float = 10.0):
        with self._cv:
            self._stop = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop thread
    def _send(self, cmd: tuple) -> bool:
        with self._cv:
            if self._stop:  # the loop will not read the inbox again
                return False
            self._inbox.append(cmd)
            self._cv.notify()
            return True

    def _run(self):
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._stop or self.engine.has_unfinished()):
                        self._cv.wait()
                    if self._stop:
                        return
                    cmds = list(self._inbox)
                    self._inbox.clear()
                for cmd in cmds:
                    self._guarded(self._handle, cmd)
                if self.engine.has_unfinished():
                    self._guarded(self._step)
        finally:
            with self._cv:
                self._stop = True
                cmds = list(self._inbox)
                self._inbox.clear()
            dead = EngineDeadError("the engine loop stopped")
            for cmd in cmds:  # requests that never reached the engine
                if cmd[0] == "add":
                    self._put(cmd[2], cmd[3], dead)
            for loop, queue in self._streams.values():
                self._put(loop, queue, dead)
            self._streams.clear()

    def _guarded(self, fn, *args):
        # LLMEngine.step already turns model errors into finish_reason="error"; anything escaping it (or
        # add/abort) is a bug: fail the affected requests instead of the whole loop
        try:
            fn(*args)
        except Exception as e:
            log.exception("engine loop: %s failed", fn.__name__)
            self._fail_all(f"internal error: {type(e).__name__}: {e}")

    def _handle(self, cmd: tuple):
        if cmd[0] == "add":
            _, req, loop, queue = cmd
            self._streams[req.request_id] = (loop, queue)  # first, so that _fail_all reaches it too
            try:
                self.engine.enqueue(req)
            except RequestError as e:
                del self._streams[req.request_id]
                if isinstance(e.__cause__, QueueFullError):
                    e = EngineOverloadedError(str(e), e.param)
                self._put(loop, queue, e)
                return
            self._put(loop, queue, ADMITTED)
        else:
            for rid in list(self._streams) if cmd[0] == "abort_all" else [cmd[1]]:
                out = self.engine.abort(rid)
                if out is not None:
                    self._deliver(out)
                self._streams.pop(rid, None)

    def _step(self):
        try:
            outputs = self.engine.step()
        except TPError as e:  # the engine failed every request and refuses new ones: end the streams with why
            self._fail_all(str(e))
            return
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput):
        stream = self._streams.get(out.request_id)
        if out.finished:
            self._streams.pop(out.request_id, None)
        if stream is not None and not self._put(*stream, out) and not out.finished:
            self.engine.abort(out.request_id)  # its event loop is gone: nobody will read it

    @staticmethod
    def _put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> bool:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
            return True
        except RuntimeError:  # the loop is closed
            return False

    def _fail_all(self, message: str):
        """After an unexpected exception: drop every request from the engine so the loop cannot spin on the
        same failure, and end each stream with an error output."""
        for rid in list(self.engine.requests):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("engine loop: abort of %s failed", rid)
                self.engine.requests.pop(rid, None)
        if self.engine.has_unfinished():  # an abort failed too: drop what is left rather than spin on it
            self.engine.drop_all()
        for rid, (loop, queue) in list(self._streams.items()):
            self._put(loop, queue, _error_output(rid, message))
        self._streams.clear()


def _error_output(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], text="", token_ids=[],
                         finished=True, finish_reason="error", logprobs=None, metrics={}, error=message)

