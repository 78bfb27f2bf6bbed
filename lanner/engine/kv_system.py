"""The contract between the engine and a KV system: the paged cache (lanner.engine.kv_paged.PagedKV) or UlaCache
(lanner.kvcache.ula.system.UlaKV). The engine talks to its KV system through these members only; a conformance
test checks that both implement all of them with these signatures."""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

from lanner.engine.request import Request
from lanner.engine.scheduler import RequestQueue, ScheduledItem
from lanner.engine.step import StepOutput
from lanner.plugins import StepKind


@runtime_checkable
class KVSystem(Protocol):
    # (config, device) -> the handlers a tensor-parallel rank > 0 runs for rank 0's calls (lanner.distributed.worker)
    worker: Callable
    scheduler: RequestQueue  # admits, schedules and preempts requests against this system's memory
    summary: str  # one line for the start-up log
    # blocks of the pool whose block tables a draft's KV may share; None: requests have no block tables (a draft
    # head then keeps blocks of its own)
    num_blocks: int | None
    supports_trees: bool  # whether run() verifies draft trees (and keep_path() moves their accepted path)

    @property
    def features(self) -> torch.Tensor | None:
        """The captured layers' outputs of the last run(), one row per scheduled token and draft token."""

    def check_fits(self, tokens: int) -> None:
        """Raises RequestError when a request of `tokens` tokens (prompt + max_tokens) can never fit."""

    def run(self, items: list[ScheduledItem], kind: StepKind, argmax: bool = False) -> StepOutput:
        """One forward over the scheduled tokens and drafts -> the rows lanner.engine.step.StepLayout gives them:
        logits, or with argmax (a greedy step) token ids where the system has that shortcut."""

    def block_table(self, req: Request) -> list[int]:
        """A running request's group-0 block table (where num_blocks is set: a draft's KV shares it)."""

    def keep_path(self, req: Request, first: int, path: list[int]) -> None:
        """After a tree verify: the accepted nodes' KV moves to the positions first, first + 1, ..."""

    def commit(self, req: Request, finishing: bool) -> None:
        """After a step: the request keeps its verified positions; rejected drafts' KV is let go."""

    def update_gauges(self, metrics) -> None:
        """Sets the KV usage gauges of lanner.metrics.EngineMetrics."""
