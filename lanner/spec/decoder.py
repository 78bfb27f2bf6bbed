"""Speculative decoding as the engine runs it: how many draft tokens each request may verify this step, the
drafts (the proposer's, and the tokens a grammar forces), their lossless verification against the target's
logits, and what each verify step accepted (per request and in the metrics). The engine calls it between
scheduling and the forward, and again with the logits; the KV system rolls back what was rejected."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lanner.distributed import tp_disabled
from lanner.spec.base import Draft, draft_room, first_path
from lanner.spec.verify import verify_chain, verify_tree
from lanner.structured import apply_bitmask


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


class SpecDecoder:
    def __init__(self, proposer, config, metrics, learner=None):
        self.proposer, self.config, self.metrics = proposer, config, metrics
        self.states: dict = {}  # request id -> the proposer's state of that request
        self.learner = learner  # lanner.spec.learn.DraftLearner under --learn-draft: keeps the verified features

    def state(self, req):
        """The proposer's state of `req` (made on first use; None for a proposer that keeps none)."""
        rid = req.request_id
        if rid not in self.states:
            self.states[rid] = self.proposer.new_state()
        return self.states[rid]

    def tokens(self, req, batch_size: int) -> int:
        """Draft tokens `req` may verify in a step of `batch_size` running requests (the scheduler's question)."""
        p = req.params
        room = draft_room(req)
        if p.unverified_draft:  # data generation: drafts at any batch size
            return min(p.unverified_draft, room)
        if batch_size > self.config.spec_max_batch or not self._may_draft(req):
            return 0
        # constrained requests also draft the tokens their grammar forces (_draft)
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
        if self.proposer is not None:
            for it in items:
                if it.admitted:  # the KV system (re)starts it at it.start: what the draft held past that is gone
                    self.proposer.restart(self.state(it.request), it.start)
                if it.samples and not it.request.output_ids and self._may_draft(it.request):
                    # the step that ends the prompt's prefill: per-prompt drafting work (a suffix index over the
                    # prompt, ~3 us per token) is done with the prompt, not in the first decode step
                    self.proposer.prepare(it.request, self.state(it.request))
        drafting = [it for it in items if it.num_spec > 0]
        if drafting:
            t0 = time.perf_counter()
            with tp_disabled():  # drafts run on rank 0 only and must not enter the group's collectives
                self._draft(drafting)
            if self.proposer is not None:
                self.metrics.child(self.metrics.spec_propose_seconds, self.proposer.name).inc(time.perf_counter() - t0)
                self.metrics.child(self.metrics.spec_propose_steps, self.proposer.name).inc()
        return bool(drafting)

    def _draft(self, items):
        """Fills draft, num_proposed and masks of each speculating item. A constrained request whose grammar forces
        tokens from here drafts those and skips the proposer. Other drafts come from the proposer (at most
        draft_limit tokens), are cut where the grammar rejects them, then extended by what the grammar forces after
        them. A constrained request verifies chains only: a tree is cut to its first path (the most likely one in a
        best-first tree). Every verify row of a constrained item gets its grammar mask."""
        forced_drafts = self.config.grammar_draft_tokens > 0
        ask = []
        for it in items:
            g = it.request.grammar
            forced = g.forced_tokens(it.num_spec) if g is not None and forced_drafts else []
            if forced:
                it.draft, it.num_proposed = Draft(forced), 0
            elif self.proposer is not None:
                ask.append(it)
        if ask:
            reqs = [it.request for it in ask]
            ks = [min(it.num_spec, self.config.draft_limit) for it in ask]
            for it, d in zip(ask, self.proposer.propose(reqs, ks, [self.state(r) for r in reqs])):
                if not d.tokens:
                    d = Draft()  # (an empty tree is no tree: a plain step)
                elif d.parents is not None and it.request.grammar is not None:
                    d = Draft(first_path(d.tokens, d.parents))
                it.draft, it.num_proposed = d, len(d)
        for it in items:
            g = it.request.grammar
            if g is None:
                continue
            if it.num_proposed and forced_drafts:
                it.draft = g.extend_forced(it.draft, it.num_spec)
            n, it.masks = g.check_draft(it.draft.tokens)
            if n < len(it.draft):
                it.draft = it.draft.cut(n)
            if it.num_proposed > n:
                if n == 0:  # nothing left to verify: the proposer rolls back now, as after a verify accepting none
                    self.proposer.after_verify(it.request, self.state(it.request), it.num_proposed, 0,
                                               it.request.num_tokens)
                it.num_proposed = n
            if not it.draft.tokens:
                it.masks = None  # a plain step: the sampler masks its one row

    @staticmethod
    def verify(it, rows) -> tuple[list[int], list[int]]:
        """A drafted item's k + 1 result rows (lanner.engine.step.StepOutput: logits, or a greedy step's token ids)
        -> (the tokens it emits: the accepted drafts and one more; the accepted draft nodes, root to leaf)."""
        req, d, logits, target = it.request, it.draft, rows.logits, rows.token_ids
        if req.params.unverified_draft:  # accept all; the target adds one token
            return d.tokens + [rows.greedy()[-1]], list(range(len(d)))
        if d.parents is not None:
            return verify_tree(logits, d.tokens, d.parents, req.params, req.generator, target)
        if it.masks is not None:  # the target verifies under the grammar, row by row (never an argmax-only step)
            apply_bitmask(logits, it.masks)
        tokens = verify_chain(logits, d.tokens, d.probs, req.params, req.generator, target)
        return tokens, list(range(len(tokens) - 1))

    def keep_features(self, req, rows: torch.Tensor):
        """The target's features of the request's newly verified positions (the draft head's input)."""
        if self.proposer is not None:
            self.proposer.keep_features(self.state(req), rows)
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
            source = self.proposer.source(st)
        self._record(req.spec_stats, len(it.draft), min(len(tokens) - 1, n_out), n_out, source)

    def finish(self, req, reason: str):
        st = self.states.pop(req.request_id, None)
        if self.learner is not None:
            self.learner.finish(req, reason)
        if self.proposer is not None:
            # e.g. the suffix proposer keeps finished outputs to draft from (not an errored one's)
            self.proposer.finish(req, st if st is not None else self.proposer.new_state(), reason != "error")

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

