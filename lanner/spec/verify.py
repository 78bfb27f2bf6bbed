"""Lossless verification of chain drafts.

Greedy: accept while the draft equals the target's argmax, then emit the target's token. Sampling: accept
draft d with probability min(1, p(d) / q(d)); on rejection draw from normalize(max(p - q, 0)); if all k are
accepted draw a bonus token from p. p and q are the target's and the draft's distributions after the request's
temperature / top-k / top-p / min-p. A proposer without probabilities has q = one-hot(d), which is still exact.
"""
from __future__ import annotations

import torch

from lanner.engine.sampling import processed_probs, sample_from_probs


def verify_chain(logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, params,
                 generator) -> list[int]:
    """logits: [k+1, V] target rows for (last token, d_1..d_k). Returns the emitted tokens (1..k+1)."""
    k = len(draft)
    if params.greedy:
        target = logits.argmax(-1).tolist()
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
