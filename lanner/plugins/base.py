"""The plugin contract. A plugin is a class found through the entry-point group `lanner.plugins`; Lanner's core
never imports vendor code. Its four hooks, in the order of the engine's life:

1. register: `architectures` / `supports(model_config)` say which model structures it handles;
2. check(model_config, hardware): before any weight loads; raise PluginMismatch naming what does not fit;
3. build(model, model_config, hardware): after weights load and before the KV cache is sized; whatever tensors
   the plugin keeps (reachable from its attributes, or CUDA allocations) are subtracted from the KV budget;
4. covers(step) / forward(step, model, *args): per model call; steps a plugin does not cover run the engine's
   own forward. A plugin may also define compute_logits(step, model, hidden) for the steps it ran. `forward` takes exactly the arguments of the covered module's own forward and returns what it
   returns: for the target and draft models (PREFILL, DECODE, VERIFY, and DRAFT / DRAFT_EXTEND of a draft
   model) that is LlamaModel.forward(input_ids, positions, kv_caches, meta, capture_layers) -> (hidden,
   captured); for an EAGLE-style draft head (DRAFT / DRAFT_EXTEND with `step.model == "draft_head"`),
   DraftHead.forward(hidden, embeds, positions, k_cache, v_cache, meta) -> (logits, hidden).

Under tensor parallelism every rank runs its own copy of each plugin on its shard. A plugin's collectives go
through `plugin_all_reduce(x, timeout_s)`: its wait is shorter than the engine's watchdog (tp_timeout_s), and
when it times out on any rank every rank raises PluginCollectiveAbort at that same collective, so the engine
aborts the step everywhere, disables the plugin and reruns the step on its own forward. Between its
collectives a plugin must not raise on one rank only (the ranks' collectives would no longer line up).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from lanner.cpu import cpu_flags, cpu_name


class StepKind(str, enum.Enum):
    PREFILL = "prefill"  # at least one sequence is prefilling prompt tokens
    DECODE = "decode"  # one new token per sequence
    VERIFY = "verify"  # the target scores draft chains
    DRAFT = "draft"  # a draft proposes its next chained token
    DRAFT_EXTEND = "draft_extend"  # a draft catches up on verified tokens


@dataclass(frozen=True)
class Step:
    kind: StepKind
    num_tokens: int  # rows in this forward
    batch_size: int  # sequences in this forward
    model: str = "target"  # "target" | "draft" (a draft model) | "draft_head"
    tree: bool = False  # a draft tree's rows (AttentionMetadata.tree): only plugins with tree_verify get the step


@dataclass(frozen=True)
class Hardware:
    device: str  # "cpu", "cuda:0", ...
    dtype: torch.dtype
    device_name: str = ""
    capability: tuple[int, int] | None = None  # CUDA compute capability
    cpu_flags: frozenset = field(default_factory=frozenset)  # e.g. {"avx512f", "avx512_bf16"}
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def kind(self) -> str:
        return "cuda" if self.device.startswith("cuda") else "cpu"

    @classmethod
    def detect(cls, device: str, dtype: torch.dtype, tp_size: int = 1, tp_rank: int = 0) -> Hardware:
        if device.startswith("cuda"):
            dev = torch.device(device)
            return cls(device, dtype, torch.cuda.get_device_name(dev), torch.cuda.get_device_capability(dev),
                       tp_size=tp_size, tp_rank=tp_rank)
        return cls(device, dtype, cpu_name(), None, cpu_flags(), tp_size, tp_rank)


class PluginMismatch(RuntimeError):
    """check() found the model, hardware, dtype or parallel layout unsupported; the message names which."""


class PluginVerifyError(RuntimeError):
    """--plugin-verify: the plugin's output differs from the engine's own beyond tolerance."""


class PluginCollectiveAbort(RuntimeError):
    """A plugin collective timed out on some tensor-parallel rank; raised on every rank at the same collective."""


def plugin_all_reduce(x: torch.Tensor, timeout_s: float) -> torch.Tensor:
    """Sums x in place over the tensor-parallel ranks (identity at TP=1) and returns it. Waits at most
    timeout_s (which must be below the engine's tp_timeout_s); then the ranks agree through one small
    all-reduce, and if the sum was late on any of them all raise PluginCollectiveAbort."""
    from lanner.distributed import all_reduce_within, any_rank

    if not any_rank(not all_reduce_within(x, timeout_s)):
        return x
    raise PluginCollectiveAbort(f"a plugin collective did not complete within {timeout_s:g} s on every "
                                "tensor-parallel rank; the step is aborted on all ranks")


def check_options(plugin: str, options: dict, types: dict):
    """Raises ValueError for an option not in `types` (name -> type or tuple of types) or of the wrong type (bool is
    an int to isinstance: only a bool option takes one)."""
    unknown = sorted(set(options) - set(types))
    if unknown:
        raise ValueError(f"plugin {plugin}: unknown option(s) {unknown}; it takes {sorted(types)}")
    for k, v in options.items():
        if not isinstance(v, types[k]) or (isinstance(v, bool) and types[k] is not bool):
            raise ValueError(f"plugin {plugin}: option {k}={v!r} has the wrong type")


class Plugin:
    name = ""  # set by the loader to the entry-point name when empty
    architectures: tuple[str, ...] = ()  # HF architecture names; override supports() for a structural predicate
    # --plugin-verify tolerance: max |plugin - own| / max |own| per output; None: 1e-4 for float32, 3e-2 otherwise
    verify_tolerance: float | None = None
    # Under TP the engine asks the ranks after each plugin call (one small all-reduce) whether it failed anywhere.
    # A plugin whose calls fail on every rank or on none (its collectives agree on aborts themselves, and nothing
    # else can fail on one rank alone) sets this True to skip that question.
    consistent_failures: bool = False
    # whether `--plugin auto` may pick it; False: only when named (e.g. a plugin that compiles for minutes at start)
    auto: bool = True
    # after build: tokens per step in which a request running alone prefills best (None: no preference), e.g. a
    # path that passes over the weights once per step (EngineConfig.solo_prefill_tokens)
    solo_prefill_tokens: int | None = None

    def __init__(self, **options):
        if options:
            raise ValueError(f"plugin {self.name!r} takes no options, got {sorted(options)}")

    def supports(self, model_config) -> bool:
        return model_config.architecture in self.architectures

    def check(self, model_config, hardware: Hardware) -> None:
        """Raise PluginMismatch naming the mismatch. No weights are loaded yet."""

    def build(self, model, model_config, hardware: Hardware) -> None:
        """Prepare weights/resources; keep them as attributes so the engine can account for their memory."""

    # whether forward honours AttentionMetadata.tree (rows that read their tree ancestors, at depth positions)
    tree_verify = False

    def covers(self, step: Step) -> bool:
        return False

    def forward(self, step: Step, model, *args):
        raise NotImplementedError

    # Optional: the logits head (a large share of the bytes a small model reads per step). Called with the rows
    # that sample, for steps whose forward this plugin ran; return model.compute_logits(hidden)'s result.
    compute_logits = None
    # Optional, with compute_logits: greedy steps' heads, the argmax of those logits (int64 [rows], the first index
    # on ties, as torch's argmax), for a plugin that finds it without handing the logits out.
    compute_argmax = None
