"""The Worker gRPC servicer: Generate / GenerateStream / Abort / GetStats over the engine's
async client.

Thin on purpose: it converts messages (convert.py), keeps the running request ids and
the caller that started each (for drain and Abort: a caller may abort only its own
requests, so one gateway, or anyone holding another token, cannot cancel another's), and
times each request for the vLLM latency histograms (telemetry.py). Everything about
scheduling and memory stays in the engine.

Request ids are scoped per caller: the engine knows a request as "<caller>:<id>" (caller
names have no ':'), so two callers may use the same id, and ALREADY_EXISTS never tells
one caller which ids another is running. Responses carry the caller's own id.

GenerateStream carries many requests on one stream: the engine puts every output of the
stream's requests into one `_StreamSink` as a step makes them (no per-request queue or
task), and the writer wakes once per step to send them all in one message. The stream's
caller owns the requests it starts; an abort sent on a stream stops only those.
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


def scoped_id(caller: str, request_id: str) -> str:
    """The engine's id of a caller's request (unchanged when no tokens name callers)."""
    return f"{caller}:{request_id}" if caller else request_id


def unscoped_id(caller: str, engine_id: str) -> str:
    return engine_id[len(caller) + 1:] if caller else engine_id


class _StreamSink:
    """The outputs of one GenerateStream's requests, gathered between two writes."""

    def __init__(self):
        self.items: list = []  # RequestOutput, EngineDeadError or StreamError, in order
        self.ready = asyncio.Event()
        self.client_done = False  # the client closed its side: end once its requests have

    def put_nowait(self, item) -> None:  # the engine's sink interface (AsyncEngine.add_request)
        self.items.append(item)
        self.ready.set()

    async def take(self) -> list:
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items


def fill_output(message: worker_pb2.GenerateResponse, out) -> None:
    """The tokens (and log-probabilities) of one engine output."""
    message.token_ids.extend(out.new_token_ids)
    for logprob, top_ids, top_logprobs in out.logprobs or ():
        message.logprobs.add(logprob=logprob, top_token_ids=top_ids, top_logprobs=top_logprobs)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, model_name: str, max_model_len: int, eos_token_id: int,
                 security: RpcSecurity | None = None):
        self.model_name, self.max_model_len, self.eos_token_id = model_name, max_model_len, eos_token_id
        self.security = security or RpcSecurity()
        self.engine = None  # AsyncEngine, set once the model is loaded
        self.telemetry = None  # telemetry.WorkerTelemetry, set with the engine
        self.draining = False
        self.running: dict[str, str] = {}  # engine id (scoped_id) with an open stream -> its caller
        self.idle = asyncio.Event()  # set whenever `running` is empty
        self.idle.set()
        self.startup = None  # common.startup.StartupProgress, set while the model loads

    def health(self) -> dict:
        """The body of the side port's /health and /ready: state and start-up progress."""
        state = ("dead" if self.engine is not None and self.engine.errored else "draining" if self.draining
                 else "ready" if self.ready else "starting")
        progress = self.startup.snapshot() if self.startup is not None else {}
        return progress | {"status": state}

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and not self.engine.errored

    @property
    def live(self) -> bool:
        """False once the engine died (a step raised): the process must be restarted."""
        return self.engine is None or not self.engine.errored

    def unavailable_reason(self) -> str:
        return ("worker is draining" if self.draining else "worker is loading" if self.engine is None
                else f"engine is dead: {self.engine.dead_error}")

    def _opened(self, request_id: str, owner: str) -> None:
        self.running[request_id] = owner
        self.idle.clear()

    def _closed(self, request_id: str) -> None:
        self.running.pop(request_id, None)
        if not self.running:
            self.idle.set()

    async def Generate(self, request, context):
        if not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.unavailable_reason())
        arrived = time.monotonic()
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
        caller = self.security.caller(context)
        engine_id = scoped_id(caller, request_id)
        if engine_id in self.running:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is already running")
        prompt = list(request.prompt_token_ids)
        try:
            if not prompt:
                raise UserError("prompt_token_ids must not be empty")
            params = convert.sampling_params(request.sampling)
            stream = self.engine.add_request(prompt, params, engine_id)
        except UserError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except EngineDeadError as err:  # retryable on another worker; this one needs a restart
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        self._opened(engine_id, caller)
        record = self.telemetry.start(engine_id, len(prompt), arrived)
        state = {"final": None, "closed": False}  # final: the finish reason once sent

        def close(reason: str) -> None:  # once per request, from whichever path ends it
            if not state["closed"]:
                state["closed"] = True
                self.telemetry.finish(record, reason)
                self._closed(engine_id)

        def on_rpc_done(_) -> None:
            # grpc.aio may drop a cancelled call's generator while it waits at a `yield`
            # without closing it: abort the engine's request here, or it would run on.
            if state["final"] is None:
                self.engine.abort(engine_id)
            close(state["final"] or "abort")

        context.add_done_callback(on_rpc_done)
        reason = "error"
        try:
            async for out in stream:
                if out.queue_time_s is not None:
                    record.queued(out.queue_time_s)
                record.tokens(len(out.new_token_ids), self.telemetry.mean_expert_bits())
                message = worker_pb2.GenerateResponse(request_id=request_id)
                fill_output(message, out)
                if out.finished:
                    reason = state["final"] = out.finish_reason or "stop"
                    _finish(message, out, len(prompt), record)
                yield message
        except asyncio.CancelledError:  # the client went away; closing the stream aborted it
            reason = "abort"
            raise
        except Exception as err:  # the engine died: the client gets INTERNAL, not silence
            await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {err}")
        finally:
            close(reason)

    async def GenerateStream(self, request_iterator, context):
        sink = _StreamSink()
        runs: dict[str, object] = {}  # engine id -> its telemetry record, while it runs
        caller = self.security.caller(context)  # owns every request this stream starts
        reader = asyncio.create_task(self._read_stream(request_iterator, sink, runs, caller))
        try:
            while runs or not sink.client_done or sink.items:
                items = await sink.take()
                message = worker_pb2.StreamResponse()
                # once per step, not per token (no telemetry yet: a worker still loading refuses all)
                bits = self.telemetry.mean_expert_bits() if self.telemetry is not None else 0.0
                for item in items:
                    self._add_to_message(message, item, runs, bits, caller)
                if message.outputs or message.errors:
                    yield message
        finally:  # the client went away (or the server stops): its running requests end here
            reader.cancel()
            for request_id, record in list(runs.items()):
                if self.engine is not None and not self.engine.errored:
                    self.engine.abort(request_id)
                self.telemetry.finish(record, "abort")
                self._closed(request_id)
            runs.clear()

    async def _read_stream(self, request_iterator, sink: _StreamSink, runs: dict, caller: str) -> None:
        try:
            async for entry in request_iterator:
                if entry.HasField("abort"):
                    # only a request this stream started, and only by its owner (as Abort)
                    engine_id = scoped_id(caller, entry.abort.request_id)
                    if engine_id in runs and self.running.get(engine_id) == caller:
                        self.engine.abort(engine_id)
                elif entry.HasField("generate"):
                    self._start(entry.generate, sink, runs, caller)
        except (asyncio.CancelledError, grpc.RpcError):
            pass  # the call ended; the writer cleans up
        finally:
            sink.client_done = True
            sink.ready.set()

    def _start(self, request, sink: _StreamSink, runs: dict, caller: str) -> None:
        """Add one request of a stream to the engine, or answer it with an error."""
        arrived = time.monotonic()
        request_id = request.request_id
        engine_id = scoped_id(caller, request_id)
        code = None
        if not request_id:
            code, detail = grpc.StatusCode.INVALID_ARGUMENT, "request_id must be set on a stream"
        elif len(request_id) > MAX_REQUEST_ID_CHARS:
            code, detail = (grpc.StatusCode.INVALID_ARGUMENT,
                            f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
        elif not self.ready:
            code, detail = grpc.StatusCode.UNAVAILABLE, self.unavailable_reason()
        elif engine_id in self.running:
            code, detail = grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is already running"
        else:
            prompt = list(request.prompt_token_ids)
            try:
                if not prompt:
                    raise UserError("prompt_token_ids must not be empty")
                self.engine.add_request(prompt, convert.sampling_params(request.sampling), engine_id, sink=sink)
            except UserError as err:
                code, detail = grpc.StatusCode.INVALID_ARGUMENT, str(err)
            except EngineDeadError as err:
                code, detail = grpc.StatusCode.UNAVAILABLE, str(err)
        if code is not None:
            sink.put_nowait(worker_pb2.StreamError(request_id=request_id, code=code.value[0], message=detail))
            return
        self._opened(engine_id, caller)
        runs[engine_id] = self.telemetry.start(engine_id, len(prompt), arrived)

    def _add_to_message(self, message: worker_pb2.StreamResponse, item, runs: dict, bits: float,
                        caller: str) -> None:
        if isinstance(item, worker_pb2.StreamError):
            message.errors.append(item)
            return
        if isinstance(item, BaseException):  # the engine died: every request of the stream fails
            for engine_id, record in list(runs.items()):
                message.errors.add(request_id=unscoped_id(caller, engine_id), code=grpc.StatusCode.INTERNAL.value[0],
                                   message=f"engine failed: {item}")
                self.telemetry.finish(record, "error")
                self._closed(engine_id)
            runs.clear()
            return
        record = runs.get(item.request_id)
        if record is None:
            return  # ended already (an abort raced the step)
        if item.queue_time_s is not None:
            record.queued(item.queue_time_s)
        record.tokens(len(item.new_token_ids), bits)
        out = message.outputs.add(request_id=unscoped_id(caller, item.request_id))
        fill_output(out, item)
        if item.finished:
            _finish(out, item, record.num_prompt_tokens, record)
            del runs[item.request_id]
            self.telemetry.finish(record, out.finish_reason)
            self._closed(item.request_id)

    async def Abort(self, request, context):
        # another caller's request is answered as not found: its existence is not theirs to learn
        caller = self.security.caller(context)
        engine_id = scoped_id(caller, request.request_id)
        found = self.running.get(engine_id) == caller
        if found:
            self.engine.abort(engine_id)
        return worker_pb2.AbortResponse(found=found)

    async def GetStats(self, request, context):
        message = worker_pb2.WorkerStats(model_name=self.model_name, max_model_len=self.max_model_len,
                                         ready=self.ready, eos_token_id=self.eos_token_id)
        if self.startup is not None and self.engine is None:
            progress = self.startup.snapshot()
            message.startup.phase, message.startup.percent = progress["phase"], progress["percent"]
            message.startup.elapsed_s = progress["elapsed_s"]
            if progress["eta_s"] is not None:
                message.startup.eta_s = progress["eta_s"]
        if self.telemetry is not None:
            self.telemetry.fill_stats(message)
        return message

    def abort_all(self) -> int:
        """Abort every running request (drain timeout): each stream ends with 'abort'."""
        for request_id in list(self.running):
            self.engine.abort(request_id)
        return len(self.running)


def _finish(message: worker_pb2.GenerateResponse, out, num_prompt_tokens: int, record) -> None:
    """The last message of a request: reason, usage, bits."""
    message.finished = True
    message.finish_reason = out.finish_reason or "stop"
    message.usage.prompt_tokens = num_prompt_tokens
    message.usage.completion_tokens = record.num_tokens
    message.mean_expert_bits = record.mean_bits
    if out.stop_reason is not None:
        message.stop_reason = out.stop_reason
