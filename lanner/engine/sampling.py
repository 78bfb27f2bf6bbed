"""Sampling parameters and the batched sampler.

Every row gets the same pipeline: penalties -> temperature -> top-k -> top-p -> min-p -> sample. Greedy rows
skip it. Seeded requests draw their noise from their own generator, so a seed reproduces the same text
whatever else is in the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lanner.structured import StructuredOutput


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before anything else
    max_tokens: int | None = 256  # None: until the context is full
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N >= 0: the chosen token's logprob plus the top N alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True  # per-request opt-out of speculative decoding
    # RCSD data generation only: after each target token the draft writes this many tokens that are accepted
    # WITHOUT verification (the output is not the target's). Greedy only; needs a draft. 0: off.
    unverified_draft: int = 0
    # constrained decoding (lanner.structured): a JSON schema, any JSON object, or tool calls
    structured: StructuredOutput | None = None
    user: str | None = None  # the API's `user`: speculation drafts from this user's earlier outputs only
    # the conversation this request continues (an agent's session): the prefix cache evicts by session
    # (lanner.kvcache.block_manager); None: plain LRU
    session: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.validate()

    def validate(self):
        """Raises ValueError naming the offending field."""
        def bad(name, why):
            raise ValueError(f"{name}: {why}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int):
            bad("top_k", f"must be an integer, got {self.top_k!r}")
        if not (0 <= self.min_p <= 1):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not (-2 <= self.presence_penalty <= 2):
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not (-2 <= self.frequency_penalty <= 2):
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a string or a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad("logprobs", f"must be between 0 and 20, got {self.logprobs!r}")
        if not (isinstance(self.unverified_draft, int) and 0 <= self.unverified_draft <= 8):
            bad("unverified_draft", f"must be an integer in 0..8, got {self.unverified_draft!r}")
        if self.unverified_draft and self.temperature != 0:
            bad("unverified_draft", "needs greedy decoding (temperature 0)")
        if self.seed is not None and not (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63):
            bad("seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(name, f"must be finite, got {getattr(self, name)!r}")
        if self.logit_bias is not None and not all(
                isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and -100 <= b <= 100
                for t, b in self.logit_bias.items()):
            bad("logit_bias", "must map non-negative token ids to values in [-100, 100]")
        if self.user is not None and not isinstance(self.user, str):
            bad("user", f"must be a string, got {self.user!r}")
        if self.session is not None and not isinstance(self.session, str):
            bad("session", f"must be a string, got {self.session!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids, output_ids) -> torch.Tensor:
    """In place on one row. Repetition penalty (CTRL) over prompt + output; presence/frequency (OpenAI) over output."""
    V = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(list(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=V)[:V].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def processed_probs(logits: torch.Tensor, params_list: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] (float32) -> probabilities after temperature, top-k, top-p and min-p of each row."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params_list], device=dev, dtype=logits.dtype)
    logits = logits / temps[:, None]
    V = logits.shape[-1]
    if any((0 < p.top_k < V) or p.top_p < 1.0 for p in params_list):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params_list], device=dev)
        sorted_logits.masked_fill_(torch.arange(V, device=dev)[None, :] >= ks[:, None], float("-inf"))
        probs = sorted_logits.softmax(-1)
        # top_p = 1 must keep everything even where float cumsum overshoots 1
        top_p = torch.tensor([p.top_p if p.top_p < 1 else 2.0 for p in params_list], device=dev, dtype=logits.dtype)
        # drop a token once the mass before it already reaches top_p (the first token always stays)
        sorted_logits.masked_fill_((probs.cumsum(-1) - probs) >= top_p[:, None], float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
    probs = logits.softmax(-1)
    if any(p.min_p > 0 for p in params_list):
        min_p = torch.tensor([p.min_p for p in params_list], device=dev, dtype=probs.dtype)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exponential-race sampling (argmax p / E, E ~ Exp(1)) is exact and needs no cumsum; each seeded row
    draws its noise from its own generator."""
    noise = torch.empty_like(probs)
    if all(g is None for g in generators):
        noise.exponential_()
    else:
        for i, g in enumerate(generators):
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(-1)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per row: {"logprob": float, "top": [(token_id, logprob), ...]} or None


def sample(logits: torch.Tensor, requests) -> SampleResult:
    """logits [R, V] for R requests that each get one new token now. `requests` expose .params,
    .prompt_ids, .output_ids and .generator."""
    logits = logits.float()
    params_list = [r.params for r in requests]
    want_logprobs = [p.logprobs is not None for p in params_list]
    raw_logprobs = logits.log_softmax(-1) if any(want_logprobs) else None
    grammars = [getattr(r, "grammar", None) for r in requests]
    if any(g is not None for g in grammars):
        from lanner.structured import mask_logits

        mask_logits(logits, grammars)  # in place: logits is the caller's gathered copy
    if any(p.has_penalties or p.logit_bias for p in params_list):
        logits = logits.clone()
        for i, r in enumerate(requests):
            if r.params.logit_bias:
                bias = r.params.logit_bias
                logits[i, list(bias)] += torch.tensor(list(bias.values()), device=logits.device)
            if r.params.has_penalties:
                apply_penalties(logits[i], r.params, r.prompt_ids, r.output_ids)
    tokens = logits.argmax(-1)
    sampled = [i for i, p in enumerate(params_list) if not p.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        probs = processed_probs(logits[rows], [params_list[i] for i in sampled])
        tokens[rows] = sample_from_probs(probs, [requests[i].generator for i in sampled])
    token_list = tokens.tolist()
    logprobs = [None] * len(requests)
    for i, want in enumerate(want_logprobs):
        if want:
            n = params_list[i].logprobs
            row = raw_logprobs[i]
            top = []
            if n:
                vals, ids = row.topk(n)
                top = list(zip(ids.tolist(), vals.tolist()))
            logprobs[i] = {"logprob": row[token_list[i]].item(), "top": top}
    return SampleResult(token_list, logprobs)
