"""One step's row layout and the forward's typed result.

Every scheduled item computes its tokens and its draft tokens in the forward (one row each: the rows the captured
features hold), and gets back logits rows for what it verifies or samples: all of them when it is drafted, its
last one when it samples, none for a prefill chunk short of the prompt's end. StepLayout says where each item's
rows are, once per step; the KV system's forward, verification and postprocessing all read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def logits_mode(it) -> str:
    """Which of a scheduled item's rows come back as logits (lanner.engine.runner.SeqChunk.logits)."""
    return "all" if it.draft else "last" if it.samples else "none"


@dataclass
class StepLayout:
    token_rows: list[range]  # per item: its tokens' and drafts' rows in the forward (and in the captured features)
    logits_rows: list[range]  # per item: its rows in the forward's result

    @classmethod
    def of(cls, items) -> StepLayout:
        token_rows, logits_rows, t, r = [], [], 0, 0
        for it in items:
            n = it.num_tokens + len(it.draft)
            mode = logits_mode(it)
            m = n if mode == "all" else 1 if mode == "last" else 0
            token_rows.append(range(t, t + n))
            logits_rows.append(range(r, r + m))
            t, r = t + n, r + m
        return cls(token_rows, logits_rows)


@dataclass
class StepOutput:
    """A forward's result rows: float32 logits [rows, vocab], or, for a greedy step that asked for the argmax only
    (lanner.engine.runner.ModelRunner.run), the rows' token ids."""

    logits: torch.Tensor | None = None
    token_ids: list[int] | None = None

    def __getitem__(self, rows: range) -> StepOutput:
        if self.token_ids is not None:
            return StepOutput(token_ids=self.token_ids[rows.start : rows.stop])
        return StepOutput(logits=self.logits[rows.start : rows.stop])

    def greedy(self) -> list[int]:
        """The rows' argmax (first index on ties)."""
        return self.token_ids if self.token_ids is not None else self.logits.argmax(-1).tolist()
