"""UlaCache decoding of MLA + DSA models (GLM-5, DeepSeek-V3.2): the model's own indexer selects, the selected
latent entries are fetched from a UlaCache backend (lanner.kvcache.ula), under tensor parallelism too."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lanner.distributed import all_gather_last
from lanner.kvcache.ula.quest_decoder import SeqRange, UlaDecoder, in_inference, joined, step_requests
from lanner.kvcache.ula import GB, CacheFull, Fetch, KVBackend, UlaTP
from lanner.kvcache.ula.store import rows_at
from lanner.layers.attention import AttentionMetadata
from lanner.models.dsa_step import LatentStore, ShardedIndexKeys

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
    features: torch.Tensor | None = None  # [n, F] the captured layers' outputs (an MTP layer's input)


@dataclass
class _MlaStep:
    rids: list
    q: torch.Tensor  # [B] new tokens per request
    fresh: torch.Tensor  # [B, Qmax] the new tokens' group-0 addresses (padding repeats a request's last one)
    row_req: torch.Tensor  # [T] request of each new token ...
    row_i: torch.Tensor  # ... and its index among the request's new tokens
    base: torch.Tensor  # [B] each request's group-0 address of position 0
    commit: bool
    bases: torch.Tensor  # [B] the requests' base addresses, sorted ...
    strides: torch.Tensor  # ... and their max_len: group g's entry of group-0 address a is a + g * stride
    new: dict = field(default_factory=dict)  # layer in group -> the new tokens' latent, written before the fetch
    fetch: Fetch | None = None
    need: torch.Tensor | None = None  # the group's fetched addresses (sorted) ...
    rows: torch.Tensor | None = None  # ... and their rows in fetch.pool
    pending: object = None


class _LatentView(LatentStore):
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
        return st.fetch.pool[rows_at(st.need, st.rows, self.dec.address(slots, self.g)), self.j]


class _IndexView:
    """The indexer keys of group g's indexer layer: resident, one row per entry (its address)."""

    def __init__(self, dec, g: int):
        self.dec, self.g = dec, g

    def __setitem__(self, slots, keys):
        self.dec.set_index_keys(self.dec.address(slots, self.g), keys)

    def __getitem__(self, slots):
        return self.dec.index_keys[self.dec.address(slots, self.g)]


class _ShardedIndexView(_IndexView, ShardedIndexKeys):
    """Under UlaTP: this rank's entries only (row address // P); the selection is merged across ranks."""

    def __getitem__(self, slots):
        raise RuntimeError("indexer keys are sharded over the TP ranks: read them through select_top")

    def select_top(self, indexer, q, w, step):
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
                index = _IndexView if self.shard is None else _ShardedIndexView
                self.views.append((v, index(self, g)) if j == 0 else (v,))
        self.reqs: dict = {}
        self.worker = None
        self.set_prefetch(prefetch)
        self.step_state = None
        self.capture_layers: tuple = ()  # layers whose outputs each step keeps (features), for an MTP draft
        self.features: torch.Tensor | None = None

    set_prefetch = UlaDecoder.set_prefetch

    # ---- requests

    @torch.inference_mode()
    def run_prefill(self, tokens: list[int]) -> MlaPrefilled:
        n = len(tokens)
        caches = [tuple(torch.empty(n, *s, dtype=self.dtype) for s in shapes)
                  for shapes in self.model.kv_cache_shapes()]
        meta = AttentionMetadata(slot_mapping=torch.arange(n), batch_size=1, max_q_len=n, kv_slots=None,
                                 kv_range=(0, n), mask=None, is_causal=True, q_dest=None, q_lens=[n], ctx_lens=[n])
        h, feats = self.model(torch.tensor(tokens), torch.arange(n), caches, meta, self.capture_layers)
        logits = self.model.compute_logits(h[-1:]).float()[0]
        entries = torch.stack([torch.stack([caches[i][0] for i in layers], 1) for layers in self.layer_groups])
        keys = torch.stack([caches[layers[0]][1] for layers in self.layer_groups])
        return MlaPrefilled(n, entries, keys, logits, joined(feats))

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
        self.reqs[rid] = SeqRange(-1, base, max_len, n)  # row -1: no page bounds (the indexer keys replace them)

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

    length = UlaDecoder.length

    # ---- decode

    @torch.inference_mode()
    def step(self, rids: list, tokens: list, commit: bool = True) -> torch.Tensor:
        """tokens: per request one new token, or a list of them (its last token and a draft to verify) -> float32
        logits, a row per token in request order; each token's query selects (the indexer) over the context up to
        it. commit=False leaves the new tokens pending until accept() says how many of them stay (a verify step)."""
        tokens = [[t] if isinstance(t, int) else list(t) for t in tokens]
        q = [len(x) for x in tokens]
        reqs = step_requests(self.reqs, rids, self.cache, self.budget, self.page, q)
        t = lambda xs: torch.tensor(xs, dtype=torch.long)
        pos, base, qt = t([r.len for r in reqs]), t([r.base for r in reqs]), t(q)
        B, Q = len(reqs), max(q)
        row_req = torch.repeat_interleave(torch.arange(B), qt)
        row_i = torch.arange(int(qt.sum())) - torch.repeat_interleave(qt.cumsum(0) - qt, qt)
        fresh = base[:, None] + pos[:, None] + torch.minimum(torch.arange(Q)[None, :], qt[:, None] - 1)  # [B, Q]
        ctx = pos + qt
        j = torch.arange(int(ctx.max()))
        # context "slots" are group-0 addresses; columns past a shorter request's context read its new token (masked)
        kv_slots = torch.where(j < ctx[:, None], base[:, None] + j, fresh[:, :1])
        meta = AttentionMetadata(slot_mapping=fresh[row_req, row_i], batch_size=B, max_q_len=Q, kv_slots=kv_slots,
                                 kv_range=None, mask=None, is_causal=False,
                                 q_dest=None if min(q) == Q else row_req * Q + row_i, q_lens=q, ctx_lens=ctx.tolist())
        order = base.argsort()
        self.step_state = st = _MlaStep(list(rids), qt, fresh, row_req, row_i, base, commit, base[order],
                                        t([r.max_len for r in reqs])[order])
        h, feats = self.model(t([x for xs in tokens for x in xs]), pos[row_req] + row_i, self.views, meta,
                              self.capture_layers)
        self.features = joined(feats)
        st.fetch.finish()  # the last group's reads are done
        if commit:
            for r, n in zip(reqs, q):
                r.len += n
        return self.model.compute_logits(h).float()

    def accept(self, rid, length: int):
        """After a step with commit=False: the request keeps its first `length` positions (the verified ones).
        Rejected positions' entries and indexer keys lie past its length, where later steps overwrite them."""
        st, r = self.step_state, self.reqs[rid]
        q = int(st.q[st.rids.index(rid)])
        if not r.len <= length <= r.len + q:
            raise ValueError(f"accept: {length} positions, the step fed {r.len}..{r.len + q}")
        r.len = length

    def address(self, slots: torch.Tensor, g: int) -> torch.Tensor:
        """Group-0 addresses of this step's requests -> group g's addresses."""
        if g == 0:
            return slots
        st = self.step_state
        return slots + g * st.strides[torch.searchsorted(st.bases, slots, right=True) - 1]

    def _plan(self, g: int, j: int, slots, valid):
        """Layer j of group g has its selection ([T, K] group-0 addresses, a row per query): at the group's first
        layer fetch each request's selected entries (the union over its queries) and its new tokens' (whose rows
        get this step's latent); later layers reuse the fetch."""
        st = self.step_state
        if j == 0:
            if st.fetch is not None:
                st.fetch.finish()  # the previous group's reads are done: commit its moves before planning this one
            if slots.shape[0] != st.q.numel():  # several queries per request: their union, each address once
                slots, valid = self._union(slots, valid)
            fresh = self.address(st.fresh, g)
            addrs = torch.cat([self.address(slots, g), fresh], 1)  # the new tokens' entries are always stored
            valid = torch.cat([valid, valid.new_zeros(fresh.shape)], 1)
            f = self.cache.fetch(st.rids, addrs, valid, fresh)
            st.need, inv = torch.unique(addrs, return_inverse=True)
            st.rows = torch.empty_like(st.need)
            st.rows[inv] = f.slots
            if self.worker is None:
                f.run(slice(None))
            else:  # this layer's part now, the group's later layers' part while this layer computes
                f.run(slice(0, 1))
                st.pending = self.worker.submit(in_inference, f.run, slice(1, self.G))
            st.fetch = f
        if j == 1 and st.pending is not None:
            st.pending.result()
            st.pending = None
        st.fetch.pool[st.fetch.fresh_slots.view(st.fresh.shape)[st.row_req, st.row_i], j] = st.new.pop(j)

    def _union(self, slots, valid):
        """Query rows' selections [T, K] -> each request's distinct selected slots [B, N] (padded, not valid)."""
        st = self.step_state
        B = st.q.numel()
        first = st.base
        pos = torch.where(valid, slots - first[st.row_req, None], 0)
        L = int(pos.max()) + 1
        want = torch.zeros(B, L, dtype=torch.bool)
        want[st.row_req[:, None].expand_as(pos)[valid], pos[valid]] = True
        N = max(1, int(want.sum(1).max()))
        idx = torch.where(want, torch.arange(L), L).sort(1).values[:, :N]
        ok = idx < L
        return torch.where(ok, first[:, None] + idx, st.fresh[:, :1]), ok
