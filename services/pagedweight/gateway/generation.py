"""One HTTP request's choices, run on the workers and turned back into text.

Each choice (a prompt times `n`) is one worker `Generate` stream. Its tokens go through
the incremental detokeniser and the stop-string filter; a stop string ends the choice
here and cancels the worker's stream (the worker aborts the request). The choices run
as tasks that feed one queue, so a streaming response interleaves them as they come.

Failure: a worker that fails before sending anything is marked failed and the choice is
retried once on another ready worker; after the first token the error ends the choice
(a streaming response sends it as an error event).
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
class ChoiceDelta:
    index: int
    text: str  # new text ("" is possible: a token that completes no character yet)
    num_tokens: int  # tokens this delta covers
    finish_reason: str | None = None  # set on the choice's last delta
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


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

    async def stream(self, specs: list[ChoiceSpec]) -> AsyncIterator[ChoiceDelta]:
        """Deltas of all choices as they come; raises APIError on the first failure."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(spec, queue)) for spec in specs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    remaining -= 1
                    continue
                yield item
        finally:  # the client went away, or a choice failed: stop the others
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_choice(self, spec: ChoiceSpec, queue: asyncio.Queue) -> None:
        try:
            await self._generate(spec, queue)
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except APIError as err:
            queue.put_nowait(err)
        except Exception as err:  # a bug: the client still gets an answer
            log.exception("choice %d of %s failed", spec.index, self.request_id)
            queue.put_nowait(APIError(500, f"internal error: {type(err).__name__}: {err}"))

    async def _generate(self, spec: ChoiceSpec, queue: asyncio.Queue) -> None:
        # the client's id first (worker logs find it), then the choice, then a suffix so two
        # clients reusing one X-Request-Id never collide on a worker
        worker_request_id = f"{self.request_id}-{spec.index}-{uuid.uuid4().hex[:6]}"
        tried: list[str] = []
        address = self.address
        while True:
            request = worker_pb2.GenerateRequest(
                request_id=worker_request_id, prompt_token_ids=spec.prompt_ids,
                sampling=spec.sampling, session_id=self.session_id or "")
            call = self.pool.stub(address).Generate(
                request, timeout=self.timeout_s,
                metadata=(("x-request-id", self.request_id), *self.pool.metadata))
            progress = _Progress()
            try:
                await self._consume(spec, call, address, queue, progress)
                self.address = address
                return
            except grpc.aio.AioRpcError as err:
                code, received = err.code(), progress.received
                if code in DOWN_CODES:
                    self.pool.mark_failed(address, err)
                if received or code not in RETRY_CODES or tried:
                    raise _api_error(err, address, received) from None
                tried.append(address)
                retry = self.pool.pick(self.session_id, None, exclude=tuple(tried))
                if retry is None:
                    raise _api_error(err, address, received) from None
                log.warning("worker %s failed before the first token of %s (%s); retrying on %s",
                            address, worker_request_id, code.name, retry)
                self.metrics.retries.inc()
                address, worker_request_id = retry, f"{worker_request_id}-retry"
            finally:
                call.cancel()  # no-op when finished; otherwise the worker aborts the request

    async def _consume(self, spec: ChoiceSpec, call, address: str, queue: asyncio.Queue,
                       progress: "_Progress") -> None:
        """Reads one worker stream into deltas."""
        detok = self.codec.detokenizer(spec.prompt_ids, spec.stops)
        last = None
        async for response in call:
            progress.received = True
            ids = list(response.token_ids)
            text = ""
            if ids:
                last = self.timer.tokens_arrived(last)
                delta = detok.push(ids)
                if delta.stopped:  # a stop string: the choice ends here; the worker is cancelled
                    queue.put_nowait(ChoiceDelta(spec.index, delta.text, len(ids), "stop", detok.stop_reason))
                    return
                text = delta.text
            if response.finished:
                tail = detok.finish()  # the held-back text (a stop string may still complete in it)
                reason = "stop" if tail.stopped else (response.finish_reason or "stop")
                stop_reason = detok.stop_reason if tail.stopped else _stop_token(response, spec)
                queue.put_nowait(ChoiceDelta(spec.index, text + tail.text, len(ids), reason, stop_reason))
                return
            queue.put_nowait(ChoiceDelta(spec.index, text, len(ids)))
        raise APIError(503, f"worker {address} ended the stream of {self.request_id} without finishing it")


def _stop_token(response: worker_pb2.GenerateResponse, spec: ChoiceSpec) -> int | None:
    """vLLM's stop_reason for a token stop: the id when it is one of the request's
    stop_token_ids; None for EOS (and for every other finish)."""
    if response.finish_reason == "stop" and response.HasField("stop_reason"):
        if response.stop_reason in spec.sampling.stop_token_ids:
            return response.stop_reason
    return None


class _Progress:
    received = False  # whether the worker sent anything yet (after that, no retry)


def _api_error(err: grpc.aio.AioRpcError, address: str, received: bool) -> APIError:
    code, details = err.code(), err.details() or err.code().name
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                grpc.StatusCode.OUT_OF_RANGE):
        return APIError(400, details)
    where = "mid-stream" if received else "before the first token"
    return APIError(503, f"worker {address} failed {where}: {err.code().name}: {details}")
