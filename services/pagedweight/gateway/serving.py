"""What every generating endpoint shares: checks, sampling, routing, admission, SSE.

The route handlers stay a few lines; the two serving classes (completions, chat) build
their choices with these helpers and shape the response their endpoint promises.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from pagedweight.gateway.config import GatewayConfig
from pagedweight.gateway.errors import APIError, sse_error_event
from pagedweight.gateway.generation import ChoiceDelta, ChoiceSpec, Generation
from pagedweight.gateway.metrics import GatewayMetrics
from pagedweight.gateway.protocol import SamplingFields
from pagedweight.gateway.sessions import Session, SessionStoreUnavailable, session_key
from pagedweight.gateway.text import TextCodec
from pagedweight.gateway.text_sandbox import TextSandbox
from pagedweight.gateway.workers import WorkerPool
from pagedweight.rpc import worker_pb2

log = logging.getLogger("pagedweight.gateway.serving")

INT64_MASK = (1 << 63) - 1

# OpenAI fields that would change what the reply must be and that no worker implements:
# refused with a 400 naming the field rather than silently ignored (unknown fields stay
# accepted, as vLLM does). field -> whether a value is harmless (the default's meaning).
UNSUPPORTED_FIELDS = {
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "best_of": lambda v: v in (None, 1),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
    "structured_outputs": lambda v: v is None,
}


@dataclass
class GatewayState:
    """Everything the serving classes share; built once, in the app's lifespan."""

    config: GatewayConfig
    codec: TextCodec
    pool: WorkerPool
    sessions: object  # RedisSessionStore | MemorySessionStore
    metrics: GatewayMetrics
    sandbox: TextSandbox  # templates and tokenisation of client text, in processes of their own
    fingerprint: str = ""  # system_fingerprint of every response: this build and model
    num_in_flight: int = 0  # requests admitted and not yet answered (streams until their end)


def new_request_id(header: str | None) -> str:
    return header if header else uuid.uuid4().hex


def sse(payload) -> str:
    # vLLM drops unset fields from chunks (a content delta has no "role": null)
    body = payload.model_dump_json(exclude_unset=True) if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ServingBase:
    def __init__(self, state: GatewayState):
        self.state = state
        self.codec = state.codec

    # ---- checks -------------------------------------------------------------------------
    def check_common(self, request: SamplingFields, unsupported: dict[str, bool]) -> None:
        """unsupported: field name -> whether the request uses it."""
        name = self.state.config.model_name
        if request.model is not None and request.model != name:
            raise APIError(404, f"The model `{request.model}` does not exist.", "model")
        for field, used in unsupported.items():
            if used:
                raise APIError(400, f"{field} is not supported by this server", field)
        for field, value in (request.model_extra or {}).items():
            harmless = UNSUPPORTED_FIELDS.get(field)
            if harmless is not None and not harmless(value):
                raise APIError(400, f"{field} is not supported by this server", field)
        if request.min_p:  # the workers' sampler has no min-p cut: refused here, naming the field
            raise APIError(400, "min_p is not supported by this server (send 0 or leave it out)", "min_p")
        self.logit_bias(request)
        if request.stop_token_ids and any(t < 0 for t in request.stop_token_ids):
            raise APIError(400, "stop_token_ids must be token ids (>= 0)", "stop_token_ids")
        extra = request.unknown_fields()
        if extra:
            log.debug("ignoring unknown request fields: %s", ", ".join(extra))

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, f"{param} is empty: give at least one token", param)
        vocab = self.codec.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param)
        return ids

    def resolve_max_tokens(self, requested: int | None, num_prompt: int, param: str) -> int:
        limit = self.codec.max_model_len
        if requested is None:
            if num_prompt >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                                    f"your prompt has {num_prompt} tokens, leaving none to generate.", param)
            return limit - num_prompt
        if num_prompt + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                f"requested {num_prompt + requested} tokens ({num_prompt} in the prompt, "
                                f"{requested} in the completion). Please reduce the length of the prompt "
                                f"or completion.", param)
        return requested

    @staticmethod
    def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", "stop")
        return stops

    def logit_bias(self, request: SamplingFields) -> dict[int, float]:
        """OpenAI's {"token id": bias} as ids; a 400 for a key that is no token id."""
        out = {}
        for key, bias in (request.logit_bias or {}).items():
            # ASCII digits only: str.isdigit() also accepts "³" and "①", which int() refuses
            if not (key.isascii() and key.isdigit()) or int(key) >= self.codec.vocab_size:
                raise APIError(400, f"logit_bias: {key!r} is not a token id (0..{self.codec.vocab_size - 1})",
                               "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise APIError(400, f"logit_bias: the bias of {key} must be in [-100, 100], got {bias}",
                               "logit_bias")
            out[int(key)] = bias
        return out

    @staticmethod
    def sampling(request: SamplingFields, max_tokens: int, choice: int,
                 logprobs: int | None = None) -> worker_pb2.SamplingParams:
        """Choice j of a seeded request samples with seed + j: distinct choices, each reproducible."""
        params = worker_pb2.SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=max(request.top_k or 0, 0),
            ignore_eos=request.ignore_eos,
            stop_token_ids=request.stop_token_ids or [],
            min_tokens=request.min_tokens,
            min_p=request.min_p or 0.0,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logit_bias={int(k): v for k, v in (request.logit_bias or {}).items()},
        )
        if logprobs is not None:
            params.logprobs = logprobs
        if request.repetition_penalty is not None:
            params.repetition_penalty = request.repetition_penalty
        if request.top_p is not None:
            params.top_p = request.top_p
        if request.seed is not None:
            params.seed = (request.seed + choice) & INT64_MASK
        return params

    # ---- admission and routing ----------------------------------------------------------
    def admit(self) -> None:
        state = self.state
        if state.num_in_flight >= state.config.max_queued_requests:
            state.metrics.rejected.labels(reason="queue_full").inc()
            raise APIError(503, f"the gateway's queue is full ({state.config.max_queued_requests} "
                                f"requests in flight); retry later or on another instance")
        state.num_in_flight += 1
        state.metrics.num_requests_running.inc()

    def release(self) -> None:
        self.state.num_in_flight -= 1
        self.state.metrics.num_requests_running.dec()

    async def load_session(self, session_id: str | None, tenant: str) -> Session | None:
        """The tenant's session of that id (a new one when there is none)."""
        if session_id is None:
            return None
        key = session_key(session_id, tenant)
        try:
            session = await self.state.sessions.get(key) or Session(is_new=True)
        except SessionStoreUnavailable as err:  # answering without the history would lose it silently
            self.state.metrics.rejected.labels(reason="session_store").inc()
            raise APIError(503, f"{err}; the session's history cannot be read: retry later, or send "
                                f"the whole conversation without a session id", "session_id") from None
        session.key = key
        return session

    async def save_session(self, session: Session) -> None:
        """Stores the session under its tenant-bound key (set by load_session)."""
        try:
            await self.state.sessions.put(session.key, session)
        except SessionStoreUnavailable as err:
            self.state.metrics.rejected.labels(reason="session_store").inc()
            raise APIError(503, f"{err}; this reply was not saved to the session", "session_id") from None

    def route(self, request_id: str, session_id: str | None, session: Session | None) -> Generation:
        affinity = session.worker if session is not None else None
        address = self.state.pool.pick(session_id, affinity)
        if address is None:
            self.state.metrics.rejected.labels(reason="no_worker").inc()
            raise APIError(503, "no worker is ready; retry later or on another instance")
        return Generation(self.state.pool, self.codec, self.state.metrics, request_id, session_id,
                          address, self.state.config.worker_timeout_s)

    def record(self, num_prompt_tokens: int, num_generated: list[int], reasons: list[str], arrival: float):
        m = self.state.metrics
        m.prompt_tokens.inc(num_prompt_tokens)
        m.request_prompt_tokens.observe(num_prompt_tokens)
        for count, reason in zip(num_generated, reasons):
            m.generation_tokens.inc(count)
            m.request_generation_tokens.observe(count)
            m.request_success[reason if reason in m.request_success else "error"].inc()
        m.e2e_request_latency.observe(time.monotonic() - arrival)


async def first_and_rest(stream: AsyncIterator[list[ChoiceDelta]]) -> tuple[list | None, AsyncIterator]:
    """Wait for the first deltas before answering, so a request that fails before any token
    (no worker, refused) gets a proper HTTP status instead of a 200 with an error event."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()
        raise
    return first, stream


async def with_first(first: list | None, rest: AsyncIterator[list]) -> AsyncIterator[list[ChoiceDelta]]:
    try:
        if first is not None:
            yield first
        async for delta in rest:
            yield delta
    finally:  # a client gone mid-stream: end the choices (and their worker requests) now
        await rest.aclose()


def session_headers(session: Session | None) -> dict[str, str]:
    """X-Session-Status: whether the stored history was found ("continued") or the session
    starts here ("new": a first request, an expired one, or a store that lost it)."""
    if session is None:
        return {}
    return {"x-session-status": "new" if session.is_new else "continued"}


def stream_error(err: APIError) -> str:
    return sse_error_event(err) + SSE_DONE


__all__ = ["ChoiceSpec", "GatewayState", "ServingBase", "SSE_DONE", "first_and_rest", "new_request_id",
           "session_headers", "sse", "stream_error", "with_first"]
