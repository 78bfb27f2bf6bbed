"""Tensor-parallel state and collectives (torch.distributed: gloo on CPU, NCCL on CUDA).

One process per rank; every rank holds its shard of each parallel layer and runs the same forward. With no
process group (the default) every helper is the identity, so models are written once for TP=1 and TP=N.
Collectives carry the group's timeout: a rank that dies or hangs turns into an error, never a hang.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_STATE = {"rank": 0, "size": 1, "group": None}


class TPError(RuntimeError):
    """A tensor-parallel rank failed, hung past the collective timeout, or disagreed with the others."""


def init_tp(rank: int, size: int, init_method: str, backend: str = "gloo", timeout_s: float = 60.0):
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _STATE.update(rank=rank, size=size, group=dist.group.WORLD)


def destroy_tp():
    if _STATE["group"] is not None:
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already died: nothing left to tear down cleanly
            pass
    _STATE.update(rank=0, size=1, group=None)


def tp_rank() -> int:
    return _STATE["rank"]


def tp_size() -> int:
    return _STATE["size"]


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


def broadcast_object(obj=None, src: int = 0):
    """Rank `src` sends a picklable object to every rank; returns it on all."""
    if _STATE["size"] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_STATE["group"])
    return box[0]
