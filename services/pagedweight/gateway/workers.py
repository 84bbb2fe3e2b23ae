"""The gateway's view of its workers: gRPC clients, readiness and load.

A background task polls every worker's GetStats; a worker is ready while that answers
with `ready` set. A worker whose call fails is taken out at once (not at the next poll)
and comes back when a poll succeeds again.

Requests go to a worker over one long-lived `GenerateStream` per worker (`WorkerStream`):
the worker sends one message per engine step with every request's new tokens, and one
reader task here hands each output to its request's handler as a plain call. A broken
stream fails the requests it carried (each handler decides whether to retry) and the next
request opens a new one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from pagedweight.common.rpc_security import RpcSecurity
from pagedweight.gateway.routing import WorkerLoad, pick_worker
from pagedweight.rpc import worker_pb2, worker_pb2_grpc

log = logging.getLogger("pagedweight.gateway.workers")
_CODES = {code.value[0]: code for code in grpc.StatusCode}  # status number -> StatusCode
_END = object()  # queued when a call is over: its request iterator returns


class WorkerStream:
    """One GenerateStream call to a worker, shared by every request routed to it.

    A handler has `on_output(GenerateResponse)` and `on_error(code, details)`; both are
    called from the reader task, once per output, and must not block."""

    def __init__(self, address: str, stub: worker_pb2_grpc.WorkerStub, metadata: tuple = ()):
        self.address, self.stub = address, stub
        self.metadata = metadata  # the RPC token, sent with the call
        self.handlers: dict[str, object] = {}  # worker request id -> handler, while it runs
        self._outbox: list[worker_pb2.StreamRequest] = []
        self._wake = asyncio.Event()
        self._call = None
        self._reader: asyncio.Task | None = None

    def submit(self, request: worker_pb2.GenerateRequest, handler) -> None:
        self.handlers[request.request_id] = handler
        self._send(worker_pb2.StreamRequest(generate=request))

    def abort(self, request_id: str) -> None:
        """Stop a request that is still running (its handler hears nothing more)."""
        if self.handlers.pop(request_id, None) is not None and self._call is not None:
            self._send(worker_pb2.StreamRequest(abort=worker_pb2.AbortRequest(request_id=request_id)))

    def _send(self, message: worker_pb2.StreamRequest) -> None:
        if self._call is None:
            self._outbox, self._wake = [], asyncio.Event()
            self._call = self.stub.GenerateStream(self._requests(self._outbox, self._wake),
                                                  metadata=self.metadata)
            self._reader = asyncio.get_running_loop().create_task(self._read(self._call, self._outbox, self._wake))
        self._outbox.append(message)
        self._wake.set()

    @staticmethod
    async def _requests(outbox: list, wake: asyncio.Event):
        """The client side of the call: whatever was queued since the last wake-up, until
        _END. gRPC drains this iterator in a task of its own that nothing cancels once the
        call has failed: ending the iterator lets that task finish, where one left waiting
        here would be destroyed pending, this generator closed while it runs."""
        while True:
            await wake.wait()
            wake.clear()
            items = outbox[:]
            del outbox[:]
            for item in items:
                if item is _END:
                    return
                yield item

    async def _read(self, call, outbox: list, wake: asyncio.Event) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, f"worker {self.address} closed the stream"
        try:
            async for message in call:
                handlers = self.handlers
                for out in message.outputs:
                    handler = handlers.pop(out.request_id, None) if out.finished else handlers.get(out.request_id)
                    if handler is not None:
                        handler.on_output(out)
                for err in message.errors:
                    handler = handlers.pop(err.request_id, None)
                    if handler is not None:
                        handler.on_error(_CODES.get(err.code, grpc.StatusCode.UNKNOWN), err.message)
        except grpc.aio.AioRpcError as err:
            code, details = err.code(), err.details() or err.code().name
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "the gateway is stopping"
            raise
        finally:  # this call is over: its requests fail, the next request opens a new one
            outbox.append(_END)
            wake.set()
            if self._call is call:
                self._call = None
            failed, self.handlers = self.handlers, {}
            for handler in failed.values():
                handler.on_error(code, details)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


@dataclass
class WorkerState:
    address: str
    stub: worker_pb2_grpc.WorkerStub
    channel: grpc.aio.Channel
    ready: bool = False
    stats: worker_pb2.WorkerStats | None = None
    num_sent_since_poll: int = 0  # requests routed here since the last stats arrived
    stream: WorkerStream | None = None  # the shared GenerateStream, opened on first use

    def load(self) -> WorkerLoad:
        load = self.stats.load if self.stats is not None else None
        queued = (load.num_running + load.num_waiting) if load is not None else 0
        usage = load.kv_cache_usage_perc if load is not None else 0.0
        return WorkerLoad(queued + self.num_sent_since_poll, usage)


class WorkerPool:
    def __init__(self, addresses: tuple[str, ...], poll_interval_s: float, security: RpcSecurity | None = None):
        self.poll_interval_s = poll_interval_s
        self.security = security or RpcSecurity()
        self.metadata = self.security.metadata()  # the RPC token every call carries
        self.workers: dict[str, WorkerState] = {}  # address -> state
        for address in addresses:
            channel = self.security.channel(address)
            self.workers[address] = WorkerState(address, worker_pb2_grpc.WorkerStub(channel), channel)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.poll()
        self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for worker in self.workers.values():
            if worker.stream is not None:
                await worker.stream.close()
            await worker.channel.close()

    # ---- routing ------------------------------------------------------------------------
    def ready(self) -> list[str]:
        return [a for a, w in self.workers.items() if w.ready]

    def pick(self, session_id: str | None, affinity: str | None, exclude: tuple[str, ...] = ()) -> str | None:
        loads = {a: w.load() for a, w in self.workers.items() if w.ready and a not in exclude}
        address = pick_worker(loads, session_id, affinity)
        if address is not None:
            self.workers[address].num_sent_since_poll += 1
        return address

    def mark_failed(self, address: str, err: Exception) -> None:
        worker = self.workers[address]
        if worker.ready:
            log.warning("worker %s failed (%s); routing around it until it answers again", address, err)
        worker.ready = False

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        return self.workers[address].stub

    def stream(self, address: str) -> WorkerStream:
        worker = self.workers[address]
        if worker.stream is None:
            worker.stream = WorkerStream(address, worker.stub, self.metadata)
        return worker.stream

    # ---- polling ------------------------------------------------------------------------
    async def poll(self) -> None:
        await asyncio.gather(*(self._poll_one(w) for w in self.workers.values()))

    async def _poll_one(self, worker: WorkerState) -> None:
        timeout = max(self.poll_interval_s * 2, 1.0)
        try:
            stats = await worker.stub.GetStats(worker_pb2.GetStatsRequest(), timeout=timeout,
                                               metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            if worker.ready:
                log.warning("worker %s does not answer GetStats (%s); not ready", worker.address, err.code().name)
            worker.ready, worker.stats = False, None  # its last stats no longer describe it
            return
        if stats.ready != worker.ready:
            log.info("worker %s is %s", worker.address, "ready" if stats.ready else "not ready")
        worker.stats, worker.ready, worker.num_sent_since_poll = stats, stats.ready, 0

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll()
            except Exception:  # a bug here must not stop routing updates for good
                log.exception("polling the workers failed")
