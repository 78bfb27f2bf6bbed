"""Suffix drafts (after SuffixDecoding, arXiv 2411.04975): continuations of the longest recent match, scored by
how often they followed it.

Two indexes, both C++ (csrc/suffix.cpp, a suffix trie truncated at `depth` tokens, nodes addressed by a hash of
their context):
- per request, over its prompt + output, kept on the request and extended by the tokens verified since the last
  step (O(new tokens * depth));
- one shared index over finished outputs, capped at `shared_tokens` tokens with the oldest output evicted first,
  scoped by the request's `user`: a scope seeds every hash, so one user's outputs never draft for another.

Per request the proposer drafts from both and keeps the draft with the higher score (the expected number of
accepted tokens if the frequencies were the target's probabilities: the sum of the running products of
count / total). A draft is at most min(k, factor * match length) tokens and stops where the running probability
falls below `min_prob`. Drafts carry no probabilities (q is one-hot), which rejection sampling handles exactly.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from lanner.spec.base import Draft, Proposer, draft_room

log = logging.getLogger("lanner")
SOURCE = Path(__file__).resolve().parent / "csrc" / "suffix.cpp"
_ext: dict = {}


def extension():
    """The compiled index (built once per source version into torch's extension cache, ~20 s the first time)."""
    if "module" not in _ext:
        from torch.utils.cpp_extension import load as cpp_load

        t0 = time.perf_counter()
        _ext["module"] = cpp_load(name="lanner_spec_suffix", sources=[str(SOURCE)], extra_cflags=["-O3"])
        log.info("spec: suffix index ready in %.1fs", time.perf_counter() - t0)
    return _ext["module"]


def scope_of(user: str | None) -> int:
    """A stable 64-bit hash seed per user; requests without a user share scope 1."""
    if user is None:
        return 1
    return int.from_bytes(hashlib.blake2b(user.encode(), digest_size=8).digest(), "little") | 2


@dataclass
class SuffixState:
    """A request's own suffix index (built at its prefill, extended by the tokens verified since)."""

    index: object = None


@dataclass
class SuffixDraft:
    """A draft from an index, with what the hybrid weighs it by."""

    tokens: list[int]
    score: float  # expected accepted tokens under the index's frequencies
    parents: list[int] | None = None  # a tree: each node's parent index (-1: the request's last token)
    probs: list[float] | None = None  # a chain: each token's running probability (score = their sum)
    match: int = 0  # tokens of context the index matched (a longer match drafts more reliably)


class SuffixProposer(Proposer):
    name = "suffix"

    def __init__(self, depth: int = 24, factor: float = 1.0, min_prob: float = 0.1,
                 shared_tokens: int = 1 << 20, max_depth: int = 0):
        """max_depth > 0: draft trees (k nodes per request, paths of up to max_depth tokens); 0: chains of k."""
        self.depth, self.factor, self.min_prob, self.max_depth = depth, factor, min_prob, max_depth
        self.ext = extension()
        self.shared = self.ext.SuffixIndex(depth)
        self.shared_tokens = shared_tokens
        self.documents: deque[tuple[list[int], int, int]] = deque()  # (tokens, first counted, scope), oldest first
        self.stored_tokens = 0

    def new_state(self):
        return SuffixState()

    def index(self, req, st: SuffixState):
        """The request's own index, brought up to its verified tokens."""
        if st.index is None:
            st.index = self.ext.SuffixIndex(self.depth)
        n = st.index.length()
        if n < req.num_tokens:
            st.index.extend(req.all_ids[n:])
        return st.index

    def prepare(self, req, st):
        self.index(req, st)

    def draft(self, req, st: SuffixState, k: int) -> SuffixDraft:
        """The request's draft of up to k tokens (a tree: k nodes, paths of up to max_depth tokens): the better of
        its own index's and the shared index's."""
        index = self.index(req, st)
        if k <= 0:
            return SuffixDraft([], 0.0)
        depth = min(self.max_depth, draft_room(req)) if self.max_depth else 0
        own = self._draft(lambda *a: index.draft_tree_own(*a), lambda *a: index.draft_own(*a), k, depth)
        if req.params.seed is not None and not req.params.greedy:
            # a seeded sample is a function of its prompt and seed only when its drafts are: other requests'
            # outputs would change them (and with them which random draws the verifier makes)
            return own
        tail, scope = req.all_ids[-self.depth:], scope_of(req.params.user)
        shared = self._draft(lambda *a: self.shared.draft_tree(tail, scope, *a),
                             lambda *a: self.shared.draft(tail, scope, *a), k, depth)
        return shared if shared.score > own.score else own

    def _draft(self, tree, chain, k: int, depth: int) -> SuffixDraft:
        if self.max_depth:
            tokens, parents, match, score = tree(k, depth, self.factor, self.min_prob)
            return SuffixDraft(tokens, score, parents, match=match)
        tokens, match, score, probs = chain(k, self.factor, self.min_prob)
        return SuffixDraft(tokens, score, probs=probs, match=match)

    def propose(self, requests, ks, states):
        return [Draft(d.tokens, parents=d.parents) for d in map(self.draft, requests, states, ks)]

    def forget(self):
        while self.documents:
            old, start, old_scope = self.documents.popleft()
            self.shared.add(old, start, old_scope, -1)
        self.stored_tokens = 0

    def finish(self, req, st=None, completed: bool = True):
        """A finished request's output joins the shared index (with `depth` prompt tokens of context before it);
        the oldest outputs leave while the index holds more than shared_tokens tokens."""
        if not completed or not req.output_ids or self.shared_tokens == 0:
            return
        ctx = req.prompt_ids[-self.depth:]
        doc, scope = ctx + list(req.output_ids), scope_of(req.params.user)
        self.shared.add(doc, len(ctx), scope, 1)
        self.documents.append((doc, len(ctx), scope))
        self.stored_tokens += len(doc) - len(ctx)
        while self.stored_tokens > self.shared_tokens and self.documents:
            old, start, old_scope = self.documents.popleft()
            self.shared.add(old, start, old_scope, -1)
            self.stored_tokens -= len(old) - start


def step_cost_ms(tokens: list[int], context: int = 8192, new_per_step: int = 4, k: int = 16,
                 steps: int = 500) -> float:
    """Mean per-step cost of a request's suffix drafting at a `context`-token context: index `new_per_step` new
    tokens, then draft up to k tokens from the own and the shared index. `tokens` (real text, repeated to length)
    supplies the context and the steps' new tokens."""
    from types import SimpleNamespace

    need = context + steps * new_per_step
    text = (tokens * (need // max(1, len(tokens)) + 1))[:need]
    proposer = SuffixProposer()
    params = SimpleNamespace(user=None, seed=None, greedy=True)
    finished = SimpleNamespace(prompt_ids=text[:64], output_ids=text[: context // 2], params=params)
    proposer.finish(finished)  # a shared index with content, as in a serving process
    req = SimpleNamespace(all_ids=text[:context], params=params, num_tokens=context)
    st = SuffixState()
    proposer.draft(req, st, k)  # builds the request's index over its prompt (prefill-time work, not per step)
    t0 = time.perf_counter()
    for s in range(context, need, new_per_step):
        req.all_ids.extend(text[s : s + new_per_step])
        req.num_tokens = len(req.all_ids)
        proposer.draft(req, st, k)
    return (time.perf_counter() - t0) / steps * 1000
