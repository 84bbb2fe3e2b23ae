"""One HTTP request's choices, run on the workers and turned back into text.

Each choice (a prompt times `n`) is one request on the worker's shared `GenerateStream`
(workers.WorkerStream). The stream's reader hands every output to its choice as a plain
call: the choice detokenises it, applies the stop strings and adds a delta to the
request's pending list, and the request's one consumer (the HTTP response) wakes once
per engine step to take everything that arrived. No task or queue per choice or token: the
gateway's cost grows with steps, not with tokens x requests. A stop string ends the choice
here and aborts it on the worker.

Failure: a choice whose worker fails before sending it anything is retried once on another
ready worker (the failed one is taken out of routing when it is down); after the first
token the error ends the request (a streaming response sends it as an error event).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from pagedweight.gateway.errors import APIError
from pagedweight.gateway.text import TextCodec
from pagedweight.gateway.workers import WorkerPool
from pagedweight.rpc import worker_pb2

log = logging.getLogger("pagedweight.gateway.generation")

# Worst case before the first byte: try another worker. Only a worker that cannot be
# reached is taken out of routing at once: UNKNOWN / INTERNAL / CANCELLED also come from
# this side (bad metadata, a cancelled call) and one request must never take a healthy
# worker out for everyone; a worker whose engine died says so in its next GetStats poll.
RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
               grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED}
DOWN_CODES = {grpc.StatusCode.UNAVAILABLE}


@dataclass(frozen=True)
class ChoiceSpec:
    index: int  # the choice's index in the response
    prompt_ids: list[int]
    sampling: worker_pb2.SamplingParams
    stops: tuple[str, ...]  # stop strings: the text ends before the first one


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely (token id, logprob), most likely first


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str  # new text ("" is possible: a token that completes no character yet)
    num_tokens: int  # tokens this delta covers
    finish_reason: str | None = None  # set on the choice's last delta
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: tuple[TokenLogprob, ...] = ()  # with the request's logprobs: one per token


class RequestTimer:
    """When the request came and when its tokens did (for the latency metrics)."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first_token: float | None = None

    def tokens_arrived(self, last: float | None) -> float:
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            self.metrics.time_to_first_token.observe(now - self.arrival)
        elif last is not None:
            self.metrics.inter_token_latency.observe(now - last)
        return now


class Generation:
    def __init__(self, pool: WorkerPool, codec: TextCodec, metrics, request_id: str,
                 session_id: str | None, address: str, timeout_s: float):
        self.pool, self.codec, self.metrics = pool, codec, metrics
        self.request_id, self.session_id = request_id, session_id
        self.address = address  # the worker this request was routed to (updated by a retry)
        self.timeout_s = timeout_s
        self.timer = RequestTimer(metrics)
        self._pending: list = []  # ChoiceDelta or APIError, in arrival order
        self._ready = asyncio.Event()

    def push(self, item) -> None:
        """From a choice (called by a stream's reader): a delta, or the error that ends us."""
        self._pending.append(item)
        self._ready.set()

    async def stream(self, specs: list[ChoiceSpec]) -> AsyncIterator[list[ChoiceDelta]]:
        """The deltas of all choices, one list per wake-up (what arrived since the last);
        raises APIError on the first failure."""
        choices = [_Choice(self, spec) for spec in specs]
        for choice in choices:
            choice.submit(self.address)
        # one timer for the whole request, not a timeout per wait
        deadline = asyncio.get_running_loop().call_later(self.timeout_s, self._expire)
        try:
            remaining = len(choices)
            while remaining:
                await self._ready.wait()
                self._ready.clear()
                items, self._pending = self._pending, []
                for item in items:
                    if isinstance(item, APIError):
                        raise item
                    if item.finish_reason is not None:
                        remaining -= 1
                if items:
                    yield items
        finally:  # the client went away, or a choice failed: stop the others on their workers
            deadline.cancel()
            for choice in choices:
                choice.cancel()

    def _expire(self) -> None:
        self.push(APIError(503, f"request {self.request_id} took longer than {self.timeout_s:.0f} s"))


class _Choice:
    """One choice's worker request: its detokeniser, retry state and progress."""

    def __init__(self, generation: Generation, spec: ChoiceSpec):
        self.generation, self.spec = generation, spec
        self.detok = generation.codec.detokenizer(spec.prompt_ids, spec.stops)
        # the client's id first (worker logs find it), then the choice, then a suffix so two
        # clients reusing one X-Request-Id never collide on a worker
        self.worker_request_id = f"{generation.request_id}-{spec.index}-{uuid.uuid4().hex[:6]}"
        self.address = generation.address
        self.tried: list[str] = []
        self.received = False  # anything from the worker yet (after that, no retry)
        self.done = False
        self.last: float | None = None  # when its previous tokens arrived

    def submit(self, address: str) -> None:
        self.address = address
        request = worker_pb2.GenerateRequest(
            request_id=self.worker_request_id, prompt_token_ids=self.spec.prompt_ids,
            sampling=self.spec.sampling, session_id=self.generation.session_id or "")
        self.generation.pool.stream(address).submit(request, self)

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.generation.pool.stream(self.address).abort(self.worker_request_id)

    # ---- from the stream's reader --------------------------------------------------------
    def on_output(self, response: worker_pb2.GenerateResponse) -> None:
        if self.done:
            return
        self.received = True
        generation, spec = self.generation, self.spec
        if spec.index == 0:
            generation.address = self.address
        ids = list(response.token_ids)
        logprobs = _logprobs(ids, response.logprobs)
        text = ""
        if ids:
            self.last = generation.timer.tokens_arrived(self.last)
            delta = self.detok.push(ids)
            if delta.stopped:  # a stop string: the choice ends here; the worker's request is aborted
                generation.push(ChoiceDelta(spec.index, delta.text, len(ids), "stop", self.detok.stop_reason,
                                            logprobs))
                self.cancel()
                return
            text = delta.text
        if response.finished:
            self.done = True
            tail = self.detok.finish()  # the held-back text (a stop string may still complete in it)
            reason = "stop" if tail.stopped else (response.finish_reason or "stop")
            stop_reason = self.detok.stop_reason if tail.stopped else _stop_token(response, spec)
            generation.push(ChoiceDelta(spec.index, text + tail.text, len(ids), reason, stop_reason, logprobs))
            return
        if text or ids:
            generation.push(ChoiceDelta(spec.index, text, len(ids), logprobs=logprobs))

    def on_error(self, code: grpc.StatusCode, details: str) -> None:
        if self.done:
            return
        generation, pool = self.generation, self.generation.pool
        if code in DOWN_CODES:
            pool.mark_failed(self.address, f"{code.name}: {details}")
        if not self.received and code in RETRY_CODES and not self.tried:
            self.tried.append(self.address)
            retry = pool.pick(generation.session_id, None, exclude=tuple(self.tried))
            if retry is not None:
                log.warning("worker %s failed before the first token of %s (%s); retrying on %s",
                            self.address, self.worker_request_id, code.name, retry)
                generation.metrics.retries.inc()
                self.worker_request_id = f"{self.worker_request_id}-retry"
                self.submit(retry)
                return
        self.done = True
        generation.push(_api_error(code, details, self.address, self.received))


def _logprobs(ids: list[int], entries) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(t, e.logprob, tuple(zip(e.top_token_ids, e.top_logprobs)))
                 for t, e in zip(ids, entries))


def _stop_token(response: worker_pb2.GenerateResponse, spec: ChoiceSpec) -> int | None:
    """vLLM's stop_reason for a token stop: the id when it is one of the request's
    stop_token_ids; None for EOS (and for every other finish)."""
    if response.finish_reason == "stop" and response.HasField("stop_reason"):
        if response.stop_reason in spec.sampling.stop_token_ids:
            return response.stop_reason
    return None


def _api_error(code: grpc.StatusCode, details: str, address: str, received: bool) -> APIError:
    details = details or code.name
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                grpc.StatusCode.OUT_OF_RANGE):
        return APIError(400, details)
    where = "mid-stream" if received else "before the first token"
    return APIError(503, f"worker {address} failed {where}: {code.name}: {details}")
