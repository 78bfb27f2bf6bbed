"""UlaCache's per-rank storage: slot free lists, logical address ranges, and the device + host TieredStore
whose device pool PB-LRU manages (lanner.kvcache.ula explains the design)."""
from __future__ import annotations

import math

import torch

from lanner.kvcache.lru import PBLRU

GB = 2 ** 30


class CacheFull(RuntimeError):
    """A request does not fit the cache's memory: admission refused."""


def entry_shape(model, group: int) -> tuple[int, ...]:
    """Per-entry shape for a dense model: K and V of the group's G layers, this rank's KV heads."""
    a = model.layers[0].self_attn
    return (group, 2, a.num_kv_heads, a.head_dim)


def slots_for(gb: float, entry_bytes: int) -> int:
    return round(gb * GB) // entry_bytes


def new_pool(n: int, shape, dtype, device: str, host: bool, poison: bool) -> torch.Tensor:
    pin = host and torch.cuda.is_available()  # pinned host memory: asynchronous copies to the GPU
    t = torch.empty(n, *shape, dtype=dtype, device="cpu" if host else device, pin_memory=pin)
    return t.fill_(math.nan) if poison else t


def rows_at(sorted_keys: torch.Tensor, values: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """values[i] belongs to sorted_keys[i]; -> the values of `wanted` keys (all present)."""
    return values[torch.searchsorted(sorted_keys, wanted)]


class FreeList:
    """Free slots as a stack tensor: pop / push n slots in a couple of tensor ops."""

    def __init__(self, n: int):
        self.stack = torch.arange(n - 1, -1, -1)  # slot 0 pops first
        self.top = n

    def __len__(self):
        return self.top

    def pop(self, n: int) -> torch.Tensor:
        if n > self.top:
            raise CacheFull(f"{n} slots needed, {self.top} free")
        self.top -= n
        return self.stack[self.top : self.top + n].clone()

    def push(self, slots: torch.Tensor):
        n = slots.numel()
        self.stack[self.top : self.top + n] = slots
        self.top += n


class AddressSpace:
    """One contiguous range of logical addresses per request; finished requests' ranges are reused first-fit."""

    def __init__(self):
        self.top, self.holes = 0, []  # holes: sorted [(start, size)]

    def alloc(self, n: int) -> int:
        for i, (s, size) in enumerate(self.holes):
            if size >= n:
                self.holes[i : i + 1] = [(s + n, size - n)] if size > n else []
                return s
        s, self.top = self.top, self.top + n
        return s

    def free(self, start: int, n: int):
        merged = []
        for s, size in sorted(self.holes + [(start, n)]):
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((s, size))
        self.holes = merged


# ------------------------------------------------------------------ one rank's tiered store

class TieredStore:
    """A device pool + a host pool over local logical addresses; PB-LRU decides what stays on the device."""

    def __init__(self, shape, dtype, dev_slots: int, host_slots: int, device: str = "cpu", poison: bool = False,
                 buckets: int = 64, dev: torch.Tensor | None = None):
        if dev_slots <= 0:
            raise ValueError("the device pool needs at least one slot")
        self.poison = poison
        self.dev = new_pool(dev_slots, shape, dtype, device, False, poison) if dev is None else dev
        self.host = new_pool(host_slots, shape, dtype, device, True, poison)
        self.policy = PBLRU(dev_slots, 0, num_buckets=buckets)  # its addr_slot is the mapping's device column
        self.host_slot = torch.empty(0, dtype=torch.long)  # the mapping's host column
        self.live = torch.empty(0, dtype=torch.bool)
        self.host_free = FreeList(host_slots)
        self.evicted = self.loaded = 0  # entries moved device -> host, host -> device

    @property
    def capacity(self) -> int:
        return self.dev.shape[0] + self.host.shape[0]

    def grow(self, n: int):
        extra = n - self.host_slot.numel()
        if extra > 0:
            self.policy.grow(n)
            self.host_slot = torch.cat([self.host_slot, self.host_slot.new_full((extra,), -1)])
            self.live = torch.cat([self.live, self.live.new_zeros(extra)])

    def move(self, addrs: torch.Tensor, fresh: torch.Tensor, unique: bool = False) -> StoreMove:
        """Plans making `addrs` device-resident; `fresh` (new entries, no data yet) just get slots.
        unique: `addrs` is already sorted and unique."""
        return StoreMove(self, addrs, fresh, unique)

    def write(self, addrs: torch.Tensor, data: torch.Tensor):
        """New entries with their data (a prefill), in chunks the device pool can take; older ones spill to host."""
        chunk = self.dev.shape[0]
        for i in range(0, addrs.numel(), chunk):
            a = addrs[i : i + chunk]
            m = self.move(a, fresh=a)
            m.run()
            self.dev[m.slots_of(a)] = data[i : i + chunk].to(self.dev.device)
            m.finish()

    def release(self, addrs: torch.Tensor):
        """The entries' request finished: their slots are free again (and poisoned)."""
        slots = self.policy.release(addrs)
        hs = self.host_slot[addrs]
        hs = hs[hs >= 0]
        self.host_free.push(hs)
        self.host_slot[addrs] = -1
        self.live[addrs] = False
        if self.poison:
            self.dev[slots] = math.nan
            self.host[hs] = math.nan

    def read(self, addrs: torch.Tensor) -> torch.Tensor:
        """The entries' data wherever they live (for checks)."""
        d, h = self.policy.addr_slot[addrs], self.host_slot[addrs]
        if not bool(((d >= 0) ^ (h >= 0)).all()):
            raise KeyError("an entry is not stored exactly once")
        out = self.dev.new_empty(addrs.numel(), *self.dev.shape[1:])
        out[d >= 0] = self.dev[d[d >= 0]]
        out[h >= 0] = self.host[h[h >= 0]].to(out.device)
        return out

    def check(self):
        """Invariants: a live entry is in exactly one place, a free address nowhere; slot tables agree."""
        d, h = self.policy.addr_slot, self.host_slot
        assert bool((((d >= 0) ^ (h >= 0)) == self.live).all()), "an entry is stored twice or lost"
        assert bool((((d >= 0) | (h >= 0)) <= self.live).all())
        hs = h[h >= 0]
        assert hs.unique().numel() == hs.numel() == self.host.shape[0] - len(self.host_free)
        assert bool((self.policy.slot_addr[d[d >= 0]] == (d >= 0).nonzero().flatten()).all())


class StoreMove:
    """One step's data movement in a TieredStore: run() copies (optionally a slice of the entry's layers at a
    time), finish() commits the mapping once the data is in place."""

    def __init__(self, st: TieredStore, addrs: torch.Tensor, fresh: torch.Tensor, unique: bool = False):
        self.st = st
        plan = st.policy.plan(addrs, unique)
        miss = plan.load_addrs
        src = st.host_slot[miss]
        from_host = src >= 0
        new = miss[~from_host]
        bad = new[st.live[new] | ~torch.isin(new, fresh)]
        if bad.numel():
            raise KeyError(f"entries {bad[:8].tolist()} were never written")
        self.plan, self.fresh, self.from_host = plan, new, miss[from_host]
        self.ev_slots = st.policy.addr_slot[plan.evicted_addrs]
        self.src, self.dst = src[from_host], plan.load_slots[from_host]
        # host slots for the evicted entries: free ones, else (host full) the ones this move's loads vacate, whose
        # data is then read whole before the write-back overwrites it
        n_ev = plan.evicted_addrs.numel()
        take = min(n_ev, len(st.host_free))
        self.eager = n_ev - take
        if self.eager > self.src.numel():
            raise CacheFull(f"host tier full: {n_ev} evictions, {take} free host slots")
        self.new_host = torch.cat([st.host_free.pop(take), self.src[: self.eager]])
        st.host_free.push(self.src[self.eager :])  # free once read: nothing in this move writes them
        self.started = False
        slots = st.policy.addr_slot[plan.addrs].clone()
        slots[~plan.hit] = plan.load_slots
        self.slots = slots  # device slot of each plan.addrs (sorted)

    def slots_of(self, addrs: torch.Tensor) -> torch.Tensor:
        return rows_at(self.plan.addrs, self.slots, addrs)

    def run(self, sl: slice = slice(None)):
        """Copies the loads' slice `sl` of layers in; the first call also writes the evicted entries out whole
        (and, poisoning, fills the victim slots with NaN: no part of an old entry stays readable)."""
        st, dev = self.st, self.st.dev.device
        if not self.started:
            self.started = True
            self.staged = st.host[self.src[: self.eager]].to(dev)
            st.host[self.new_host] = st.dev[self.ev_slots].to("cpu")
            if st.poison:
                st.dev[self.plan.load_slots] = math.nan
        rest = self.src[self.eager :]
        st.dev[self.dst[self.eager :], sl] = st.host[rest, sl].to(dev, non_blocking=True)
        st.dev[self.dst[: self.eager], sl] = self.staged[:, sl]
        if st.poison:
            st.host[rest, sl] = math.nan

    def finish(self):
        st, plan = self.st, self.plan
        st.policy.commit(plan)
        st.host_slot[plan.evicted_addrs] = self.new_host
        st.host_slot[self.from_host] = -1
        st.live[self.fresh] = True
        st.evicted += plan.evicted_addrs.numel()
        st.loaded += self.from_host.numel()

