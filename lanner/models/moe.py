"""Mixture-of-experts feed-forward: E SwiGLU experts as two stacked weights, any router.

Under TP every rank holds every expert with its intermediate dimension split (column-parallel gate|up,
row-parallel down), so routing is identical on all ranks and one all-reduce sums the partial outputs.
Dispatch visits only the experts some row picked: at decode (<= 8 rows, <= 8 * top_k experts) that is a
handful of small GEMMs, with no sort over all tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lanner.distributed import all_reduce, shard_range

# checkpoint projection name -> (piece in w13 or w2); Mixtral names its experts' projections w1 (gate), w3 (up),
# w2 (down)
_PROJ = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.full_inter = num_experts, intermediate_size
        self.i0, self.i1 = shard_range(intermediate_size)
        self.inter = self.i1 - self.i0
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter))
        # checkpoint tensors that fill each stacked parameter: per expert gate and up (w13), down (w2)
        self.pieces = list(range(2 * num_experts))

    @staticmethod
    def checkpoint_piece(expert: int, proj: str) -> tuple[str, int]:
        """(parameter leaf, piece) for one expert's projection; for the model's `checkpoint_name`."""
        p = _PROJ[proj]
        return ("w2", expert) if p == 2 else ("w13", 2 * expert + p)

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, piece: int = 0):
        i0, i1 = self.i0, self.i1
        if name == "w2":
            self.w2[piece].copy_(tensor[:, i0:i1])
        else:
            e, half = divmod(piece, 2)
            self.w13[e, half * self.inter : (half + 1) * self.inter].copy_(tensor[i0:i1])

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                reduce: bool = True) -> torch.Tensor:
        """x: [T, hidden]; topk_ids/topk_weights: [T, k]. Returns sum_k w * expert_k(x), all-reduced over TP
        ranks unless reduce=False (the caller then reduces once, e.g. after adding shared experts)."""
        out = torch.zeros_like(x)
        flat = topk_ids.reshape(-1)
        hit = torch.zeros(self.num_experts, dtype=torch.bool, device=x.device)
        hit[flat] = True
        for e in hit.nonzero().flatten().tolist():
            rows, slot = (topk_ids == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e])
            out.index_add_(0, rows, y * topk_weights[rows, slot, None].to(y.dtype))
        return all_reduce(out) if reduce else out
