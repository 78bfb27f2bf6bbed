"""Per-request state and the public output record."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from lanner.engine.sampling import SamplingParams
from lanner.spec.decoder import SpecStats


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict] | None
    metrics: dict
    delta_text: str = ""  # text added since the previous output of this request (streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict] | None = None
    error: str | None = None
    draft_sources: list[int] | None = None  # unverified_draft requests: 1 where the draft wrote the token
    tool_calls: list[dict] | None = None  # LLM.chat with tools: the calls parsed from text (OpenAI shape)



class RequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI error bodies carry it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None,
                 max_tokens: int, eos_token_ids: list[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.output_ids: list[int] = []
        self.all_ids: list[int] = list(prompt_ids)  # prompt + outputs: what the KV cache must hold
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.num_preemptions = 0
        self.spec_stats = SpecStats()  # what its verify steps accepted (lanner.spec.decoder)
        self.draft_sources: list[int] | None = [] if params.unverified_draft else None
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.text = ""
        self.sent_text_len = 0
        self.sent_tokens = 0
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.detok = None  # IncrementalDetokenizer, set by the engine
        self.grammar = None  # lanner.structured.GrammarState of a constrained request, set by the engine
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def append_token(self, token_id: int):
        self.output_ids.append(token_id)
        self.all_ids.append(token_id)
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def metrics(self) -> dict:
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        decode = 0.0 if self.first_token_time is None else self.last_token_time - self.first_token_time
        n = len(self.output_ids)
        return {
            "ttft_s": ttft,
            "decode_s": decode,
            "queue_s": None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time,
            "prompt_tokens": len(self.prompt_ids),
            "output_tokens": n,
            "cached_prompt_tokens": self.num_cached_tokens,
            "tpot_s": decode / (n - 1) if n > 1 else None,
            "decode_tok_s": (n - 1) / decode if n > 1 and decode > 0 else None,
            "preemptions": self.num_preemptions,
            **self.spec_stats.metrics(),
        }
