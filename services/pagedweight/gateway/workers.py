"""The gateway's view of its workers: gRPC clients, readiness and load.

A background task polls every worker's GetStats; a worker is ready while that answers
with `ready` set. A worker whose call fails is taken out at once (not at the next poll)
and comes back when a poll succeeds again.
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


@dataclass
class WorkerState:
    address: str
    stub: worker_pb2_grpc.WorkerStub
    channel: grpc.aio.Channel
    ready: bool = False
    stats: worker_pb2.WorkerStats | None = None
    num_sent_since_poll: int = 0  # requests routed here since the last stats arrived

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
            worker.ready = False
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
