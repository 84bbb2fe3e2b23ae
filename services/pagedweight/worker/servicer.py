"""The Worker gRPC servicer: Generate / Abort / GetStats over the engine's async client.

Thin on purpose: it converts messages (convert.py), keeps the running request ids and
the caller that started each (for drain and Abort: a caller may abort only its own
requests, so one gateway, or anyone holding another token, cannot cancel another's), and
times each request for the vLLM latency histograms (telemetry.py). Everything about
scheduling and memory stays in the engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from pagedweight.common.errors import EngineDeadError, UserError
from pagedweight.common.rpc_security import RpcSecurity
from pagedweight.rpc import worker_pb2, worker_pb2_grpc
from pagedweight.worker import convert


MAX_REQUEST_ID_CHARS = 512  # the gateway's ids (<= 256) plus its choice and retry suffixes


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, model_name: str, max_model_len: int, eos_token_id: int,
                 security: RpcSecurity | None = None):
        self.model_name, self.max_model_len, self.eos_token_id = model_name, max_model_len, eos_token_id
        self.security = security or RpcSecurity()
        self.engine = None  # AsyncEngine, set once the model is loaded
        self.telemetry = None  # telemetry.WorkerTelemetry, set with the engine
        self.draining = False
        self.running: dict[str, str] = {}  # request id with an open stream -> the caller that owns it
        self.idle = asyncio.Event()  # set whenever `running` is empty
        self.idle.set()

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and not self.engine.errored

    @property
    def live(self) -> bool:
        """False once the engine died (a step raised): the process must be restarted."""
        return self.engine is None or not self.engine.errored

    async def Generate(self, request, context):
        if not self.ready:
            reason = ("worker is draining" if self.draining else "worker is loading" if self.engine is None
                      else f"engine is dead: {self.engine.dead_error}")
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
        arrived = time.monotonic()
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
        if request_id in self.running:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is already running")
        prompt = list(request.prompt_token_ids)
        try:
            if not prompt:
                raise UserError("prompt_token_ids must not be empty")
            params = convert.sampling_params(request.sampling)
            stream = self.engine.add_request(prompt, params, request_id)
        except UserError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except EngineDeadError as err:  # retryable on another worker; this one needs a restart
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        self.running[request_id] = self.security.caller(context)
        self.idle.clear()
        record = self.telemetry.start(request_id, len(prompt), arrived)
        state = {"final": None, "closed": False}  # final: the finish reason once sent

        def close(reason: str) -> None:  # once per request, from whichever path ends it
            if not state["closed"]:
                state["closed"] = True
                self.telemetry.finish(record, reason)
                self.running.pop(request_id, None)
                if not self.running:
                    self.idle.set()

        def on_rpc_done(_) -> None:
            # grpc.aio may drop a cancelled call's generator while it waits at a `yield`
            # without closing it: abort the engine's request here, or it would run on.
            if state["final"] is None:
                self.engine.abort(request_id)
            close(state["final"] or "abort")

        context.add_done_callback(on_rpc_done)
        reason = "error"
        try:
            async for out in stream:
                if out.queue_time_s is not None:
                    record.queued(out.queue_time_s)
                record.tokens(len(out.new_token_ids), self.telemetry.mean_expert_bits())
                if not out.finished:
                    yield worker_pb2.GenerateResponse(request_id=request_id, token_ids=out.new_token_ids)
                    continue
                reason = state["final"] = out.finish_reason or "stop"
                yield worker_pb2.GenerateResponse(
                    request_id=request_id, token_ids=out.new_token_ids, finished=True,
                    finish_reason=reason,
                    usage=worker_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=record.num_tokens),
                    mean_expert_bits=record.mean_bits, stop_reason=out.stop_reason)
        except asyncio.CancelledError:  # the client went away; closing the stream aborted it
            reason = "abort"
            raise
        except Exception as err:  # the engine died: the client gets INTERNAL, not silence
            await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {err}")
        finally:
            close(reason)

    async def Abort(self, request, context):
        # another caller's request is answered as not found: its existence is not theirs to learn
        found = self.running.get(request.request_id) == self.security.caller(context)
        if found:
            self.engine.abort(request.request_id)
        return worker_pb2.AbortResponse(found=found)

    async def GetStats(self, request, context):
        message = worker_pb2.WorkerStats(model_name=self.model_name, max_model_len=self.max_model_len,
                                         ready=self.ready, eos_token_id=self.eos_token_id)
        if self.telemetry is not None:
            self.telemetry.fill_stats(message)
        return message

    def abort_all(self) -> int:
        """Abort every running request (drain timeout): each stream ends with 'abort'."""
        for request_id in list(self.running):
            self.engine.abort(request_id)
        return len(self.running)
