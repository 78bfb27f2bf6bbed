"""How a model's layers share the paged KV pool when some of them attend over a sliding window (Gemma 3).

Layers are split into groups of equal size (the gcd of the full and the sliding layer counts), each with its own
block table per request, all drawing blocks from one pool, so one memory budget serves both kinds (the idea of
vLLM's hybrid KV allocator). A pool block holds `members` layers' KV of `block_size` tokens; a layer reads the
member tensor of its place in its group through its group's table. A sliding group frees a block once all its
positions have left the window of every later query, so its layers keep about `window` tokens however long the
context. Full groups come first: group 0's table is the request's `block_table` (drafts share it, the prefix
cache names its chain).

A model without sliding layers, or with sliding layers only, has one group of every layer (`flat`): one table,
one tensor per layer, as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    windows: tuple[int | None, ...]  # per group: None (full attention) or the window (query p reads keys > p - w)
    layer_group: tuple[int, ...]  # per layer
    layer_member: tuple[int, ...]  # per layer: its member tensor (its place in its group)
    members: int  # layers per group: the number of member tensors of the pool

    @staticmethod
    def flat(num_layers: int) -> KVLayout:
        return KVLayout((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @staticmethod
    def grouped(layer_windows: list[int | None]) -> KVLayout:
        """layer_windows: per layer None (full) or its window. Flat unless full and sliding layers both exist."""
        full = [i for i, w in enumerate(layer_windows) if w is None]
        sliding = [i for i, w in enumerate(layer_windows) if w is not None]
        if not full or not sliding:
            return KVLayout.flat(len(layer_windows))
        size = math.gcd(len(full), len(sliding))
        group, member, windows = [0] * len(layer_windows), [0] * len(layer_windows), []
        for layers in (full, sliding):
            for at in range(0, len(layers), size):
                for m, layer in enumerate(layers[at : at + size]):
                    group[layer], member[layer] = len(windows), m
                windows.append(layer_windows[layers[at]])
        return KVLayout(tuple(windows), tuple(group), tuple(member), size)

    @staticmethod
    def of(model, grouped: bool = True) -> KVLayout:
        """The layout a model asks for (`layer_windows()`, Gemma 3) unless not `grouped`, else flat over its cache
        shapes' layers."""
        windows = model.layer_windows() if grouped and hasattr(model, "layer_windows") else None
        if windows is None:
            return KVLayout.flat(len(model.kv_cache_shapes()))
        return KVLayout.grouped(list(windows))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_flat(self) -> bool:
        return self.num_groups == 1

    def first_kept_block(self, group: int, next_position: int, block_size: int) -> int:
        """The first block of `group` that a query at `next_position` or later can read: earlier ones may go."""
        w = self.windows[group]
        return 0 if w is None else max(0, next_position - w + 1) // block_size

    def blocks_for(self, tokens: int, chunk: int, block_size: int) -> int:
        """Pool blocks one request of `tokens` tokens holds at most, prefilled `chunk` tokens per step: a sliding
        group keeps the window behind a chunk plus the chunk."""
        n = -(-tokens // block_size)
        return sum(n if w is None else min(n, -(-(w - 1 + chunk) // block_size) + 1) for w in self.windows)
