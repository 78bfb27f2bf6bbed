"""OpenAI-compatible request and response models (the subset lanner serves).

Requests are strict: no coercion ("16" is not 16, true is not 1), no NaN or infinity (Python's JSON parser
accepts them), no lone surrogates, and every number has a sane range; each failure becomes a 400 naming the
field. Unknown fields are ignored (clients send many optional ones), but fields that would change the result
and that lanner does not implement are declared in UNSUPPORTED and refused by name rather than silently
dropped. Value checks that need the engine (the context length, the vocabulary) stay in SamplingParams and
LLMEngine, so the server and the Python API agree on them.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer
from pydantic.json_schema import SkipJsonSchema

from lanner.server.tool_wire import DeltaToolCall, ToolCall, ToolFields

LEGACY_MAX_TOKENS = 16  # /v1/completions' default when max_tokens is absent or null, as in OpenAI's legacy API
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP = 16  # stop strings (OpenAI allows 4)
MAX_LOGIT_BIAS = 1024  # entries


def _utf8(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone surrogate (not valid Unicode)") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# ---------------------------------------------------------------------------------------------- requests
class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (lanner.server.tool_wire)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)

    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role  # OpenAI's newer name for system


class StreamOptions(_Request):
    include_usage: bool = True  # lanner always sends the usage chunk; accepted for compatibility


class _SamplingFields(_Request):
    """Fields shared by chat and completions. None means 'the default'."""
    # refused with a 400 naming the field when given (not null); SkipJsonSchema keeps them out of the OpenAPI
    # schema, which lists what works
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ()

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)  # None: until EOS or the end of the context
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)  # <= 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None  # SamplingParams refuses ""
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    # token id (a decimal string, as OpenAI) -> added to its logit
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                     Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=1024)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: Text | None = None
    # name the session whose prefix the cache keeps (first given of prompt_cache_key, user, safety_identifier;
    # an X-Session-Id header wins): docs/server.md
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None

    def unsupported_field(self) -> str | None:
        return next((name for name in self.UNSUPPORTED if getattr(self, name) is not None), None)


class ChatCompletionRequest(_SamplingFields, ToolFields):
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("functions", "function_call", "audio", "modalities", "prediction",
                                              "web_search_options")

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)  # newer name for max_tokens; wins
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    functions: SkipJsonSchema[Any] = None
    function_call: SkipJsonSchema[Any] = None
    audio: SkipJsonSchema[Any] = None
    modalities: SkipJsonSchema[Any] = None
    prediction: SkipJsonSchema[Any] = None
    web_search_options: SkipJsonSchema[Any] = None


class CompletionRequest(_SamplingFields):
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("suffix", "echo", "best_of")

    prompt: Text | list[TokenId] | list[Text]
    logprobs: int | None = Field(None, ge=0, le=20)  # number of alternatives per token, as in the legacy API
    max_tokens: int | None = Field(LEGACY_MAX_TOKENS, ge=1, le=INT64_MAX)  # null also means 16
    suffix: SkipJsonSchema[Any] = None
    echo: SkipJsonSchema[Any] = None
    best_of: SkipJsonSchema[Any] = None

    def unsupported_field(self) -> str | None:
        # the no-op values of these are harmless: clients send them explicitly
        if self.echo is False:
            self.echo = None
        if self.best_of == 1 and type(self.best_of) is int:
            self.best_of = None
        if self.suffix == "":
            self.suffix = None
        return super().unsupported_field()


# ---------------------------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # speculative decoding (Lanner extension): mean tokens per verify step, bonus included; None when off
    spec_accept_length: float | None = None
    spec_accepted_per_position: list[int] | None = None
    # draft tokens proposed / accepted per proposer ("suffix", "draft-head", ...); None when off
    spec_draft_tokens: dict[str, int] | None = None
    spec_accepted_tokens: dict[str, int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        # as OpenAI does: a delta carries only what changed ({} in the finish chunk)
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the full response and a stream chunk (OpenAI uses the same object for both)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lanner"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: Any = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
