"""Lossless verification of drafts: chains, and trees of one-hot candidates (verify_tree).

Greedy: accept while the draft equals the target's argmax, then emit the target's token. Sampling: accept
draft d with probability min(1, p(d) / q(d)); on rejection draw from normalize(max(p - q, 0)); if all k are
accepted draw a bonus token from p. p and q are the target's and the draft's distributions after the request's
temperature / top-k / top-p / min-p. A proposer without probabilities has q = one-hot(d), which is still exact.
"""
from __future__ import annotations

import torch

from lanner.engine.sampling import processed_probs, sample_from_probs


def verify_chain(logits: torch.Tensor | None, draft: list[int], draft_probs: torch.Tensor | None, params,
                 generator, target: list[int] | None = None) -> list[int]:
    """logits: [k+1, V] target rows for (last token, d_1..d_k); target: their argmax where the step brought only
    that (greedy; logits None). Returns the emitted tokens (1..k+1)."""
    k = len(draft)
    if params.greedy:
        target = target if target is not None else logits.argmax(-1).tolist()
        out = []
        for i in range(k):
            if draft[i] != target[i]:
                break
            out.append(draft[i])
        out.append(target[len(out)])
        return out
    p = processed_probs(logits.float(), [params] * (k + 1))
    u = torch.rand(k, generator=generator, device=p.device).tolist() if k else []
    out = []
    for i, d in enumerate(draft):
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        p_d = float(p[i, d])
        if q_d > 0 and u[i] * q_d < p_d:  # u < p/q without dividing
            out.append(d)
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - draft_probs[i].to(p.dtype)).clamp_min_(0.0)
        total = residual.sum()
        if total <= 0:  # p == q exactly: any rejection is measure-zero, fall back to p
            residual = p[i]
            total = residual.sum()
        out.append(int(sample_from_probs((residual / total)[None], [generator])[0]))
        return out
    out.append(int(sample_from_probs(p[k][None], [generator])[0]))
    return out


def verify_tree(logits: torch.Tensor | None, tokens: list[int], parents: list[int], params,
                generator, target: list[int] | None = None) -> tuple[list[int], list[int]]:
    """A draft tree of one-hot candidates: logits [n+1, V] rows for (last token, node 0..n-1); parents[i] is node
    i's parent (-1: the last token), siblings carry distinct tokens. -> (emitted tokens, accepted nodes).

    From the root, a node's children are its candidates. Greedy: follow the child equal to the target's argmax.
    Sampling (SpecInfer / EAGLE-2 style, one-hot drafts): try the children in order; accept one with probability
    p(token) / (the mass p has left), else remove its token from p; when all are rejected draw from what is left.
    Each emitted token is so distributed as p, exactly: a rejection sampler without replacement."""
    children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]  # row -> its child nodes
    for i, parent in enumerate(parents):
        children[parent + 1].append(i)
    out, path, row = [], [], 0
    if params.greedy:
        target = target if target is not None else logits.argmax(-1).tolist()
        while True:
            nxt = next((c for c in children[row] if tokens[c] == target[row]), None)
            if nxt is None:
                return out + [target[row]], path
            out.append(tokens[nxt])
            path.append(nxt)
            row = nxt + 1
    probs = processed_probs(logits.float(), [params] * logits.shape[0])
    while True:
        p = probs[row].clone()
        for c in children[row]:
            left = float(p.sum())
            if float(torch.rand(1, generator=generator)) * left < float(p[tokens[c]]):
                break
            p[tokens[c]] = 0.0
        else:  # every candidate rejected (or none): draw from the mass left
            return out + [int(sample_from_probs((p / p.sum())[None], [generator])[0])], path
        out.append(tokens[c])
        path.append(c)
        row = c + 1
