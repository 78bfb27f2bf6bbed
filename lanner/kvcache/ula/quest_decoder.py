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
from lanner.layers.attention import AttentionBackend, AttentionMetadata


@dataclass
class Prefilled:
    """A prompt's dense prefill: its entries, its page bounds and its last token's logits."""

    tokens: int
    entries: torch.Tensor  # [groups, n, G, 2, Hkv, D]
    kmax: torch.Tensor  # [groups, pages, Hkv, D] float32
    kmin: torch.Tensor
    logits: torch.Tensor  # [V] float32
    features: torch.Tensor | None = None  # [n, F] the captured layers' outputs (a draft head's input)


@dataclass
class SeqRange:
    row: int
    base: int
    max_len: int
    len: int


@dataclass
class _Step:
    """One decode step: request b feeds q[b] tokens at positions pos[b]..; the flat rows (one per token, request
    by request) are request row_req at offset row_i."""
    rids: list
    rows: torch.Tensor  # [B] the requests' page-bound rows
    pos: torch.Tensor  # [B] first new position
    q: torch.Tensor  # [B] new tokens
    bases: torch.Tensor
    max_lens: torch.Tensor
    row_req: torch.Tensor  # [T]
    row_i: torch.Tensor  # [T]
    commit: bool = True
    fetch: Fetch | None = None
    mask: torch.Tensor | None = None  # [B, 1, Q, N] (None: every fetched entry, one query per request)
    pending: object = None
    selected: list = field(default_factory=list)  # per group: (positions [B, N], valid [B, N])
    keys: list = field(default_factory=list)  # per group: the new tokens' float32 keys [T, Hkv, D] (bounds)

    @property
    def row_pos(self) -> torch.Tensor:
        return self.pos[self.row_req] + self.row_i


def step_requests(reqs: dict, rids: list, cache, budget: int, page: int, q: list[int] | None = None) -> list:
    """The requests of one decode step (q[b] new tokens each, default 1), refused when one would pass its max_len
    or when the step's worst case (every query reading `budget` tokens in pages of `page`) may not fit the device
    slots: scheduled by the worst case, not by luck."""
    out = [reqs[r] for r in rids]
    q = q or [1] * len(out)
    if any(r.len + n > r.max_len for r, n in zip(out, q)):
        raise ValueError("a request reached its max_len")
    if not cache.step_fits(q, budget, page):
        raise CacheFull(f"{cache.name}: a step of {len(q)} requests feeding {sum(q)} queries may need more device "
                        f"slots than there are")
    return out


class UlaDecoder(AttentionBackend):
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
        self.mode, self.step_state, self.captured = None, None, []
        self.capture_layers: tuple = ()  # layers whose outputs each step keeps (features), for a draft head
        self.features: torch.Tensor | None = None  # the last step's, a row per token

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
        self.mode, self.captured = "prefill", []
        meta = AttentionMetadata(slot_mapping=None, batch_size=1, max_q_len=n, kv_slots=None, kv_range=None,
                                 mask=None, is_causal=True, q_dest=None, backend=self)
        h, feats = self.model(torch.tensor(tokens), torch.arange(n), self.no_kv, meta, self.capture_layers)
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
        return Prefilled(n, entries, kmax, kmin, logits, joined(feats))

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
    def step(self, rids: list, tokens: list, commit: bool = True) -> torch.Tensor:
        """tokens: per request one new token, or a list of them (its last token and a draft to verify) -> float32
        logits, a row per token in request order. Each token's query selects and reads as a step of its own would
        (its pages' bounds hold the tokens up to it). commit=False leaves the new tokens pending until accept()
        says how many of them stay (a verify step)."""
        tokens = [[t] if isinstance(t, int) else list(t) for t in tokens]
        q = [len(x) for x in tokens]
        reqs = step_requests(self.reqs, rids, self.cache, self.budget, self.page, q)
        t = lambda xs: torch.tensor(xs, dtype=torch.long)
        qt = t(q)
        row_req = torch.repeat_interleave(torch.arange(len(q)), qt)
        row_i = torch.arange(int(qt.sum())) - torch.repeat_interleave(qt.cumsum(0) - qt, qt)
        st = _Step(list(rids), t([r.row for r in reqs]), t([r.len for r in reqs]), qt, t([r.base for r in reqs]),
                   t([r.max_len for r in reqs]), row_req, row_i, commit)
        self.mode, self.step_state = "decode", st
        meta = AttentionMetadata(slot_mapping=None, batch_size=len(reqs), max_q_len=max(q), kv_slots=None,
                                 kv_range=None, mask=None, is_causal=False, q_dest=None, backend=self)
        h, feats = self.model(t([x for xs in tokens for x in xs]), st.row_pos, self.no_kv, meta, self.capture_layers)
        self.features = joined(feats)
        if commit:
            for rid, r, n in zip(rids, reqs, q):
                self.accept(rid, r.len + n)
        return self.model.compute_logits(h).float()

    def accept(self, rid, length: int):
        """After a step with commit=False: the request keeps its first `length` positions (the verified ones);
        their pages' bounds take the kept tokens' keys, the rejected ones are overwritten by later steps."""
        st, r = self.step_state, self.reqs[rid]
        b = st.rids.index(rid)
        n = length - r.len
        if not 0 <= n <= int(st.q[b]):
            raise ValueError(f"accept: {length} positions, the step fed {r.len}..{r.len + int(st.q[b])}")
        rows = ((st.row_req == b) & (st.row_i < n)).nonzero().flatten()
        for g, kf in enumerate(st.keys):
            self._fold(r.row, g, st.row_pos[rows], kf[rows])
        r.len = length

    def _fold(self, row: int | torch.Tensor, g: int, pos: torch.Tensor, kf: torch.Tensor):
        """Widens the stored page bounds of bound-row(s) `row` by the float32 keys kf of the tokens at `pos`."""
        widen(self.kmax, self.kmin, (torch.as_tensor(row) * self.groups + g) * self.pages + pos // self.page, kf)

    @property
    def selected(self) -> list:
        """The last step's selection per group: per sequence, the positions it read."""
        return [[idx[b][valid[b]] for b in range(idx.shape[0])] for idx, valid in self.step_state.selected]

    def forward(self, q, k, v, layer, k_cache, v_cache, meta, scale):
        """Every layer's attention (meta.backend is this decoder): the model's own caches are unused."""
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
        fresh = f.fresh_slots.view(st.q.numel(), -1)[st.row_req, st.row_i]
        f.pool[fresh, j, 0] = k  # the new tokens' entries are written through the cache ...
        f.pool[fresh, j, 1] = v
        kp, vp = f.pool[f.slots, j, 0], f.pool[f.slots, j, 1]  # ... and read back with the selected ones
        B, Q = st.q.numel(), int(st.q.max())
        if Q == 1:
            qp = q.view(T, 1, H, D)
        else:  # one padded row of queries per request
            qp = q.new_zeros(B, Q, H, D)
            qp[st.row_req, st.row_i] = q
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                             attn_mask=st.mask, scale=scale, enable_gqa=True).transpose(1, 2)
        if j == self.G - 1:
            f.finish()
        return (out.reshape(T, H * D) if Q == 1 else out[st.row_req, st.row_i]).reshape(T, H * D)

    def _select(self, st: _Step, g: int, q, k):
        T, H, D = q.shape
        B, Q = st.q.numel(), int(st.q.max())
        kf = k.float()
        pos = st.row_pos
        ctx = pos + 1
        L = int(ctx.max())
        P = -(-L // self.page)
        if Q == 1 and st.commit:  # a plain decode step: the new keys join the stored bounds now
            self._fold(st.rows, g, pos, kf)
            kmax, kmin = self.kmax[st.rows, g, :P], self.kmin[st.rows, g, :P]
        else:  # each query's own bounds: the stored ones and the new tokens up to it (none stored before accept)
            st.keys.append(kf)
            kmax, kmin = self.kmax[st.rows[st.row_req], g, :P], self.kmin[st.rows[st.row_req], g, :P]
            # the token at row s widens the bounds of rows s, s + 1, .. of its request
            rows = [(st.row_i + d < st.q[st.row_req]).nonzero().flatten() for d in range(Q)]
            src, dst = torch.cat(rows), torch.cat([r + d for d, r in enumerate(rows)])
            widen(kmax, kmin, dst * P + pos[src] // self.page, kf[src])
        keep = quest_pages(q.view(T, 1, H, D), kmax, kmin, ctx, self.page, self.budget)
        tok = keep.repeat_interleave(self.page, 1)[:, :L] & (torch.arange(L)[None, :] < ctx[:, None])  # [T, L]
        want = tok if Q == 1 else torch.zeros(B, L, dtype=torch.int32).index_add_(0, st.row_req, tok.int()) > 0
        N = int(want.sum(1).max())
        idx = torch.where(want, torch.arange(L), L).sort(1).values[:, :N]  # positions in order, padded with L
        valid = idx < L
        first = st.bases + g * st.max_lens  # address of position 0 of this group
        fresh = first[:, None] + st.pos[:, None] + torch.minimum(torch.arange(Q)[None, :], st.q[:, None] - 1)
        addrs = torch.where(valid, first[:, None] + idx, fresh[:, :1])  # padding reads a new token (masked)
        if Q == 1:
            st.mask = None if bool(valid.all()) else valid[:, None, None, :]
        else:  # row t reads what its own selection holds
            rows = tok.gather(1, idx.clamp(max=L - 1)[st.row_req]) & valid[st.row_req]  # [T, N]
            st.mask = torch.zeros(B, Q, N, dtype=torch.bool)
            st.mask[:, :, 0] = True  # padding queries (discarded) read something
            st.mask[st.row_req, st.row_i] = rows
            st.mask = st.mask[:, None]
        st.selected.append((idx, valid))
        f = self.cache.fetch(st.rids, addrs, valid, fresh)
        if self.worker is None:
            f.run(slice(None))
        else:
            f.run(slice(0, 1))
            st.pending = self.worker.submit(in_inference, f.run, slice(1, self.G))
        st.fetch = f


def widen(kmax: torch.Tensor, kmin: torch.Tensor, at: torch.Tensor, kf: torch.Tensor):
    """Page bounds (contiguous, [..., Hkv, D]) at flat page indices `at` take the keys kf [n, Hkv, D]: a reduction,
    not an indexed assignment, since several keys may share a page (the last write would win)."""
    idx = at[:, None, None].expand_as(kf)
    kmax.view(-1, *kf.shape[1:]).scatter_reduce_(0, idx, kf, "amax")
    kmin.view(-1, *kf.shape[1:]).scatter_reduce_(0, idx, kf, "amin")


def joined(captured: list) -> torch.Tensor | None:
    """The captured layers' outputs side by side ([T, layers * hidden]), as a draft head reads them."""
    return torch.cat(captured, -1) if captured else None


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

