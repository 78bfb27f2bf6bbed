"""One step's layout for DeepSeek sparse attention (DSA): which cache entries each query row may read, padded per
sequence, and the seams through which a latent cache that is not a tensor (UlaCache's, lanner.kvcache.ula.mla_decoder)
serves the selected entries."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lanner.layers.attention import AttentionMetadata


@dataclass
class DsaStep:
    """What every layer of one forward shares: each query row's context and the current top-k selection.

    Padded layout as in paged_attention: B sequences x Qmax query rows; `q_dest` places the T real rows."""
    meta: AttentionMetadata
    ctx_slots: torch.Tensor  # [B, L] cache slot of each context position (padding columns: any slot, masked)
    allowed: torch.Tensor  # [B, Qmax, L] bool: causal context of each query row (padded rows: position 0 only)
    absorbed: bool  # attention path of this step
    selected: torch.Tensor | None = None  # [B, Qmax, K] context positions the last indexer layer picked

    @classmethod
    def build(cls, meta: AttentionMetadata, absorbed: bool) -> DsaStep:
        dev = meta.slot_mapping.device
        if meta.kv_range is not None:
            ctx_slots = torch.arange(*meta.kv_range, device=dev)[None]
        else:
            ctx_slots = meta.kv_slots
        ctx = torch.tensor(meta.ctx_lens, device=dev)
        q_lens = torch.tensor(meta.q_lens, device=dev)
        i = torch.arange(meta.max_q_len, device=dev)
        real = i[None, :] < q_lens[:, None]  # [B, Qmax]
        qpos = (ctx - q_lens)[:, None] + i[None, :]
        j = torch.arange(ctx_slots.shape[1], device=dev)
        allowed = (j <= qpos[..., None]) & (j < ctx[:, None, None]) & real[..., None]
        allowed[..., 0] |= ~real  # padded rows read position 0: no empty softmax rows
        return cls(meta, ctx_slots, allowed, absorbed)

    def pad(self, x):
        """[T, ...] real rows -> [B, Qmax, ...]."""
        B, Q = self.meta.batch_size, self.meta.max_q_len
        if self.meta.q_dest is None:
            return x.view(B, Q, *x.shape[1:])
        out = x.new_zeros(B * Q, *x.shape[1:])
        out[self.meta.q_dest] = x
        return out.view(B, Q, *x.shape[1:])

    def unpad(self, x):
        """[B, Qmax, ...] -> [T, ...] real rows."""
        x = x.reshape(-1, *x.shape[2:])
        return x if self.meta.q_dest is None else x[self.meta.q_dest]

    def select_all(self) -> torch.Tensor:
        B, Q, L = self.allowed.shape
        return torch.arange(L, device=self.allowed.device).expand(B, Q, L)

    def selected_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per real query row, the cache slots of its selected tokens and whether each is in its context: [T, K]."""
        B, Q, K = self.selected.shape
        slots = self.ctx_slots.gather(1, self.selected.reshape(B, Q * K)).view(B, Q, K)
        return self.unpad(slots), self.unpad(self.allowed.gather(2, self.selected))

    def selected_mask(self) -> torch.Tensor:
        """[B, Qmax, L] bool: the context positions each query row attends to."""
        valid = self.allowed.gather(2, self.selected)
        return torch.zeros_like(self.allowed).scatter_(2, self.selected, valid)


class LatentStore:
    """A latent cache that is not a tensor (lanner.kvcache.ula.mla_decoder: the latent lives in UlaCache): it is written
    like one, sees a step's whole selection before the reads (plan_selected) and serves them (read_selected)."""

    def plan_selected(self, slots: torch.Tensor, valid: torch.Tensor):
        raise NotImplementedError

    def read_selected(self, slots: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ShardedIndexKeys:
    """Indexer keys spread over tensor-parallel ranks (UlaCache TP): each rank scores the positions whose keys it
    holds and the ranks merge their top-k (select_top replaces Indexer.top over all keys)."""

    def select_top(self, indexer, q, w, step) -> torch.Tensor:
        raise NotImplementedError


def gather_selected_latent(latent_cache, slots: torch.Tensor) -> torch.Tensor:
    """The one read of the latent KV cache: cache slots [..., K] -> latent entries [..., K, kv_lora_rank + rope].
    Callers pass only slots the indexer selected (per query row, or their union per sequence)."""
    if isinstance(latent_cache, LatentStore):
        return latent_cache.read_selected(slots)
    return latent_cache[slots]
