"""Architecture-independent description of a decoder-only transformer."""
from __future__ import annotations

from dataclasses import dataclass, field

WEIGHT_MODES = ("dequantize", "stored")  # GGUF tensors: dequantized at load, or kept in their blocks

SUPPORTED_ARCHITECTURES = {
    # HF `architectures[0]` / GGUF `general.architecture` -> model family
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    # MoE feed-forward over Llama-style dense attention
    "Qwen3MoeForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    # MLA + DeepSeek sparse attention (lightning indexer) + MoE
    "DeepseekV32ForCausalLM": "deepseek",
    "GlmMoeDsaForCausalLM": "deepseek",
    # sliding-window local layers + global layers, (1 + w) norms, pre/post norms, GeGLU
    "Gemma3ForCausalLM": "gemma",
    "gemma3": "gemma",
}

# families whose models attend over a sliding window themselves (the others are capped at the window)
SLIDING_WINDOW_FAMILIES = ("gemma",)


class UnsupportedModelError(ValueError):
    pass


def check_architecture(arch: str) -> str:
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedModelError(f"unsupported architecture {arch!r}; Lanner supports: {supported}")
    return SUPPORTED_ARCHITECTURES[arch]


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    family: str = "llama"  # which model class runs it (lanner.models.loader.MODEL_CLASSES)
    hf: dict = field(default_factory=dict, repr=False)  # the raw HF config: family-specific fields are read from it

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        family = check_architecture(arch)
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        # transformers >= 5 writes `rope_parameters` (theta included); older configs `rope_theta` + `rope_scaling`
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = rope if (rope.get("rope_type") or rope.get("type") or "default") != "default" else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size") or cfg.get("moe_intermediate_size"),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            family=family,
            hf=dict(cfg),
        )

    @property
    def max_context(self) -> int:
        # Llama-family models have no sliding-window attention: cap the context where full attention is still exact.
        if self.sliding_window and self.family not in SLIDING_WINDOW_FAMILIES:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings
