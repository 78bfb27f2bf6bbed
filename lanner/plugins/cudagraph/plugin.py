"""CudaGraphPlugin: decode and verify steps of dense Llama-family models through one compiled, padded step
(lanner.plugins.cudagraph.step) that on CUDA is captured once per bucket and replayed as a CUDA graph; on the CPU
(option cpu=true, for tests) the same compiled step runs without graphs. Prefill, trees, oversized steps and
anything else it does not cover run the engine's own forward."""
from __future__ import annotations

import logging
import math
from typing import ClassVar

import numpy as np
import torch
from torch.fx.experimental import _config as fx_config

from lanner.models.config import SUPPORTED_ARCHITECTURES
from lanner.models.llama import LlamaModel, is_moe_layer
from lanner.models.quant import QuantLinear
from lanner.plugins.base import Hardware, Plugin, PluginMismatch, Step, StepKind, check_options
from lanner.plugins.cudagraph.step import static_step

log = logging.getLogger("lanner")
ALIGN = 16  # int64 elements: each input view starts 128-byte aligned (inductor's kernels assume aligned inputs)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Bucket:
    """One padded shape: Bp sequences of Qp rows over NB blocks each. Its inputs are views of the plugin's packed
    int64 buffer at fixed offsets, so a graph captured on them reads each step's values from the same addresses."""

    def __init__(self, Bp: int, Qp: int, NB: int):
        self.Bp, self.Qp, self.NB = Bp, Qp, NB
        self.shapes = [(Bp,), (Bp,), (Bp, Qp), (Bp * Qp,), (Bp, NB)]  # start, qlen, src, out_rows, tables
        self.offsets, at = [], 0
        for shape in self.shapes:
            self.offsets.append(at)
            at += -(-math.prod(shape) // ALIGN) * ALIGN
        self.size = at
        self.graphs: dict[tuple, tuple] = {}  # capture_layers -> (CUDAGraph, its captured-layer outputs)

    def views(self, buf: torch.Tensor) -> list:
        return [buf[o : o + math.prod(s)].view(s) for o, s in zip(self.offsets, self.shapes)]

    def mark_dynamic(self, views: list):
        """Sizes above 1 become symbols, so one compile serves every bucket with the same (Bp == 1, Qp == 1)
        pattern: at most four compiles (inductor specializes its layouts on sizes of 1). `maybe_`: a backend that
        specializes a size compiles once more instead of failing."""
        for t in views:
            for d, n in enumerate(t.shape):
                if n > 1:
                    torch._dynamo.maybe_mark_dynamic(t, d)


class CudaGraphPlugin(Plugin):
    """Options (--plugin-option cudagraph.NAME=VALUE, JSON values):
    batch_sizes: padded batch sizes (sequences per step) it captures, default [1, 2, 4, 8, 16]; larger batches run
        the engine's forward;
    rows: padded rows per sequence, default [1, 2, 4, 8, 17]: 1 is decode, the others verify steps of up to
        rows - 1 drafts (17: the default suffix drafts of up to 16 tokens);
    contexts: padded context lengths (tokens per sequence), default [256, 512, 1024, 2048, 4096]; a step whose
        longest sequence exceeds the last runs the engine's forward. Keys are gathered up to the bucket's length;
    max_rows: most padded rows (batch x rows) of a bucket, default 128 (the logits buffer holds that many rows);
    block_size: the engine's KV block size, default 16 (another size runs the engine's forward);
    cpu: allow a CPU device (compiled step, no graphs), default false: the CPU's fast path is lowlat;
    graphs: capture CUDA graphs on CUDA, default true (false: the compiled step alone, for A/B runs);
    backend: torch.compile backend, default "inductor" ("aot_eager" traces the same graph without codegen);
    dynamic: one compile per class of buckets (batch and rows of 1, or more), their sizes symbolic; default true.
        False: one static compile per bucket (the fallback if a dynamic-shape compile fails on some device);
    warmup: compile at build (before the KV cache is sized, so the graphs' pool is counted), default: on CUDA."""

    name = "cudagraph"
    # --plugin auto must not pick it: it compiles for minutes at startup, and it has not yet run on a GPU
    auto = False
    OPTIONS: ClassVar[dict] = {"batch_sizes": list, "rows": list, "contexts": list, "max_rows": int,
                               "block_size": int, "cpu": bool, "graphs": bool, "backend": str, "dynamic": bool,
                               "warmup": bool}

    def __init__(self, **options):
        check_options("cudagraph", options, self.OPTIONS)
        for k in ("batch_sizes", "rows", "contexts"):
            v = options.get(k)
            if v is not None and not (v and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                for n in v)):
                raise ValueError(f"plugin cudagraph: {k} must be a non-empty list of positive integers, got {v!r}")
        self.batch_sizes = sorted(set(options.get("batch_sizes", [1, 2, 4, 8, 16])))
        self.rows = sorted(set(options.get("rows", [1, 2, 4, 8, 17])))
        self.contexts = sorted(set(options.get("contexts", [256, 512, 1024, 2048, 4096])))
        self.max_rows = options.get("max_rows", 128)
        self.block_size = options.get("block_size", 16)
        self.cpu, self.graphs = options.get("cpu", False), options.get("graphs", True)
        self.backend, self.warmup = options.get("backend", "inductor"), options.get("warmup")
        self.dynamic = options.get("dynamic", True)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"plugin cudagraph: block_size must be a power of two, got {self.block_size}")
        if self.max_rows < 1:
            raise ValueError("plugin cudagraph: max_rows must be >= 1")
        self.hardware = None
        self._model = None
        self.eager_steps = 0  # covered steps that did not fit a bucket and ran the engine's forward
        self._ran = None  # the hidden rows of the step it ran last, for its logits hooks
        self._warned = False

    # ------------------------------------------------------------------ contract
    def supports(self, model_config) -> bool:
        return SUPPORTED_ARCHITECTURES.get(model_config.architecture) == "llama" and not any(
            is_moe_layer(model_config, i) for i in range(model_config.num_layers))

    def check(self, model_config, hardware: Hardware) -> None:
        if hardware.kind == "cpu" and not self.cpu:
            raise PluginMismatch("cudagraph: CUDA graphs need a CUDA device, this engine runs on cpu "
                                 "(cudagraph.cpu=true runs the compiled step without graphs, for tests)")
        if hardware.kind == "cuda" and (hardware.capability or (0, 0)) < (7, 0):
            raise PluginMismatch(f"cudagraph: compute capability {hardware.capability} below 7.0")
        if hardware.dtype not in DTYPES:
            raise PluginMismatch(f"cudagraph: dtype {hardware.dtype} not supported; use one of {list(DTYPES)}")
        if hardware.tp_size > 1:
            raise PluginMismatch(f"cudagraph: runs on one rank only, got tp_size {hardware.tp_size}")
        if not self.supports(model_config):
            raise PluginMismatch(f"cudagraph: {model_config.architecture} is not a dense Llama-family model")

    def build(self, model, model_config, hardware: Hardware) -> None:
        if type(model) is not LlamaModel or any(isinstance(m, QuantLinear) for m in model.modules()):
            raise PluginMismatch("cudagraph: needs the dense LlamaModel with weights in the model dtype")
        self.hardware, self._model = hardware, model
        dev, cuda = torch.device(hardware.device), hardware.kind == "cuda"
        bs = self.block_size
        max_pos = model_config.max_position_embeddings
        nbs = sorted({max(2, -(-min(c, max_pos) // bs)) for c in self.contexts})  # >= 2: no size-1 pattern
        self.buckets = {(b, q, nb): Bucket(b, q, nb) for b in self.batch_sizes for q in self.rows for nb in nbs
                        if b * q <= self.max_rows}
        if not self.buckets:
            raise PluginMismatch(f"cudagraph: no bucket has at most max_rows={self.max_rows} rows")
        self.nbs, self.max_tokens = nbs, max(nbs) * bs
        rows = max(b * q for b, q, _ in self.buckets)
        # static buffers: inputs (token ids, the packed int64 layout) and outputs (shared by all buckets)
        self._raw = torch.zeros(rows, dtype=torch.long, device=dev)
        size = max(k.size for k in self.buckets.values())
        self._packed = torch.zeros(size, dtype=torch.long, device=dev)
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=cuda)
        self._host_np = self._host.numpy()
        self._copied = torch.cuda.Event() if cuda else None  # the last host -> device copy of _host
        self._hidden = torch.zeros(rows, model_config.hidden_size, dtype=hardware.dtype, device=dev)
        self._logits = torch.zeros(rows, model_config.vocab_size, dtype=hardware.dtype, device=dev)
        self._argmax = torch.zeros(rows, dtype=torch.long, device=dev)
        self._views = {key: k.views(self._packed) for key, k in self.buckets.items()}
        if self.dynamic:
            for key, k in self.buckets.items():
                k.mark_dynamic(self._views[key])
        self._kv_ptr = None  # the KV cache the graphs were captured on
        # one code object serves every bucket (and every engine in the process): room for their few compiles
        # (the limit's name before torch 2.7: cache_size_limit)
        cfg = torch._dynamo.config
        limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, limit, max(getattr(cfg, limit), 64))
        # dynamic=False: no automatic dynamic shapes either (only the KV cache's pool size stays symbolic)
        self._compiled = torch.compile(static_step, fullgraph=True, backend=self.backend,
                                       dynamic=None if self.dynamic else False)
        self._use_graphs = cuda and self.graphs
        self._pool = torch.cuda.graph_pool_handle() if self._use_graphs else None
        self._reserve = None
        if cuda:
            # the same choice as the engine's runner (made after plugins build): cuDNN's SDPA plans per shape
            torch.backends.cuda.enable_cudnn_sdp(False)
        if self.warmup if self.warmup is not None else cuda:
            self._warm(model, dev)

    def _classes(self) -> list[Bucket]:
        """The largest bucket of each compile class (batch 1 or more, rows 1 or more; static: every bucket), largest
        first."""
        best = {}
        for k in self.buckets.values():
            cls = (k.Bp == 1, k.Qp == 1) if self.dynamic else (k.Bp, k.Qp, k.NB)
            if cls not in best or (k.Bp * k.Qp, k.NB) > (best[cls].Bp * best[cls].Qp, best[cls].NB):
                best[cls] = k
        return sorted(best.values(), key=lambda k: (k.Bp * k.Qp, k.NB), reverse=True)

    @torch.inference_mode()
    def _warm(self, model, dev):
        """Compiles every class on a scratch KV cache (all rows padding: it reads and writes slot 0 only) and, on
        CUDA, keeps as much memory as the largest run took: the graphs' pool gets it back at the first capture,
        after the KV cache was sized without it."""
        cuda = dev.type == "cuda"
        with torch.inference_mode(False):  # a normal tensor, like the engine's cache: dynamo guards the difference
            scratch = [tuple(torch.zeros(2 * self.block_size + 1, *s, dtype=self.hardware.dtype, device=dev)
                             for s in layer) for layer in model.kv_cache_shapes()]
        self._mark_kv(scratch)
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        for k in self._classes():
            self._packed.zero_()
            self._run(k, scratch, ())
            log.info("cudagraph: compiled for batch %d x rows %d x %d tokens%s", k.Bp, k.Qp, k.NB * self.block_size,
                     " (and every bucket of its class)" if self.dynamic else "")
        if cuda:
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev) - base
            del scratch
            self._reserve = torch.empty(int(peak * 1.25) + 2**24, dtype=torch.uint8, device=dev)

    @staticmethod
    def _mark_kv(kv_caches):
        for layer in kv_caches:
            for t in layer:
                # any pool size: the scratch cache's compiles serve the engine's. Hard (not maybe_): dynamic=False
                # ignores soft marks, and this size only ever indexes, so nothing specializes it
                torch._dynamo.mark_dynamic(t, 0)

    # ------------------------------------------------------------------ per step
    def covers(self, step: Step) -> bool:
        return (self._model is not None and step.model == "target" and not step.tree
                and step.kind in (StepKind.DECODE, StepKind.VERIFY) and step.batch_size <= self.batch_sizes[-1])

    def _bucket(self, model, meta) -> Bucket | None:
        """The smallest bucket the step fits, or None (the engine's forward runs it)."""
        if meta.block_size != self.block_size and not self._warned:
            self._warned = True
            log.warning("cudagraph: the engine's KV blocks hold %d tokens, the plugin was built for %d "
                        "(cudagraph.block_size): every step runs the engine's forward", meta.block_size,
                        self.block_size)
        if (model is not self._model or meta.backend is not None or meta.group_tables is not None
                or meta.tree is not None or meta.q_lens is None or meta.block_size != self.block_size):
            return None
        B, Q, ctx = len(meta.q_lens), max(meta.q_lens), max(meta.ctx_lens)
        # a row at position 0 would write the slot padded rows write back (a one-token prompt's "decode")
        if any(c - q < 1 for c, q in zip(meta.ctx_lens, meta.q_lens)) or ctx > self.max_tokens:
            return None
        Bp = next((b for b in self.batch_sizes if b >= B), None)
        Qp = next((q for q in self.rows if q >= Q), None)
        NB = next((nb for nb in self.nbs if nb * self.block_size >= ctx), None)
        return self.buckets.get((Bp, Qp, NB))

    @torch.inference_mode()
    def forward(self, step: Step, model, input_ids, positions, kv_caches, meta, capture_layers=()):
        bucket = self._bucket(model, meta)
        if bucket is None:
            self._ran = None
            self.eager_steps += 1
            return model(input_ids, positions, kv_caches, meta, capture_layers)
        capture_layers = tuple(capture_layers)
        if self._kv_ptr != kv_caches[0][0].data_ptr():  # a new KV cache: graphs on the old one are stale
            self._mark_kv(kv_caches)
            for k in self.buckets.values():
                k.graphs.clear()
            self._kv_ptr = kv_caches[0][0].data_ptr()
        graph = self._graph(bucket, kv_caches, capture_layers) if self._use_graphs else None
        T = input_ids.shape[0]
        self._fill(bucket, meta)
        self._raw[:T].copy_(input_ids)
        if graph is not None:
            graph[0].replay()
            captured = graph[1]
        else:
            captured = self._run(bucket, kv_caches, capture_layers)
        self._ran = self._hidden[:T]
        return self._ran, [c[:T] for c in captured]

    def _fill(self, k: Bucket, meta):
        """The step's layout into the host buffer, then one copy to the device (pinned, asynchronous on CUDA)."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        h, (o_start, o_qlen, o_src, o_out, o_tab) = self._host_np, k.offsets
        Bp, Qp, NB = k.Bp, k.Qp, k.NB
        ql = np.asarray(meta.q_lens, dtype=np.int64)
        B, T = len(ql), int(ql.sum())
        first = np.cumsum(ql) - ql  # each sequence's first row in the step
        h[o_start : o_start + Bp] = 0
        h[o_start : o_start + B] = np.asarray(meta.ctx_lens, dtype=np.int64) - ql
        h[o_qlen : o_qlen + Bp] = 0
        h[o_qlen : o_qlen + B] = ql
        i = np.arange(Qp)
        src = h[o_src : o_src + Bp * Qp].reshape(Bp, Qp)
        src[:] = 0
        src[:B] = np.where(i[None, :] < ql[:, None], first[:, None] + i[None, :], 0)
        out = h[o_out : o_out + Bp * Qp]
        out[:] = 0
        out[:T] = np.repeat(np.arange(B) * Qp - first, ql) + np.arange(T)
        tables = h[o_tab : o_tab + Bp * NB].reshape(Bp, NB)
        tables[:] = 0  # past a sequence's blocks: block 0, read under the length mask only
        for b, bt in enumerate(meta.block_tables):
            n = min(len(bt), NB)
            tables[b, :n] = bt[:n]
        tables[B:] = meta.block_tables[0][0]  # padded sequences: position 0 of sequence 0 (see step.PaddedWrite)
        self._packed[: k.size].copy_(self._host[: k.size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _run(self, k: Bucket, kv_caches, capture_layers) -> list:
        """The compiled step on the bucket's inputs; its results go to the shared output buffers (a captured graph
        writes them there on every replay). Returns the captured layers' rows."""
        views = self._views[(k.Bp, k.Qp, k.NB)]
        # equal sizes must not share a symbol (batch 4 x rows 4 would guard the next bucket into a recompile)
        with fx_config.patch(use_duck_shape=False):
            hidden, captured, logits, argmax = self._compiled(self._model, self._raw, *views, kv_caches,
                                                              self.block_size, capture_layers)
        n = hidden.shape[0]
        self._hidden[:n].copy_(hidden)
        self._logits[:n].copy_(logits)
        self._argmax[:n].copy_(argmax)
        return captured

    def _graph(self, k: Bucket, kv_caches, capture_layers):
        """The bucket's CUDA graph, captured on first use; the first capture takes the largest bucket first, so
        the others reuse its pool's memory."""
        graph = k.graphs.get(capture_layers)
        if graph is not None:
            return graph
        if self._reserve is not None:  # hand the memory held since build to the graphs' pool
            self._reserve = None
            torch.cuda.empty_cache()
            largest = self._classes()[0]
            if largest is not k:
                self._capture(largest, kv_caches, capture_layers)
        return self._capture(k, kv_caches, capture_layers)

    def _capture(self, k: Bucket, kv_caches, capture_layers):
        self._packed[: k.size].zero_()  # every row padding: the warm-up runs read and write back slot 0 only
        stream = torch.cuda.Stream(self._packed.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # lazy initializations (cuBLAS handles, autotuning) must not happen under capture
                self._run(k, kv_caches, capture_layers)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            captured = self._run(k, kv_caches, capture_layers)
        k.graphs[capture_layers] = (graph, captured)
        log.info("cudagraph: captured batch %d x rows %d x %d tokens", k.Bp, k.Qp, k.NB * self.block_size)
        return k.graphs[capture_layers]

    # ------------------------------------------------------------------ logits
    def compute_logits(self, step: Step, model, hidden: torch.Tensor) -> torch.Tensor:
        """The step's logits, computed inside it; a copy, since the next step overwrites the buffer."""
        if hidden is not self._ran:
            return model.compute_logits(hidden)
        return self._logits[: hidden.shape[0]].clone()

    def compute_argmax(self, step: Step, model, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy tokens, computed on the device inside the step (no host synchronisation until the caller reads)."""
        if hidden is not self._ran:
            return model.compute_logits(hidden).argmax(-1)
        return self._argmax[: hidden.shape[0]].clone()
