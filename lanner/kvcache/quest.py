"""Training-free sparse decode attention for dense models (Quest-style), and the KV access traces it produces.

Each decode query reads only the `budget` tokens of the pages (page_size tokens) whose keys can score highest:
a page's bound is sum_d max(q_d * kmin_d, q_d * kmax_d) from the per-page elementwise key min/max, summed over
the heads of the layer, so one selection serves all heads of a layer; a layer group of G layers shares the
selection of its first layer (like GLM-5's shared indexer). The query's own (last) page is always kept. Prefill
stays dense. This gives the default SmolLM2 model realistic sparse access patterns on real long text, which is
what UlaCache's policies are measured on (`lanner bench kv lru`; the documents and the quality evaluation that
records the trace are lanner.bench.kv_quality).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lanner.layers.attention import AttentionBackend, build_attention_metadata, paged_attention


class QuestSelector(AttentionBackend):
    """Quest-sparse decode attention over the paged cache: each decode query reads the selected pages only."""

    def __init__(self, num_layers: int, page_size: int = 16, budget: int = 256, group: int = 1):
        if budget < page_size or page_size <= 0 or group <= 0:
            raise ValueError("quest: need page_size > 0, budget >= page_size, group > 0")
        self.L, self.page, self.budget, self.group = num_layers, page_size, budget, group
        self.selected: list[list[torch.Tensor]] = []  # per layer group of the last step: per sequence, positions
        self._mask = None

    def start_step(self):
        self.selected = []

    def forward(self, q, k, v, layer, k_cache, v_cache, meta, scale):
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale,
                               select=lambda qp, kp: self.decode_mask(qp, kp, meta, layer))

    def decode_mask(self, qp: torch.Tensor, kp: torch.Tensor, meta, layer: int) -> torch.Tensor:
        """qp: [B, 1, H, D] decode queries; kp: [B, Lmax, Hkv, D] their keys. -> bool mask [B, 1, 1, Lmax]: a
        group's first layer selects, the group's later layers reuse its selection."""
        if layer % self.group and self._mask is not None:
            return self._mask
        B, L, Hkv, D = kp.shape
        ctx = torch.tensor(meta.ctx_lens, device=kp.device)
        P = -(-L // self.page)
        pad = P * self.page - L
        valid = torch.arange(P * self.page, device=kp.device)[None, :] < ctx[:, None]  # [B, P*page]
        k = F.pad(kp.float(), (0, 0, 0, 0, 0, pad)).view(B, P, self.page, Hkv, D)
        v = valid.view(B, P, self.page, 1, 1)
        kmax = k.masked_fill(~v, -math.inf).amax(2)  # [B, P, Hkv, D]
        kmin = k.masked_fill(~v, math.inf).amin(2)
        keep = quest_pages(qp, kmax, kmin, ctx, self.page, self.budget)
        mask = keep.repeat_interleave(self.page, dim=1)[:, :L] & valid[:, :L]
        self._mask = mask[:, None, None, :]
        self.selected.append([mask[b].nonzero().flatten().cpu() for b in range(B)])
        return self._mask


def quest_pages(qp, kmax, kmin, ctx, page: int, budget: int) -> torch.Tensor:
    """The page selection. qp: [B, 1, H, D] decode queries; kmax/kmin: [B, P, Hkv, D] float32 per-page key bounds;
    ctx: [B] context lengths. -> keep [B, P] bool: the `budget // page` best pages, always the query's own."""
    B, P, Hkv, D = kmax.shape
    q = qp[:, 0].float().view(B, Hkv, qp.shape[2] // Hkv, D)  # query heads grouped by the KV head they read
    bound = torch.maximum(q[:, None] * kmax[:, :, :, None], q[:, None] * kmin[:, :, :, None])  # [B,P,Hkv,g,D]
    score = bound.nan_to_num(neginf=-math.inf).sum(dim=(2, 3, 4))
    pages_valid = -(-ctx // page)
    page_ids = torch.arange(P, device=kmax.device)[None, :]
    score = score.masked_fill(page_ids >= pages_valid[:, None], -math.inf)
    score[torch.arange(B, device=kmax.device), pages_valid - 1] = math.inf  # the query's own page
    keep = torch.zeros(B, P, dtype=torch.bool, device=kmax.device)
    keep.scatter_(1, score.topk(min(budget // page, P), dim=1).indices, True)
    return keep & (page_ids < pages_valid[:, None])


class SparseSession:
    """One sequence decoded token by token over its own KV pool, dense or Quest-sparse."""

    def __init__(self, model, max_len: int, block_size: int = 16, selector: QuestSelector | None = None):
        self.model, self.bs, self.selector = model, block_size, selector
        w = next(model.parameters())
        nb = -(-max_len // block_size)
        self.table = list(range(nb))
        self.kv = [tuple(torch.zeros(nb * block_size, *s, dtype=w.dtype, device=w.device) for s in layer)
                   for layer in model.kv_cache_shapes()]
        self.len = 0

    @torch.inference_mode()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Appends tokens; returns float32 logits of their rows. Single tokens go through the sparse path."""
        n = len(tokens)
        meta = build_attention_metadata([n], [self.len + n], [self.table], self.bs, "cpu")
        if self.selector is not None and n == 1:
            meta.backend = self.selector
            self.selector.start_step()
        pos = torch.arange(self.len, self.len + n)
        h, _ = self.model(torch.tensor(tokens), pos, self.kv, meta)
        self.len += n
        return self.model.compute_logits(h).float()
