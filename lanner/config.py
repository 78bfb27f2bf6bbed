"""Engine configuration, validated once at start-up."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "bfloat16"
    device: str | None = None  # None: cuda if available, else cpu
    block_size: int = 16
    kv_cache_memory: str | float = "auto"  # "auto", GiB ("2GiB" or 2.0 > 1), or a fraction (0 < x <= 1)
    max_num_seqs: int = 64  # running requests
    max_queue_len: int = 1024  # waiting requests; beyond it new requests are refused
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    seed: int = 0
    served_model_name: str | None = None
    skip_tokenizer: bool = False  # token ids in and out only
    spec: str | None = None  # None: plain decoding; "ngram" (prompt lookup) or "draft" (needs `draft`)
    draft: str | None = None  # draft model: HF folder / GGUF of a smaller model with the same tokenizer
    spec_tokens: int = 5  # k: draft tokens verified per step
    # speculate only while at most this many requests run: on the 2-core CPU, n-gram drafting (tau ~1.7 on chat)
    # gained 1.08x at 1 request, broke even at 2-4 and lost at 8 (0.86x) and 16 (0.70x): results/bench_spec_batch
    spec_max_batch: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    # kernel plugins (lanner.plugins): None/"none", "auto" (use what fits, skip the rest) or "name[,name]" (each
    # must fit or the engine stops); options per plugin name; verify: run both paths for the first N steps of each
    # kind and raise on mismatch
    plugin: str | None = None
    plugin_options: dict | None = None
    plugin_verify: int = 0
    # tensor parallelism: tp processes, each holding a shard of every layer (rank 0 is this process; Lanner
    # spawns the others, or they come from torchrun). tp_timeout_s bounds every collective: a rank that dies or
    # hangs turns into a TPError within it
    tp: int = 1
    tp_timeout_s: float = 60.0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device: cuda was requested but torch sees no CUDA device")
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("dtype: float16 is only supported on CUDA; use bfloat16 or float32 on CPU")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.spec not in (None, "ngram", "draft"):
            raise ValueError(f"spec: must be 'ngram', 'draft' or None, got {self.spec!r}")
        if self.spec == "draft" and not self.draft:
            raise ValueError("draft: spec='draft' needs a draft model path")
        if self.plugin_verify < 0:
            raise ValueError("plugin_verify: must be >= 0")
        if self.plugin_options is not None and not (isinstance(self.plugin_options, dict) and all(
                isinstance(v, dict) for v in self.plugin_options.values())):
            raise ValueError("plugin_options: expected {plugin name: {option: value}}")
        if not 1 <= self.spec_tokens <= 8:
            raise ValueError(f"spec_tokens: must be in 1..8, got {self.spec_tokens}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp: must be an integer >= 1, got {self.tp!r}")
        if isinstance(self.tp_timeout_s, bool) or not isinstance(self.tp_timeout_s, (int, float)) or \
                not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s: must be a positive number of seconds, got {self.tp_timeout_s!r}")
        if self.tp > 1 and self.device.startswith("cuda"):
            if self.device not in ("cuda", "cuda:0"):
                raise ValueError(f"device: with tp={self.tp} rank r runs on cuda:r; give 'cuda', not {self.device!r}")
            if torch.cuda.device_count() < self.tp:
                raise ValueError(f"tp: {self.tp} ranks need {self.tp} CUDA devices, torch sees "
                                 f"{torch.cuda.device_count()}")
        for name in ("max_num_seqs", "max_queue_len", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def kv_cache_bytes(self, bytes_per_token: int, already_used: int = 0) -> int:
        """Resolve the KV budget. 'auto' = 90% of free device memory on CUDA; on CPU, 25% of available RAM
        capped at 1 GiB (a CPU box is usually shared with other work). already_used: bytes that plugins took
        after the budget's memory was measured; they come off an explicit or CPU budget (free CUDA memory
        already reflects them)."""
        total, from_free_memory = self._kv_budget()
        return total if from_free_memory else max(0, total - already_used)

    def _kv_budget(self) -> tuple[int, bool]:
        spec, absolute = self.kv_cache_memory, False
        if isinstance(spec, str):
            m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|g)?\s*", spec.lower())
            if spec == "auto":
                spec = None
            elif m is None:
                raise ValueError(f"kv_cache_memory: expected 'auto', '<N>GiB' or a fraction, got {spec!r}")
            else:
                spec, absolute = float(m.group(1)), m.group(2) is not None
        if spec is not None and spec <= 0:
            raise ValueError("kv_cache_memory: must be positive")
        if spec is not None and (absolute or spec > 1):
            return int(spec * 2**30), False
        available, cuda = _available_bytes(self.device), self.device.startswith("cuda")
        if spec is None:
            if not cuda:
                return int(min(0.25 * available, 2**30)), False
            return int(0.9 * available), True
        return int(spec * available), cuda


def _available_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
