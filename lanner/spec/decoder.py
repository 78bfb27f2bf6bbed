"""Speculative decoding as the engine runs it: how many draft tokens each request may verify this step, the
drafts (the proposer's, and the tokens a grammar forces), their lossless verification against the target's
logits, and what each verify step accepted (per request and in the metrics). The engine calls it between
scheduling and the forward, and again with the logits; the KV system rolls back what was rejected."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lanner.distributed import tp_disabled
from lanner.spec.verify import argmax_rows, verify_chain, verify_tree
from lanner.structured import apply_bitmask, propose_drafts


@dataclass
class SpecStats:
    """One request's speculation so far (reported in its metrics)."""

    drafted: dict = field(default_factory=dict)  # draft tokens proposed, by proposer
    accepted: dict = field(default_factory=dict)  # draft tokens accepted, by proposer
    steps: int = 0  # verify steps
    emitted: int = 0  # tokens emitted by verify steps (accepted drafts + 1 each)
    accepted_at: list = field(default_factory=list)  # [i]: verify steps whose draft token i+1 was accepted

    def metrics(self) -> dict:
        return {"spec_accept_length": self.emitted / self.steps if self.steps else None,
                "spec_verify_steps": self.steps, "spec_accepted_per_position": list(self.accepted_at),
                "spec_draft_tokens": dict(self.drafted), "spec_accepted_tokens": dict(self.accepted)}


@dataclass
class DraftState:
    """A request's drafting progress, kept by the SpecDecoder (by request id) and handed to its proposer."""

    computed: int = 0  # positions whose KV the draft holds
    # draft heads: target features of positions computed.. not yet consumed, as the steps appended them (joined
    # when read: a cat per step would copy the whole backlog each time, and a request the hybrid keeps on suffix
    # drafts builds one of ~10 MB)
    feature_rows: list[torch.Tensor] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # the draft's own KV blocks (a target without block tables)
    suffix: object = None  # the suffix proposer's index over the request's tokens
    source: str | None = None  # the proposer that drafted the request's last step
    head_accepted: float | None = None  # hybrid: running mean of the head's accepted tokens per step
    suffix_predicted: float = 0.0  # hybrid: accepted tokens the suffix draft of the last step was expected to get
    suffix_chain: tuple[list[float], int] | None = None  # hybrid: that draft's running probabilities and match

    @property
    def features(self) -> torch.Tensor | None:
        if len(self.feature_rows) > 1:
            self.feature_rows = [torch.cat(self.feature_rows)]
        return self.feature_rows[0] if self.feature_rows else None

    @features.setter
    def features(self, rows: torch.Tensor | None):
        self.feature_rows = [] if rows is None else [rows]


def draft_room(req) -> int:
    """Most draft tokens one path may hold: the verify step's last emitted token is the request's last allowed
    one (the engine admits prompt + max_tokens within the context)."""
    return req.max_tokens - len(req.output_ids) - 1


class SpecDecoder:
    def __init__(self, proposer, config, metrics):
        self.proposer, self.config, self.metrics = proposer, config, metrics
        self.states: dict[str, DraftState] = {}
        self.learner = None  # lanner.spec.learn.DraftLearner under --learn-draft: keeps the verified features

    def state(self, req) -> DraftState:
        st = self.states.get(req.request_id)
        if st is None:
            st = self.states[req.request_id] = DraftState()
        return st

    def tokens(self, req, batch_size: int) -> int:
        """Draft tokens `req` may verify in a step of `batch_size` running requests (the scheduler's question)."""
        p = req.params
        room = draft_room(req)
        if p.unverified_draft:  # data generation: drafts at any batch size
            return min(p.unverified_draft, room)
        if batch_size > self.config.spec_max_batch or not self._may_draft(req):
            return 0
        # constrained requests also draft the tokens their grammar forces (lanner.structured.propose_drafts)
        k = max(self.config.draft_limit if self.proposer is not None else 0,
                self.config.grammar_draft_tokens if req.grammar is not None else 0)
        if self.config.spec_tree and req.grammar is None and room > 0:
            return k  # a tree's paths, not its node count, stay within the room (the proposer cuts them there)
        return min(k, room)

    @staticmethod
    def _may_draft(req) -> bool:
        """Whether the request's sampling allows drafts at all (the verifier applies no penalties, logprobs or
        logit bias)."""
        p = req.params
        return p.speculative and not (p.has_penalties or p.logprobs is not None or p.logit_bias)

    def propose(self, items) -> bool:
        """Fills the drafts of the scheduled items that may speculate; -> whether any may."""
        for it in items:
            if it.admitted:  # the KV system (re)starts it at it.start: what the draft held past that is gone
                st = self.state(it.request)
                st.computed, st.features = it.start, None
            if self.proposer is not None and it.samples and not it.request.output_ids and self._may_draft(it.request):
                # the step that ends the prompt's prefill: per-prompt drafting work (a suffix index over the
                # prompt, ~3 us per token) is done with the prompt, not in the first decode step
                self.proposer.prepare(it.request, self.state(it.request))
        spec = [it for it in items if it.num_spec > 0]
        if spec:
            t0 = time.perf_counter()
            draft = rollback = None
            if self.proposer is not None:
                def draft(reqs, ks):
                    return self.proposer.propose(reqs, ks, [self.state(r) for r in reqs])

                def rollback(req, proposed):  # the grammar cut a whole draft: as after a verify accepting none
                    self.proposer.after_verify(req, self.state(req), proposed, 0, req.num_tokens)
            with tp_disabled():  # drafts run on rank 0 only and must not enter the group's collectives
                propose_drafts(draft, rollback, spec, self.config.draft_limit, self.config.grammar_draft_tokens > 0)
            if self.proposer is not None:
                self.metrics.child(self.metrics.spec_propose_seconds, self.proposer.name).inc(time.perf_counter() - t0)
                self.metrics.child(self.metrics.spec_propose_steps, self.proposer.name).inc()
        return bool(spec)

    @staticmethod
    def verify(it, logits: torch.Tensor) -> list[int]:
        """A drafted item's k + 1 logits rows (a greedy step: their argmax) -> the tokens it emits: the accepted
        drafts and one more (it.path:
        the accepted draft nodes)."""
        req = it.request
        if req.params.unverified_draft:  # accept all; the target adds one token
            it.path = list(range(len(it.draft)))
            return it.draft + [argmax_rows(logits)[-1]]
        if it.draft_parents is not None:
            tokens, it.path = verify_tree(logits, it.draft, it.draft_parents, req.params, req.generator)
            return tokens
        if it.masks is not None:  # the target verifies under the grammar, row by row
            apply_bitmask(logits, it.masks)
        tokens = verify_chain(logits, it.draft, it.draft_probs, req.params, req.generator)
        it.path = list(range(len(tokens) - 1))
        return tokens

    def keep_features(self, req, rows: torch.Tensor):
        """The target's features of the request's newly verified positions (the draft head's input)."""
        st = self.state(req)
        st.feature_rows.append(rows)
        if self.learner is not None:
            self.learner.keep(req, rows)

    def after_step(self, seconds: float, rows: int):
        """A decode or verify step's forward and verification of `rows` rows took `seconds` (cost-aware proposers
        weigh it)."""
        if self.proposer is not None:
            self.proposer.after_step(seconds, rows)

    def verified(self, req, it, tokens: list[int], n_out: int, before: int):
        """After a verify step: `tokens` were emitted by verification (n_out of them kept: a stop may cut the
        chain), the request held `before` tokens."""
        source = "grammar"
        if it.num_proposed:  # grammar-forced drafts never touched the proposer
            st = self.state(req)
            self.proposer.after_verify(req, st, it.num_proposed, len(tokens) - 1, before)
            source = st.source or self.proposer.name
        self._record(req.spec_stats, len(it.draft), min(len(tokens) - 1, n_out), n_out, source)

    def finish(self, req, reason: str):
        st = self.states.pop(req.request_id, None)
        if self.learner is not None:
            self.learner.finish(req, reason)
        if self.proposer is not None:
            # e.g. the suffix proposer keeps finished outputs to draft from (not an errored one's)
            self.proposer.finish(req, st or DraftState(), reason != "error")

    def _record(self, st: SpecStats, proposed: int, accepted: int, emitted: int, source: str):
        st.steps += 1
        st.drafted[source] = st.drafted.get(source, 0) + proposed
        st.accepted[source] = st.accepted.get(source, 0) + accepted
        st.emitted += emitted
        if len(st.accepted_at) < proposed:
            st.accepted_at.extend([0] * (proposed - len(st.accepted_at)))
        for i in range(accepted):
            st.accepted_at[i] += 1
        m = self.metrics
        child = m.child
        m.spec_verify_steps.inc()
        m.spec_draft_tokens.inc(proposed)
        child(m.spec_proposer_steps, source).inc()
        child(m.spec_proposer_draft_tokens, source).inc(proposed)
        child(m.spec_proposer_accepted_tokens, source).inc(accepted)
        m.spec_emitted_tokens.inc(emitted)
        for i in range(accepted):
            child(m.spec_accepted_at, str(i + 1)).inc()

