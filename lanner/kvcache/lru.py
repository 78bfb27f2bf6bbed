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
Both avoid per-entry Python: cost per step is a fixed number of tensor ops (PB-LRU: plus a loop over the
buckets it takes victims from).

Per-slot tables are indexed by slot + 1: row 0 is a sentinel that absorbs the misses' slot -1, so a step's
recency update is one pass over all its slots with no boolean selection of the hits (index_select and
index_fill_ on contiguous indices are the fast CPU gathers; masks and advanced indexing cost 3-8x more).

On CPU tables (`native=None`: when the extension builds) the step's lookup and PB-LRU's recency update and victim
walk run as single C++ loops (csrc/lru.cpp) over the same tables, with the same decisions: PB-LRU's bucket
bookkeeping is several tensor passes per step in PyTorch, one loop there. The exact LRU's own work is one
index_fill_ and one top-k, already single kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

WORD = 64  # slots per leaf word of PB-LRU's bitmap


@dataclass
class Plan:
    addrs: torch.Tensor  # [n] unique addresses this step needs, sorted
    hit: torch.Tensor  # [n] bool: already resident
    load_addrs: torch.Tensor  # [m] the misses, to be copied in ...
    load_slots: torch.Tensor  # [m] ... to these slots (after their current entries were written back / dropped)
    evicted_addrs: torch.Tensor  # [e] entries that lose their slot (e <= m: free slots evict nothing)


class Policy:
    name = "?"

    def __init__(self, num_slots: int, num_addrs: int, native: bool | None = None):
        """native: run the C++ loops (None: when they build; False: PyTorch ops only)."""
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots, self.num_addrs = num_slots, num_addrs
        self.native = None
        if native is not False:
            from lanner.kvcache import _lru_ext

            self.native = _lru_ext.load()
            if native and self.native is None:
                raise RuntimeError("the kvcache C++ extension could not be built (see the log)")
        self.addr_slot = torch.full((num_addrs,), -1, dtype=torch.long)
        self.slot_addr = torch.full((num_slots,), -1, dtype=torch.long)
        self.step = 0
        self.hits = self.accesses = 0

    def grow(self, num_addrs: int):
        """Widen the logical address space (new requests); addresses never move."""
        if num_addrs > self.num_addrs:
            self.addr_slot = torch.cat([self.addr_slot, self.addr_slot.new_full((num_addrs - self.num_addrs,), -1)])
            self.num_addrs = num_addrs

    def plan(self, addrs: torch.Tensor, unique: bool = False) -> Plan:
        """unique=True: `addrs` is already sorted and unique (torch.unique's output), which the caller often has."""
        if not unique:
            addrs = torch.unique(addrs)
        n = addrs.numel()
        if n > self.num_slots:
            raise ValueError(f"a step needs {n} entries but the device pool has {self.num_slots} slots")
        if n and (int(addrs[-1]) >= self.num_addrs or int(addrs[0]) < 0):
            raise IndexError(f"addresses {int(addrs[0])}..{int(addrs[-1])} outside the address space "
                             f"(0..{self.num_addrs - 1})")
        if self.native is not None:
            slot1, miss = self.native.lookup(self.addr_slot, addrs)
        else:
            slot1 = self.addr_slot.index_select(0, addrs) + 1  # 0: not resident (the sentinel row)
            miss = addrs[slot1 == 0]
        hit = slot1 > 0
        self.hits += n - miss.numel()
        self.accesses += n
        self._touch(slot1, resident=True)  # the step's hits become its most recent, hence protected, slots
        victims = self._victims(miss.numel(), slot1)
        old = self.slot_addr.index_select(0, victims)
        return Plan(addrs, hit, miss, victims, old[old >= 0])

    def commit(self, plan: Plan):
        """After the data moved: point the evicted addresses at nothing and the loaded ones at their slots."""
        self.addr_slot.index_fill_(0, plan.evicted_addrs, -1)
        self.addr_slot.index_copy_(0, plan.load_addrs, plan.load_slots)
        self.slot_addr.index_copy_(0, plan.load_slots, plan.load_addrs)
        self._touch(plan.load_slots + 1, resident=False)
        self.step += 1

    def access(self, addrs: torch.Tensor, unique: bool = False) -> Plan:
        """plan + commit, for replaying traces (no data to move)."""
        p = self.plan(addrs, unique)
        self.commit(p)
        return p

    def slots_of(self, addrs: torch.Tensor) -> torch.Tensor:
        return self.addr_slot[addrs]

    def release(self, addrs: torch.Tensor) -> torch.Tensor:
        """Drops entries (their request finished): their slots become free ones; returns those slots."""
        slots = self.addr_slot[addrs]
        slots = slots[slots >= 0]
        self._free(slots + 1)
        self.addr_slot[addrs] = -1
        self.slot_addr[slots] = -1
        return slots

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    # slot1: slot + 1 (0 = the sentinel, for misses). resident=False: some slots may be free ones.
    def _touch(self, slot1: torch.Tensor, resident: bool):
        raise NotImplementedError

    def _victims(self, n: int, step_slot1: torch.Tensor) -> torch.Tensor:
        """n distinct slots to load into, none of them holding an entry of this step (`step_slot1`)."""
        raise NotImplementedError

    def _free(self, slot1: torch.Tensor):
        raise NotImplementedError


class ExactLRU(Policy):
    """Timestamp LRU: the slot used longest ago goes first (free slots have timestamp -1). The step's own slots
    carry the newest timestamp, so the top-k of the oldest never reaches them while the pool can hold the step."""

    name = "lru"

    def __init__(self, num_slots: int, num_addrs: int, native: bool | None = None):
        super().__init__(num_slots, num_addrs, native)
        self.last_use = torch.full((num_slots + 1,), -1, dtype=torch.long)  # [0]: sentinel

    def _touch(self, slot1, resident):
        self.last_use.index_fill_(0, slot1, self.step)

    def _free(self, slot1):
        self.last_use.index_fill_(0, slot1, -1)

    def _victims(self, n, step_slot1):
        if n == 0:
            return torch.empty(0, dtype=torch.long)
        return torch.topk(self.last_use[1:], n, largest=False, sorted=False).indices


class PBLRU(Policy):
    """Parallel bucketed LRU. A slot remembers the epoch of its last use; its bucket is that epoch modulo B,
    except that epochs older than the B-1 most recent all count as the coldest bucket (so expiring a bucket is
    adding one row of counts into the next, with no pass over the slots). Bucket id B is the free bucket.

    Level 1 of the bitmap, `count[b, 1 + w]`: how many slots of word w are in bucket b (column 0 belongs to the
    sentinel and is never read). Touching a slot moves one count between two rows; finding victims reads a
    bucket's row, then the slots of only those words that cover what is still needed."""

    name = "pb-lru"

    def __init__(self, num_slots: int, num_addrs: int, num_buckets: int = 64, span: int = 1,
                 native: bool | None = None):
        super().__init__(num_slots, num_addrs, native)
        if num_buckets < 2 or num_buckets & (num_buckets - 1):
            raise ValueError(f"num_buckets must be a power of two >= 2, got {num_buckets}")
        if span < 1:
            raise ValueError("span must be >= 1")
        self.B, self.span = num_buckets, span
        self.words = -(-num_slots // WORD)
        self.row = self.words + 1  # count columns per bucket: the sentinel's, then one per word
        self.slot_epoch = torch.full((num_slots + 1,), -1, dtype=torch.long)  # -1: free
        self.slot_epoch[0] = 0  # the sentinel always reads as resident, so hits need no free-slot test
        self.count = torch.zeros((num_buckets + 1) * self.row, dtype=torch.long)
        self.count.view(num_buckets + 1, self.row)[num_buckets, 1:].index_add_(
            0, torch.arange(num_slots) // WORD, torch.ones(num_slots, dtype=torch.long))
        self.sizes = torch.zeros(num_buckets + 1, dtype=torch.long)  # level 0, slots per bucket (C++ path only)
        self.sizes[num_buckets] = num_slots
        self.epoch = 0
        self._lanes = torch.arange(WORD)

    def _bucket(self, epochs, resident: bool):
        b = epochs.clamp(min=self.epoch - self.B + 1) & (self.B - 1)
        return b if resident else torch.where(epochs < 0, self.B, b)

    def _advance(self):
        epoch = self.step // self.span
        rows = self.count.view(self.B + 1, self.row)
        while self.epoch < epoch:
            # the coldest bucket's id is reused by the new epoch: its entries join the next-coldest bucket
            self.epoch += 1
            cur = self.epoch & (self.B - 1)
            rows[(cur + 1) & (self.B - 1)] += rows[cur]
            rows[cur].zero_()
            self.sizes[(cur + 1) & (self.B - 1)] += self.sizes[cur]
            self.sizes[cur] = 0

    def _move(self, slot1, resident: bool, to_bucket: int):
        col = (slot1 + WORD - 1) >> 6  # word + 1; the sentinel (slot1 0) lands in column 0
        old = self._bucket(self.slot_epoch.index_select(0, slot1), resident)
        ones = torch.ones_like(col)
        self.count.index_add_(0, col.add(old, alpha=self.row), ones, alpha=-1)
        self.count.index_add_(0, col.add(to_bucket * self.row), ones)

    def _touch(self, slot1, resident):
        self._advance()
        if slot1.numel() == 0:
            return
        if self.native is not None:
            self.native.pb_move(self.slot_epoch, self.count, self.sizes, slot1, self.epoch, self.B, self.row,
                                self.epoch & (self.B - 1), self.epoch)
            return
        self._move(slot1, resident, self.epoch & (self.B - 1))  # slots are unique: they come from unique addresses
        self.slot_epoch.index_fill_(0, slot1, self.epoch)
        self.slot_epoch[0] = 0

    def _free(self, slot1):
        if slot1.numel() == 0:
            return
        if self.native is not None:
            self.native.pb_move(self.slot_epoch, self.count, self.sizes, slot1, self.epoch, self.B, self.row,
                                self.B, -1)
            return
        self._move(slot1, True, self.B)
        self.slot_epoch.index_fill_(0, slot1, -1)

    def _victims(self, n, step_slot1):
        if n == 0:
            return torch.empty(0, dtype=torch.long)
        self._advance()
        if self.native is not None:
            return self.native.pb_victims(self.slot_epoch, self.count, self.sizes, n, self.epoch, self.B, self.row,
                                          self.num_slots, step_slot1)
        cur = self.epoch & (self.B - 1)
        rows = self.count.view(self.B + 1, self.row)[:, 1:]
        sizes = rows.sum(1).tolist()  # level 0: slots per bucket
        order = [self.B] + [(cur + 1 + i) & (self.B - 1) for i in range(self.B)]  # free, coldest ... current
        found, need = [], n
        for b in order:
            if sizes[b] == 0:
                continue
            counts = rows[b]
            words = counts.nonzero().flatten()
            # level 2: the slots of only the words that cover what is still needed; the current bucket (span > 1
            # only: otherwise it is exactly this step's slots) also holds protected slots, so it is read whole
            upto = words.numel() if b == cur else int(torch.searchsorted(counts[words].cumsum(0), need)) + 1
            cand = (words[:upto, None] * WORD + self._lanes).flatten()
            cand = cand[cand < self.num_slots]
            keep = self._bucket(self.slot_epoch.index_select(0, cand + 1), False) == b
            if b == cur:
                keep &= ~torch.isin(cand + 1, step_slot1)
            cand = cand[keep][:need]
            found.append(cand)
            need -= cand.numel()
            if need == 0:
                break
        if need:
            raise RuntimeError(f"PB-LRU: {need} slots short (all remaining slots are protected)")
        return torch.cat(found)
