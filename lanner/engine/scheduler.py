"""Continuous batching with chunked prefill, prefix caching and recompute preemption.

Every step, each scheduled request advances by some number of tokens: 1 for a decoding request, a chunk
for one that is still prefilling. Running requests go first (oldest first); then waiting requests are
admitted while the token budget, the running limit and the KV pool allow. When a running request needs a
block and none is free, the newest running request is preempted: its blocks are freed and it re-enters the
queue at the front, to be recomputed (its verified blocks usually come back from the prefix cache).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lanner.engine.request import Request, Status
from lanner.kvcache.block_manager import BlockManager
from lanner.kvcache.layout import KVLayout
from lanner.spec.base import Draft


class QueueFullError(RuntimeError):
    pass


@dataclass
class ScheduledItem:
    """One request's part of a step. The scheduler writes the first fields; the speculation decoder
    (lanner.spec.decoder) writes the draft and what it needs to verify it."""

    request: Request
    start: int  # first position computed this step
    num_tokens: int
    num_spec: int = 0  # draft tokens this decode step may verify on top of its one token
    samples: bool = False  # this step reaches the end of the request's tokens, so a new token is sampled
    admitted: bool = False  # the KV system (re)admitted the request this step, keeping positions < start
    draft: Draft = field(default_factory=Draft)
    num_proposed: int = 0  # how many of the draft tokens the proposer wrote (the rest the grammar forced)
    masks: object = None  # constrained requests: grammar bitmask per verify row (lanner.structured)

    def __post_init__(self):
        self.samples = self.start + self.num_tokens == self.request.num_tokens


@dataclass
class BlockTables:
    """A running request's blocks in the paged pool."""

    table: list[int] = field(default_factory=list)  # group 0's (lanner.kvcache.layout): every layer's under a flat one
    groups: list[list[int]] = field(default_factory=list)  # the other groups' tables, as long as `table`; -1: let go
    hashes: list[int] = field(default_factory=list)  # the chain hashes of its full blocks named in the prefix cache


class RequestQueue:
    """Waiting and running requests: what the engine's request handling needs of any scheduler."""

    def __init__(self, max_num_seqs: int, max_queue_len: int):
        self.max_num_seqs = max_num_seqs
        self.max_queue_len = max_queue_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.refused: list[Request] = []  # the last schedule() gave up on these (their error says why)
        self.num_preemptions = 0

    def add(self, req: Request):
        # the queue is what waits after admission: requests that the next step will admit into free running
        # slots do not count, so a burst of max_num_seqs + max_queue_len requests all get in
        queued = len(self.waiting) - max(0, self.max_num_seqs - len(self.running))
        if queued >= self.max_queue_len:
            raise QueueFullError(f"the request queue is full ({self.max_queue_len} waiting); retry later")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str):
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def _release(self, req: Request):
        """Frees what the request holds in the KV cache."""
        raise NotImplementedError


class Scheduler(RequestQueue):
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_queue_len: int,
                 layout: KVLayout | None = None, solo_budget: int = 0):
        """solo_budget: the step's tokens while one request is running or waiting and nothing else (at least
        max_num_batched_tokens)."""
        super().__init__(max_num_seqs, max_queue_len)
        self.blocks = blocks
        self.budget = max_num_batched_tokens
        self.solo_budget = max(solo_budget, max_num_batched_tokens)
        self.layout = layout or KVLayout.flat(1)
        self.groups = self.layout.num_groups
        self.tables: dict[str, BlockTables] = {}  # request id -> its blocks, while it is running

    def add(self, req: Request):
        super().add(req)
        # a session's next turn has arrived: its cached blocks count as active from now, before admission
        self.blocks.touch(req.params.session)

    def _blocks_needed(self, req: Request, upto: int) -> int:
        """Pool blocks for positions up to `upto`: as many new table entries in every group."""
        return max(0, -(-upto // self.blocks.block_size) - len(self.tables[req.request_id].table)) * self.groups

    def _extend(self, req: Request, need: int):
        n = need // self.groups
        bt = self.tables[req.request_id]
        bt.table.extend(self.blocks.allocate(n))
        for table in bt.groups:
            table.extend(self.blocks.allocate(n))

    def _cached(self, req: Request) -> tuple[list[list[int]], list[int]]:
        """The longest prefix-cache hit that every group can serve -> (its blocks per group, -1 where a sliding
        group needs none, group 0 first; the chain hashes). A sliding group needs only the blocks inside the
        window of the first position after the hit."""
        cached, hashes = self.blocks.match_prefix(req.all_ids)
        bs, m = self.blocks.block_size, len(cached)
        while m > 0:
            tables = [cached[:m]]
            for g in range(1, self.groups):
                lo = self.layout.first_kept_block(g, m * bs, bs)
                found = [self.blocks.lookup(g, h) for h in hashes[lo:m]]
                if None in found:
                    break
                tables.append([-1] * lo + found)
            else:
                return tables, hashes[:m]
            m -= 1
        return [[] for _ in range(self.groups)], []

    def _free_tables(self, req: Request):
        bt = self.tables.pop(req.request_id, None)
        if bt is None:  # never admitted, or preempted and waiting
            return
        # group 0 and the other full groups first, the sliding groups' window blocks last: in LRU order those
        # go last, and without them no hit on this prefix can be served
        session = req.params.session
        self.blocks.free(bt.table, session)
        for g, table in sorted(enumerate(bt.groups, 1), key=lambda e: self.layout.windows[e[0]] is not None):
            self.blocks.free(table, session)

    def _preempt(self, req: Request):
        self.running.remove(req)
        self._free_tables(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self, spec_tokens: Callable[[Request, int], int] | None = None) -> list[ScheduledItem]:
        """spec_tokens(request, batch size) -> how many draft tokens a decoding request may verify this step."""
        budget = self.solo_budget if len(self.running) + len(self.waiting) == 1 else self.budget
        items: list[ScheduledItem] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            k = 0
            if spec_tokens is not None and req.num_tokens - req.num_computed == 1:
                k = max(0, min(spec_tokens(req, len(self.running)), budget - 1))
            need = self._blocks_needed(req, req.num_computed + n + k)
            while need > self.blocks.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                break
            self._extend(req, need)
            items.append(ScheduledItem(req, req.num_computed, n, num_spec=k))
            budget -= n + k
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            tables, hashes = self._cached(req)
            held = [b for table in tables for b in table if b >= 0]
            num_cached = len(tables[0]) * self.blocks.block_size
            n = min(req.num_tokens - num_cached, budget)
            need = (-(-(num_cached + n) // self.blocks.block_size) - len(tables[0])) * self.groups
            if not self.blocks.can_allocate(need, held):
                break  # the engine refuses requests that could not fit even alone, so this one waits
            self.waiting.popleft()
            self.blocks.touch(req.params.session)
            self.blocks.acquire_cached(held)
            self.tables[req.request_id] = BlockTables(tables[0], tables[1:], hashes)
            self._extend(req, need)
            req.num_computed = num_cached  # cached blocks carry a draft's KV too (same block tables)
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
            self.blocks.query_tokens += req.num_tokens
            self.blocks.hit_tokens += num_cached
            req.status = Status.RUNNING
            self.running.append(req)
            items.append(ScheduledItem(req, num_cached, n, admitted=True))
            budget -= n
        return items

    def trim(self, req: Request):
        """Roll back: free blocks past the verified tokens (rejected draft positions); sliding groups also let go
        of the blocks that left the window of the next query."""
        bs, bt = self.blocks.block_size, self.tables[req.request_id]
        keep = -(-req.num_computed // bs)
        for table in [bt.table] + bt.groups:
            if len(table) > keep:
                self.blocks.free(table[keep:])
                del table[keep:]
        for g, table in enumerate(bt.groups, 1):
            lo = self.layout.first_kept_block(g, req.num_computed, bs)
            first = lo  # the kept blocks are a suffix: walk back from lo to the last one let go
            while first > 0 and table[first - 1] >= 0:
                first -= 1
            if first < lo:
                self.blocks.free(table[first:lo])
                table[first:lo] = [-1] * (lo - first)

    def _release(self, req: Request):
        self._free_tables(req)
