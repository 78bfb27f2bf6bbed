"""Tensor-parallel layers. Each holds only its rank's shard and knows how to cut that shard out of a full
checkpoint tensor (`load`), so loading streams the checkpoint once per rank with no full copy kept.

A layer's output (column) or input (row) dimension is a list of pieces, `(units, unit_size)`: fused
projections (q|k|v, gate|up) keep their pieces apart, and a piece is split by whole units (a KV group of heads,
a head, a row), so every rank gets whole heads. Sizes need not divide evenly: 3 KV heads over 2 ranks -> 2, 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lanner.distributed import (
    all_gather_last,
    all_reduce,
    shard_range,
    split_sizes,
    tp_size,
)


class _Sharded:
    """Offsets of each piece's local slice along the sharded dimension."""

    def _plan(self, pieces):
        self.pieces = [(int(u), int(s)) for u, s in pieces]
        self.ranges = [shard_range(u) for u, _ in self.pieces]
        self.local_sizes = [(e - s) * us for (s, e), (_, us) in zip(self.ranges, self.pieces)]
        return sum(self.local_sizes)

    def _slice(self, tensor: torch.Tensor, piece: int, dim: int):
        (s, e), (_, us) = self.ranges[piece], self.pieces[piece]
        offset = sum(self.local_sizes[:piece])
        return offset, tensor.narrow(dim, s * us, (e - s) * us)


class ColumnParallelLinear(nn.Linear, _Sharded):
    """Output features split over ranks; the output stays sharded (feed it to a RowParallelLinear)."""

    def __init__(self, in_features: int, pieces, bias: bool = False):
        nn.Linear.__init__(self, in_features, self._plan(pieces), bias=bias)

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, piece: int = 0):
        offset, src = self._slice(tensor, piece, 0)
        getattr(self, name)[offset : offset + src.shape[0]].copy_(src)


class RowParallelLinear(nn.Linear, _Sharded):
    """Input features split over ranks; partial outputs are summed across ranks (the bias is added once)."""

    def __init__(self, pieces, out_features: int, bias: bool = False):
        nn.Linear.__init__(self, self._plan(pieces), out_features, bias=bias)

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, piece: int = 0):
        if name == "bias":
            self.bias.copy_(tensor)
            return
        offset, src = self._slice(tensor, piece, 1)
        self.weight[:, offset : offset + src.shape[1]].copy_(src)

    def forward(self, x):
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding, _Sharded):
    """Rows of the vocabulary split over ranks; each rank looks up its own ids and the sum fills the rest."""

    def __init__(self, vocab_size: int, hidden_size: int):
        rows = self._plan([(vocab_size, 1)])
        weight = torch.empty(rows, hidden_size)
        # nn.Embedding's own init: on the meta device (where models are built for loading) its normal_ imports
        # torch._dynamo, 2.5 s of every load
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        nn.Embedding.__init__(self, rows, hidden_size, _weight=weight)
        self.vocab_start, self.vocab_end = self.ranges[0]

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, piece: int = 0):
        _, src = self._slice(tensor, 0, 0)
        self.weight.copy_(src)

    def forward(self, ids):
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        out = F.embedding(torch.where(mine, ids - self.vocab_start, 0), self.weight)
        return all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """LM head over a vocab-sharded weight ([local vocab, hidden], the embedding's or the head's shard):
    every rank returns the full logits row."""
    return all_gather_last(F.linear(hidden, weight), split_sizes(vocab_size, tp_size()))


@torch.no_grad()
def load_param(param: nn.Parameter, owner: nn.Module | None, name: str, tensor: torch.Tensor, piece: int = 0):
    """Copies a checkpoint tensor into a parameter, cutting this rank's shard when the owner is parallel."""
    if owner is not None and hasattr(owner, "load"):
        owner.load(name, tensor, piece)
    else:
        if param.shape != tensor.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(tensor.shape)}")
        param.copy_(tensor)
