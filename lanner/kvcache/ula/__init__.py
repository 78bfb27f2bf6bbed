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

from lanner.kvcache.ula.backends import Fetch, GpuOnly, HiSparse, KVBackend, UlaDP
from lanner.kvcache.ula.store import (GB, AddressSpace, CacheFull, FreeList, StoreMove, TieredStore, entry_shape,
                                      slots_for)
from lanner.kvcache.ula.tp import UlaTP

__all__ = ["GB", "AddressSpace", "CacheFull", "FreeList", "StoreMove", "TieredStore", "entry_shape", "slots_for",
           "Fetch", "KVBackend", "GpuOnly", "UlaDP", "HiSparse", "UlaTP", "make_backend"]


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

