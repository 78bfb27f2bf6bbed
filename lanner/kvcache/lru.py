"""Replacement policies for a shared device pool of KV slots in front of a larger logical address space.

Every KV entry has a fixed logical address; `addr_slot[a]` says which device slot holds it (-1: not resident,
read from the CPU tier). A decode step asks for a set of addresses (the sparse selection of every request in
the batch); the policy reports hits, picks victims for the misses and returns a `Plan`. The caller moves the
data first and calls `commit(plan)` after, which is the only place the mapping changes: no access can find a
slot whose data has not arrived yet.

Two policies with one interface:
- `PBLRU` (parallel bucketed LRU): slots are grouped into buckets by the epoch of their last use (an epoch is
  `span` steps); hits are detected and moved to the current bucket in one vectorized pass; victims come from the
  free bucket, then the coldest bucket onward, found through a two-level bitmap (per-bucket counts per 64-slot
  word, then the words' slots), never among the entries this step needs.
- `ExactLRU`: a per-slot timestamp and a top-k over all slots for the victims: the reference for hit rates.
Both avoid per-entry Python: cost per step is a fixed number of tensor ops (PB-LRU: plus a loop over buckets).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

WORD = 64  # slots per leaf word of PB-LRU's bitmap


@dataclass
class Plan:
    addrs: torch.Tensor  # [n] unique addresses this step needs
    hit: torch.Tensor  # [n] bool: already resident
    load_addrs: torch.Tensor  # [m] the misses, to be copied in ...
    load_slots: torch.Tensor  # [m] ... to these slots (after their current entries were written back / dropped)
    evicted_addrs: torch.Tensor  # [e] entries that lose their slot (e <= m: free slots evict nothing)


class Policy:
    name = "?"

    def __init__(self, num_slots: int, num_addrs: int):
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots, self.num_addrs = num_slots, num_addrs
        self.addr_slot = torch.full((num_addrs,), -1, dtype=torch.long)
        self.slot_addr = torch.full((num_slots,), -1, dtype=torch.long)
        self.step = 0
        self.hits = self.accesses = 0

    def grow(self, num_addrs: int):
        """Widen the logical address space (new requests); addresses never move."""
        if num_addrs > self.num_addrs:
            self.addr_slot = torch.cat([self.addr_slot, self.addr_slot.new_full((num_addrs - self.num_addrs,), -1)])
            self.num_addrs = num_addrs

    def plan(self, addrs: torch.Tensor) -> Plan:
        addrs = torch.unique(addrs)
        if addrs.numel() > self.num_slots:
            raise ValueError(f"a step needs {addrs.numel()} entries but the device pool has {self.num_slots} slots")
        if addrs.numel() and int(addrs.max()) >= self.num_addrs:
            raise IndexError(f"address {int(addrs.max())} outside the address space ({self.num_addrs})")
        slots = self.addr_slot[addrs]
        hit = slots >= 0
        self.hits += int(hit.sum())
        self.accesses += addrs.numel()
        self._touch(slots[hit])
        protected = torch.zeros(self.num_slots, dtype=torch.bool)
        protected[slots[hit]] = True
        miss = addrs[~hit]
        victims = self._victims(miss.numel(), protected)
        old = self.slot_addr[victims]
        return Plan(addrs, hit, miss, victims, old[old >= 0])

    def commit(self, plan: Plan):
        """After the data moved: point the evicted addresses at nothing and the loaded ones at their slots."""
        self.addr_slot[plan.evicted_addrs] = -1
        self.addr_slot[plan.load_addrs] = plan.load_slots
        self.slot_addr[plan.load_slots] = plan.load_addrs
        self._touch(plan.load_slots)
        self.step += 1

    def access(self, addrs: torch.Tensor) -> Plan:
        """plan + commit, for replaying traces (no data to move)."""
        p = self.plan(addrs)
        self.commit(p)
        return p

    def slots_of(self, addrs: torch.Tensor) -> torch.Tensor:
        return self.addr_slot[addrs]

    def release(self, addrs: torch.Tensor) -> torch.Tensor:
        """Drops entries (their request finished): their slots become free ones; returns those slots."""
        slots = self.addr_slot[addrs]
        slots = slots[slots >= 0]
        self._free(slots)
        self.addr_slot[addrs] = -1
        self.slot_addr[slots] = -1
        return slots

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def _touch(self, slots: torch.Tensor):
        raise NotImplementedError

    def _victims(self, n: int, protected: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _free(self, slots: torch.Tensor):
        raise NotImplementedError


class ExactLRU(Policy):
    """Timestamp LRU: the slot used longest ago goes first (free slots have timestamp -1)."""

    name = "lru"

    def __init__(self, num_slots: int, num_addrs: int):
        super().__init__(num_slots, num_addrs)
        self.last_use = torch.full((num_slots,), -1, dtype=torch.long)

    def _touch(self, slots):
        self.last_use[slots] = self.step

    def _free(self, slots):
        self.last_use[slots] = -1

    def _victims(self, n, protected):
        if n == 0:
            return torch.empty(0, dtype=torch.long)
        age = self.last_use.masked_fill(protected, torch.iinfo(torch.long).max)
        return torch.topk(age, n, largest=False, sorted=False).indices


class PBLRU(Policy):
    """Parallel bucketed LRU. A slot remembers the epoch of its last use; its bucket is that epoch modulo B,
    except that epochs older than the B-1 most recent all count as the coldest bucket (so expiring a bucket is
    adding one row of counts into the next, with no pass over the slots). Bucket id B is the free bucket."""

    name = "pb-lru"

    def __init__(self, num_slots: int, num_addrs: int, num_buckets: int = 64, span: int = 1):
        super().__init__(num_slots, num_addrs)
        if num_buckets < 2:
            raise ValueError("num_buckets must be >= 2")
        self.B, self.span = num_buckets, span
        self.words = -(-num_slots // WORD)
        self.slot_epoch = torch.full((num_slots,), -1, dtype=torch.long)  # -1: free
        # level 1 of the bitmap: per bucket, how many of its slots each 64-slot word holds
        self.word_count = torch.zeros(num_buckets + 1, self.words, dtype=torch.long)
        self.word_count[num_buckets].index_add_(0, torch.arange(num_slots) // WORD,
                                                torch.ones(num_slots, dtype=torch.long))
        self.epoch = 0

    def _bucket(self, slots):
        e = self.slot_epoch[slots]
        return torch.where(e < 0, self.B, e.clamp(min=self.epoch - self.B + 1) % self.B)

    def _advance(self):
        epoch = self.step // self.span
        while self.epoch < epoch:
            # the coldest bucket's id is reused by the new epoch: its entries join the next-coldest bucket
            self.epoch += 1
            cur = self.epoch % self.B
            self.word_count[(cur + 1) % self.B] += self.word_count[cur]
            self.word_count[cur].zero_()

    def _touch(self, slots):
        self._advance()
        if slots.numel() == 0:  # slots are unique: they come from unique addresses
            return
        w = slots // WORD
        self.word_count.index_put_((self._bucket(slots), w), torch.full_like(w, -1), accumulate=True)
        self.word_count[self.epoch % self.B].index_add_(0, w, torch.ones_like(w))
        self.slot_epoch[slots] = self.epoch

    def _free(self, slots):
        if slots.numel() == 0:
            return
        w = slots // WORD
        self.word_count.index_put_((self._bucket(slots), w), torch.full_like(w, -1), accumulate=True)
        self.word_count[self.B].index_add_(0, w, torch.ones_like(w))
        self.slot_epoch[slots] = -1

    def _victims(self, n, protected):
        if n == 0:
            return torch.empty(0, dtype=torch.long)
        self._advance()
        cur = self.epoch % self.B
        order = [self.B] + [(cur + 1 + i) % self.B for i in range(self.B)]  # free, coldest ... current
        found, need, slack = [], n, int(protected.sum())
        for b in order:
            counts = self.word_count[b]
            words = counts.nonzero().flatten()
            if words.numel() == 0:
                continue
            # level 2: only the words that can cover what is still needed (plus protected slots inside them)
            upto = int(torch.searchsorted(counts[words].cumsum(0), need + slack)) + 1
            cand = (words[:upto, None] * WORD + torch.arange(WORD)).flatten()
            cand = cand[cand < self.num_slots]
            cand = cand[(self._bucket(cand) == b) & ~protected[cand]][:need]
            found.append(cand)
            need -= cand.numel()
            if need == 0:
                break
        if need:
            raise RuntimeError(f"PB-LRU: {need} slots short (all remaining slots are protected)")
        return torch.cat(found)
