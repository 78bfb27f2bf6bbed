"""Hybrid speculation: per request and per step, the suffix draft, the draft head's, or none, whichever is
expected to emit the most tokens per unit of time.

The suffix draft comes with its score, the tokens it expects to get accepted (lanner.spec.suffix); it costs
microseconds. The head's expectation is the running mean of its accepted tokens per verify step on this request
(a prior until it has drafted), and it costs a head forward per token: with a verify step taking T and a head
draft H, the head yields (1 + head accepted) tokens per T + H, a suffix draft (1 + score) per T. Both times are
measured as the engine runs (moving averages of the verify forwards and of the head's steady drafting calls), so the
choice follows the hardware: on lowlat's CPU path a head draft costs about as much as the verify step itself and
pays only when its acceptance is high; on a slow forward it is cheap in comparison. Until the head has drafted
once its cost counts as zero (it gets its chance). A seeded sample decides without the times: its drafts, and with
them the verifier's random draws, must be a function of its prompt and seed alone, not of the machine's load.
"""
from __future__ import annotations

import time

from lanner.spec.decoder import draft_room
from lanner.spec.proposers import Proposer
from lanner.spec.suffix import SuffixProposer

HEAD_PRIOR = 0.5  # accepted tokens per head step before a request has any (the shipped head: ~0.4-0.5 at k = 3)
HEAD_DECAY = 0.7  # weight of the old mean per head step: recent text decides
TIME_DECAY = 0.9  # weight of the old mean of the step and head times


class HybridProposer(Proposer):
    name = "hybrid"

    def __init__(self, suffix: SuffixProposer, head: Proposer, head_tokens: int):
        self.suffix, self.head, self.head_tokens = suffix, head, head_tokens
        self.verify_s: float | None = None  # moving mean of a verify forward's seconds
        self.head_s: float | None = None  # moving mean of a head drafting call's seconds

    def head_cost(self) -> float:
        """A head draft's time relative to a verify step (0 until both were measured)."""
        if self.verify_s is None or self.head_s is None:
            return 0.0
        return self.head_s / self.verify_s

    def propose(self, requests, ks, states):
        out: list = [None] * len(requests)
        to_head = []
        cost = self.head_cost()
        for i, (r, k, st) in enumerate(zip(requests, ks, states)):
            d = self.suffix.draft(r, st, k)
            expect = HEAD_PRIOR if st.head_accepted is None else st.head_accepted
            seeded = r.params.seed is not None and not r.params.greedy
            if (1 + expect) / (1 + (0.0 if seeded else cost)) > 1 + (d.score if d.tokens else 0.0):
                st.source = self.head.name
                to_head.append(i)
            else:  # the suffix draft (possibly empty: a plain decode step is the better bet)
                st.source = self.suffix.name
                out[i] = (d.tokens, None, d.parents)
        if to_head:
            # only steady-state calls are timed: a head catching up on a long stretch (a prompt, a run of suffix
            # drafts) pays that once, and one such sample must not lock the head out for good
            steady = all(states[i].features is None or states[i].features.shape[0] <= ks[i] + 1 for i in to_head)
            t0 = time.perf_counter()
            drafts = self.head.propose([requests[i] for i in to_head],
                                       [min(ks[i], self.head_tokens, draft_room(requests[i])) for i in to_head],
                                       [states[i] for i in to_head])
            if steady:
                self.head_s = _mean(self.head_s, time.perf_counter() - t0)
            for i, d in zip(to_head, drafts):
                out[i] = d
        return out

    def after_step(self, seconds: float):
        self.verify_s = _mean(self.verify_s, seconds)

    def after_verify(self, req, st, num_proposed, num_accepted, tokens_before):
        if st.source != self.head.name:
            return
        self.head.after_verify(req, st, num_proposed, num_accepted, tokens_before)
        prev = HEAD_PRIOR if st.head_accepted is None else st.head_accepted
        st.head_accepted = HEAD_DECAY * prev + (1 - HEAD_DECAY) * num_accepted

    def finish(self, req, st, completed):
        self.head.finish(req, st, completed)
        self.suffix.finish(req, st, completed)

    def forget(self):
        self.suffix.forget()


def _mean(old: float | None, new: float) -> float:
    return new if old is None else TIME_DECAY * old + (1 - TIME_DECAY) * new
