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


class ExpertStack(nn.Module):
    """One projection of all experts, stacked: weight [E, out, in], filled by `parts` checkpoint tensors per expert
    (gate and up: 2, down: 1) laid along `out`. `split` is the dim holding the expert intermediate size, which TP
    cuts (0: column-parallel gate|up, 1: row-parallel down).

    A module of its own because the shared loader counts checkpoint pieces per owning module: w13 takes 2E
    tensors, w2 takes E."""

    def __init__(self, num_experts: int, parts: int, out_features: int, in_features: int, split: int):
        super().__init__()
        self.parts, self.split = parts, split
        inter = out_features // parts if split == 0 else in_features
        self.i0, self.i1 = shard_range(inter)
        n = self.i1 - self.i0
        self.expected = (inter, in_features) if split == 0 else (out_features, inter)  # one checkpoint tensor
        shape = (parts * n, in_features) if split == 0 else (out_features, n)
        self.weight = nn.Parameter(torch.empty(num_experts, *shape))
        self.pieces = list(range(num_experts * parts))

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, piece: int = 0):
        # an explicit check: copy_ would broadcast some wrong shapes silently
        if tuple(tensor.shape) != self.expected:
            raise ValueError(f"expert tensor of shape {tuple(tensor.shape)}, expected {self.expected}")
        expert, part = divmod(piece, self.parts)
        n = self.i1 - self.i0
        self.weight[expert].narrow(self.split, part * n, n).copy_(tensor.narrow(self.split, self.i0, n))


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.full_inter = num_experts, intermediate_size
        self.gate_up = ExpertStack(num_experts, 2, 2 * intermediate_size, hidden_size, split=0)
        self.down = ExpertStack(num_experts, 1, hidden_size, intermediate_size, split=1)
        self.i0, self.i1 = self.down.i0, self.down.i1
        self.inter = self.i1 - self.i0  # this rank's share of each expert's intermediate size

    @property
    def w13(self) -> torch.Tensor:
        """[E, 2 * local inter, hidden]: per expert this rank's gate rows, then its up rows."""
        return self.gate_up.weight

    @property
    def w2(self) -> torch.Tensor:
        """[E, hidden, local inter]."""
        return self.down.weight

    @staticmethod
    def checkpoint_piece(expert: int, proj: str) -> tuple[str, int]:
        """(parameter name relative to this module, piece) for one expert's projection; for the model's
        `checkpoint_name`, which prefixes it with the module's path."""
        p = _PROJ[proj]
        return ("down.weight", expert) if p == 2 else ("gate_up.weight", 2 * expert + p)

    def load(self, name: str, tensor: torch.Tensor, piece: int = 0):
        """name: "w13" / "w2" or what checkpoint_piece returned."""
        stack = self.down if name in ("w2", "down.weight") else self.gate_up
        stack.load("weight", tensor, piece)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                reduce: bool = True) -> torch.Tensor:
        """x: [T, hidden]; topk_ids/topk_weights: [T, k]. Returns sum_k w * expert_k(x), all-reduced over TP
        ranks unless reduce=False (the caller then reduces once, e.g. after adding shared experts)."""
        out = torch.zeros_like(x)
        w13, w2 = self.gate_up.weight, self.down.weight
        hit = torch.zeros(self.num_experts, dtype=torch.bool, device=x.device)
        hit[topk_ids.reshape(-1)] = True
        for e in hit.nonzero().flatten().tolist():
            rows, slot = (topk_ids == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e])
            out.index_add_(0, rows, y * topk_weights[rows, slot, None].to(y.dtype))
        return all_reduce(out) if reduce else out
