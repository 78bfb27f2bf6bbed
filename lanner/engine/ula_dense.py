"""Quest-sparse decoding of a dense model whose KV lives in a UlaCache backend (lanner.kvcache.ula): prefill is
dense and writes its entries through the backend; each decode step fetches only the selected entries."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lanner.kvcache.quest import quest_pages
from lanner.kvcache.ula import CacheFull, Fetch, KVBackend, entry_shape
from lanner.layers.attention import AttentionMetadata


@dataclass
class Prefilled:
    """A prompt's dense prefill: its entries, its page bounds and its last token's logits."""

    tokens: int
    entries: torch.Tensor  # [groups, n, G, 2, Hkv, D]
    kmax: torch.Tensor  # [groups, pages, Hkv, D] float32
    kmin: torch.Tensor
    logits: torch.Tensor  # [V] float32


@dataclass
class SeqRange:
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


def step_requests(reqs: dict, rids: list, cache, budget: int, page: int) -> list:
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
        self.reqs[rid] = SeqRange(row, base, max_len, n)

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
        reqs = step_requests(self.reqs, rids, self.cache, self.budget, self.page)
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
            st.pending = self.worker.submit(in_inference, f.run, slice(1, self.G))
        st.fetch = f


def in_inference(fn, *args):
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

