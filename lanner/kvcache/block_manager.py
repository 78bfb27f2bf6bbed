"""Paged KV block pool with hash-chained prefix caching.

A full block is named by hash(parent block's hash, its token ids), so equal prefixes map to equal
blocks. Freed blocks that carry a hash stay findable until their slot is reused (LRU order), which
is what lets a multi-turn conversation skip prefilling its history again. Under a grouped layout
(lanner.kvcache.layout) group g > 0's block of the same tokens is named (g, hash); -1 in a table is a
block a sliding group has let go.

Eviction of free cached blocks is by session (a request's SamplingParams.session: an agent's conversation).
Blocks freed by a request without a session are plain LRU. A session is idle once `session_idle_s` passed since
its last request arrived or finished; idle sessions' blocks go with the plain ones, in order of (the session's
last-active time, block last-used time), so the longest idle session goes first. Blocks of active sessions go
only when nothing else is free, the most recently started session's first: an agent's main session waits
through its subagents' turns, and LRU (or "last active first") would evict it on every round of a rotation that
does not fit, so no one hits; keeping the sessions that came first keeps at least their prefixes.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class Session:
    first_seen: float
    last_active: float
    free: OrderedDict = field(default_factory=OrderedDict)  # its free cached blocks, least recently used first


MAX_SESSIONS = 4096  # beyond this, idle sessions that hold no free block are forgotten


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 session_idle_s: float = 300.0, clock=time.monotonic):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # free blocks without a hash, popped from the end: kept sorted descending so a lone request
        # gets consecutive blocks, which lets attention slice its KV instead of gathering it
        self.free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # free blocks with a hash freed by requests without a session, LRU first (sessions keep their own)
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.sessions: dict[str, Session] = {}
        self.owner: list[str | None] = [None] * num_blocks  # the session whose free list holds the block
        self.freed_at = [0.0] * num_blocks
        self.num_session_free = 0
        self.session_idle_s, self.clock = session_idle_s, clock
        self.hit_tokens = 0
        self.query_tokens = 0

    # ------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached) + self.num_session_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    # ------------------------------------------------------------ allocation
    def _take_free(self) -> int:
        if self.free_plain:
            b = self.free_plain.pop()
        elif self.free_cached or self.num_session_free:
            b = self.victim()
            self._unfree(b)
            del self.hash_to_block[self.block_hash[b]]
            self.block_hash[b] = None
        else:
            raise NoFreeBlocksError
        self.ref_count[b] = 1
        return b

    def victim(self) -> int:
        """The free cached block to evict next: the head of the plain LRU list or of a session's list, whichever
        has the smallest (tier, time, block last-used): tier 0 = plain blocks (time: their last use) and idle
        sessions (their last-active time), tier 1 = active sessions (time: minus their start)."""
        now, best, best_key = self.clock(), None, None
        if self.free_cached:
            best = next(iter(self.free_cached))
            best_key = (0, self.freed_at[best], self.freed_at[best])
        for s in self.sessions.values():
            if s.free:
                b = next(iter(s.free))
                idle = now - s.last_active > self.session_idle_s
                key = (0, s.last_active, self.freed_at[b]) if idle else (1, -s.first_seen, self.freed_at[b])
                if best_key is None or key < best_key:
                    best, best_key = b, key
        return best

    def touch(self, session: str | None):
        """Marks the session active now (a request of it arrived, was admitted or finished)."""
        if session is None:
            return
        now = self.clock()
        s = self.sessions.get(session)
        if s is not None:
            s.last_active = now
            return
        if len(self.sessions) >= MAX_SESSIONS:
            self.sessions = {k: v for k, v in self.sessions.items()
                             if v.free or now - v.last_active <= self.session_idle_s}
        self.sessions[session] = Session(now, now)

    def _unfree(self, b: int):
        owner = self.owner[b]
        if owner is None:
            del self.free_cached[b]
        else:
            del self.sessions[owner].free[b]
            self.num_session_free -= 1
            self.owner[b] = None

    def _release(self, b: int, session: str | None = None):
        self.ref_count[b] -= 1
        if self.ref_count[b] == 0:
            if self.block_hash[b] is not None:
                self.freed_at[b] = self.clock()
                if session in self.sessions:
                    self.sessions[session].free[b] = None
                    self.owner[b] = session
                    self.num_session_free += 1
                else:
                    self.free_cached[b] = None
            else:
                self.free_plain.append(b)

    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Longest cached prefix of full blocks -> (block ids, their hashes). Does not take references.
        The last token is never matched: its logits must be computed."""
        blocks, hashes = [], []
        if not self.enable_prefix_caching:
            return blocks, hashes
        h = None
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            h = hash((h, tuple(token_ids[i * bs : (i + 1) * bs])))
            b = self.hash_to_block.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
        return blocks, hashes

    def can_allocate(self, n_new_blocks: int, cached_blocks: list[int]) -> bool:
        # cached blocks that are currently free stop being free once we reference them
        revived = sum(1 for b in cached_blocks if self.ref_count[b] == 0)
        return self.num_free - revived >= n_new_blocks

    def acquire_cached(self, blocks: list[int]):
        for b in blocks:
            if self.ref_count[b] == 0:
                self._unfree(b)
            self.ref_count[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocksError
        return [self._take_free() for _ in range(n)]

    def free(self, blocks: list[int], session: str | None = None):
        """session: the releasing request's; its cached blocks join that session's free list."""
        self.touch(session)
        # release in reverse so a request's tail blocks are evicted before its shared head
        for b in reversed(blocks):
            if b >= 0:
                self._release(b, session)
        self.free_plain.sort(reverse=True)

    def lookup(self, group: int, h: int) -> int | None:
        """The cached block of group `group` (> 0) named by chain hash `h`, if any."""
        return self.hash_to_block.get((group, h))

    def commit_full_blocks(self, blocks: list[int], hashes: list[int], token_ids: list[int], num_verified: int,
                           group_tables: list[list[int]] = ()):
        """Name every full block of verified tokens that has no hash yet (in `blocks`, group 0's table, and in
        the other groups' tables); extends `hashes` in place."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        h = hashes[-1] if hashes else None
        for i in range(len(hashes), num_verified // bs):
            h = hash((h, tuple(token_ids[i * bs : (i + 1) * bs])))
            hashes.append(h)
            self._name(blocks[i], h)
            for g, table in enumerate(group_tables, 1):
                if table[i] >= 0:
                    self._name(table[i], (g, h))

    def _name(self, b: int, key):
        other = self.hash_to_block.get(key)
        if other is not None:
            if self.ref_count[other] > 0:
                return  # an identical block is in use; keep ours unnamed
            # the identical block is free (a hit that fell short recomputed it): the name moves to ours, which
            # is in use, and the free copy becomes a plain free block
            self._unfree(other)
            self.block_hash[other] = None
            self.free_plain.append(other)
            self.free_plain.sort(reverse=True)
        self.block_hash[b] = key
        self.hash_to_block[key] = b
