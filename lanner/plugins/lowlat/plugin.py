"""LowLatPlugin: the whole Llama-family forward in one C++ call for small CPU batches (decode, verify of k
drafts, small prefill chunks) of the target or a draft model, dense or MoE (Qwen3-MoE, Mixtral: router, top-k,
and each hit expert's GEMVs over only the rows that picked it) or Gemma 3 (sliding-window local layers, (1 + w)
pre/post norms, GeGLU), lowlat's GEMV for the LM head (core's compute_logits hook) and for an EAGLE-style draft
head's linears. The kernels are in csrc/ (lowlat.cpp names its headers)."""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import weakref
from typing import ClassVar

import torch

from lanner.cpu import amx_usable
from lanner.models.config import SUPPORTED_ARCHITECTURES
from lanner.models.quant import QuantLinear, parameter_count
from lanner.plugins.base import (
    Hardware,
    Plugin,
    PluginCollectiveAbort,
    PluginMismatch,
    Step,
    StepKind,
    check_options,
)
from lanner.layers.attention import build_attention_metadata
from lanner.plugins.lowlat import pack
from lanner.plugins.lowlat.heads import DraftHeadKernels

log = logging.getLogger("lanner")
AVX2_FLAGS = ("avx2", "fma", "f16c")


def cpu_variant(cpu_flags) -> str | None:
    """The build of the extension a CPU with these flags runs by default: "avx512" (AVX-512F), "avx2" (AVX2 + FMA
    + F16C: the same kernels on 256-bit halves, csrc/avx2.h) or None (neither: lowlat does not run)."""
    if "avx512f" in cpu_flags:
        return "avx512"
    return "avx2" if all(f in cpu_flags for f in AVX2_FLAGS) else None


class LowLatPlugin(DraftHeadKernels, Plugin):
    """Options (plugin_options={"lowlat": {...}} / --plugin-option lowlat.NAME=VALUE):
    threads: OpenMP threads for the kernels (default: torch.get_num_threads() at build);
    max_rows: most rows (tokens) of a DECODE / VERIFY / DRAFT step it runs, up to 256; larger steps go to the
        engine's own forward. Default 72 (8 sequences x 9 verify rows). On the 2-core AVX-512 box lowlat beats
        the engine's forward at every size up to 72 rows (2 threads, bf16: 4.0x at 1 row, 3.4x at 6, 1.15x at
        72), but the margin shrinks with the rows: PyTorch's GEMM reuses each weight across all of them, lowlat's
        GEMV across 6-8 at a time;
    prefill_rows: the same for PREFILL / DRAFT_EXTEND steps (0 leaves prefill to the engine). Default: 72; for GGUF
        blocks kept as stored, 256 and every prefill step of the target, however long, in pieces of up to 256
        rows: 0-10% slower than the engine's dequantizing matmuls and SDPA on long prompts (tools/prefill_paths.py),
        but every prompt token then gets the batch-invariant kernels' bits, so chunking does not matter and a
        prompt answered again from the prefix cache (its tail block recomputed) gives the same tokens;
    gemm_prefill_from: a stored-weights target's prefill steps of at least this many rows go to the engine's
        forward instead: its matmuls dequantize 4096-row tiles (lowlat's dequant_t) and run PyTorch's bf16 GEMM,
        which oneDNN runs on AMX tiles where the CPU has them (414-561 GMAC/s a core against lowlat's q8 kernel's
        96-104, tools/gemm_efficiency.py: a 2048-token Qwen2.5-Coder-1.5B prompt in 9.7 s instead of 18.6, 2
        threads, tools/amx_prefill.py). Default: 128 on a CPU
        with AMX-BF16 in bf16 (where the two paths break even), else 0 (never). Those steps' bits are the
        engine's, not the batch-invariant kernels': a prompt's tokens can then depend on how it was chunked;
    max_batch: most sequences per step (default 8);
    isa: "auto" (AVX-512, with AVX512_BF16 dot products when the CPU has them; AVX2 + FMA + F16C on a CPU without
        AVX-512F), "avx512f" (bf16 -> fp32 shifts + FMA) or "avx2" (the AVX2 build: the same kernels on 256-bit
        halves, bit-identical results; csrc/avx2.h);
    allreduce (tensor parallelism): "auto" (a memory segment shared by the ranks when they are on one host, else
        the process group), "shm" (the segment or a build error) or "group" (torch.distributed, gloo);
    timeout_s (tensor parallelism): the longest wait for another rank inside a step (default: half the engine's
        tp_timeout_s, at most 5 s); on timeout every rank aborts the step and the engine reruns it without lowlat.
    act (GGUF weights kept as stored, EngineConfig.weights="stored"): "auto" (default: q8 from 1B parameters, q16
        below), "q16" (activations quantized per block of 32 to 16-bit integers, 3e-5 of the block's largest
        value; integer dot products, text as with float activations), "q8" (8 bits per block, as llama.cpp does
        them: half q16's dot products, so verify rows cost far less; on the bundled 135M model greedy answers
        change visibly, on Qwen2.5-Coder-1.5B they part from llama.cpp's where q16's do, at small top-2 gaps) or
        "float" (float32 activations against the exact dequantized weights);
    amx_attention: attention on AMX tiles for bf16 models with a bf16 KV cache, on CPUs with AMX-BF16 (default
        on there): 1.1-2.5x the FMA kernel's speed for a decode row (least at long contexts, where one core's
        reads bound it), 2-3.9x for 4-16 verify rows (tools/lowlat_attention.py);
        batch-invariant too, but its bits are not the FMA kernel's;
    attn_split: flash-decoding (default on): where a sequence's keys span several 512-key parts, its attention
        runs as (heads, part) units over all threads, then each row folds its parts in order. The bits are those
        of the parts folded on one thread (off), so it changes speed only: with fewer kv groups than threads
        (Qwen2.5: 2) threads no longer idle or re-read a group's keys;
    amx_gemv_rows: GGUF-block GEMVs with q8 activations of at least this many rows run on AMX-INT8 tiles, on CPUs
        with them (0: never), with the VNNI kernel's bits; default 8 (Qwen2.5-Coder-1.5B, 2 threads: 8 / 16 rows
        1.14x / 1.37x faster, 2 / 4 rows slower; tools/qgemv_rows.py --amx-rows 0,2,8);
    invariant: batch-invariant GEMVs and attention (a row's bits do not depend on the other rows of its step, so
        speculative greedy output equals plain greedy output in every dtype); default on. Off: the GEMVs pick
        their accumulator chains per block size and attention mirrors PyTorch's exp variants.
    Under TP every rank runs lowlat on its shard and all ranks use the same thread count (the smallest asked)."""

    name = "lowlat"
    # Llama-family models, dense or with MoE feed-forwards (Qwen3-MoE, Mixtral), and Gemma 3; not MLA (DeepSeek)
    architectures = tuple(sorted(a for a, f in SUPPORTED_ARCHITECTURES.items() if f in ("llama", "gemma")))
    GEMMA_ARCHITECTURES = tuple(sorted(a for a, f in SUPPORTED_ARCHITECTURES.items() if f == "gemma"))
    ROPE_ROWS = 4096  # Gemma's rotary tables start this long and double as positions grow (its model keeps none)
    MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
    ACT_MODES = ("float", "q8", "q16")  # index = quant.h's QAct
    # act="auto": q8 from this many parameters (results/bench_quant_qwen.json: on the 1.5B model q8 decodes 1.3x
    # q16 and parts from llama.cpp's greedy tokens where q16 does; on the 135M model q8 changes answers)
    Q8_FROM = 1_000_000_000
    AMX_GEMV_ROWS = 8  # amx_gemv_rows' default (see the option)
    AMX_PREFILL_FROM = 128  # gemm_prefill_from's default with AMX: the rows where the paths break even (Qwen 1.5B)
    OPTIONS: ClassVar[dict] = {"threads": (int, type(None)), "max_rows": int, "prefill_rows": int, "max_batch": int,
                               "isa": str, "allreduce": str, "timeout_s": (int, float), "act": str,
                               "invariant": bool, "head_weights": str, "gemm_prefill_from": int,
                               "amx_attention": bool, "amx_gemv_rows": int, "attn_split": bool}

    def __init__(self, **options):
        check_options("lowlat", options, self.OPTIONS)
        self.threads = options.get("threads")
        self.max_rows = options.get("max_rows", 72)
        self.prefill_rows = self.options_prefill_rows = options.get("prefill_rows")  # None: by the weights, at build
        self.max_batch = options.get("max_batch", 8)
        self.isa = options.get("isa", "auto")
        self.allreduce = options.get("allreduce", "auto")
        self.timeout_s = options.get("timeout_s")
        self.act = options.get("act", "auto")
        self.invariant = options.get("invariant")
        self.amx_attention = options.get("amx_attention", True)
        self.attn_split = options.get("attn_split", True)
        self.amx_gemv_rows = options.get("amx_gemv_rows", self.AMX_GEMV_ROWS)
        if self.amx_gemv_rows < 0:
            raise ValueError("plugin lowlat: amx_gemv_rows must be >= 0")
        # an EAGLE head's matrices: "q8" (Q8_0 blocks, made at load) or "dense" (its own dtype)
        self.head_weights = options.get("head_weights", "q8")
        self.gemm_prefill_from = self.options_gemm_prefill_from = options.get("gemm_prefill_from")  # None: at build
        if self.gemm_prefill_from is not None and self.gemm_prefill_from < 0:
            raise ValueError("plugin lowlat: gemm_prefill_from must be >= 0")
        if self.head_weights not in ("q8", "dense"):
            raise ValueError(f"plugin lowlat: head_weights must be 'q8' or 'dense', got {self.head_weights!r}")
        if self.act not in ("auto", *self.ACT_MODES):
            raise ValueError(f"plugin lowlat: act must be 'auto' or one of {list(self.ACT_MODES)}, got {self.act!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError("plugin lowlat: threads must be >= 1")
        if not 1 <= self.max_rows <= 256:
            raise ValueError("plugin lowlat: max_rows must be in 1..256")
        if self.prefill_rows is not None and not 0 <= self.prefill_rows <= 256:
            raise ValueError("plugin lowlat: prefill_rows must be in 0..256")
        if self.max_batch < 1:
            raise ValueError("plugin lowlat: max_batch must be >= 1")
        if self.isa not in ("auto", "avx512f", "avx2"):
            raise ValueError(f"plugin lowlat: isa must be 'auto', 'avx512f' or 'avx2', got {self.isa!r}")
        self.variant = "avx2" if self.isa == "avx2" else "avx512"  # which build of the extension; see check()
        if self.allreduce not in ("auto", "shm", "group"):
            raise ValueError(f"plugin lowlat: allreduce must be 'auto', 'shm' or 'group', got {self.allreduce!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError("plugin lowlat: timeout_s must be > 0")
        self.rows = max(self.max_rows, self.prefill_rows or 0)  # the kernels' capacity (set again at build)
        self._kernel = None  # the target model's kernel
        self._scratch = None  # its activation buffers, reachable here so the engine accounts for them
        self._others: dict[int, tuple] = {}  # id(draft model) -> (weakref, kernel): built on first use
        self._target_id = None
        self._lock = threading.Lock()  # a kernel's buffers serve one forward at a time
        self.gemm_rows = 0  # prefill rows the engine's GEMMs ran (gemm_prefill_from)
        self.hardware = None
        self.stored = False  # the target holds GGUF blocks as stored (lanner.models.quant)
        self._segment = None  # under TP on one host: the memory segment the ranks sum through (counted as ours)
        # True when a failure is raised on every rank or none (the shared segment's waits agree by themselves), so
        # the engine need not ask the ranks after each call
        self.consistent_failures = False

    # ------------------------------------------------------------------ contract
    def supports(self, model_config) -> bool:
        return model_config.architecture in self.architectures and self._problem(model_config) is None

    @classmethod
    def _problem(cls, c) -> str | None:
        """Why lowlat cannot run this (supported-architecture) model's structure, or None."""
        if not (c.head_dim % 16 == 0 and c.head_dim <= 512 and c.num_heads % c.num_kv_heads == 0):
            return (f"head_dim {c.head_dim} / heads {c.num_heads} / kv heads {c.num_kv_heads} not supported "
                    "(head_dim a multiple of 16, <= 512)")
        if c.architecture in cls.MOE_ARCHITECTURES:
            hf = c.hf or {}
            experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
            top_k = hf.get("num_experts_per_tok") or 0
            if experts and not 1 <= top_k <= experts:
                return f"MoE top_k {top_k} of {experts} experts not supported (needs 1 <= top_k <= experts)"
        return None

    def check(self, model_config, hardware: Hardware) -> None:
        if hardware.kind == "cuda":
            raise PluginMismatch(f"lowlat: CUDA path not built (device {hardware.device}); lowlat runs on CPU only")
        if hardware.dtype not in (torch.bfloat16, torch.float32):
            raise PluginMismatch(f"lowlat: dtype {hardware.dtype} not supported; use bfloat16 or float32")
        self.variant = "avx2" if self.isa == "avx2" or (self.isa == "auto" and "avx512f" not in hardware.cpu_flags) \
            else "avx512"
        if self.variant == "avx512" and "avx512f" not in hardware.cpu_flags:
            raise PluginMismatch(f"lowlat: the CPU ({hardware.device_name or 'unknown'}) lacks the avx512f flag "
                                 "that isa='avx512f' asks for")
        missing = [f for f in AVX2_FLAGS if f not in hardware.cpu_flags]
        if self.variant == "avx2" and missing:
            raise PluginMismatch(f"lowlat: the CPU ({hardware.device_name or 'unknown'}) has neither AVX-512F nor "
                                 f"AVX2 + FMA + F16C (it lacks {', '.join(missing)})")
        if model_config.architecture not in self.architectures:
            raise PluginMismatch(f"lowlat: architecture {model_config.architecture} not supported; it runs "
                                 f"{list(self.architectures)}")
        problem = self._problem(model_config)
        if problem:
            raise PluginMismatch(f"lowlat: {problem}")
        if model_config.architecture in self.GEMMA_ARCHITECTURES and hardware.tp_size > 1:
            raise PluginMismatch(f"lowlat: {model_config.architecture} runs on one rank only (tensor parallelism "
                                 "is not built for its post-norms)")
        self.extension()

    @property
    def kernel(self):
        """The target model's compiled kernel (the extension's Model: profiling counters, tuning switches), or None
        before build()."""
        return self._kernel

    def extension(self):
        """Compiles (first use on this machine, ~20-60 s) or loads the C++ extension. In check(), so that a
        machine without a working C++ toolchain is a mismatch ("auto" mode skips the plugin) rather than an
        engine that fails after loading the weights."""
        from lanner.plugins.lowlat._ext import load

        try:
            return load(self.variant)  # cached in lanner.plugins.lowlat._ext (not here: the engine walks attributes)
        except Exception as e:
            raise PluginMismatch(f"lowlat: the C++ extension did not build ({type(e).__name__}: "
                                 f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); it needs g++ "
                                 "with OpenMP and ninja") from e

    def build(self, model, model_config, hardware: Hardware) -> None:
        ext = self.extension()
        self.hardware = hardware
        self.threads_used = self.threads or torch.get_num_threads()
        if hardware.tp_size > 1:
            from lanner.distributed import agree_min

            self.threads_used = agree_min(self.threads_used)  # the ranks split the hidden columns alike
        self.stored = any(isinstance(m, QuantLinear) for m in model.modules())
        if self.act == "auto":  # the target's size picks; a draft model built later runs the same mode
            self.act = "q8" if self.stored and parameter_count(model) >= self.Q8_FROM else "q16"
        if self.stored and hardware.tp_size > 1:
            raise PluginMismatch("lowlat: GGUF weights kept as stored run on one rank only")
        if self.options_prefill_rows is None:
            self.prefill_rows = 256 if self.stored else 72
        if self.options_gemm_prefill_from is None:
            amx = hardware.dtype == torch.bfloat16 and hardware.kind == "cpu" and amx_usable()
            self.gemm_prefill_from = self.AMX_PREFILL_FROM if self.stored and amx else 0
        # the GEMM route dequantizes every weight tile once per step: a lone long prompt in 2048-token steps
        # reaches its first token 1.5x sooner than in 512-token ones (docs/quantized.md#prefill)
        self.solo_prefill_tokens = 2048 if self.stored and self.gemm_prefill_from > 0 else None
        self.rows = max(self.max_rows, self.prefill_rows)
        # stored-type kernels take float activations; bf16 dot products are for bf16 weights
        self.uses_dot = (hardware.dtype == torch.bfloat16 and self.isa == "auto" and not self.stored
                         and "avx512_bf16" in hardware.cpu_flags and ext.have_avx512_bf16)
        self._kernel = self._make_kernel(model)
        self._target_id = id(model)
        self._scratch = self._kernel.scratch
        if hardware.tp_size > 1:
            self._join_tp(model, hardware)

    def _join_tp(self, model, hardware: Hardware):
        """Connects the target's kernel to the other ranks: through a segment every rank maps (rank 0 creates a
        zero-filled file in /dev/shm; a rank that cannot see it is on another host) or the process group."""
        from lanner.distributed import (
            all_reduce_within,
            any_rank,
            broadcast_object,
            split_sizes,
            tp_timeout_s,
        )

        limit = tp_timeout_s()
        timeout = self.timeout_s if self.timeout_s is not None else min(5.0, limit / 2)
        if not timeout < limit:
            raise ValueError(f"plugin lowlat: timeout_s={timeout:g} must be below the engine's tp_timeout_s={limit:g}")
        P, rank = hardware.tp_size, hardware.tp_rank
        sizes = split_sizes(model.cfg.vocab_size, P)
        segment = None
        if self.allreduce != "group":
            nbytes = self._kernel.tp_segment_bytes(P, max(sizes))
            path = None
            if rank == 0:
                fd, path = tempfile.mkstemp(prefix="lanner-lowlat-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                            else None)
                try:  # reserve the pages now: a full /dev/shm must be an error here, not a SIGBUS mid-step
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    log.warning("lowlat: no room for the %d-byte TP segment in %s (%s)", nbytes, path, e)
                    os.unlink(path)
                    path = None
                os.close(fd)
            path = broadcast_object(path)
            try:
                if path is not None and os.path.getsize(path) == nbytes:  # from_file would create a missing file
                    segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            except OSError:
                pass
            apart = any_rank(segment is None)  # also: every rank has mapped it before rank 0 unlinks it
            if rank == 0 and path is not None:
                os.unlink(path)
            if apart:
                if self.allreduce == "shm":
                    raise PluginMismatch("lowlat: allreduce='shm' but the ranks share no segment (other hosts, or "
                                         "no room in /dev/shm)")
                segment = None
        self._segment = segment
        self.consistent_failures = segment is not None
        self._kernel.set_tp(P, rank, sizes, float(timeout), segment,
                            None if segment is not None else lambda t: all_reduce_within(t, timeout))
        log.info("lowlat: tensor parallel rank %d of %d, all-reduce through %s, wait limit %.3g s", rank, P,
                 "a shared memory segment" if segment is not None else "the process group", timeout)

    tree_verify = True

    def _gemm_route(self, step: Step) -> bool:
        """A long target prefill step for the engine's GEMMs (AMX where the CPU has it)."""
        return (step.kind in (StepKind.PREFILL, StepKind.DRAFT_EXTEND) and self.stored and step.model == "target"
                and 0 < self.gemm_prefill_from <= step.num_tokens)

    def covers(self, step: Step) -> bool:
        if self._kernel is None:
            return False
        prefill = step.kind in (StepKind.PREFILL, StepKind.DRAFT_EXTEND)
        if self._gemm_route(step):
            return step.batch_size == 1  # one sequence: _gemm_then_tail; several: the engine's forward alone
        if prefill and self.stored and step.model == "target" and self.prefill_rows:
            return True  # any length and batch, in pieces (_model_forward): every prompt token gets lowlat's bits
        if step.batch_size > self.max_batch:
            return False
        return step.num_tokens <= (self.prefill_rows if prefill else self.max_rows)

    def forward(self, step: Step, model, *args):
        if step.model == "draft_head":
            return self._head_forward(model, *args)
        if self._gemm_route(step):
            return self._gemm_then_tail(model, *args)
        return self._model_forward(model, *args)

    def _gemm_then_tail(self, model, input_ids, positions, kv_caches, meta, capture_layers=()):
        """One sequence's long prefill step: the engine's GEMMs up to the step's last KV block, lowlat from there.
        A prompt asked again is served from the prefix cache up to that block and recomputes only its last block,
        on lowlat: with the same bits as here, so it gets the same answer (the GEMMs' bits differ from lowlat's)."""
        q, ctx, bs = meta.q_lens[0], meta.ctx_lens[0], meta.block_size
        cut = (ctx - 1) // bs * bs - (ctx - q)  # the step's rows before its last block
        if cut <= 0 or meta.tree or meta.group_tables:
            return model(input_ids, positions, kv_caches, meta, capture_layers)
        head = build_attention_metadata([cut], [ctx - q + cut], meta.block_tables, bs, input_ids.device)
        h1, c1 = model(input_ids[:cut], positions[:cut], kv_caches, head, capture_layers)
        h2, c2 = self._model_forward(model, input_ids[cut:], positions[cut:], kv_caches,
                                     build_attention_metadata([q - cut], [ctx], meta.block_tables, bs,
                                                              input_ids.device), capture_layers)
        self.gemm_rows += cut
        return torch.cat([h1, h2]), [torch.cat(pair) for pair in zip(c1, c2)]

    def _model_forward(self, model, input_ids, positions, kv_caches, meta, capture_layers=()):
        kernel = self._kernel_for(model)
        if kernel is None:  # a draft model lowlat cannot run: its own forward
            return model(input_ids, positions, kv_caches, meta, capture_layers)
        if meta.q_lens is None:
            raise RuntimeError("lowlat: AttentionMetadata carries no q_lens/ctx_lens/block_tables")
        with self._lock:
            if max(meta.ctx_lens) > kernel.max_pos and self._is_gemma(model):
                kernel.set_rope(*pack.rope_tables(model, max(meta.ctx_lens), self.ROPE_ROWS))
            if input_ids.shape[0] <= self.rows and len(meta.q_lens) <= self.max_batch:
                out = kernel.forward(input_ids, positions, kv_caches, meta.q_lens, meta.ctx_lens, meta.block_tables,
                                     meta.block_size, list(capture_layers), meta.tree or [], meta.group_tables or [],
                                     meta.layer_group or [])
            else:
                out = self._pieces(kernel, input_ids, positions, kv_caches, meta, capture_layers)
        self._check_aborted(kernel)
        return out

    def _pieces(self, kernel, input_ids, positions, kv_caches, meta, capture_layers):
        """A prefill step of more rows or sequences than the kernels take: sequence by sequence, each one's rows in
        order, self.rows at a time, each piece reading the keys its sequence's earlier pieces wrote (chunked
        prefill inside one engine step; the batch-invariant kernels give every row the bits it gets in any other
        split). A draft tree's rows (another sequence's verify in the same step) are few: never split."""
        hidden, captured, t = [], [], 0
        for s, (q, ctx) in enumerate(zip(meta.q_lens, meta.ctx_lens)):
            groups = [[tables[s]] for tables in meta.group_tables or []]
            for a in range(0, q, self.rows):
                b = min(q, a + self.rows)
                h, cap = kernel.forward(input_ids[t + a : t + b], positions[t + a : t + b], kv_caches, [b - a],
                                        [ctx - q + b], [meta.block_tables[s]], meta.block_size, list(capture_layers),
                                        [meta.tree[s]] if meta.tree else [], groups, meta.layer_group or [])
                hidden.append(h)
                captured.append(cap)
            t += q
        return torch.cat(hidden), [torch.cat(parts) for parts in zip(*captured)]

    def _check_aborted(self, kernel):
        if kernel is self._kernel and self.hardware.tp_size > 1 and kernel.tp_aborted:
            raise PluginCollectiveAbort("lowlat: a tensor-parallel rank did not reach a collective within the "
                                        "wait limit (timeout_s); the step is aborted on every rank")

    # ------------------------------------------------------------------ kernels
    def _is_gemma(self, model):
        return model.cfg.architecture in self.GEMMA_ARCHITECTURES

    def _make_kernel(self, model):
        dtype, gemma = self.hardware.dtype, self._is_gemma(model)
        if gemma:  # the global tables go in as the Llama ones
            rope = pack.rope_tables(model, 0, self.ROPE_ROWS)
        else:
            rope = [model.rotary.cos.float().contiguous(), model.rotary.sin.float().contiguous()]
        with torch.no_grad():  # the model's own tensors, no copies: the kernel keeps references
            tensors, options = pack.model_weights(model, dtype, gemma, rope)
            kernel = self.extension().Model(tensors, **options, bf16=dtype == torch.bfloat16, dot=self.uses_dot,
                                                  threads=self.threads_used, max_rows=self.rows)
            if gemma:
                kernel.set_gemma(*pack.gemma_settings(model, dtype))
                kernel.set_rope(*rope)
        if any(isinstance(m, QuantLinear) for m in model.modules()):
            kernel.set_quant(pack.stored_weights(model), self.ACT_MODES.index(self.act))
            for m in model.modules():  # the engine's own prefill matmuls dequantize their tiles here too
                if isinstance(m, QuantLinear):
                    m.tile_kernel = kernel.dequant_t
        kernel.invariant = self.invariant is not False
        # attention through vdpbf16ps: the FMA path's bits with fewer instructions
        kernel.attn_dot = self.isa == "auto" and self.extension().have_avx512_bf16
        kernel.attn_amx = self.amx_attention and self.isa == "auto" and self.extension().have_amx_bf16
        kernel.attn_split = self.attn_split
        # (a process-wide setting of the extension, like its prefetch distances)
        self.extension().set_amx_gemv_rows(self.amx_gemv_rows if self.isa == "auto" and self.extension().have_amx_int8
                                           else 0)
        return kernel

    def _kernel_for(self, model):
        """The target's kernel, or one built on first use for a draft model (the engine builds plugins for the
        target only); None when the draft's structure is one lowlat does not run."""
        if id(model) == self._target_id:
            return self._kernel
        entry = self._others.get(id(model))
        if entry is None or entry[0]() is not model:
            kernel = None
            if self.supports(model.cfg) and next(model.parameters()).dtype == self.hardware.dtype:
                try:
                    kernel = self._make_kernel(model)
                except PluginMismatch as e:
                    log.info("lowlat: the draft model runs on the engine's own forward: %s", e)
            else:
                log.info("lowlat: the draft model (%s) runs on the engine's own forward", model.cfg.architecture)
            entry = self._others[id(model)] = (weakref.ref(model), kernel)
        return entry[1]

    @staticmethod
    def _softcap(model, logits):
        """Gemma's final_logit_softcapping, the ops of its compute_logits on the same model-dtype logits."""
        cap = getattr(model, "softcap", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    # ------------------------------------------------------------------ extras
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_float: bool = False) -> torch.Tensor:
        """x [M, K] @ weight[N, K].T (+ bias) with lowlat's GEMV, in the model dtype (out_float: float32, not
        rounded to the model dtype)."""
        return self._kernel.linear(x, weight, bias, out_float, False)

    def compute_logits(self, step: Step, model, hidden: torch.Tensor) -> torch.Tensor:
        """model.compute_logits(hidden) through lowlat's GEMV, for the steps lowlat ran (core's logits hook). The
        LM head is the largest single weight (49152 x 576 for the default model: a fifth of the bytes a decode
        step reads), and PyTorch's bf16 GEMV streams it at under half of lowlat's rate."""
        return self._lm_head(model, hidden, False)

    def compute_argmax(self, step: Step, model, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits(...).argmax(-1) (int64 [rows], first index on ties) with the argmax inside the LM head's
        kernel call, on the logits each thread just wrote: greedy steps skip the model-dtype copy of the logits,
        the float32 copy and torch's argmax passes (for Gemma 3's 262144-token vocabulary 1 MB per row each)."""
        if getattr(model, "softcap", None):  # the argmax of the capped model-dtype values, ties included
            return self._lm_head(model, hidden, False).argmax(-1)
        return self._lm_head(model, hidden, True)

    def _lm_head(self, model, hidden: torch.Tensor, argmax: bool) -> torch.Tensor:
        def own():
            logits = model.compute_logits(hidden)
            return logits.argmax(-1) if argmax else logits

        head = model.embed_tokens if model.lm_head is None else model.lm_head
        if isinstance(head, QuantLinear):
            kernel = self._kernel_for(model)
            if kernel is None or hidden.shape[0] > self.rows:
                return own()
            with self._lock:
                out = kernel.qlinear(hidden.contiguous(), head.packed(), head.out_features, False, argmax)
            return out if argmax else self._softcap(model, out)
        weight = head.weight
        if hidden.shape[0] > self.rows or weight.dtype != self.hardware.dtype:
            return own()
        if id(model) != self._target_id or self.hardware.tp_size == 1:
            out = self._kernel.linear(hidden, weight, None, False, argmax)
            return out if argmax else self._softcap(model, out)
        if self._segment is None:  # across hosts the gather is the process group's, like the engine's own
            return own()
        with self._lock:
            out = self._kernel.linear_gather(hidden.contiguous(), weight)  # every rank gets the full row
        self._check_aborted(self._kernel)
        return out.argmax(-1) if argmax else out
