"""UlaCache across tensor-parallel ranks: entry a lives on rank a mod P; ranks fetch each other's entries in one
all_gather."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lanner.kvcache.lru import PBLRU
from lanner.kvcache.ula.backends import Fetch, KVBackend
from lanner.kvcache.ula.store import CacheFull, TieredStore, new_pool, rows_at, slots_for

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
        self.dev = new_pool(ndev, self.shape, dtype, device, False, poison)
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
        dst = self.nhome + rows_at(plan.addrs, bs, want)
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

        return Fetch(self.dev, rows_at(need, rows, addrs), rows_at(need, rows, fresh), run, finish)

