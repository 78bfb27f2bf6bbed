"""What every draft proposer is: `propose(requests, ks, states) -> [Draft]`, with per-request state it owns.

`ks[i]` is the most tokens request i may receive (it can get fewer: an n-gram miss proposes nothing); `states[i]`
is the object the proposer's `new_state()` made for request i, which the SpecDecoder keeps while the request runs.
Proposers with probabilities draw their drafts from q = the draft model's distribution after the request's
temperature / top-k / top-p, which is what lossless rejection sampling needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Draft:
    """One request's draft for one verify step."""

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len(tokens), vocab] draft distributions; None: one-hot (greedy drafts)
    parents: list[int] | None = None  # a tree: each node's parent index (-1: the request's last token); None: chain

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, n: int) -> Draft:
        """The draft's first n tokens (a chain: trees are cut by first_path)."""
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n])


def first_path(tokens: list[int], parents: list[int]) -> list[int]:
    """A tree's path that always takes a node's first child."""
    path, at = [], -1
    for i, (tok, parent) in enumerate(zip(tokens, parents)):
        if parent == at:  # parents come before their children
            path.append(tok)
            at = i
    return path


def draft_room(req) -> int:
    """Most draft tokens one path may hold: the verify step's last emitted token is the request's last allowed
    one (the engine admits prompt + max_tokens within the context)."""
    return req.max_tokens - len(req.output_ids) - 1


class Proposer:
    name = "base"

    def new_state(self):
        """The proposer's per-request state (None: it keeps none)."""
        return None

    def propose(self, requests, ks: list[int], states) -> list[Draft]:
        raise NotImplementedError

    def prepare(self, req, st):
        """Called in the step that ends a request's prompt prefill (when it may draft): per-prompt work that would
        otherwise land in its first decode step."""

    def restart(self, st, start: int):
        """The KV system (re)admitted the request keeping positions < start: draft KV past that is gone."""

    def keep_features(self, st, rows: torch.Tensor):
        """The target's features of the request's newly verified positions (draft heads read them)."""

    def source(self, st) -> str:
        """The name of the proposer that drafted the request's last step (a hybrid picks one per step)."""
        return self.name

    def after_verify(self, req, st, num_proposed: int, num_accepted: int, tokens_before: int):
        """Called once the target verified; lets stateful proposers roll their KV back."""

    def after_step(self, seconds: float, rows: int):
        """Called after each decode or verify forward (and its verification), with its wall time and the rows it
        computed (cost-aware proposers)."""

    def finish(self, req, st, completed: bool):
        """Called when a request ends (completed: finished or aborted, not failed) with its last state."""

    def forget(self):
        """Drops what was learned across requests (benchmarks: one measurement must not draft from the outputs of
        the previous one replaying the same turns)."""
