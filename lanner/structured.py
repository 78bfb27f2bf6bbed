"""Constrained decoding with xgrammar: JSON schemas, JSON objects and tool-call structural tags.

`StructuredOutput` (on SamplingParams.structured) says what the output must be. The engine's `Grammars` compiles
it once per distinct constraint (an LRU keyed by its canonical JSON) and gives each request its own
`GrammarState` (an xgrammar matcher). The sampler masks constrained rows with token bitmasks, batched with
unconstrained rows; the engine advances the matcher on every accepted token.

With speculation (lanner.spec.decoder), `GrammarState.check_draft` cuts a draft where the grammar rejects it and
returns one bitmask per verify row, and `forced_tokens` gives the tokens the grammar alone determines
(`{"name": "` after the tool-call tag): they join the draft without a proposer. That stays lossless because the target verifies them
under the mask like any other draft token.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

class FieldError(ValueError):
    """Bad input: `param` names the request field (as the OpenAI API spells it), the message starts with it."""

    def __init__(self, message: str):
        super().__init__(message)
        self.param = message.split(":", 1)[0]


# Hermes / Qwen2.5 tool-call format: the arguments object sits inside {"name": ..., "arguments": ...}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # (the other families: lanner.tool_formats)


@dataclass
class StructuredOutput:
    """One of: json_schema, json_object, or tools (OpenAI function tools) with a tool_choice of "auto",
    "required" or a function name. strict=False lets objects carry properties the schema does not name."""
    json_schema: dict | None = None
    json_object: bool = False
    tools: list[dict] = field(default_factory=list)
    tool_choice: str = "auto"  # "auto" | "required" | "function:<name>"
    parallel_tool_calls: bool = True
    strict: bool = True
    family: str = "hermes"  # the tool-call format the model writes (lanner.tool_formats.FAMILIES)

    def __post_init__(self):
        self.validate()

    def validate(self):
        """Raises FieldError."""
        if sum([self.json_schema is not None, self.json_object, bool(self.tools)]) != 1:
            raise FieldError("structured: give exactly one of json_schema, json_object or tools")
        if self.json_schema is not None:
            check_schema(self.json_schema, "response_format.json_schema.schema")
        names = []
        for i, tool in enumerate(self.tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise FieldError(f"tools[{i}].function: needs a non-empty string name")
            check_schema(fn.get("parameters", {"type": "object"}), f"tools[{i}].function.parameters")
            names.append(fn["name"])
        from lanner.tool_formats import FAMILIES

        if self.family not in FAMILIES:
            raise FieldError(f"structured.family: expected one of {FAMILIES}, got {self.family!r}")
        if self.tool_choice not in ("auto", "required"):
            name = self.tool_choice.removeprefix("function:")
            if not self.tool_choice.startswith("function:") or name not in names:
                raise FieldError(f"tool_choice: no tool named {name!r}; the tools are {names}")

    def key(self) -> str:
        """Canonical JSON: equal constraints share one compiled grammar."""
        return json.dumps([self.json_schema, self.json_object, self.tools, self.tool_choice,
                           self.parallel_tool_calls, self.strict, self.family], sort_keys=True)

    def structural_tag(self):
        """The xgrammar structural tag of a tools constraint, in the family's formats (lanner.tool_formats)."""
        from lanner.tool_formats import structural_tag

        return structural_tag(self.tools, self.tool_choice, self.parallel_tool_calls, self.family)

    def tool_parser(self):
        """A lanner.tool_formats.ToolCallParser for this request's output: its family, its tools."""
        from lanner.tool_formats import ToolCallParser

        return ToolCallParser(self.tools, self.family, self.parallel_tool_calls)


def check_schema(schema, where: str):
    """A JSON Schema (draft 2020-12) or FieldError naming `where`."""
    import jsonschema

    if not isinstance(schema, dict):
        raise FieldError(f"{where}: must be a JSON Schema object, got {type(schema).__name__}")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in e.path)
        raise FieldError(f"{where}: not a valid JSON Schema: {e.message}" + (f" (at {path})" if path else "")) \
            from None


class Grammars:
    """The engine's grammar compiler over its tokenizer, and an LRU of compiled grammars. Thread-safe: requests
    are made (and their grammars compiled) on the server's worker threads."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 128):
        import xgrammar as xgr  # imported on first use: it takes seconds, and most engines never constrain

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.cache: OrderedDict[str, "xgr.CompiledGrammar"] = OrderedDict()
        self.cache_size = cache_size
        self.hits = self.misses = 0
        self.lock = threading.Lock()

    def compile(self, so: StructuredOutput) -> "xgr.CompiledGrammar":
        with self.lock:  # (a grammar two threads compile at once is compiled once)
            return self._compile(so)

    def _compile(self, so: StructuredOutput) -> "xgr.CompiledGrammar":
        key = so.key()
        compiled = self.cache.get(key)
        if compiled is not None:
            self.hits += 1
            self.cache.move_to_end(key)
            return compiled
        self.misses += 1
        try:
            if so.json_object or so.json_schema is not None:
                # no free whitespace: a small model would otherwise pad with newlines until max_tokens
                schema = {"type": "object"} if so.json_object else so.json_schema
                compiled = self.compiler.compile_json_schema(schema, any_whitespace=False,
                                                             strict_mode=so.strict and not so.json_object)
            else:
                compiled = self.compiler.compile_structural_tag(so.structural_tag())
        except Exception as e:  # noqa: BLE001 - xgrammar's errors for schemas it cannot express
            where = "response_format" if not so.tools else "tools"
            raise FieldError(f"{where}: the grammar engine cannot compile it: {e}") from None
        self.cache[key] = compiled
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return compiled

    def state(self, so: StructuredOutput, max_rollback: int) -> GrammarState:
        matcher = self.xgr.GrammarMatcher(self.compile(so), max_rollback_tokens=max_rollback)
        return GrammarState(matcher, self.vocab_size)


class GrammarState:
    """One request's matcher: where its output stands in the grammar."""

    def __init__(self, matcher: "xgr.GrammarMatcher", vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.rejected = False  # a token outside the grammar was forced in (never by sampling under the mask)

    def accept(self, token: int):
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            self.rejected = True

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Writes the legal next tokens into bitmask[row]; False when every token is legal."""
        return self.matcher.fill_next_token_bitmask(bitmask, row)

    def forced_tokens(self, limit: int) -> list[int]:
        """Tokens the grammar alone determines from here (at most `limit`)."""
        if limit <= 0 or self.matcher.is_terminated():
            return []
        return self.matcher.find_jump_forward_tokens()[:limit]

    def check_draft(self, draft: list[int]) -> tuple[int, torch.Tensor]:
        """-> (how many leading draft tokens the grammar accepts = n, bitmask [n + 1, words]: row i masks the
        target's prediction after draft[:i]). Leaves the matcher where it was."""
        bitmask = new_bitmask(len(draft) + 1, self.vocab_size)
        n = 0
        for tok in draft:
            self.fill(bitmask, n)
            if not self.matcher.accept_token(tok):
                break
            n += 1
            if self.matcher.is_terminated():  # a stop token: the request ends there
                break
        if not self.matcher.is_terminated():
            self.fill(bitmask, n)
        if n:
            self.matcher.rollback(n)
        return n, bitmask[: n + 1]

    def extend_forced(self, draft, limit: int):
        """A lanner.spec.base.Draft + the tokens this grammar forces after it (when it accepts the whole draft), up to
        `limit` tokens. Forced tokens are certain, so their draft distribution is one-hot."""
        n = 0
        for tok in draft.tokens:
            if not self.matcher.accept_token(tok):
                break
            n += 1
        forced = self.forced_tokens(limit - len(draft.tokens)) if n == len(draft.tokens) else []
        if n:
            self.matcher.rollback(n)
        if not forced:
            return draft
        probs = draft.probs
        if probs is not None:
            probs = torch.cat([probs, torch.nn.functional.one_hot(torch.tensor(forced, device=probs.device),
                                                                  probs.shape[-1]).to(probs.dtype)])
        return type(draft)(draft.tokens + forced, probs)


def mask_logits(logits: torch.Tensor, states: list[GrammarState | None]) -> torch.Tensor:
    """Masks each row i whose states[i] is set to its grammar's legal tokens, in place: the caller owns `logits`
    (float32). Unconstrained rows are untouched."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    bitmask = new_bitmask(logits.shape[0], states[rows[0]].vocab_size)
    rows = [i for i in rows if states[i].fill(bitmask, i)]
    if rows:
        apply_bitmask(logits, bitmask, rows)
    return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None):
    """In place: illegal tokens of the given rows (all when None) get -inf."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        # xgrammar's CPU kernel wants float32 on the host; elsewhere the torch path is one masked_fill
        bits = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
        idx = torch.arange(logits.shape[0], device=logits.device) if rows is None else \
            torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~bits[idx], float("-inf"))
        return
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """All tokens legal: int32 words of 32 token bits (xgrammar's layout)."""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 words [R, W] -> bool [R, vocab] (bit j of word w is token 32 w + j)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
