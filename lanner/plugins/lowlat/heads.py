"""LowLatPlugin's EAGLE-style draft head: its forward with lowlat's GEMV, and its greedy drafting in one C++ call
(csrc/head.h)."""
from __future__ import annotations

import weakref

import torch

from lanner.plugins.lowlat import pack


class DraftHeadKernels:
    """Mixed into LowLatPlugin (whose kernel, lock, hardware and options these use)."""

    HEAD_PARTS = ("input_layernorm", "hidden_norm", "qkv_proj", "o_proj", "post_attention_layernorm", "mlp", "norm",
                  "lm_head", "rotary", "scale", "H", "Hkv", "D")

    def _head_forward(self, head, hidden, token_emb, positions, k_cache, v_cache, meta):
        """DraftHead.forward (one decoder layer over the fused target features, then its draft-vocabulary head)
        with lowlat's GEMV for its six linears and PyTorch for the rest: at one row per step the head is a few
        small GEMVs, which PyTorch runs at a third of lowlat's rate. A head of another structure runs its own
        forward."""
        if not all(hasattr(head, a) for a in self.HEAD_PARTS) or head.lm_head.weight.dtype != self.hardware.dtype:
            return head(hidden, token_emb, positions, k_cache, v_cache, meta)
        from lanner.layers.attention import paged_attention
        from lanner.layers.rotary import apply_rotary

        def lin(x, layer):
            return self._kernel.linear(x.contiguous(), layer.weight, layer.bias, False, False)

        T, H, Hkv, D = hidden.shape[0], head.H, head.Hkv, head.D
        x = torch.cat([head.input_layernorm(token_emb), head.hidden_norm(hidden)], dim=-1)
        qkv = lin(x, head.qkv_proj).view(T, H + 2 * Hkv, D)
        cos, sin = head.rotary.lookup(positions, hidden.dtype)
        qk = apply_rotary(qkv[:, : H + Hkv], cos, sin)
        attn = paged_attention(qk[:, :H], qk[:, H:], qkv[:, H + Hkv :], k_cache, v_cache, meta, head.scale)
        out = hidden + lin(attn, head.o_proj)
        gate, up = lin(head.post_attention_layernorm(out), head.mlp.gate_up_proj).chunk(2, dim=-1)
        out = out + lin(torch.nn.functional.silu(gate) * up, head.mlp.down_proj)
        return lin(head.norm(out), head.lm_head), out

    def draft_chain(self, head, embed_weight, hidden, tokens, positions, steps, k_cache, v_cache, block_tables,
                    block_size):
        """The head's next `steps` greedy draft tokens for each row in one C++ call (no Python between steps):
        hidden [B, h] is the head's output where `tokens` (the first draft tokens, target ids) enter at
        `positions`. Returns int64 [B, steps] (target ids), or None for a head lowlat cannot run."""
        kernel = self._head_kernel(head, embed_weight)
        if kernel is None or hidden.shape[0] > self.max_batch:
            return None
        with self._lock:
            return kernel.chain(hidden.contiguous(), tokens, positions, steps, k_cache, v_cache, block_tables,
                                block_size)

    def draft_propose(self, head, embed_weight, features, tokens, positions, q_lens, steps, k_cache, v_cache,
                      block_tables, block_size):
        """A draft-extend and the greedy chain after it in one C++ call: features [T, 3h] (the target's) with
        tokens and positions [T] over sequences of q_lens rows write the head's KV; from each sequence's last
        row, `steps` greedy draft tokens follow. Returns int64 [B, steps] (target ids), or None for a head lowlat
        cannot run."""
        kernel = self._head_kernel(head, embed_weight)
        if kernel is None or len(q_lens) > self.max_batch or features.dtype != self.hardware.dtype:
            return None
        with self._lock:
            return kernel.propose(features.contiguous(), tokens, positions, q_lens, steps, k_cache, v_cache,
                                  block_tables, block_size)

    def _head_kernel(self, head, embed_weight):
        entry = self._others.get(id(head))
        if entry is None or entry[0]() is not head:
            kernel = None
            if all(hasattr(head, a) for a in self.HEAD_PARTS) and head.lm_head.weight.dtype == self.hardware.dtype \
                    and embed_weight.dtype == self.hardware.dtype:
                tensors, options = pack.head_weights(head, embed_weight)
                q8 = self.head_weights == "q8"
                kernel = self.extension().Head(tensors, **options, bf16=self.hardware.dtype == torch.bfloat16,
                                                     dot=self.uses_dot and not q8, threads=self.threads_used,
                                                     max_rows=self.max_batch)
                if q8:
                    kernel.set_quant(pack.head_q8(head), self.ACT_MODES.index(self.head_act()))
            entry = self._others[id(head)] = (weakref.ref(head), kernel)
        return entry[1]

    def head_act(self) -> str:
        """A q8 head's activation mode: the target's for stored weights, else q16 (float quality)."""
        return self.act if self.stored and self.act in ("q8", "q16") else "q16"
