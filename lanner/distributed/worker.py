"""Tensor-parallel processes: rank 0 (the engine) drives ranks 1..N-1, which only run the model.

A generic transport: a worker runs a *service*, a module-level function its owner passes to TPGroup (e.g.
lanner.engine.llm_engine.paged_worker) that loads this rank's shard and returns named handlers. Rank 0's
`call(name, arg, payload, local)` broadcasts the name's code, an int argument and an int64 payload over the
control group, then runs its own part `local()`; every worker runs the handler of that name, so the model's
collectives line up. The transport knows no message but shutdown. Workers are spawned here
(torch.multiprocessing, rank 0 = the engine process; the service is pickled by reference) or started by torchrun
(`run_worker`, which the CLI calls on ranks > 0).

Failures: every collective carries tp_timeout_s. A worker that dies closes its sockets, so rank 0's next
collective fails at once; a worker that hangs makes it time out. Either way rank 0 raises TPError naming the
rank and the cause (exit signal or code, the worker's own error, or the timeout), kills the other workers and
stays failed. Workers exit when rank 0 goes away: their pending receive fails when its sockets close.
"""
from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import time
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from lanner.distributed import TPError, ctrl_group, destroy_tp, init_tp, tp_rank, tp_size
from lanner.plugins import register_plugin, registered_plugins

log = logging.getLogger("lanner")

OP_SHUTDOWN = 0  # the transport's own message; a service's calls are sent as op_code(name)
HEAD = 3  # op, argument, payload length
INLINE = 256  # payload ints that ride in the fixed-size first message; a longer payload follows in a second one


def op_code(name: str) -> int:
    """A call's wire code: stable across processes (unlike hash()), never OP_SHUTDOWN."""
    return zlib.crc32(name.encode()) + 1


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _recv() -> tuple[int, int, list[int]]:
    head = torch.empty(HEAD + INLINE, dtype=torch.int64)
    dist.broadcast(head, 0, group=ctrl_group())
    op, arg, n = head[:HEAD].tolist()
    payload = head[HEAD : HEAD + min(n, INLINE)].tolist()
    if n > INLINE:
        rest = torch.empty(n - INLINE, dtype=torch.int64)
        dist.broadcast(rest, 0, group=ctrl_group())
        payload += rest.tolist()
    return op, arg, payload


# ------------------------------------------------------------------ rank 0

class TPGroup:
    """Rank 0's side: starts the workers (or joins torchrun's ranks), sends them each step, turns any failure
    into TPError and shuts them down (`close`, also run at interpreter exit by the engine's finalizer)."""

    def __init__(self, config, service: Callable):
        """service(config, device) -> {name: handler(arg, payload)} runs on every worker (a module-level function:
        it is pickled by reference)."""
        self.size, self.timeout_s = config.tp, float(config.tp_timeout_s)
        self.procs, self.pipes = [], []  # spawned workers (none under torchrun) and their error pipes
        self.failed: TPError | None = None
        self.closed = False
        self.steps, self.send_s = 0, 0.0  # per-step messaging cost, for benchmarks
        backend = backend_for(config.device)
        env_size = int(os.environ.get("WORLD_SIZE", "1"))
        if env_size > 1:  # torchrun: the other ranks run run_worker
            if env_size != self.size or int(os.environ.get("RANK", "0")) != 0:
                raise TPError(f"under torchrun the engine runs on rank 0 with tp equal to WORLD_SIZE ({env_size}); "
                              f"this is rank {os.environ.get('RANK')} with tp={self.size}")
            init_tp(0, self.size, "env://", backend, self.timeout_s)
            return
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = torch.multiprocessing.get_context("spawn")
        # each worker computes with as many threads as rank 0 does
        threads, plugins = torch.get_num_threads(), registered_plugins()
        try:
            for rank in range(1, self.size):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker_main, name=f"lanner-tp{rank}", daemon=True,
                                args=(rank, self.size, init_method, config, service, threads, plugins, writer))
                p.start()
                writer.close()
                self.procs.append(p)
                self.pipes.append(reader)
            init_tp(0, self.size, init_method, backend, self.timeout_s)
        except BaseException as e:
            self.failed = self._diagnose(e)
            self.close()
            raise self.failed from e

    # -------------------------------------------------------------- messages
    def _send(self, op: int, arg: int = 0, payload: list[int] = ()):
        n = len(payload)
        head = [op, arg, n] + list(payload[:INLINE])
        msgs = [torch.tensor(head + [0] * (HEAD + INLINE - len(head)), dtype=torch.int64)]
        if n > INLINE:
            msgs.append(torch.tensor(payload[INLINE:], dtype=torch.int64))
        for t in msgs:  # async + bounded wait: a receiver that is not there must not hang rank 0
            dist.broadcast(t, 0, group=ctrl_group(), async_op=True).wait(datetime.timedelta(seconds=self.timeout_s))

    def call(self, name: str, arg: int, payload: list[int], local):
        """Has every worker run its handler `name`(arg, payload), then runs rank 0's part `local()` and returns its
        result. Any failure is fatal: the ranks are out of step."""
        if self.failed is not None:
            raise TPError(str(self.failed))
        try:
            self._check_workers()
            t0 = time.perf_counter()
            self._send(op_code(name), arg, payload)
            self.send_s += time.perf_counter() - t0
            self.steps += 1
            return local()
        except BaseException as e:
            err = self.fail(e)
            if isinstance(e, KeyboardInterrupt):  # still an interrupt to the caller (the group is gone now)
                raise
            raise err from e

    # -------------------------------------------------------------- failures
    def fail(self, exc: BaseException) -> TPError:
        """Records the failure (the first one wins), kills the workers, returns the TPError to raise."""
        if self.failed is None:
            self.failed = exc if isinstance(exc, TPError) else self._diagnose(exc)
            log.error("%s", self.failed)
            self.close()
        return self.failed

    def _check_workers(self):
        for rank, p in enumerate(self.procs, 1):
            if not p.is_alive():
                raise TPError(self._exit_message(rank))

    def _exit_message(self, rank: int) -> str:
        code = self.procs[rank - 1].exitcode
        why = f"{signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        msg = f"tensor-parallel rank {rank} exited ({why})"
        pipe = self.pipes[rank - 1]
        try:
            if pipe.poll():
                msg += f": {pipe.recv()}"
        except (EOFError, OSError):
            pass
        return msg

    def explain(self, exc: BaseException) -> TPError | None:
        """The TPError behind a failed collective (a worker exited, or a rank did not answer in time), or None
        when exc is not a communication failure (rank 0's own error, e.g. a bad option)."""
        if isinstance(exc, TPError):
            return exc
        if not isinstance(exc, RuntimeError):  # collectives raise RuntimeError (DistBackendError)
            return None
        text = f"{type(exc).__name__}: {exc}"
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        # a killed peer's sockets close before its exit status is visible: give it a moment to be reaped
        deadline = time.monotonic() + (0.2 if timed_out else 2.0)
        while self.procs:
            dead = [r for r, p in enumerate(self.procs, 1) if not p.is_alive()]
            if dead:
                return TPError(self._exit_message(dead[0]))
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if timed_out:
            stopped = [r for r, p in enumerate(self.procs, 1) if _proc_state(p.pid) == "T"]
            who = f"rank {stopped[0]}" if stopped else "rank 1" if self.size == 2 else "a rank"
            return TPError(f"tensor-parallel {who} did not answer within {self.timeout_s:g} s"
                           + (" (its process is stopped)" if stopped else "") + f" [{text[:200]}]")
        if "closed" in text.lower() or "reset" in text.lower():  # torchrun: no process handles to name the rank
            return TPError(f"a tensor-parallel rank went away: {text[:300]}")
        return None

    def _diagnose(self, exc: BaseException) -> TPError:
        return self.explain(exc) or TPError(f"tensor-parallel step failed on rank 0, the ranks are out of step: "
                                            f"{type(exc).__name__}: {exc}".rstrip(": "))

    # -------------------------------------------------------------- shutdown
    def close(self):
        """Stops the workers (politely when the group is healthy, else by SIGKILL) and leaves the group."""
        if self.closed:
            return
        self.closed = True
        if self.failed is None and dist.is_initialized():
            try:
                self._send(OP_SHUTDOWN)
            except Exception:  # a worker is already gone: it is killed below
                pass
        deadline = time.monotonic() + (5.0 if self.failed is None else 0.0)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()  # also ends a stopped (SIGSTOP) process
                p.join(5)
        for pipe in self.pipes:
            pipe.close()
        destroy_tp()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


# ------------------------------------------------------------------ ranks > 0

def _worker_main(rank, size, init_method, config, service, threads, plugins, pipe):
    """Entry point of a spawned worker: its error, if any, goes to rank 0 through `pipe` before it exits."""
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s lanner-tp{rank}: %(message)s")
    try:
        run_worker(config, service, rank, size, init_method, plugins)
    except BaseException as e:  # rank 0 reports it (it learns of the exit from its next collective)
        try:
            pipe.send(f"{type(e).__name__}: {e}")
        except OSError:
            pass
        os._exit(1)


def run_worker(config, service: Callable, rank: int | None = None, size: int | None = None,
               init_method: str = "env://", plugins: dict | None = None):
    """Serves rank 0's calls with `service`'s handlers until rank 0 shuts the group down. Without a rank it takes
    it from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK)."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    size = int(os.environ["WORLD_SIZE"]) if size is None else size
    for name, cls in (plugins or {}).items():
        register_plugin(name, cls)
    device = "cpu"
    if config.device.startswith("cuda"):
        device = f"cuda:{os.environ.get('LOCAL_RANK', rank)}"
        torch.cuda.set_device(device)
    init_tp(rank, size, init_method, backend_for(config.device), config.tp_timeout_s)
    try:
        torch.manual_seed(config.seed)
        handlers = service(config, device)
        if handlers is None:  # the service could not start (rank 0 raises the error that names why)
            return
        by_code = {op_code(name): fn for name, fn in handlers.items()}
        while True:
            op, arg, payload = _recv()
            if op == OP_SHUTDOWN:
                return
            if op not in by_code:
                raise TPError(f"tensor-parallel rank {tp_rank()}/{tp_size()}: unknown message {op}")
            by_code[op](arg, payload)
    finally:
        destroy_tp()
