"""One forward of a model over its own paged KV cache, outside the engine: for step-time measurements (tools/) and
for tests that compare a kernel plugin's rows with the model's. A step is a list of rows (token ids, position of
the first, block table), every row's logits computed, as in a verify step."""
from __future__ import annotations

import torch

from lanner.layers.attention import build_attention_metadata
from lanner.plugins import Step, StepKind

BLOCK_SIZE = 16


def kv_caches(cfg, blocks: int = 40, dtype=torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (key, value) caches of `blocks` blocks of BLOCK_SIZE tokens per layer of the model config `cfg`."""
    return [tuple(torch.zeros(blocks * BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype=dtype) for _ in range(2))
            for _ in range(cfg.num_layers)]


def forward_rows(model, plugin, kv, rows: list[tuple[list[int], int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over rows = [(token ids, first position, block table)] by `plugin` (None: the model's own
    forward) -> (hidden states, logits) of every token."""
    ids = torch.tensor([t for r in rows for t in r[0]])
    pos = torch.tensor([p for r in rows for p in range(r[1], r[1] + len(r[0]))])
    meta = build_attention_metadata([len(r[0]) for r in rows], [r[1] + len(r[0]) for r in rows],
                                    [r[2] for r in rows], BLOCK_SIZE, "cpu")
    with torch.inference_mode():
        if plugin is None:
            hidden = model(ids, pos, kv, meta)[0]
            return hidden, model.compute_logits(hidden)
        step = Step(StepKind.VERIFY, len(ids), len(rows))
        hidden = plugin.forward(step, model, ids, pos, kv, meta)[0]
        return hidden, plugin.compute_logits(step, model, hidden)
