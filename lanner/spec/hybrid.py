"""Hybrid speculation: per request and per step, the suffix draft or the draft head's.

The suffix draft comes with its score, the tokens it expects to get accepted (lanner.spec.suffix). The head's
expectation is the running mean of its accepted tokens per verify step on this request (a prior until it has
drafted). The suffix draft wins when its score beats that; otherwise the head drafts, up to its own k. A
suffix draft costs microseconds, a head draft a head forward per token, so requests that the suffix index
serves well also skip the head's forwards.
"""
from __future__ import annotations

from lanner.spec.proposers import Proposer
from lanner.spec.suffix import SuffixProposer

HEAD_PRIOR = 0.5  # accepted tokens per head step before a request has any (the shipped head: ~0.4-0.5 at k = 3)
HEAD_DECAY = 0.7  # weight of the old mean per head step: recent text decides


class HybridProposer(Proposer):
    name = "hybrid"

    def __init__(self, suffix: SuffixProposer, head: Proposer, head_tokens: int):
        self.suffix, self.head, self.head_tokens = suffix, head, head_tokens

    def propose(self, requests, ks):
        out: list = [None] * len(requests)
        to_head = []
        for i, (r, k) in enumerate(zip(requests, ks)):
            tokens, score = self.suffix.draft(r, k)
            st = r.spec_state
            expect = HEAD_PRIOR if st.head_accepted is None else st.head_accepted
            if tokens and score > expect:
                st.source = self.suffix.name
                out[i] = (tokens, None)
            else:
                st.source = self.head.name
                to_head.append(i)
        if to_head:
            drafts = self.head.propose([requests[i] for i in to_head], [min(ks[i], self.head_tokens) for i in to_head])
            for i, d in zip(to_head, drafts):
                out[i] = d
        return out

    def after_verify(self, req, num_proposed, num_accepted, tokens_before):
        st = req.spec_state
        if st.source != self.head.name:
            return
        self.head.after_verify(req, num_proposed, num_accepted, tokens_before)
        prev = HEAD_PRIOR if st.head_accepted is None else st.head_accepted
        st.head_accepted = HEAD_DECAY * prev + (1 - HEAD_DECAY) * num_accepted

    def finish(self, req):
        self.suffix.finish(req)
