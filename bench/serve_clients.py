"""Load clients of bench/serve_load.py and its sweep (bench/serve_sweep.py): the requests,
the cluster they run against, and the same closed loop against three layers.

- in-process: `AsyncEngine.add_request` in this process;
- worker gRPC: one `GenerateStream` to the worker (as the gateway talks to it);
- gateway HTTP: `POST /v1/completions` streamed, one connection per request, read with
  asyncio streams (no HTTP library: at c256 a client library's per-event cost would
  measure the client, not the gateway).

Each returns a `RequestTiming` per request: TTFT and inter-token gaps as the client sees
them (an SSE event or a stream message with tokens is one arrival), tokens, finish reason.
`closed_loop` keeps `concurrency` requests in flight for `duration_s` (a request that
finishes starts the next; those running at the deadline finish and count).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestTiming:
    ttft_s: float
    itl_s: list[float]
    output_tokens: int
    finish_reason: str


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # offset from the start of the run
    prompt_ids: list[int]
    output_len: int


def summarize(timings: list[RequestTiming], elapsed_s: float) -> dict:
    ttft = np.array([t.ttft_s for t in timings]) * 1000
    itl = np.array([x for t in timings for x in t.itl_s]) * 1000
    tokens = sum(t.output_tokens for t in timings)

    def pct(a):
        return {f"p{p}": round(float(np.percentile(a, p)), 2) for p in (50, 90, 99)} | {
            "mean": round(float(a.mean()), 2)} if len(a) else {}

    return {"completed": len(timings), "finish_reasons": sorted({t.finish_reason for t in timings}),
            "elapsed_s": round(elapsed_s, 3), "requests_per_s": round(len(timings) / elapsed_s, 3),
            "output_tokens": tokens, "output_tokens_per_s": round(tokens / elapsed_s, 2),
            "ttft_ms": pct(ttft), "itl_ms": pct(itl)}


def worker_config(args):
    from pagedweight.worker.config import WorkerConfig

    extra = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    return WorkerConfig(model_dir=args.model, memory_budget=args.memory_budget, policy=args.policy,
                        threads=args.threads, device=args.device, dtype=args.dtype, **extra)


def worker_flags(args) -> list[str]:
    """The flags that make the worker process run what worker_config(args) runs in process."""
    flags = ["--device", args.device]
    if args.dtype:
        flags += ["--dtype", args.dtype]
    if args.max_num_seqs is not None:
        flags += ["--max-num-seqs", str(args.max_num_seqs)]
    return flags


def start_cluster(args):
    """planner + worker + gateway on free ports; returns (services, url, worker metrics port)."""
    import socket

    from pagedweight.cluster.processes import Service, grpc_serving, http_ok, wait_until

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    p, ph, w, wh, g = (free_port() for _ in range(5))
    services = [
        Service("planner", ["planner", "--port", str(p), "--http-port", str(ph)]),
        Service("worker", ["worker", "--model", args.model, "--port", str(w), "--http-port", str(wh),
                           "--memory-budget", args.memory_budget, "--policy", args.policy,
                           "--threads", str(args.threads), "--planner", f"127.0.0.1:{p}",
                           "--served-model-name", args.served_model_name, *worker_flags(args)]),
        Service("gateway", ["gateway", "--model", args.model, "--port", str(g), "--workers", f"127.0.0.1:{w}",
                            "--served-model-name", args.served_model_name, "--max-queued-requests", "4096",
                            "--log-level", "warning"]),
    ]
    checks = [lambda: grpc_serving(f"127.0.0.1:{p}"),
              lambda: grpc_serving(f"127.0.0.1:{w}", "pagedweight.v1.Worker"),
              lambda: http_ok(f"http://127.0.0.1:{g}/health")]
    for service, ready in zip(services, checks):
        service.start()
        wait_until(ready, service, 300)
    return services, f"http://127.0.0.1:{g}", wh, f"127.0.0.1:{w}"


@dataclass
class _Arrivals:
    """A request's arrivals so far (filled by a reader, not by the request's own task)."""

    sent: float
    last: float | None = None
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0

    def arrived(self, now: float, num_tokens: int) -> None:
        if self.last is None:
            self.ttft_s = now - self.sent
        else:
            self.itl_s.append(now - self.last)
        self.last = now
        self.tokens += num_tokens

    def timing(self, reason: str) -> RequestTiming:
        return RequestTiming(self.ttft_s, self.itl_s, self.tokens, reason)


async def closed_loop(concurrency: int, duration_s: float, requests: list, send) -> tuple[list, float]:
    """`send(request) -> RequestTiming` from `concurrency` users until duration_s has passed;
    returns (timings, elapsed seconds until the last one finished)."""
    start = time.monotonic()
    deadline = start + duration_s
    timings: list[RequestTiming] = []

    async def user(first: int) -> None:
        i = first
        while time.monotonic() < deadline:
            timings.append(await send(requests[i % len(requests)]))
            i += concurrency

    await asyncio.gather(*(user(u) for u in range(concurrency)))
    return timings, time.monotonic() - start


class InProcessClient:
    def __init__(self, engine):
        self.engine = engine

    async def send(self, request) -> RequestTiming:
        from pagedweight.engine.sampler import SamplingParams

        arrivals, reason = _Arrivals(time.monotonic()), ""
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
        async for out in self.engine.add_request(request.prompt_ids, params):
            if out.new_token_ids:
                arrivals.arrived(time.monotonic(), len(out.new_token_ids))
            reason = out.finish_reason or reason
        return arrivals.timing(reason)


class WorkerStreamClient:
    """Requests multiplexed on one GenerateStream; its reader records every arrival."""

    def __init__(self, address: str):
        import grpc

        from pagedweight.common.rpc_security import RpcSecurity
        from pagedweight.rpc import worker_pb2, worker_pb2_grpc

        self.pb = worker_pb2
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.pending: dict[str, tuple[_Arrivals, asyncio.Future]] = {}
        self.outbox: list = []
        self.wake = asyncio.Event()
        self.ids = 0
        # the RPC token, when $PAGEDWEIGHT_RPC_TOKEN gives the workers one
        self.call = self.stub.GenerateStream(self._requests(), metadata=RpcSecurity.from_settings().metadata())
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self):
        while True:
            await self.wake.wait()
            self.wake.clear()
            items, self.outbox = self.outbox, []
            for item in items:
                yield item

    async def _read(self) -> None:
        async for message in self.call:
            now = time.monotonic()
            for out in message.outputs:
                arrivals, done = self.pending[out.request_id]
                if out.token_ids:
                    arrivals.arrived(now, len(out.token_ids))
                if out.finished:
                    del self.pending[out.request_id]
                    done.set_result(arrivals.timing(out.finish_reason))
            for err in message.errors:
                _, done = self.pending.pop(err.request_id)
                done.set_exception(RuntimeError(f"worker refused {err.request_id}: {err.code} {err.message}"))

    async def send(self, request) -> RequestTiming:
        self.ids += 1
        request_id = f"bench-{self.ids}"
        done = asyncio.get_running_loop().create_future()
        self.pending[request_id] = (_Arrivals(time.monotonic()), done)
        self.outbox.append(self.pb.StreamRequest(generate=self.pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=request.prompt_ids,
            sampling=self.pb.SamplingParams(max_tokens=request.output_len, ignore_eos=True))))
        self.wake.set()
        return await done

    async def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
        await self.channel.close()


class GatewayHttpClient:
    def __init__(self, host: str, port: int, model: str):
        self.host, self.port, self.model = host, port, model

    async def send(self, request) -> RequestTiming:
        body = json.dumps({"model": self.model, "prompt": request.prompt_ids, "max_tokens": request.output_len,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        arrivals = _Arrivals(time.monotonic())
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        try:
            status = await reader.readline()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                headers[key.strip().lower()] = value.strip().lower()
            if b" 200 " not in status:
                raise RuntimeError(f"HTTP {status.decode().strip()}: {(await reader.read(300))!r}")
            chunked = headers.get("transfer-encoding") == "chunked"
            buffer, reason, tokens = b"", "", 0
            while True:
                if chunked:
                    size = int((await reader.readline()).strip() or b"0", 16)
                    if size == 0:
                        break
                    data = (await reader.readexactly(size + 2))[:-2]
                else:
                    data = await reader.read(65536)
                    if not data:
                        break
                now = time.monotonic()
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    chunk = json.loads(event[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"stream error: {chunk['error']}")
                    for choice in chunk["choices"]:
                        # every chunk with a choice carries new tokens (vllm bench serve's ITL)
                        arrivals.arrived(now, 0)
                        reason = choice.get("finish_reason") or reason
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        finally:
            writer.close()
        arrivals.tokens = tokens
        return arrivals.timing(reason)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    import os

    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
