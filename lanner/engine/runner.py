"""One forward per step: gathers the scheduled tokens, builds attention metadata, returns logits."""
from __future__ import annotations

import torch

from lanner.layers.attention import build_attention_metadata


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype, device):
        cfg = model.cfg
        self.model, self.block_size, self.device = model, block_size, device
        # one tensor for the whole pool: [layers, k|v, slots, kv_heads, head_dim]; zero-filled because padded
        # attention rows read slots that were never written (masked, but 0 * NaN would still poison them)
        self.kv = torch.zeros(cfg.num_layers, 2, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim,
                              dtype=dtype, device=device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(cfg.num_layers)]

    @staticmethod
    def bytes_per_token(cfg, dtype) -> int:
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8

    @torch.inference_mode()
    def run(self, items) -> torch.Tensor:
        """items: ScheduledItem list. Returns logits [number of items that sample, vocab] (float32)."""
        ids, pos, q_lens, ctx_lens, tables, rows = [], [], [], [], [], []
        t = 0
        for it in items:
            req, s, n = it.request, it.start, it.num_tokens
            ids.extend(req.all_ids[s : s + n])
            pos.extend(range(s, s + n))
            q_lens.append(n)
            ctx_lens.append(s + n)
            tables.append(req.block_table)
            t += n
            if it.samples:
                rows.append(t - 1)
        dev = self.device
        meta = build_attention_metadata(q_lens, ctx_lens, tables, self.block_size, dev)
        hidden, _ = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), self.kv_caches, meta)
        if not rows:
            return hidden.new_empty(0, 0)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=dev)]).float()
