"""The single-rank KV systems behind one interface (open / write / fetch / close): GpuOnly, UlaDP, HiSparse."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lanner.kvcache.lru import ExactLRU
from lanner.kvcache.ula.store import AddressSpace, CacheFull, FreeList, TieredStore, new_pool, rows_at, slots_for

@dataclass
class Fetch:
    """Where a step's selected entries are: pool[slots] ([B, N] rows), the new tokens' rows pool[fresh_slots].
    run(layers) moves the data (a slice of the group's layers at a time), finish() commits after the group."""

    pool: torch.Tensor
    slots: torch.Tensor
    fresh_slots: torch.Tensor
    run: Callable[[slice], None] = lambda sl=slice(None): None
    finish: Callable[[], None] = lambda: None


class KVBackend:
    name = "?"

    def __init__(self, shape, dtype, poison: bool = False):
        self.shape, self.dtype, self.poison = tuple(shape), dtype, poison
        self.entry_bytes = math.prod(self.shape) * torch.empty((), dtype=dtype).element_size()
        self.space = AddressSpace()
        self.requests: dict = {}  # rid -> (base, n)
        self.stats = {"accesses": 0, "hits": 0}

    def open(self, rid, n: int) -> int:
        """Admits a request of n entries: returns its base address, or raises CacheFull."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already open")
        self._admit(n)
        base = self.space.alloc(n)
        self._grow(self.space.top)
        self.requests[rid] = (base, n)
        self._opened(rid, base, n)
        return base

    def can_open(self, n: int) -> bool:
        """Whether open(_, n) would admit a request of n entries now."""
        try:
            self._admit(n)
        except CacheFull:
            return False
        return True

    def close(self, rid):
        base, n = self.requests.pop(rid)
        self._closed(rid, torch.arange(base, base + n))
        self.space.free(base, n)

    def max_requests(self, n_entries: int) -> int:
        """Requests of n_entries each that this system's memory holds at once."""
        raise NotImplementedError

    def max_batch(self, budget: int, page: int) -> int:
        """Requests one decode step can serve at once: one layer group's selection of each (up to `budget`
        entries, whole pages) must be on the device together."""
        raise NotImplementedError

    def step_fits(self, q: list[int], budget: int, page: int) -> bool:
        """Whether a decode step fits the device slots whose request b feeds q[b] queries (a verify step feeds
        several), each reading up to `budget` entries: a request's queries may select different pages."""
        return sum(q) <= self.max_batch(budget, page)

    def _count(self, hits: int, accesses: int):
        self.stats["hits"] += hits
        self.stats["accesses"] += accesses

    def _grow(self, top: int):
        pass

    def _opened(self, rid, base: int, n: int):
        pass


class GpuOnly(KVBackend):
    name = "gpu-only"

    def __init__(self, shape, dtype, kv_device_gb: float, device: str = "cpu", poison: bool = False):
        super().__init__(shape, dtype, poison)
        n = slots_for(kv_device_gb, self.entry_bytes)
        self.dev = new_pool(n, self.shape, dtype, device, False, poison)
        self.free = FreeList(n)
        self.slot = torch.empty(0, dtype=torch.long)
        self.capacity = n

    def max_requests(self, n_entries):
        return self.capacity // n_entries

    def max_batch(self, budget, page):
        return 1 << 62  # everything is resident

    def _admit(self, n):
        if n > len(self.free):
            raise CacheFull(f"gpu-only: {n} entries, {len(self.free)} device slots free")

    def _grow(self, top):
        self.slot = torch.cat([self.slot, self.slot.new_full((top - self.slot.numel(),), -1)])

    def _opened(self, rid, base, n):
        self.slot[base : base + n] = self.free.pop(n)

    def _closed(self, rid, addrs):
        s = self.slot[addrs]
        self.free.push(s)
        self.slot[addrs] = -1
        if self.poison:
            self.dev[s] = math.nan

    def write(self, addrs, data):
        self.dev[self.slot[addrs]] = data

    def fetch(self, rids, addrs, valid, fresh) -> Fetch:
        n = int(valid.sum())
        self._count(n, n)
        return Fetch(self.dev, self.slot[addrs], self.slot[fresh])


class UlaDP(KVBackend):
    name = "ula-dp"

    def __init__(self, shape, dtype, kv_device_gb: float, kv_host_gb: float, device: str = "cpu",
                 poison: bool = False, buckets: int = 64):
        super().__init__(shape, dtype, poison)
        self.store = TieredStore(self.shape, dtype, slots_for(kv_device_gb, self.entry_bytes),
                                 slots_for(kv_host_gb, self.entry_bytes), device, poison, buckets)
        self.capacity = self.store.capacity
        self.reserved = 0  # admitted requests' entries: moves never run out of room

    def max_requests(self, n_entries):
        return self.capacity // n_entries

    def max_batch(self, budget, page):
        return self.store.dev.shape[0] // budget

    def _admit(self, n):
        if self.reserved + n > self.capacity:
            raise CacheFull(f"ula-dp: {n} entries, {self.capacity - self.reserved} of {self.capacity} free")

    def _grow(self, top):
        self.store.grow(top)

    def _opened(self, rid, base, n):
        self.reserved += n

    def _closed(self, rid, addrs):
        self.store.release(addrs)
        self.reserved -= addrs.numel()

    def write(self, addrs, data):
        self.store.write(addrs, data)

    def fetch(self, rids, addrs, valid, fresh) -> Fetch:
        m = self.store.move(torch.unique(addrs), fresh, unique=True)
        # reads of stored entries only: a new token's address may be resident (a rejected draft's, overwritten now)
        read = ~torch.isin(m.plan.addrs, fresh)
        self._count(int((m.plan.hit & read).sum()), int(read.sum()))
        return Fetch(self.store.dev, m.slots_of(addrs), m.slots_of(fresh), m.run, m.finish)


class HiSparse(KVBackend):
    """Full history on the host; per request a fixed device buffer of `buffer_entries` with its own LRU."""

    name = "hisparse"

    def __init__(self, shape, dtype, kv_device_gb: float, kv_host_gb: float, buffer_entries: int,
                 device: str = "cpu", poison: bool = False):
        super().__init__(shape, dtype, poison)
        regions = slots_for(kv_device_gb, self.entry_bytes) // buffer_entries  # 0: admits nothing
        self.buf_n = buffer_entries
        self.dev = new_pool(regions * buffer_entries, self.shape, dtype, device, False, poison)
        self.host = new_pool(slots_for(kv_host_gb, self.entry_bytes), self.shape, dtype, device, True, poison)
        self.regions, self.host_free = FreeList(regions), FreeList(self.host.shape[0])
        self.host_slot = torch.empty(0, dtype=torch.long)
        self.lru: dict = {}  # rid -> (region, ExactLRU over the request's local addresses)
        self.stats["loaded"] = 0

    def max_requests(self, n_entries):
        return min(self.host.shape[0] // n_entries, self.dev.shape[0] // self.buf_n)

    def max_batch(self, budget, page):
        return self.dev.shape[0] // self.buf_n if self.buf_n >= budget else 0

    def step_fits(self, q, budget, page):  # a request's queries share its own buffer
        return len(q) <= self.max_batch(budget, page) and max(q) * budget <= self.buf_n

    def _admit(self, n):
        if n > len(self.host_free) or len(self.regions) == 0:
            raise CacheFull(f"hisparse: {n} entries, {len(self.host_free)} host slots and "
                            f"{len(self.regions)} device buffers free")

    def _grow(self, top):
        self.host_slot = torch.cat([self.host_slot, self.host_slot.new_full((top - self.host_slot.numel(),), -1)])

    def _opened(self, rid, base, n):
        self.host_slot[base : base + n] = self.host_free.pop(n)
        self.lru[rid] = (int(self.regions.pop(1)), ExactLRU(self.buf_n, n))

    def _closed(self, rid, addrs):
        region, _ = self.lru.pop(rid)
        hs = self.host_slot[addrs]
        self.host_free.push(hs)
        self.regions.push(torch.tensor([region]))
        self.host_slot[addrs] = -1
        if self.poison:
            self.host[hs] = math.nan
            self.dev[region * self.buf_n : (region + 1) * self.buf_n] = math.nan

    def write(self, addrs, data):
        self.host[self.host_slot[addrs]] = data.to("cpu")

    def fetch(self, rids, addrs, valid, fresh) -> Fetch:
        fresh_rows = fresh.view(len(rids), -1)  # [B] or [B, Q]: each request's new tokens
        slots, fresh_slots = torch.empty_like(addrs), torch.empty_like(fresh_rows)
        src, dst, victims, plans = [], [], [], []
        for b, rid in enumerate(rids):  # one LRU per request: a loop over requests, not entries
            base = self.requests[rid][0]
            region, pol = self.lru[rid]
            local, lf = addrs[b] - base, fresh_rows[b] - base
            plan = pol.plan(local)
            s = pol.addr_slot[plan.addrs].clone()
            s[~plan.hit] = plan.load_slots
            s += region * self.buf_n
            slots[b], fresh_slots[b] = rows_at(plan.addrs, s, local), rows_at(plan.addrs, s, lf)
            old = ~torch.isin(plan.load_addrs, lf)  # the new tokens have nothing on the host yet
            src.append(self.host_slot[plan.load_addrs[old] + base])
            dst.append(plan.load_slots[old] + region * self.buf_n)
            victims.append(plan.load_slots + region * self.buf_n)
            plans.append((pol, plan))
            self._count(int(plan.hit.sum()), plan.addrs.numel() - torch.unique(lf).numel())
        src, dst, victims = torch.cat(src), torch.cat(dst), torch.cat(victims)
        self.stats["loaded"] += src.numel()
        started = []

        def run(sl=slice(None)):
            if self.poison and not started:
                self.dev[victims] = math.nan  # whole entries: no part of an old one stays readable
            started.append(sl)
            self.dev[dst, sl] = self.host[src, sl].to(self.dev.device, non_blocking=True)  # clean copies

        def finish():
            for pol, plan in plans:
                pol.commit(plan)
            self.host[self.host_slot[fresh_rows]] = self.dev[fresh_slots].to("cpu")  # write-through: all on host

        return Fetch(self.dev, slots, fresh_slots.view_as(fresh), run, finish)

