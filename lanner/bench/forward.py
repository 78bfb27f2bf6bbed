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


def block_table(llm, tokens: int) -> list[int]:
    """An idle engine's KV blocks 0.. as one sequence's table of `tokens` positions (outside the scheduler)."""
    return list(range(-(-tokens // llm.engine.kv.block_size)))


def teacher_forced_logprobs(llm, ids: list[int], n_eval: int, rows: int = 32, room: int = 0) -> torch.Tensor:
    """Through an idle engine's runner (its KV blocks 0.. as one sequence's table): prefills ids[:-n_eval] in
    max_num_batched_tokens steps, then feeds the last n_eval tokens in verify steps of `rows` rows (lowlat's own
    attention reads the cache there) -> log-probs [n_eval, vocab] of each fed token's next token. room: positions
    past ids the table covers (for decode steps after it)."""
    from lanner.engine.runner import SeqChunk

    runner, mnbt = llm.engine.kv.runner, llm.engine.config.max_num_batched_tokens
    table, head = block_table(llm, len(ids) + room), len(ids) - n_eval
    with torch.inference_mode():
        for s in range(0, head, mnbt):
            runner.run([SeqChunk(ids[s : min(s + mnbt, head)], s, table, "none")], StepKind.PREFILL)
        out = [runner.run([SeqChunk(ids[s : s + rows], s, table, "all")], StepKind.VERIFY).log_softmax(-1)
               for s in range(head, len(ids), rows)]
    return torch.cat(out)


def divergence(p: torch.Tensor, q: torch.Tensor, nxt: torch.Tensor) -> dict:
    """Two runs' next-token log-probs p, q [n, vocab] over the same text (nxt: its next tokens): mean and max KL(p||q),
    top-1 agreement, mean and max |delta| of the actual next token's log-probability."""
    kl = (p.exp() * (p - q)).sum(-1)
    dlp = (p.gather(1, nxt[:, None]) - q.gather(1, nxt[:, None])).abs()
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1_agree": (p.argmax(-1) == q.argmax(-1)).float().mean().item(),
            "dlogprob_mean": dlp.mean().item(), "dlogprob_max": dlp.max().item()}
