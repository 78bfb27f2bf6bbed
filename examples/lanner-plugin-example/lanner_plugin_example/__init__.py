"""An example Lanner kernel plugin: decode steps in plain PyTorch with dense attention over the block tables.

Not fast: it exists to show the contract. Its forward reads the model's weights and Lanner's paged KV cache
the way a fused kernel would (per-sequence block tables from the attention metadata)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lanner.plugins.base import Plugin, PluginMismatch, Step, StepKind


class ExamplePlugin(Plugin):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "llama", "mistral")  # HF and GGUF names

    def __init__(self, max_batch: int = 4, kinds=("decode",), build_mib: int = 0, require: str | None = None,
                 fail_at: int | None = None, perturb: float = 0.0, logits: bool = False):
        self.max_batch, self.build_mib, self.require = int(max_batch), int(build_mib), require
        self.kinds = {StepKind(k) for k in kinds}
        self.fail_at, self.perturb = fail_at, float(perturb)
        self.calls = 0
        self.workspace = None
        if logits:  # also serve the logits head of the steps it ran
            self.compute_logits = self._logits

    def check(self, model_config, hardware):
        if self.require is not None and hardware.kind != self.require:
            raise PluginMismatch(f"example: needs a {self.require} device, this engine runs on {hardware.device}")
        if hardware.tp_size != 1:
            raise PluginMismatch(f"example: supports tp_size 1, got {hardware.tp_size}")
        if model_config.qk_norm or model_config.attention_bias:
            raise PluginMismatch("example: q/k norm and qkv bias are not implemented")

    def build(self, model, model_config, hardware):
        # stands for repacked weights or kernel scratch: the engine subtracts it from the KV budget
        self.workspace = torch.empty(self.build_mib * 2**20, dtype=torch.uint8, device=hardware.device) \
            if self.build_mib else None

    def covers(self, step: Step) -> bool:
        return step.model == "target" and step.kind in self.kinds and step.batch_size <= self.max_batch

    @torch.inference_mode()
    def forward(self, step, model, input_ids, positions, kv_caches, meta, capture_layers):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise RuntimeError(f"example: failing on purpose in call {self.calls} (fail_at)")
        cfg = model.cfg
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = model.embed_tokens(input_ids)
        cos, sin = model.rotary.cos[positions].to(x.dtype), model.rotary.sin[positions].to(x.dtype)
        # each row's (sequence, absolute position): new tokens of sequence b end at ctx_lens[b]
        rows = [(b, c - q + i) for b, (q, c) in enumerate(zip(meta.q_lens, meta.ctx_lens)) for i in range(q)]
        bs = meta.block_size
        slots = [torch.tensor([meta.block_tables[b][p // bs] * bs + p % bs for p in range(c)], device=x.device)
                 for b, c in enumerate(meta.ctx_lens)]
        captured = {}
        for li, layer in enumerate(model.layers):
            k_cache, v_cache = kv_caches[li]
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = F.linear(h, attn.qkv_proj.weight).split([H * D, Hkv * D, Hkv * D], dim=-1)
            q, k = _rope(q.view(-1, H, D), cos, sin), _rope(k.view(-1, Hkv, D), cos, sin)
            k_cache[meta.slot_mapping], v_cache[meta.slot_mapping] = k, v.view(-1, Hkv, D)
            out = torch.empty_like(q)
            for t, (b, pos) in enumerate(rows):
                ks, vs = k_cache[slots[b][: pos + 1]], v_cache[slots[b][: pos + 1]]  # [L, Hkv, D]
                ks, vs = ks.repeat_interleave(H // Hkv, 1), vs.repeat_interleave(H // Hkv, 1)
                w = torch.einsum("hd,lhd->hl", q[t].float(), ks.float()) * attn.scale
                out[t] = torch.einsum("hl,lhd->hd", w.softmax(-1), vs.float()).to(q.dtype)
            x = x + F.linear(out.view(-1, H * D), attn.o_proj.weight)
            gate, up = F.linear(layer.post_attention_layernorm(x), layer.mlp.gate_up_proj.weight).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
            if li in capture_layers:
                captured[li] = x
        hidden = model.norm(x)
        if self.perturb:
            hidden = hidden + self.perturb
        return hidden, [captured[i] for i in capture_layers]


    @staticmethod
    def _logits(step, model, hidden):
        weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        return hidden @ weight.t()


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]
