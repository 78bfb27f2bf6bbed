"""MTP drafting: the target checkpoint's own multi-token prediction layer (DeepSeek-V3 layout, also GLM-4.5+ /
GLM-5) as an EAGLE-style draft head whose feature is the target's last hidden state before the final norm.

It runs through DraftHeadProposer's path unchanged (draft-extend over the target features of the verified tokens,
chained steps feeding its own hidden state back, rollback by re-extending after verify); only the forward differs:
no fusion layer, the whole target vocabulary, and an MLA latent + index-key cache of its own in a pool that shares
the target's block tables (or, over UlaCache, in blocks of its own).
"""
from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.nn.functional as F

from lanner.layers.attention import build_attention_metadata
from lanner.models.loader import (
    _FP8,
    ModelSource,
    _fp8_block_size,
    dequantize_block_fp8,
)
from lanner.models.weights import load_checkpoint
from lanner.spec.proposers import DraftHeadProposer


def _tensor_files(folder: str) -> dict[str, str]:
    """checkpoint tensor name -> safetensors file, from the shard index or the files' headers."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        return json.load(open(index))["weight_map"]
    where = {}
    for f in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, f), framework="pt") as h:
            where |= dict.fromkeys(h.keys(), f)
    return where


def _read(folder: str, where: dict[str, str], names):
    """(name, tensor) for `names` only (a target's whole checkpoint is hundreds of GB): block-FP8 weights come
    out dequantized, as the target loader does."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        handles = {}

        def get(name):
            f = where[name]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(os.path.join(folder, f), framework="pt"))
            return handles[f].get_tensor(name)

        for name in names:
            t = get(name)
            if t.dtype in _FP8:
                if name + "_scale_inv" not in where:
                    raise ValueError(f"{folder}: FP8 weight {name!r} has no {name + '_scale_inv'!r}")
                t = dequantize_block_fp8(t, get(name + "_scale_inv"), _fp8_block_size(folder))
            yield name, t


def load_mtp(source: ModelSource, target, dtype, device):
    """The MTP module of `target`'s checkpoint (an MtpLayer). ValueError when the target is not DeepSeek-family or
    its checkpoint has no MTP layer."""
    from lanner.models.deepseek import DeepseekModel

    if not isinstance(target, DeepseekModel) or source.kind != "hf":
        raise ValueError(f"draft 'mtp' runs the target checkpoint's own multi-token prediction layer: it needs a "
                         f"DeepSeek-family model (DeepSeek-V3.2, GLM-5) from a Hugging Face folder, not "
                         f"{target.cfg.architecture}")
    where = _tensor_files(source.path)
    try:
        with torch.device("meta"):
            mtp = target.make_mtp(where)
    except ValueError as e:
        raise ValueError(f"draft 'mtp': {source.path}: {e}") from e
    mtp = mtp.to_empty(device=device).to(dtype)
    names = [n for n in where if not n.endswith("_scale_inv") and mtp.checkpoint_name(n) is not None]
    load_checkpoint(mtp, _read(source.path, where, names))  # scales come with their weights
    return mtp.eval().requires_grad_(False)


class _HeadView:
    """What DraftHeadProposer.propose reads off its head: the MTP takes the target feature as it is (no fusion
    layer) and predicts over the whole target vocabulary (d2t is the identity)."""

    def __init__(self, mtp, vocab: int, device):
        self.fc = mtp.eh_proj  # propose() casts the features to fc.weight.dtype
        self.d2t = torch.arange(vocab, device=device)

    @staticmethod
    def fuse(features):
        return features


class MtpProposer(DraftHeadProposer):
    name = "mtp"

    def __init__(self, mtp, target, num_blocks: int | None, block_size: int, dtype, device, plugins=None,
                 embed_weight: torch.Tensor | None = None, block_table=None):
        self.mtp, self.target, self.block_size, self.device = mtp, target, block_size, device
        self.block_table = block_table
        self.vocab = target.cfg.vocab_size
        self.head = _HeadView(mtp, self.vocab, device)
        self.plugins = None  # kernel plugins cover DraftHead.forward's signature, not this module's
        # embedding and head: the module's own copies, else the main model's (whole: under tensor parallelism the
        # engine passes the gathered embedding; a vocab-sharded LM head cannot serve here)
        self.embed_weight = mtp.embed_tokens.weight if mtp.embed_tokens is not None else \
            target.embed_tokens.weight if embed_weight is None else embed_weight
        if mtp.shared_head.head is not None:
            self.head_weight = mtp.shared_head.head.weight
        else:
            self.head_weight = self.embed_weight if target.lm_head is None else target.lm_head.weight
        if self.head_weight.shape[0] != self.vocab:
            raise ValueError("draft 'mtp': this checkpoint's MTP layer shares the main LM head, which is split over "
                             "the tensor-parallel ranks; run MTP drafting at tp=1")
        self.caches = tuple(torch.zeros(0, *shape, dtype=dtype, device=device) for shape in mtp.kv_cache_shapes()[0])
        self._init_blocks(num_blocks)

    def _grow(self, slots: int):
        self.caches = tuple(torch.cat([c, c.new_zeros(slots, *c.shape[1:])]) for c in self.caches)

    def _num_slots(self) -> int:
        return self.caches[0].shape[0]

    @torch.inference_mode()
    def _forward(self, kind, hidden, tokens, positions, q_lens, ctx_lens, tables):
        meta = build_attention_metadata(q_lens, ctx_lens, tables, self.block_size, self.device)
        emb = F.embedding(torch.tensor(tokens, device=self.device), self.embed_weight)
        out = self.mtp(hidden, emb, torch.tensor(positions, device=self.device), self.caches, meta,
                       self.target.rotary, self.target._absorbed(meta))
        return F.linear(self.mtp.shared_head.norm(out), self.head_weight), out
