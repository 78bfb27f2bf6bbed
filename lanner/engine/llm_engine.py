"""The synchronous engine: add requests, call step() until done. Everything else (Python API, server,
benchmarks) drives this one loop."""
from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref

import torch

from lanner.config import EngineConfig
from lanner.distributed import TPError, all_gather_rows, split_sizes, tp_rank, tp_size
from lanner.distributed.worker import TPGroup
from lanner.engine.kv_paged import PagedKV
from lanner.engine.kv_system import KVSystem
from lanner.engine.loading import load_target
from lanner.engine.request import Request, RequestError, RequestOutput
from lanner.engine.sampling import SamplingParams, sample
from lanner.engine.scheduler import QueueFullError, ScheduledItem
from lanner.engine.step import StepLayout, StepOutput
from lanner.kvcache.ula.system import UlaKV
from lanner.metrics import EngineMetrics
from lanner.models.loader import ModelSource
from lanner.models.quant import weight_bytes
from lanner.plugins import Hardware, PluginVerifyError, StepKind
from lanner.spec.build import build_proposer, build_spec, load_draft
from lanner.spec.drafts import DraftKind
from lanner.spec.proposers import DraftHeadProposer, DraftModelProposer
from lanner.structured import FieldError, Grammars
from lanner.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("lanner")


def kv_system(config: EngineConfig) -> type[KVSystem]:
    """The KV system a config asks for: UlaCache when `kv_tier` is set, else the paged cache."""
    return UlaKV if config.kv_tier is not None else PagedKV


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.failed: TPError | None = None  # set when a tensor-parallel rank failed: the engine refuses work
        if tp_size() > 1:  # module-level TP state: one tensor-parallel engine per process, and no TP=1 beside it
            raise TPError(f"a tensor-parallel engine (tp={tp_size()}) is already running in this process; "
                          "close() it before building another engine")
        # ranks > 0 run the KV system's worker
        self.tp = TPGroup(config, kv_system(config).worker) if config.tp > 1 else None
        try:
            self._load(config)
        except BaseException as e:
            if self.tp is not None:  # stop the workers; a failed worker explains the error better than e does
                cause = self.tp.explain(e)
                self.tp.fail(cause or TPError(f"the engine failed to start: {type(e).__name__}: {e}"))
                if cause is not None and cause is not e:
                    raise cause from e
            raise
        # stops the workers when the engine is dropped or the interpreter exits (holds the group, not the engine)
        self._finalizer = weakref.finalize(self, self.tp.close) if self.tp is not None else None

    def _load(self, config: EngineConfig):
        torch.manual_seed(config.seed)
        self.source = ModelSource.resolve(config.model)
        self.model_name = config.served_model_name or self.source.name
        t0 = time.perf_counter()
        self.metrics = EngineMetrics()
        self.hardware = Hardware.detect(config.device, config.torch_dtype, tp_size(), tp_rank())
        self.model, self.model_config, self.plugins, self.plugin_bytes, self.weights = load_target(
            config, self.hardware, self.metrics)
        config.check_model(self.model_config)
        self.weight_bytes = weight_bytes(self.model)  # before the KV cache is sized: the budget sees what is left
        log.info("weights: %.1f MiB (%s)", self.weight_bytes / 2**20, self.weights)
        # skip_tokenizer: token ids in and out only (like vLLM's skip_tokenizer_init), e.g. for tokenizer-less models
        self.tokenizer = None if config.skip_tokenizer else Tokenizer(self.source, self.model_config.eos_token_ids,
                                                                      self.model_config.architecture)
        self.eos_token_ids = self.model_config.eos_token_ids if self.tokenizer is None else \
            self.tokenizer.eos_token_ids
        self.load_s = time.perf_counter() - t0
        ctx = self.model_config.max_context
        self.max_model_len = min(config.max_model_len or ctx, ctx)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.grammars = None  # lanner.structured.Grammars, built by the first constrained request
        self._grammars_lock = threading.Lock()  # requests are made on the server's worker threads
        # greedy steps take their tokens from the LM head's argmax without the logits (False: always the logits;
        # tools/greedy_argmax_ab.py compares the two)
        self.fused_argmax = True
        self._build_kv_and_spec(config)
        log.info("loaded %s in %.1fs: %s, max_model_len %d", self.model_name, self.load_s, self.kv.summary,
                 self.max_model_len)

    def _build_kv_and_spec(self, config: EngineConfig):
        """The KV system and its scheduler, then the speculation over them (a draft's pool shares the KV system's
        block tables and budget, and the KV system captures the target layers a draft head reads)."""
        draft = load_draft(config, self.source, self.model, self.model_config)
        capture = () if draft is None else draft.capture(self.model_config.num_layers)
        self.kv: KVSystem
        if config.kv_tier is not None:
            self.kv = UlaKV(config, self.model, self.model_config, self.tp, capture)
        else:
            draft_bytes = 0 if draft is None else draft.kv_bytes_per_token(config.torch_dtype)
            self.kv = PagedKV(config, self.model, self.plugins, self.plugin_bytes, self.tp, draft_bytes, capture)
        self.scheduler = self.kv.scheduler
        # a head runs on rank 0 only, outside the group: it gets the whole embedding table, not the shard
        embed = self._gather_embedding() if self.tp is not None and draft is not None and \
            draft.kind is not DraftKind.MODEL else None
        proposer = build_proposer(config, draft, self.model, self.kv, self.plugins, embed)
        self.spec = build_spec(config, draft, proposer, self.model.embed_tokens, self.metrics)

    @property
    def proposer(self):
        """The draft proposer (None: no speculation but grammar-forced drafts); lanner.spec.decoder runs it."""
        return self.spec.proposer

    @proposer.setter
    def proposer(self, proposer):
        self.spec.proposer = proposer

    def _gather_embedding(self) -> torch.Tensor:
        """The full (vocab-gathered) embedding table on rank 0, for rank-0-only draft heads."""
        w = self.model.embed_tokens.weight
        return self.tp.call("gather_embedding", 0, [], lambda: all_gather_rows(
            w, split_sizes(self.model_config.vocab_size, self.config.tp)))

    def close(self):
        """Stops the tensor-parallel workers (a no-op at TP=1) and the learn-draft trainer. The engine is unusable
        afterwards under TP."""
        if self.spec.learner is not None:
            self.spec.learner.close()
        if self.tp is not None:
            self.tp.close()
            if self.failed is None:
                self.failed = TPError("the engine was closed")

    # ------------------------------------------------------------------ requests
    def make_request(self, prompt: str | list[int] | None, params: SamplingParams | None = None,
                     request_id: str | None = None, prompt_ids: list[int] | None = None) -> Request:
        """Validates and tokenizes; raises RequestError naming the field. Does not queue. Runs on the server's
        worker threads beside the engine thread: it reads the engine's state and writes only the grammar cache,
        which is locked."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        if prompt_ids is None:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise RequestError("this engine runs without a tokenizer: give the prompt as token ids", "prompt")
                prompt_ids = self.tokenizer.encode(prompt) if prompt else []
            elif isinstance(prompt, (list, tuple)):
                prompt_ids = list(prompt)
            else:
                raise RequestError("prompt must be a string or a list of token ids", "prompt")
        if not prompt_ids:
            raise RequestError("prompt is empty", "prompt")
        if not all(isinstance(t, int) and 0 <= t < self.model_config.vocab_size for t in prompt_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {self.model_config.vocab_size})", "prompt")
        if params.logit_bias and max(params.logit_bias) >= self.model_config.vocab_size:
            raise RequestError(f"logit_bias: token ids must be in [0, {self.model_config.vocab_size})", "logit_bias")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestError(f"prompt is {n} tokens; this model's context is {self.max_model_len} tokens "
                               "(prompt plus at least one generated token must fit)", "messages")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise RequestError(f"max_tokens={max_tokens} plus the {n}-token prompt exceeds the context of "
                               f"{self.max_model_len} tokens; use max_tokens <= {self.max_model_len - n}",
                               "max_tokens")
        self.kv.check_fits(n + max_tokens)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use", "request_id")
        if params.unverified_draft and not isinstance(self.proposer, (DraftHeadProposer, DraftModelProposer)):
            raise RequestError("unverified_draft needs an engine with a draft (spec='draft')", "unverified_draft")
        if self.tokenizer is None and params.stop:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids", "stop")
        req = Request(rid, prompt_ids, params, text, max_tokens, self.eos_token_ids)
        if self.tokenizer is not None:
            req.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        if params.structured is not None:
            req.grammar = self._grammar_state(params)
        return req

    def _grammar_state(self, params: SamplingParams):
        if self.tokenizer is None:
            raise RequestError("structured output needs a tokenizer", "response_format")
        if params.unverified_draft:
            raise RequestError("unverified_draft cannot be constrained by a grammar", "unverified_draft")
        with self._grammars_lock:
            if self.grammars is None:  # imports xgrammar (seconds): only once a request needs it
                self.grammars = Grammars(self.tokenizer.hf, self.model_config.vocab_size, self.eos_token_ids)
        try:
            return self.grammars.state(params.structured, max_rollback=self.config.spec_tokens +
                                       self.config.grammar_draft_tokens + 1)
        except FieldError as e:
            raise RequestError(str(e), e.param) from None

    def add_request(self, prompt=None, params=None, request_id=None, prompt_ids=None) -> Request:
        req = self.make_request(prompt, params, request_id, prompt_ids)
        self.enqueue(req)
        return req

    def enqueue(self, req: Request):
        if self.failed is not None:
            raise TPError(str(self.failed))
        try:
            self.scheduler.add(req)
        except QueueFullError as e:
            raise RequestError(str(e), None) from e
        self.requests[req.request_id] = req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return None
        self.scheduler.finish(req, "abort")
        self.spec.finish(req, "abort")
        self._observe_finish(req)
        self._update_gauges()  # no step may follow (the last request was aborted): refresh KV/queue gauges now
        return self._output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def has_room(self) -> bool:
        """Whether the waiting queue takes another request now (enqueue refuses one beyond max_queue_len)."""
        return len(self.scheduler.waiting) < self.config.max_queue_len

    def drop_all(self):
        """Forgets every queued and running request without finishing them: the last resort of a loop whose
        aborts fail too, so it cannot spin on the same failure."""
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self.requests.clear()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """schedule -> propose drafts -> run the model -> verify / sample -> append tokens and emit outputs."""
        if self.failed is not None:
            raise TPError(str(self.failed))
        if self.spec.learner is not None:  # between steps: a head the trainer published replaces the served one
            self.spec.learner.poll()
        items = self._schedule()
        outputs = []
        for req in self.scheduler.refused:  # the KV system gave up on them (their error says why)
            self._finish(req, "error")
            outputs.append(self._output(req))
        if items:
            try:
                drafted = self.spec.propose(items)
                kind = StepKind.PREFILL if any(it.num_tokens > 1 for it in items) else \
                    StepKind.VERIFY if drafted else StepKind.DECODE
                layout = StepLayout.of(items)
                t_forward = time.perf_counter()
                out = self.kv.run(items, kind, self.fused_argmax and self._argmax_only(items))
                emitted = self._verify_and_sample(items, layout, out)
                if kind != StepKind.PREFILL:  # forward + verify: the tokens are on the host now
                    self.spec.after_step(time.perf_counter() - t_forward, layout.token_rows[-1].stop)
            except TPError as e:  # the ranks are out of step: fail everything, refuse new work
                self._fail_engine(e)
                raise
            except PluginVerifyError:  # --plugin-verify exists to stop loudly
                raise
            except Exception as e:  # a bug or a device error: fail this batch, keep serving the rest
                log.exception("engine step failed; failing %d requests", len(items))
                self.metrics.step_errors.inc()
                for it in items:
                    it.request.error = f"internal error: {type(e).__name__}: {e}"
                    self._finish(it.request, "error")
                    outputs.append(self._output(it.request))
                return outputs
            outputs += self._postprocess(items, layout, emitted)
        self._update_gauges()
        return outputs

    def _schedule(self) -> list[ScheduledItem]:
        preempted_before = self.scheduler.num_preemptions
        items = self.scheduler.schedule(self.spec.tokens)
        self.metrics.preemptions.inc(self.scheduler.num_preemptions - preempted_before)
        now = time.perf_counter()
        for it in items:
            if it.request.first_scheduled_time is None:
                it.request.first_scheduled_time = now
        return items

    @staticmethod
    def _argmax_only(items: list[ScheduledItem]) -> bool:
        """Whether the step's logits rows matter only through their argmax: every item that samples or verifies
        decodes greedily, with nothing that reads or changes its logits (logprobs, penalties, a logit bias, a
        grammar). Such a step gets its tokens from the LM head's kernel without the logits (runner.run)."""
        for it in items:
            if not (it.samples or it.draft):
                continue
            p, req = it.request.params, it.request
            if not p.greedy or p.logprobs is not None or p.has_penalties or p.logit_bias or req.grammar is not None:
                return False
        return True

    def _verify_and_sample(self, items: list[ScheduledItem], layout: StepLayout, out: StepOutput) -> dict:
        """-> id(item) -> (the tokens a drafted item emits, its accepted draft nodes); id(request) -> (token,
        logprobs) for one that samples."""
        emitted, plain_rows, plain_reqs = {}, [], []
        for it, rows in zip(items, layout.logits_rows):
            if it.draft:
                emitted[id(it)] = self.spec.verify(it, out[rows])
            elif it.samples:
                plain_rows.append(rows.start)
                plain_reqs.append(it.request)
        if plain_reqs and out.token_ids is not None:
            for r, i in zip(plain_reqs, plain_rows):
                emitted[id(r)] = (out.token_ids[i], None)
        elif plain_reqs:
            result = sample(out.logits[plain_rows], plain_reqs)
            for r, tok, lp in zip(plain_reqs, result.token_ids, result.logprobs):
                emitted[id(r)] = (tok, lp)
        return emitted

    def _postprocess(self, items: list[ScheduledItem], layout: StepLayout, emitted: dict) -> list[RequestOutput]:
        """Appends the emitted tokens, keeps the draft head's features, rolls back rejected drafts, finishes what
        stopped -> the outputs of the items that produced tokens."""
        outputs, feats = [], self.kv.features
        for it, own in zip(items, layout.token_rows):
            req = it.request
            tokens, path = emitted[id(it)] if it.draft else (None, [])
            if feats is not None:  # keep the target features of the verified rows for the draft head
                first = own.start
                rows = feats[first : first + it.num_tokens + len(path)]  # a chain's kept rows are a prefix
                if it.draft.parents is not None:  # a tree's: the scheduled tokens', then the accepted path's
                    at = first + it.num_tokens + torch.tensor(path, dtype=torch.long, device=feats.device)
                    rows = torch.cat([feats[first : first + it.num_tokens], feats[at]])
                self.spec.keep_features(req, rows)
            reason = None
            if it.draft:
                before = req.num_tokens
                req.num_computed += it.num_tokens + len(tokens) - 1
                n_out = 0
                for i, tok in enumerate(tokens):
                    n_out += 1
                    if req.draft_sources is not None:
                        req.draft_sources.append(int(i < len(it.draft)))
                    reason = self._accept_token(req, tok, None)
                    if reason:
                        break
                # count what was emitted: a stop inside the accepted chain drops the tokens after it
                self.spec.verified(req, it, tokens, n_out, before)
                if it.draft.parents is not None:  # the accepted path's KV moves to its positions' slots
                    self.kv.keep_path(req, it.start + it.num_tokens, path)
            else:
                req.num_computed += it.num_tokens
                if it.samples:
                    if req.draft_sources is not None:
                        req.draft_sources.append(0)
                    reason = self._accept_token(req, *emitted[id(req)])
            self.kv.commit(req, finishing=bool(reason))
            if reason:
                self._finish(req, reason)
            if it.samples:
                outputs.append(self._output(req))
        return outputs

    def _fail_engine(self, error: TPError):
        self.failed = error
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            req.error = str(error)
            self._finish(req, "error")
        self._update_gauges()

    def _accept_token(self, req: Request, token: int, logprob: dict | None) -> str | None:
        """Appends one token; returns the finish reason it causes, if any (the caller finishes the request)."""
        req.append_token(token)
        if req.grammar is not None:
            req.grammar.accept(token)
        if req.logprobs is not None:
            req.logprobs.append({"token_id": token, **logprob})
        self.metrics.generation_tokens.inc()
        if len(req.output_ids) == 1 and req.first_token_time is not None:
            self.metrics.ttft.observe(req.first_token_time - req.arrival_time)
        delta = req.detok.add([token]) if req.detok is not None else ""
        req.text += delta
        reason = None
        if token in req.stop_ids:
            reason = "stop"
        elif req.params.stop and delta:
            reason = self._check_stop_strings(req, len(delta))
        if reason is None and (len(req.output_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        return reason

    @staticmethod
    def _check_stop_strings(req: Request, delta_len: int) -> str | None:
        longest = max(len(s) for s in req.params.stop)
        start = max(0, len(req.text) - delta_len - longest + 1)
        for s in req.params.stop:
            at = req.text.find(s, start)
            if at >= 0:
                req.text = req.text[: at + len(s)] if req.params.include_stop_str_in_output else req.text[:at]
                return "stop"
        return None

    def _finish(self, req: Request, reason: str):
        # builds no output: _output() consumes the pending delta, so only the output actually returned may call it
        self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)
        self.spec.finish(req, reason)
        self._observe_finish(req)

    def _observe_finish(self, req: Request):
        m = req.metrics()
        self.metrics.requests.labels(req.finish_reason).inc()
        self.metrics.prompt_tokens.inc(m["prompt_tokens"])
        self.metrics.cached_tokens.inc(m["cached_prompt_tokens"])
        if m["tpot_s"] is not None:
            self.metrics.tpot.observe(m["tpot_s"])
        if req.first_token_time is not None:
            self.metrics.e2e.observe(req.last_token_time - req.arrival_time)

    def _update_gauges(self):
        self.metrics.queue_len.set(len(self.scheduler.waiting))
        self.metrics.running.set(len(self.scheduler.running))
        self.kv.update_gauges(self.metrics)

    def _output(self, req: Request) -> RequestOutput:
        # while running, hold back text that could still become the start of a stop string
        hold = 0 if req.finished or not req.params.stop else max(len(s) for s in req.params.stop) - 1
        visible = req.text[: len(req.text) - hold] if hold else req.text
        delta_text = visible[req.sent_text_len :]
        req.sent_text_len = max(req.sent_text_len, len(visible))
        delta_ids = req.output_ids[req.sent_tokens :]
        delta_lp = req.logprobs[req.sent_tokens :] if req.logprobs is not None else None
        req.sent_tokens = len(req.output_ids)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids, text=visible,
            token_ids=list(req.output_ids), finished=req.finished, finish_reason=req.finish_reason,
            logprobs=req.logprobs, metrics=req.metrics(), delta_text=delta_text, delta_token_ids=delta_ids,
            delta_logprobs=delta_lp, error=req.error,
            draft_sources=list(req.draft_sources) if req.draft_sources is not None else None,
        )
