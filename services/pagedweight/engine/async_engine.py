"""The asyncio API the worker service wraps: add a request, stream its tokens, abort, stats.

One background task drives the engine: it applies the adds and aborts queued since the
last step, runs `Engine.step()` in a worker thread (so the event loop keeps serving) and
hands each request's outputs to its stream. Adds and aborts only ever touch the engine
between steps, from the event loop, so the engine itself needs no locks. A stream whose
consumer stops early (closes the async iterator) aborts its request.

A step that raises kills the engine: its KV blocks, pager and scheduler may be half
updated, so it is never stepped again. `errored` turns true, `dead_error` holds an
`EngineDeadError` (caused by the original exception), every in-flight stream raises it,
and every later `add_request` fails fast with it; `check_health()` raises it for the
service's health endpoint.

Without requests the loop still ticks (an empty step every `idle_tick_s`) while the memory
broker has work (`MemoryBroker.wants_idle_steps`): the pager's raises wait for calm step
boundaries, so without ticks the bits lowered under a load would never come back between
loads. Once the weights have taken what they can, the loop sleeps until the next request.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import AsyncIterator

from pagedweight.common.errors import EngineDeadError, UserError
from pagedweight.engine.engine import Engine, EngineStats, RequestOutput
from pagedweight.engine.sampler import SamplingParams


class AsyncEngine:
    def __init__(self, engine: Engine, idle_tick_s: float = 0.05):
        if not idle_tick_s > 0:
            raise UserError(f"idle_tick_s must be > 0, got {idle_tick_s}")
        self.engine = engine
        self.idle_tick_s = idle_tick_s  # idle steps while the weights still move (module doc)
        self.num_idle_ticks = 0
        self._streams: dict[str, asyncio.Queue] = {}  # request_id -> outputs (or an error); or a sink
        self._adds: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stats = engine.stats()  # refreshed after every step, in the step's thread
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None

    # ---- health ---------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead

    # ---- the API --------------------------------------------------------------------
    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, sink=None
    ) -> AsyncIterator[RequestOutput] | None:
        """Queue a request; iterate the result to receive its outputs as they come.

        With `sink` (anything with `put_nowait(item)`, e.g. one shared by many requests of
        a connection) the outputs go there instead, as they are made, and None is returned:
        an item is a RequestOutput, or the EngineDeadError that ends every request. Aborting
        a request of a sink is the caller's job (`abort`)."""
        if self._dead is not None:
            raise self._dead
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise UserError(f"request id {request_id!r} is already in use")
        self.engine.check_request(prompt_ids, params)  # bad input fails here, not later
        queue = sink if sink is not None else asyncio.Queue()
        self._streams[request_id] = queue
        self._adds.append((request_id, list(prompt_ids), params))
        self._ensure_running()
        return self._stream(request_id, queue) if sink is None else None

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason 'abort'."""
        if request_id in self._streams and self._dead is None:
            self._aborts.append(request_id)
            self._ensure_running()

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step."""
        return self._stats

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # ---- the driver -----------------------------------------------------------------
    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing to abort: the engine is dead
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)  # the consumer went away

    def _ensure_running(self) -> None:
        if self._dead is not None:
            return  # a dead engine is never restarted
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._wake.set()

    async def _loop(self) -> None:
        try:
            while True:
                self._apply_queued()
                if not self.engine.has_work:
                    self._wake.clear()
                    if not self.engine.broker.wants_idle_steps():
                        await self._wake.wait()
                    elif not await self._woken_within(self.idle_tick_s):
                        await asyncio.to_thread(self._step)  # an idle tick: no request to serve
                        self.num_idle_ticks += 1
                    continue
                outputs = await asyncio.to_thread(self._step)
                for out in outputs:
                    self._deliver(out)
        except Exception as err:  # a bug: the engine's state is suspect from here on
            self._die(err)

    async def _woken_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
            return True
        except asyncio.TimeoutError:
            return False

    def _die(self, err: Exception) -> None:
        dead = EngineDeadError(f"the engine failed a step and stopped: {type(err).__name__}: {err}")
        dead.__cause__ = err
        self._dead = dead
        self._adds.clear()
        self._aborts.clear()
        for queue in self._streams.values():
            queue.put_nowait(dead)
        self._streams.clear()

    def _step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        self._stats = self.engine.stats()
        return outputs

    def _apply_queued(self) -> None:
        adds, self._adds = self._adds, []
        for request_id, prompt_ids, params in adds:
            self.engine.add_request(request_id, prompt_ids, params)
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            out = self.engine.abort(request_id)
            if out is not None:
                self._deliver(out)
        if adds or aborts:
            self._stats = self.engine.stats()

    def _deliver(self, out: RequestOutput) -> None:
        queue = self._streams.get(out.request_id)
        if queue is None:
            return
        queue.put_nowait(out)
        if out.finished:
            del self._streams[out.request_id]
