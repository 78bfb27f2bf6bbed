"""UlaCache: one logical address space for sparse-attention KV across device pools and a host (CPU) tier.

Entries. An entry is one token's KV for one selection group of G layers (the layers that share one sparse
selection): K and V of those layers, shape [G, 2, Hkv, D] (for an MLA model, MlaDecoder: the latent of the G
layers that share one indexer's selection, [G, kv_lora_rank + rope]). Its logical
address is fixed when its request is admitted: request r owns [base_r, base_r + groups * max_len) and the entry of
(group g, position p) is base_r + g * max_len + p. The decoder selects and asks for entries by address only.

Mapping. Per logical address two int64 columns say where the entry lives now: `dev` (a slot of the device pool;
the rank is the caller's own in DP mode, address mod P in TP mode) and `host` (a slot of the host pool). A live
entry has exactly one of them >= 0 (nothing is stored twice), a free address neither. Moving an entry between
tiers rewrites these columns, never the address. The `dev` column is the replacement policy's own table
(lanner.kvcache.lru: PB-LRU). Lookups, moves and updates are tensor ops over index tensors, no per-entry Python.

Moves. A step's needs become a Plan (hits, and the misses with their victims; needed entries are protected).
The data moves first (victims out to the host, misses in from the host; a new token's entry gets a slot and no
data), the mapping is committed after. With `poison=True` every slot that loses its entry is filled with NaN
before anything is written there, so a read that ran ahead of its data turns the model's outputs into NaN.

Systems, behind one interface (open / write / fetch / close) so that one decoder runs them all:
- GpuOnly: every entry has a device slot from admission to finish; admission is limited by the device pool.
- HiSparse: the full history lives in the host pool; each request has a fixed device buffer with its own LRU
  holding clean copies of recently selected entries; new tokens are written through to the host.
- UlaDP: one TieredStore per rank: device pool + host pool, capacity their sum, PB-LRU over the device pool;
  an entry evicted from the device moves to the host, a host entry loaded to the device frees its host slot.
- UlaTP: P ranks (torch.distributed; gloo on CPU); entry a lives on rank a mod P (in that rank's device pool or
  its host pool), so no rank stores another's history. A computing rank reads its own entries from its pool and
  keeps a local device buffer of recently selected other ranks' entries (PB-LRU over it: reused when selected
  again); it fetches only the buffer's misses from their home ranks (one all_gather; a home rank first brings
  host-tier entries up to its device pool). The buffer's copies are clean caches, not stored entries.

Budgets are bytes (`kv_device_gb`, `kv_host_gb`); the host pool is pinned when CUDA is available.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lanner.distributed import all_gather_last
from lanner.kvcache.lru import PBLRU, ExactLRU
from lanner.layers.attention import AttentionMetadata

GB = 2 ** 30


class CacheFull(RuntimeError):
    """A request does not fit the cache's memory: admission refused."""


def entry_shape(model, group: int) -> tuple[int, ...]:
    """Per-entry shape for a dense model: K and V of the group's G layers, this rank's KV heads."""
    a = model.layers[0].self_attn
    return (group, 2, a.num_kv_heads, a.head_dim)


def slots_for(gb: float, entry_bytes: int) -> int:
    return round(gb * GB) // entry_bytes


def _new_pool(n: int, shape, dtype, device: str, host: bool, poison: bool) -> torch.Tensor:
    pin = host and torch.cuda.is_available()  # pinned host memory: asynchronous copies to the GPU
    t = torch.empty(n, *shape, dtype=dtype, device="cpu" if host else device, pin_memory=pin)
    return t.fill_(math.nan) if poison else t


def _rows_at(sorted_keys: torch.Tensor, values: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
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
        self.dev = _new_pool(dev_slots, shape, dtype, device, False, poison) if dev is None else dev
        self.host = _new_pool(host_slots, shape, dtype, device, True, poison)
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
        return _rows_at(self.plan.addrs, self.slots, addrs)

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


# ------------------------------------------------------------------ systems

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
        self.dev = _new_pool(n, self.shape, dtype, device, False, poison)
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
        self._count(int(m.plan.hit.sum()), m.plan.addrs.numel() - fresh.numel())
        return Fetch(self.store.dev, m.slots_of(addrs), m.slots_of(fresh), m.run, m.finish)


class HiSparse(KVBackend):
    """Full history on the host; per request a fixed device buffer of `buffer_entries` with its own LRU."""

    name = "hisparse"

    def __init__(self, shape, dtype, kv_device_gb: float, kv_host_gb: float, buffer_entries: int,
                 device: str = "cpu", poison: bool = False):
        super().__init__(shape, dtype, poison)
        regions = slots_for(kv_device_gb, self.entry_bytes) // buffer_entries  # 0: admits nothing
        self.buf_n = buffer_entries
        self.dev = _new_pool(regions * buffer_entries, self.shape, dtype, device, False, poison)
        self.host = _new_pool(slots_for(kv_host_gb, self.entry_bytes), self.shape, dtype, device, True, poison)
        self.regions, self.host_free = FreeList(regions), FreeList(self.host.shape[0])
        self.host_slot = torch.empty(0, dtype=torch.long)
        self.lru: dict = {}  # rid -> (region, ExactLRU over the request's local addresses)
        self.stats["loaded"] = 0

    def max_requests(self, n_entries):
        return min(self.host.shape[0] // n_entries, self.dev.shape[0] // self.buf_n)

    def max_batch(self, budget, page):
        return self.dev.shape[0] // self.buf_n if self.buf_n >= budget else 0

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
        slots, fresh_slots = torch.empty_like(addrs), torch.empty_like(fresh)
        src, dst, victims, plans = [], [], [], []
        for b, rid in enumerate(rids):  # one LRU per request: a loop over requests, not entries
            base = self.requests[rid][0]
            region, pol = self.lru[rid]
            local, lf = addrs[b] - base, fresh[b : b + 1] - base
            plan = pol.plan(local)
            s = pol.addr_slot[plan.addrs].clone()
            s[~plan.hit] = plan.load_slots
            s += region * self.buf_n
            slots[b], fresh_slots[b] = _rows_at(plan.addrs, s, local), _rows_at(plan.addrs, s, lf)[0]
            old = plan.load_addrs != lf  # the new token has nothing on the host yet
            src.append(self.host_slot[plan.load_addrs[old] + base])
            dst.append(plan.load_slots[old] + region * self.buf_n)
            victims.append(plan.load_slots + region * self.buf_n)
            plans.append((pol, plan))
            self._count(int(plan.hit.sum()), plan.addrs.numel() - 1)
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
            self.host[self.host_slot[fresh]] = self.dev[fresh_slots].to("cpu")  # write-through: full history on host

        return Fetch(self.dev, slots, fresh_slots, run, finish)


def _all_gather_rows(x: torch.Tensor, sizes: list[int], group=None) -> list[torch.Tensor]:
    """Every rank's rows of x (`sizes`: every rank's row count, known to all) -> one tensor per rank. Sent as
    bytes: gloo lacks bf16."""
    P = dist.get_world_size(group)
    row = math.prod(x.shape[1:])
    if max(sizes) == 0:
        return [x.new_empty(0, *x.shape[1:]) for _ in sizes]
    flat = x.reshape(x.shape[0], row).contiguous().view(torch.uint8)
    buf = flat.new_zeros(max(sizes), flat.shape[1])
    buf[: x.shape[0]] = flat
    parts = [torch.empty_like(buf) for _ in range(P)]
    dist.all_gather(parts, buf, group=group)
    return [p[:s].view(x.dtype).view(s, *x.shape[1:]) for p, s in zip(parts, sizes)]


class UlaTP(KVBackend):
    """TP mode: entry a lives on rank a mod P (in its home pool on the device or in its host pool).

    Each rank's device memory is one tensor: its home pool's slots, then its buffer's. A step reads its own
    entries straight from the home pool (host-tier ones are brought up first) and the other ranks' entries from
    the buffer, which keeps clean copies of recently selected ones (PB-LRU: reused when selected again); only the
    buffer's misses are fetched, from their home ranks, in one all_gather (per slice of layers when prefetching).

    Every rank calls open/write/fetch/close with the same arguments in the same order: under TP every rank runs
    the same step, with the same budgets. So every rank's buffer policy sees the same sequence of selections, and
    each rank keeps a mirror of the others' (address -> slot tables only, no data): it knows what every rank
    misses without being asked, and the step's one collective is the data itself. The dense stand-in here runs the whole model on every rank, as every MLA rank reads the whole
    latent entry, so a new token's entry is computed on every rank and its home rank stores it without a
    transfer (MlaDecoder runs the MLA model itself under TP, heads split: its latent projection is replicated). Per-rank budgets: `kv_device_gb` (`buffer_frac` of it for the buffer) and `kv_host_gb`."""

    name = "ula-tp"

    def __init__(self, shape, dtype, kv_device_gb: float, kv_host_gb: float, buffer_frac: float = 0.5,
                 device: str = "cpu", poison: bool = False, buckets: int = 64, group=None):
        super().__init__(shape, dtype, poison)
        self.group = group
        self.P, self.rank = dist.get_world_size(group), dist.get_rank(group)
        ndev = slots_for(kv_device_gb, self.entry_bytes)
        nbuf = slots_for(kv_device_gb * buffer_frac, self.entry_bytes)
        self.nhome = ndev - nbuf
        if nbuf <= 0 or self.nhome <= 0:
            raise ValueError(f"ula-tp: {ndev} device slots cannot hold both a home pool and a buffer")
        self.dev = _new_pool(ndev, self.shape, dtype, device, False, poison)
        self.store = TieredStore(self.shape, dtype, self.nhome, slots_for(kv_host_gb, self.entry_bytes), device,
                                 poison, buckets, dev=self.dev[: self.nhome])
        # every rank's buffer policy, this rank's own and mirrors of the others'
        self.bufpols = [PBLRU(nbuf, 0, num_buckets=buckets) for _ in range(self.P)]
        self.bufpol = self.bufpols[self.rank]
        self.capacity = self.P * self.store.capacity
        self.reserved = 0  # per rank: a request's entries spread over the ranks, at most ceil(n / P) here
        self.stats.update(remote=0)

    def max_requests(self, n_entries):
        return self.store.capacity // -(-n_entries // self.P)

    def max_batch(self, budget, page):
        # a selection is whole pages (the last one partial): at most ceil(page / P) of a page's entries per rank
        per_rank = budget // page * -(-page // self.P)
        return min(self.nhome, self.bufpol.num_slots) // per_rank

    def _admit(self, n):
        if self.reserved + -(-n // self.P) > self.store.capacity:
            raise CacheFull(f"ula-tp: {n} entries, {self.store.capacity - self.reserved} of {self.store.capacity} "
                            f"free on rank {self.rank}")

    def _grow(self, top):
        self.store.grow(-(-top // self.P))
        for pol in self.bufpols:
            pol.grow(top)

    def _opened(self, rid, base, n):
        self.reserved += -(-n // self.P)

    def _closed(self, rid, addrs):
        self.store.release(addrs[addrs % self.P == self.rank] // self.P)
        s = [pol.release(addrs) for pol in self.bufpols][self.rank]
        if self.poison:
            self.dev[self.nhome + s] = math.nan
        self.reserved -= -(-addrs.numel() // self.P)

    def write(self, addrs, data):
        mine = addrs % self.P == self.rank  # every rank computed the prefill: each keeps its share
        self.store.write(addrs[mine] // self.P, data[mine])

    def fetch(self, rids, addrs, valid, fresh) -> Fetch:
        P, rank = self.P, self.rank
        need = torch.unique(addrs)
        own = need % P == rank
        plans = [pol.plan(need[need % P != r], unique=True) for r, pol in enumerate(self.bufpols)]
        plan = plans[rank]  # plan.addrs == need[~own]
        # what each rank misses (a remote new token's entry was computed there too), known here from the mirrors
        wants = [p.load_addrs[~torch.isin(p.load_addrs, fresh)] for p in plans]
        want = wants[rank]
        union = torch.unique(torch.cat(wants))
        homes = [union[union % P == r] for r in range(P)]
        served = homes[rank]
        own_hits = int((self.store.policy.addr_slot[need[own] // P] >= 0).sum())
        # own entries and the ones others asked for: resident in the home pool (host-tier ones brought up)
        m = self.store.move(torch.cat([need[own], served]) // P, fresh=fresh[fresh % P == rank] // P)
        bs = self.bufpol.addr_slot[plan.addrs].clone()
        bs[~plan.hit] = plan.load_slots
        rows = torch.empty_like(need)
        rows[own] = m.slots_of(need[own] // P)
        rows[~own] = self.nhome + bs
        served_slots = m.slots_of(served // P)
        keys = torch.cat(homes)
        order = keys.argsort()
        at = order[torch.searchsorted(keys[order], want)]  # row of each wanted entry in the gathered data
        dst = self.nhome + _rows_at(plan.addrs, bs, want)
        sizes = [h.numel() for h in homes]
        self._count(own_hits + int(plan.hit.sum()), need.numel() - fresh.numel())
        self.stats["remote"] += want.numel()
        started = []

        def run(sl=slice(None)):
            m.run(sl)
            data = torch.cat(_all_gather_rows(self.store.dev[served_slots, sl], sizes, self.group))
            if self.poison and not started:
                self.dev[self.nhome + plan.load_slots] = math.nan  # whole entries, as in StoreMove
            started.append(sl)
            self.dev[dst, sl] = data[at]

        def finish():
            m.finish()
            for pol, p in zip(self.bufpols, plans):
                pol.commit(p)

        return Fetch(self.dev, _rows_at(need, rows, addrs), _rows_at(need, rows, fresh), run, finish)


# ------------------------------------------------------------------ sparse decoding over a backend

def make_backend(system: str, shape, dtype, device_gb: float, host_gb: float, hisparse_buffer: int = 0,
                 tp_buffer: float = 0.5, group=None, device: str = "cpu", poison: bool = False) -> KVBackend:
    """A system's KV backend under these budgets (ula-tp: this rank's share). hisparse_buffer: entries in each
    request's device buffer; tp_buffer: ula-tp's buffer share of the device budget."""
    if system in ("gpu-only", "gpu-only-tp"):  # under TP every rank keeps every entry (the plain model's cache)
        return GpuOnly(shape, dtype, device_gb, device, poison)
    if system in ("hisparse", "hisparse-tp"):  # under TP every rank holds the same (replicated latent) history
        return HiSparse(shape, dtype, device_gb, host_gb, hisparse_buffer, device, poison)
    if system == "ula-dp":
        return UlaDP(shape, dtype, device_gb, host_gb, device, poison)
    if system == "ula-tp":
        return UlaTP(shape, dtype, device_gb, host_gb, tp_buffer, device, poison, group=group)
    raise ValueError(f"unknown KV system {system!r}; choose from gpu-only, hisparse, ula-dp, ula-tp (and, for a "
                     "model run under TP, gpu-only-tp, hisparse-tp)")


def quest_pages(qp, kmax, kmin, ctx, page: int, budget: int) -> torch.Tensor:
    """qp: [B, 1, H, D]; kmax/kmin: [B, P, Hkv, D] float32 page bounds; ctx: [B]. -> keep [B, P] bool.
    The same arithmetic as QuestSelector.decode_mask, so the selection is the same."""
    B, P, Hkv, D = kmax.shape
    q = qp[:, 0].float().view(B, Hkv, qp.shape[2] // Hkv, D)
    bound = torch.maximum(q[:, None] * kmax[:, :, :, None], q[:, None] * kmin[:, :, :, None])  # [B,P,Hkv,g,D]
    score = bound.nan_to_num(neginf=-math.inf).sum(dim=(2, 3, 4))
    pages_valid = -(-ctx // page)
    page_ids = torch.arange(P)[None, :]
    score = score.masked_fill(page_ids >= pages_valid[:, None], -math.inf)
    score[torch.arange(B), pages_valid - 1] = math.inf  # the query's own page
    keep = torch.zeros(B, P, dtype=torch.bool)
    keep.scatter_(1, score.topk(min(budget // page, P), dim=1).indices, True)
    return keep & (page_ids < pages_valid[:, None])


@dataclass
class Prefilled:
    """A prompt's dense prefill: its entries, its page bounds and its last token's logits."""

    tokens: int
    entries: torch.Tensor  # [groups, n, G, 2, Hkv, D]
    kmax: torch.Tensor  # [groups, pages, Hkv, D] float32
    kmin: torch.Tensor
    logits: torch.Tensor  # [V] float32


@dataclass
class _Req:
    row: int
    base: int
    max_len: int
    len: int


@dataclass
class _Step:
    rids: list
    rows: torch.Tensor
    pos: torch.Tensor
    bases: torch.Tensor
    max_lens: torch.Tensor
    fetch: Fetch | None = None
    mask: torch.Tensor | None = None
    pending: object = None
    selected: list = field(default_factory=list)  # per group: (positions [B, N], valid [B, N])


def _step_requests(reqs: dict, rids: list, cache, budget: int, page: int) -> list:
    """The requests of one decode step, refused when one is full or when the step's worst case (every request
    reading `budget` tokens in pages of `page`) may not fit the device slots: scheduled by the worst case, not by
    luck."""
    out = [reqs[r] for r in rids]
    if any(r.len >= r.max_len for r in out):
        raise ValueError("a request reached its max_len")
    limit = cache.max_batch(budget, page)
    if len(out) > limit:
        raise CacheFull(f"{cache.name}: a step of {len(out)} requests may need more device slots than there are "
                        f"(up to {limit} requests)")
    return out


class UlaDecoder:
    """Quest-sparse decoding (lanner.kvcache.quest's selection) of a batch of sequences whose KV lives in a
    KVBackend. Prefill is dense (one sequence from position 0) and writes its entries through the backend; a
    decode step writes the new tokens' entries and, per layer group, fetches only the selected entries and
    attends over them. The selection reads per-page key bounds of the group's first layer (float32, kept
    resident per request like a sparse model's indexer keys; outside the KV budgets).

    prefetch: at a group's first layer, move layer 0's part of the fetched entries, hand the later layers' parts
    to a worker thread and compute meanwhile (a GPU would use a copy stream); the next layer waits for them."""

    def __init__(self, model, cache: KVBackend, page_size: int = 16, budget: int = 256, group: int = 10,
                 max_len: int = 4096, prefetch: bool = False):
        L = model.cfg.num_layers
        if L % group:
            raise ValueError(f"group {group} does not divide the model's {L} layers")
        if budget < page_size:
            raise ValueError("budget must be >= page_size")
        self.model, self.cache, self.page, self.budget = model, cache, page_size, budget
        self.G, self.groups, self.max_len = group, L // group, max_len
        shape = entry_shape(model, group)
        if tuple(cache.shape) != shape:
            raise ValueError(f"cache entries are {cache.shape}, the model's are {shape}")
        self.Hkv, self.D = shape[2], shape[3]
        self.pages = -(-max_len // page_size)
        self.kmax = torch.empty(0, self.groups, self.pages, self.Hkv, self.D)
        self.kmin = torch.empty_like(self.kmax)
        self.free_rows: list[int] = []
        self.reqs: dict = {}
        self.worker = None
        self.set_prefetch(prefetch)
        self.no_kv = [(None, None)] * L
        self.mode, self.calls, self.step_state, self.captured = None, 0, None, []

    def set_prefetch(self, on: bool):
        if on and self.worker is None and self.G > 1:
            self.worker = ThreadPoolExecutor(1)
        elif not on and self.worker is not None:
            self.worker.shutdown()
            self.worker = None

    # ---- requests

    @torch.inference_mode()
    def run_prefill(self, tokens: list[int]) -> Prefilled:
        n, G, ng = len(tokens), self.G, self.groups
        self.mode, self.calls, self.captured = "prefill", 0, []
        meta = AttentionMetadata(slot_mapping=None, batch_size=1, max_q_len=n, kv_slots=None, kv_range=None,
                                 mask=None, is_causal=True, q_dest=None, sparse=self)
        h, _ = self.model(torch.tensor(tokens), torch.arange(n), self.no_kv, meta)
        logits = self.model.compute_logits(h[-1:]).float()[0]
        k = torch.stack([c[0] for c in self.captured])  # [L, n, Hkv, D]
        v = torch.stack([c[1] for c in self.captured])
        self.captured = []
        entries = torch.stack([k, v], 2).view(ng, G, n, 2, self.Hkv, self.D).transpose(1, 2).contiguous()
        kf = k[::G].float()  # each group's first layer: the one its selection reads
        P = -(-n // self.page)
        pad = (0, 0, 0, 0, 0, P * self.page - n)
        kmax = F.pad(kf, pad, value=-math.inf).view(ng, P, self.page, self.Hkv, self.D).amax(2)
        kmin = F.pad(kf, pad, value=math.inf).view(ng, P, self.page, self.Hkv, self.D).amin(2)
        return Prefilled(n, entries, kmax, kmin, logits)

    def add(self, rid, pre: Prefilled, max_len: int):
        """Admits a request whose prompt was prefilled (raises CacheFull) and writes its entries."""
        if max_len > self.max_len or pre.tokens >= max_len:
            raise ValueError(f"max_len {max_len}: the decoder takes up to {self.max_len}, the prompt has "
                             f"{pre.tokens} tokens")
        base = self.cache.open(rid, self.groups * max_len)
        if not self.free_rows:
            n = max(4, self.kmax.shape[0])
            self.free_rows = list(range(self.kmax.shape[0] + n - 1, self.kmax.shape[0] - 1, -1))
            self.kmax = torch.cat([self.kmax, self.kmax.new_empty(n, *self.kmax.shape[1:])])
            self.kmin = torch.cat([self.kmin, self.kmin.new_empty(n, *self.kmin.shape[1:])])
        row = self.free_rows.pop()
        P = pre.kmax.shape[1]
        self.kmax[row], self.kmin[row] = -math.inf, math.inf
        self.kmax[row, :, :P], self.kmin[row, :, :P] = pre.kmax, pre.kmin
        n = pre.tokens
        addrs = (base + torch.arange(self.groups)[:, None] * max_len + torch.arange(n)).flatten()
        self.cache.write(addrs, pre.entries.reshape(self.groups * n, *self.cache.shape))
        self.reqs[rid] = _Req(row, base, max_len, n)

    def prefill(self, rid, tokens: list[int], max_len: int) -> torch.Tensor:
        pre = self.run_prefill(tokens)
        self.add(rid, pre, max_len)
        return pre.logits

    def close(self, rid):
        self.cache.close(rid)
        self.free_rows.append(self.reqs.pop(rid).row)

    def length(self, rid) -> int:
        return self.reqs[rid].len

    # ---- decode

    @torch.inference_mode()
    def step(self, rids: list, tokens: list[int]) -> torch.Tensor:
        """One decode token per request -> float32 logits [B, V]."""
        reqs = _step_requests(self.reqs, rids, self.cache, self.budget, self.page)
        t = lambda xs: torch.tensor(xs, dtype=torch.long)
        st = _Step(list(rids), t([r.row for r in reqs]), t([r.len for r in reqs]), t([r.base for r in reqs]),
                   t([r.max_len for r in reqs]))
        self.mode, self.calls, self.step_state = "decode", 0, st
        meta = AttentionMetadata(slot_mapping=None, batch_size=len(reqs), max_q_len=1, kv_slots=None, kv_range=None,
                                 mask=None, is_causal=False, q_dest=None, sparse=self)
        h, _ = self.model(t(tokens), st.pos, self.no_kv, meta)
        for r in reqs:
            r.len += 1
        return self.model.compute_logits(h).float()

    @property
    def selected(self) -> list:
        """The last step's selection per group: per sequence, the positions it read."""
        return [[idx[b][valid[b]] for b in range(idx.shape[0])] for idx, valid in self.step_state.selected]

    def attend(self, q, k, v, meta, scale):
        """Called by paged_attention for every layer (meta.sparse is this decoder)."""
        layer = self.calls
        self.calls += 1
        T, H, D = q.shape
        if self.mode == "prefill":
            self.captured.append((k, v))
            out = F.scaled_dot_product_attention(q[None].transpose(1, 2), k[None].transpose(1, 2),
                                                 v[None].transpose(1, 2), is_causal=True, scale=scale,
                                                 enable_gqa=True)
            return out.transpose(1, 2).reshape(T, H * D)
        st = self.step_state
        g, j = divmod(layer, self.G)
        if j == 0:
            self._select(st, g, q, k)
        if j == 1 and st.pending is not None:
            st.pending.result()
            st.pending = None
        f = st.fetch
        f.pool[f.fresh_slots, j, 0] = k  # the new tokens' entries are written through the cache ...
        f.pool[f.fresh_slots, j, 1] = v
        kp, vp = f.pool[f.slots, j, 0], f.pool[f.slots, j, 1]  # ... and read back with the selected ones
        out = F.scaled_dot_product_attention(q.view(T, 1, H, D).transpose(1, 2), kp.transpose(1, 2),
                                             vp.transpose(1, 2), attn_mask=st.mask, scale=scale, enable_gqa=True)
        if j == self.G - 1:
            f.finish()
        return out.transpose(1, 2).reshape(T, H * D)

    def _select(self, st: _Step, g: int, q, k):
        B, H, D = q.shape
        page = st.pos // self.page
        kf = k.float()
        self.kmax[st.rows, g, page] = torch.maximum(self.kmax[st.rows, g, page], kf)
        self.kmin[st.rows, g, page] = torch.minimum(self.kmin[st.rows, g, page], kf)
        ctx = st.pos + 1
        L = int(ctx.max())
        P = -(-L // self.page)
        keep = quest_pages(q.view(B, 1, H, D), self.kmax[st.rows, g, :P], self.kmin[st.rows, g, :P], ctx,
                           self.page, self.budget)
        tok = keep.repeat_interleave(self.page, 1)[:, :L] & (torch.arange(L)[None, :] < ctx[:, None])
        N = int(tok.sum(1).max())
        idx = torch.where(tok, torch.arange(L), L).sort(1).values[:, :N]  # positions in order, padded with L
        valid = idx < L
        first = st.bases + g * st.max_lens  # address of position 0 of this group
        fresh = first + st.pos
        addrs = torch.where(valid, first[:, None] + idx, fresh[:, None])  # padding reads the new token (masked)
        st.mask = None if bool(valid.all()) else valid[:, None, None, :]
        st.selected.append((idx, valid))
        f = self.cache.fetch(st.rids, addrs, valid, fresh)
        if self.worker is None:
            f.run(slice(None))
        else:
            f.run(slice(0, 1))
            st.pending = self.worker.submit(_in_inference, f.run, slice(1, self.G))
        st.fetch = f


def _in_inference(fn, *args):
    with torch.inference_mode():
        return fn(*args)


class UlaSession:
    """One sequence over a KVBackend, fed like quest.SparseSession: the prompt first, then one token at a time."""

    def __init__(self, model, cache: KVBackend, max_len: int, page_size: int = 16, budget: int = 256,
                 group: int = 1, prefetch: bool = False):
        self.dec = UlaDecoder(model, cache, page_size, budget, group, max_len, prefetch)
        self.max_len, self.len = max_len, 0

    def feed(self, tokens: list[int]) -> torch.Tensor:
        if self.len == 0:
            logits = self.dec.prefill(0, tokens, self.max_len)[None]
        elif len(tokens) == 1:
            logits = self.dec.step([0], tokens)
        else:
            raise ValueError("after the prompt, feed one token at a time")
        self.len += len(tokens)
        return logits


# ------------------------------------------------------------------ MLA + DSA models (GLM-5, DeepSeek-V3.2) over a backend

def selection_groups(model) -> list[list[int]]:
    """A DSA model's layers grouped by the selection they use: an indexer layer and the shared layers after it."""
    groups = []
    for i, layer in enumerate(model.layers):
        if layer.self_attn.indexer is not None:
            groups.append([])
        groups[-1].append(i)
    return groups


def mla_entry_shape(model) -> tuple[int, int]:
    """One entry: one token's latent (kv_lora_rank + rope dims) for each layer of one selection group. The group's
    layers read the same positions, so one fetch moves them all (and the later layers' part can be prefetched)."""
    sizes = {len(g) for g in selection_groups(model)}
    if len(sizes) != 1:
        raise ValueError(f"selection groups of unequal sizes {sorted(sizes)}: entries need one shape")
    return (sizes.pop(), model.hf["kv_lora_rank"] + model.hf["qk_rope_head_dim"])


def mla_kv_bytes(model, tp: int, dtype: torch.dtype | None = None) -> dict:
    """KV bytes per context token: the latent (every layer) and the indexer keys (indexer layers), and what one
    rank stores under TP: replicated (every rank holds the whole latent and every key, as the plain model does)
    vs UlaCache TP (each latent entry and each indexer key on one rank)."""
    e = torch.empty((), dtype=dtype or model.embed_tokens.weight.dtype).element_size()
    latent = len(model.layers) * (model.hf["kv_lora_rank"] + model.hf["qk_rope_head_dim"]) * e
    index = len(selection_groups(model)) * model.hf["index_head_dim"] * e
    return {"tp": tp, "latent": latent, "index_keys": index, "per_rank_replicated": latent + index,
            "per_rank_ula_tp": (latent + index) / tp, "unique_fraction_replicated": 1 / tp}


@dataclass
class MlaPrefilled:
    """A prompt's prefill over plain resident caches: its entries, indexer keys and last token's logits."""

    tokens: int
    entries: torch.Tensor  # [groups, n, G, latent]
    index_keys: torch.Tensor  # [groups, n, index_head_dim]
    logits: torch.Tensor  # [V] float32


@dataclass
class _MlaStep:
    rids: list
    fresh: torch.Tensor  # [B] the new tokens' group-0 addresses
    bases: torch.Tensor  # [B] the requests' base addresses, sorted ...
    strides: torch.Tensor  # ... and their max_len: group g's entry of group-0 address a is a + g * stride
    new: dict = field(default_factory=dict)  # layer in group -> the new tokens' latent, written before the fetch
    fetch: Fetch | None = None
    need: torch.Tensor | None = None  # the group's fetched addresses (sorted) ...
    rows: torch.Tensor | None = None  # ... and their rows in fetch.pool
    pending: object = None


class _LatentView:
    """What the model gets as one layer's latent cache: writes and reads go to the decoder (lanner.models.deepseek
    calls `plan_selected` with the step's whole selection, then `read_selected` per block of query rows)."""

    def __init__(self, dec, g: int, j: int):
        self.dec, self.g, self.j = dec, g, j

    def __setitem__(self, slots, latent):
        self.dec.step_state.new[self.j] = latent  # slots are the step's fresh addresses: the decoder knows them

    def plan_selected(self, slots, valid):
        self.dec._plan(self.g, self.j, slots, valid)

    def read_selected(self, slots):
        st = self.dec.step_state
        if st.rows is None:
            raise RuntimeError("UlaCache reads the latent on the absorbed decode path only (plan_selected first)")
        return st.fetch.pool[_rows_at(st.need, st.rows, self.dec.address(slots, self.g)), self.j]


class _IndexView:
    """The indexer keys of group g's indexer layer: resident, one row per entry (its address; under UlaTP this
    rank's entries only, row address // P, and the selection is merged across ranks by `select_top`)."""

    def __init__(self, dec, g: int):
        self.dec, self.g = dec, g
        if dec.shard is not None:
            self.select_top = self._select_top

    def __setitem__(self, slots, keys):
        self.dec.set_index_keys(self.dec.address(slots, self.g), keys)

    def __getitem__(self, slots):
        if self.dec.shard is not None:
            raise RuntimeError("indexer keys are sharded over the TP ranks: read them through select_top")
        return self.dec.index_keys[self.dec.address(slots, self.g)]

    def _select_top(self, indexer, q, w, step):
        """This rank scores the context positions it stores keys for (every P-th position of each request), keeps
        its top k, and the ranks' candidates are merged: the global top k is within the union of the local ones.
        -> context positions [B, Qmax, topk], as Indexer.forward returns."""
        P, rank = self.dec.shard
        addrs = self.dec.address(step.ctx_slots, self.g)  # [B, L]; a request's context addresses are consecutive
        L = addrs.shape[1]
        first = (rank - addrs[:, 0]) % P  # this rank's first column per request
        cols = first[:, None] + P * torch.arange(-(-L // P))  # [B, ceil(L / P)]
        inside = cols < L
        cols = cols.clamp(max=L - 1)  # columns past the context are masked below
        keys = self.dec.index_keys[addrs.gather(1, cols) // P]
        allowed = step.allowed.gather(2, cols[:, None, :].expand(-1, step.allowed.shape[1], -1)) & inside[:, None]
        k = min(indexer.topk, cols.shape[1])  # the same on every rank
        vals, top = indexer.top(q, w, keys, allowed, k)
        pos = cols.gather(1, top.flatten(1)).view_as(top)
        # one gather: positions ride along as float32 (exact below 2**24)
        both = all_gather_last(torch.stack([vals, pos.float()]), [k] * P)
        return both[1].gather(2, both[0].topk(indexer.topk, dim=-1).indices).long()


class MlaDecoder:
    """DSA-sparse decoding of a DeepSeek-V3.2 / GLM-5 model (lanner.models.deepseek, absorbed MLA path) whose latent
    KV lives in a KVBackend; same interface as UlaDecoder (add / step / close / set_prefetch).

    Addresses: request r owns [base, base + groups * max_len); the entry of (group g, position p) is
    base + g * max_len + p, so a group's consecutive positions alternate over TP ranks (address mod P). The model is
    run over `_LatentView`s with "slots" = group-0 addresses (base + p), which name the request and position; a view
    finds group g's entry at slot + g * max_len of the slot's request (a search over the step's sorted bases).
    A decode step: each group's indexer layer selects index_topk positions per request; its latent view fetches
    those entries plus the new token's (device hits, host round trips, remote fetches: the backend's business),
    the group's layers read them from the backend's pool, and the moves are committed before the next group plans.

    Indexer keys (index_head_dim per token and group) stay resident in one tensor indexed by address: the indexer
    scores the whole history every step. `index_gb` caps them (CacheFull at admission), so a system's device budget
    can count them. Under TP every rank holds all of them, as every rank runs the same (replicated) indexer, except
    over UlaTP: there, like the latent, a key lives on rank address mod P only (row address // P), each rank scores
    its own positions and the ranks merge their top-k candidates (one all_gather of k scores and positions per
    request and indexer layer), so the keys are stored once and the indexer's work is split P ways.

    Prefill is the plain model over plain caches (all resident); its entries are then written through the backend."""

    def __init__(self, model, cache: KVBackend, max_len: int, prefetch: bool = False, index_gb: float | None = None):
        self.model, self.cache, self.max_len = model, cache, max_len
        self.layer_groups = selection_groups(model)
        self.groups, self.G = len(self.layer_groups), len(self.layer_groups[0])
        if tuple(cache.shape) != mla_entry_shape(model):
            raise ValueError(f"cache entries are {cache.shape}, the model's are {mla_entry_shape(model)}")
        self.dtype = model.embed_tokens.weight.dtype
        self.topk = model.hf["index_topk"]
        self.budget = self.topk + 1  # entries one request's step needs per group: its selection and its new token
        self.page = 1  # a DSA selection is any set of tokens
        self.shard = (cache.P, cache.rank) if isinstance(cache, UlaTP) else None
        self.index_keys = torch.empty(0, model.hf["index_head_dim"], dtype=self.dtype)
        self.index_bytes = model.hf["index_head_dim"] * self.index_keys.element_size()  # per entry
        self.index_limit = None if index_gb is None else round(index_gb * GB) // self.index_bytes
        self.index_reserved = 0
        self.views = []
        for g, layers in enumerate(self.layer_groups):
            for j in range(len(layers)):
                v = _LatentView(self, g, j)
                self.views.append((v, _IndexView(self, g)) if j == 0 else (v,))
        self.reqs: dict = {}
        self.worker = None
        self.set_prefetch(prefetch)
        self.step_state = None

    set_prefetch = UlaDecoder.set_prefetch

    # ---- requests

    @torch.inference_mode()
    def run_prefill(self, tokens: list[int]) -> MlaPrefilled:
        n = len(tokens)
        caches = [tuple(torch.empty(n, *s, dtype=self.dtype) for s in shapes)
                  for shapes in self.model.kv_cache_shapes()]
        meta = AttentionMetadata(slot_mapping=torch.arange(n), batch_size=1, max_q_len=n, kv_slots=None,
                                 kv_range=(0, n), mask=None, is_causal=True, q_dest=None, q_lens=[n], ctx_lens=[n])
        h, _ = self.model(torch.tensor(tokens), torch.arange(n), caches, meta)
        logits = self.model.compute_logits(h[-1:]).float()[0]
        entries = torch.stack([torch.stack([caches[i][0] for i in layers], 1) for layers in self.layer_groups])
        keys = torch.stack([caches[layers[0]][1] for layers in self.layer_groups])
        return MlaPrefilled(n, entries, keys, logits)

    def add(self, rid, pre: MlaPrefilled, max_len: int):
        """Admits a request whose prompt was prefilled (raises CacheFull) and writes its entries and indexer keys."""
        if max_len > self.max_len or pre.tokens >= max_len:
            raise ValueError(f"max_len {max_len}: the decoder takes up to {self.max_len}, the prompt has "
                             f"{pre.tokens} tokens")
        n_keys = self._key_rows(self.groups * max_len)
        if self.index_limit is not None and self.index_reserved + n_keys > self.index_limit:
            raise CacheFull(f"indexer keys: {n_keys} more entries, room for "
                            f"{self.index_limit - self.index_reserved}")
        base = self.cache.open(rid, self.groups * max_len)
        self.index_reserved += n_keys
        top = self._key_rows(self.cache.space.top)
        if self.index_keys.shape[0] < top:
            grow = self.index_keys.new_empty(top - self.index_keys.shape[0], self.index_keys.shape[1])
            self.index_keys = torch.cat([self.index_keys, grow.fill_(math.nan) if self.cache.poison else grow])
        n = pre.tokens
        addrs = base + torch.arange(self.groups)[:, None] * max_len + torch.arange(n)  # [groups, n]
        self.cache.write(addrs.flatten(), pre.entries.reshape(self.groups * n, *self.cache.shape))
        self.set_index_keys(addrs.flatten(), pre.index_keys.reshape(self.groups * n, -1))
        self.reqs[rid] = _Req(-1, base, max_len, n)  # row -1: no page bounds (the indexer keys replace them)

    def prefill(self, rid, tokens: list[int], max_len: int) -> torch.Tensor:
        pre = self.run_prefill(tokens)
        self.add(rid, pre, max_len)
        return pre.logits

    def close(self, rid):
        r = self.reqs.pop(rid)
        self.cache.close(rid)
        self.index_reserved -= self._key_rows(self.groups * r.max_len)
        if self.cache.poison:
            self.set_index_keys(torch.arange(r.base, r.base + self.groups * r.max_len), math.nan)

    def _key_rows(self, n: int) -> int:
        """Indexer-key rows this rank stores for n consecutive addresses (at most)."""
        return n if self.shard is None else -(-n // self.shard[0])

    def set_index_keys(self, addrs: torch.Tensor, keys):
        if self.shard is None:
            self.index_keys[addrs] = keys
            return
        P, rank = self.shard
        mine = addrs % P == rank
        self.index_keys[addrs[mine] // P] = keys if isinstance(keys, float) else keys[mine]

    def length(self, rid) -> int:
        return self.reqs[rid].len

    # ---- decode

    @torch.inference_mode()
    def step(self, rids: list, tokens: list[int]) -> torch.Tensor:
        """One decode token per request -> float32 logits [B, V]."""
        reqs = _step_requests(self.reqs, rids, self.cache, self.budget, self.page)
        t = lambda xs: torch.tensor(xs, dtype=torch.long)
        pos, base = t([r.len for r in reqs]), t([r.base for r in reqs])
        fresh = base + pos
        ctx = pos + 1
        j = torch.arange(int(ctx.max()))
        # context "slots" are group-0 addresses; columns past a shorter request's context read its new token (masked)
        kv_slots = torch.where(j < ctx[:, None], base[:, None] + j, fresh[:, None])
        meta = AttentionMetadata(slot_mapping=fresh, batch_size=len(reqs), max_q_len=1, kv_slots=kv_slots,
                                 kv_range=None, mask=None, is_causal=False, q_dest=None, q_lens=[1] * len(reqs),
                                 ctx_lens=ctx.tolist())
        order = base.argsort()
        self.step_state = st = _MlaStep(list(rids), fresh, base[order], t([r.max_len for r in reqs])[order])
        h, _ = self.model(t(tokens), pos, self.views, meta)
        st.fetch.finish()  # the last group's reads are done
        for r in reqs:
            r.len += 1
        return self.model.compute_logits(h).float()

    def address(self, slots: torch.Tensor, g: int) -> torch.Tensor:
        """Group-0 addresses of this step's requests -> group g's addresses."""
        if g == 0:
            return slots
        st = self.step_state
        return slots + g * st.strides[torch.searchsorted(st.bases, slots, right=True) - 1]

    def _plan(self, g: int, j: int, slots, valid):
        """Layer j of group g has its selection ([B, K] group-0 addresses): at the group's first layer fetch the
        selected entries and the new tokens' (whose rows get this step's latent); later layers reuse the fetch."""
        st = self.step_state
        if j == 0:
            if st.fetch is not None:
                st.fetch.finish()  # the previous group's reads are done: commit its moves before planning this one
            fresh = self.address(st.fresh, g)
            addrs = torch.cat([self.address(slots, g), fresh[:, None]], 1)  # the new token's entry is always stored
            valid = torch.cat([valid, valid.new_zeros(valid.shape[0], 1)], 1)
            f = self.cache.fetch(st.rids, addrs, valid, fresh)
            st.need, inv = torch.unique(addrs, return_inverse=True)
            st.rows = torch.empty_like(st.need)
            st.rows[inv] = f.slots
            if self.worker is None:
                f.run(slice(None))
            else:  # this layer's part now, the group's later layers' part while this layer computes
                f.run(slice(0, 1))
                st.pending = self.worker.submit(_in_inference, f.run, slice(1, self.G))
            st.fetch = f
        if j == 1 and st.pending is not None:
            st.pending.result()
            st.pending = None
        st.fetch.pool[st.fetch.fresh_slots, j] = st.new.pop(j)
