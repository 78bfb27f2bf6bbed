"""Quest-sparse decoding on real long text, the experiment behind `lanner bench kv trace` and `capacity`: long
documents made of ShareGPT conversations, and the teacher-forced quality of sparse against dense decoding, which
records the sparse run's KV access trace (replayed by `lanner bench kv lru`)."""
from __future__ import annotations

import json
import math
import random

import torch

from lanner.kvcache.quest import QuestSelector, SparseSession
from lanner.train.data import sharegpt_records


def long_documents(tokenizer, n_tokens: int, count: int, seed: int = 0) -> list[list[int]]:
    """Real long text: whole ShareGPT conversations (every turn), shuffled by `seed`, concatenated into documents
    of exactly n_tokens tokens."""
    records = sharegpt_records()
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
