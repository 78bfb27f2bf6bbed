"""Tensor-parallel state and collectives (torch.distributed: gloo on CPU, NCCL on CUDA).

One process per rank; every rank holds its shard of each parallel layer and runs the same forward. With no
process group (the default) every helper is the identity, so models are written once for TP=1 and TP=N.
Collectives carry the group's timeout: a rank that dies or hangs turns into an error, never a hang.
Rank 0 sends each step to the other ranks over a second, gloo "control" group whose receivers wait without a
practical time limit (an idle server sends nothing for hours); see lanner.distributed.worker.
"""
from __future__ import annotations

import contextlib
import datetime
import time

import torch
import torch.distributed as dist

_STATE = {"rank": 0, "size": 1, "group": None, "ctrl": None, "device": "cpu", "timeout_s": None, "backend": None}
# receivers of the control group wait this long for rank 0's next step; a dead rank 0 still ends the wait at
# once (its sockets close), so this only has to outlast an idle server
CTRL_TIMEOUT = datetime.timedelta(days=3650)


class TPError(RuntimeError):
    """A tensor-parallel rank failed, hung past the collective timeout, or disagreed with the others."""


def init_tp(rank: int, size: int, init_method: str, backend: str = "gloo", timeout_s: float = 60.0):
    if _STATE["group"] is not None or dist.is_initialized():
        raise TPError(f"a tensor-parallel group (size {_STATE['size']}) is already active in this process; "
                      "close its engine first")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    # gloo even next to NCCL: step descriptions are small CPU int tensors
    ctrl = dist.new_group(backend="gloo", timeout=CTRL_TIMEOUT)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    _STATE.update(rank=rank, size=size, group=dist.group.WORLD, ctrl=ctrl, device=device, timeout_s=timeout_s,
                  backend=backend)


def destroy_tp():
    if _STATE["group"] is not None:
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already died: nothing left to tear down cleanly
            pass
    _STATE.update(rank=0, size=1, group=None, ctrl=None, device="cpu", timeout_s=None, backend=None)


@contextlib.contextmanager
def tp_layout(rank: int, size: int):
    """Inside, modules are built as rank `rank` of a `size`-way split and no process group is visible. With
    size 1 (`tp_disabled`) collectives are identities, so rank-0-only modules (draft models and heads) are built
    and run whole, outside the group. With size > 1 it is for building shards only (memory reports on the meta
    device): running a forward inside would skip the sums."""
    saved = dict(_STATE)
    _STATE.update(rank=rank, size=size, group=None, ctrl=None)
    try:
        yield
    finally:
        _STATE.update(saved)


def tp_disabled():
    return tp_layout(0, 1)


def ctrl_group():
    return _STATE["ctrl"]


def tp_rank() -> int:
    return _STATE["rank"]


def tp_size() -> int:
    return _STATE["size"]


def tp_timeout_s() -> float | None:
    """The group's collective timeout (the engine's tp_timeout_s), None without a group."""
    return _STATE["timeout_s"]


def split_sizes(n: int, parts: int) -> list[int]:
    """n units over `parts` ranks as evenly as possible, the first ranks taking one more (9 heads / 2 -> 5, 4)."""
    return [n // parts + (r < n % parts) for r in range(parts)]


def shard_range(n: int, rank: int | None = None, parts: int | None = None) -> tuple[int, int]:
    rank = tp_rank() if rank is None else rank
    sizes = split_sizes(n, tp_size() if parts is None else parts)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _STATE["size"] > 1:
        dist.all_reduce(x, group=_STATE["group"])
    return x


def all_gather_last(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenates every rank's x along the last dim; `sizes` are the ranks' last-dim sizes (may differ)."""
    if _STATE["size"] == 1:
        return x
    width = max(sizes)
    padded = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=_STATE["group"])
    return torch.cat([p[..., :s] for p, s in zip(parts, sizes)], dim=-1)


def all_gather_rows(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenates every rank's x along dim 0 (`sizes`: the ranks' row counts), e.g. a vocab-split table."""
    if _STATE["size"] == 1:
        return x
    height = max(sizes)
    padded = x if x.shape[0] == height else torch.cat([x, x.new_zeros(height - x.shape[0], *x.shape[1:])])
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=_STATE["group"])
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def agree_min(value: int, timeout_s: float = 600.0) -> int:
    """The smallest of every rank's value (KV blocks at start-up: every rank keeps the same block count). Runs on
    the control group with its own wait, not the step timeout: ranks reach it at different times (rank 0 also
    loads the tokenizer and any draft)."""
    if _STATE["size"] == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE["ctrl"], async_op=True)
    work.wait(datetime.timedelta(seconds=max(timeout_s, _STATE["timeout_s"])))
    return int(t.item())


def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on any (one tiny all-reduce under the group's timeout)."""
    if _STATE["size"] == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=_STATE["device"])
    dist.all_reduce(t, group=_STATE["group"])
    return bool(t.item())


def all_reduce_within(x: torch.Tensor, timeout_s: float) -> bool:
    """Sums x in place across ranks, waiting at most `timeout_s` (shorter than the group's timeout). Returns
    False when the sum did not complete in time; x is then unchanged. The sum runs on a copy that completes in
    the background once the late rank arrives, so every rank still issues the same collectives in the same
    order and the group stays usable. A failed peer (not a late one) raises as usual."""
    if _STATE["size"] == 1:
        return True
    limit = _STATE["timeout_s"]
    if not 0 < timeout_s < limit:
        raise ValueError(f"a collective timeout inside a step must be in (0, {limit:g}) s, below the engine's "
                         f"tensor-parallel timeout (tp_timeout_s={limit:g}), got {timeout_s}")
    buf = x.clone()
    work = dist.all_reduce(buf, group=_STATE["group"], async_op=True)
    if _STATE["backend"] == "gloo":
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
            return False
    else:  # NCCL's wait() only orders streams unless blocking wait is on: poll the work instead
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                return False
            time.sleep(50e-6)
    x.copy_(buf)
    return True


def broadcast_object(obj=None, src: int = 0):
    """Rank `src` sends a picklable object to every rank; returns it on all."""
    if _STATE["size"] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_STATE["group"])
    return box[0]
