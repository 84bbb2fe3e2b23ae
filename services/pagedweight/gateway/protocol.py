"""The OpenAI-compatible request and response bodies, as vLLM's server defines them.

Requests allow unknown fields (`extra="allow"`): tools send fields we do not use
(`repetition_penalty`, `user`, ...) and must not be refused; the serving classes log them
at debug. Field types are strict (pydantic's strict mode: `"10"` is not an int, `1` is not
a bool, NaN and infinities are no floats) and every integer is bounded, so a wrong value is
a 400 naming the field, never a crash later in protobuf or the tokenizer. Strings with lone
surrogates (valid JSON escapes, but no UTF-8 text) are refused the same way.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Bounds that keep every number inside what the worker's protobuf fields hold (int32 /
# int64); the model's own limits (context, vocabulary) are checked with their own messages.
INT32_MAX = (1 << 31) - 1
TokenId = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]  # negatives: refused by name later
TokenIds = list[TokenId]
# The worker's sampling floats are float32: a positive double below the smallest normal
# float32 would reach it as 0 (or a subnormal) and be refused there without naming the field.
FLOAT32_TINY = 2.0 ** -126
MAX_STRING_DEPTH = 64  # deeper nesting than this in a request is refused (JSON bombs)


def _check_text(value, path: str, depth: int = 0) -> None:
    """Every string in the request must be encodable as UTF-8 (no lone surrogates)."""
    if depth > MAX_STRING_DEPTH:
        raise ValueError(f"{path or 'body'}: nested more than {MAX_STRING_DEPTH} levels deep")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{path or 'body'}: the string contains a lone surrogate "
                             f"(not valid Unicode text)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path, depth + 1)
            _check_text(item, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{path}.{i}" if path else str(i), depth + 1)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data):
        _check_text(data, "")
        return data

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # accepted; usage comes once, at the end


class SamplingFields(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the one served model
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)  # None: fill the context
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)  # None: 1.0
    top_p: float | None = Field(default=None, ge=FLOAT32_TINY, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # -1 or 0: no cut (vLLM's -1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | Annotated[list[str], Field(max_length=64)] | None = None  # at most 64 stop strings
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=1024)
    # any 64-bit value, signed or not: choice j samples with (seed + j) mod 2^63
    seed: int | None = Field(default=None, ge=-(1 << 63), le=(1 << 64) - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    user: str | None = None
    session_id: str | None = None  # the body form of X-Session-ID (checked as the header is)
    # vLLM's penalties and OpenAI's logit_bias ({"token id": bias}), applied by the worker
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=FLOAT32_TINY, le=2.0)  # None: 1.0 (off)
    logit_bias: dict[str, float] | None = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)  # top logprobs per token (vLLM's max 20)
    suffix: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    # a string, or OpenAI content parts ([{"type": "text", "text": ...}]); text parts only
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # needs logprobs true
    add_generation_prompt: bool = True
    echo: bool = False  # vLLM: prepend the last message's content when its role is the reply's


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# ---- /v1/completions -----------------------------------------------------------------
class CompletionChoice(BaseModel):
    index: int
    text: str
    # {"text_offset", "token_logprobs", "tokens", "top_logprobs"} with the request's logprobs
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None  # the stop string that ended it, if any


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None  # this build and model (serving.fingerprint)
    choices: list[CompletionChoice]
    usage: UsageInfo


# ---- /v1/chat/completions ------------------------------------------------------------
class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None  # {"content": [...]} with the request's logprobs
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None  # this build and model (serving.fingerprint)
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


# ---- streamed chunks of either endpoint -----------------------------------------------
class StreamResponse(BaseModel):
    """One server-sent chunk: "text_completion" carries CompletionChoice, "chat.completion.chunk"
    ChatStreamChoice; the usage chunk at the end of a stream has no choices."""

    id: str
    object: Literal["text_completion", "chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None = None  # this build and model (serving.fingerprint)
    choices: list[CompletionChoice] | list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenize ----------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedweight"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
