"""Checkpoint loading shared by all model classes: names are mapped by the model (`checkpoint_name`), shards are
cut by the owning layer (`load`, tensor-parallel layers), and every expected parameter piece must arrive."""
from __future__ import annotations

import torch
from torch import nn

from lanner.distributed.layers import load_param


@torch.no_grad()
def load_checkpoint(model: nn.Module, weights):
    """weights: iterable of (checkpoint name, tensor). model.checkpoint_name(name) -> (param name, piece) or None.
    A module with a `load(name, tensor, piece)` method receives its tensors (and slices its shard); its `pieces`
    list says how many checkpoint tensors fill one of its parameters."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded = set()
    for ckpt_name, tensor in weights:
        mapped = model.checkpoint_name(ckpt_name)
        if mapped is None:
            continue
        pname, piece = mapped
        if pname not in params:
            raise KeyError(f"unexpected weight {ckpt_name!r} in checkpoint")
        owner_name, _, leaf = pname.rpartition(".")
        try:
            load_param(params[pname], modules.get(owner_name), leaf, tensor, piece)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"weight {ckpt_name!r}: {e}") from e
        loaded.add((pname, piece))
    expected = set()
    for pname in params:
        owner = modules.get(pname.rpartition(".")[0])
        n = len(owner.pieces) if hasattr(owner, "load") and hasattr(owner, "pieces") else 1
        expected |= {(pname, i) for i in range(n)}
    missing = sorted({p for p, _ in expected - loaded})
    if missing:
        raise KeyError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
