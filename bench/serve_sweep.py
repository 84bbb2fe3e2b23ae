"""`bench/serve_load.py --mode sweep`: in-process, worker gRPC and gateway HTTP side by side, and
the clients and cluster both of serve_load's modes use.

At each concurrency the same closed loop (`closed_loop`: `concurrency` requests kept in flight
for `--duration` seconds; a request that finishes starts the next, those running at the
deadline finish and count) runs against each layer: first the engine in this process, which is
then closed (its device memory freed), then planner + worker + gateway started here with the
same flags. Prompts are windows of real text tokenised by the model's tokenizer; every request
ignores EOS, so it generates exactly its drawn output length. A short warm-up precedes each
layer. Targets: gateway >= 0.9x and worker >= 0.95x in-process output tok/s.

The clients, each returning a `RequestTiming` per request (TTFT and inter-token gaps as the
client sees them: an SSE event or a stream message with tokens is one arrival):
- in-process: `AsyncEngine.add_request` in this process;
- worker gRPC: requests multiplexed on one `GenerateStream` (as the gateway talks to it);
- gateway HTTP: `POST /v1/completions` streamed, one connection per request, read with
  asyncio streams (no HTTP library: at c256 a client library's per-event cost would
  measure the client, not the gateway).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.bench_meta import RESULTS_DIR, write_result

TEXT = Path(__file__).resolve().parents[1] / "data" / "sample.txt"


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


def lengths(text: str) -> tuple[int, int]:
    """LO:HI -> (LO, HI)."""
    lo, hi = (int(x) for x in text.split(":"))
    return lo, hi


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
class Arrivals:
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

        arrivals, reason = Arrivals(time.monotonic()), ""
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
        self.pending: dict[str, tuple[Arrivals, asyncio.Future]] = {}
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
        self.pending[request_id] = (Arrivals(time.monotonic()), done)
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
        arrivals = Arrivals(time.monotonic())
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
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def real_text_requests(model_dir: str, num: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                       seed: int) -> list[TraceRequest]:
    from pagedweight.format.model_config import ModelConfig
    from pagedweight.frontend.tokenizer import Tokenizer

    vocab = ModelConfig.from_dir(Path(model_dir)).vocab_size
    ids = [t for t in Tokenizer(model_dir).encode(TEXT.read_text()) if t < vocab]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        n = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        start = int(rng.integers(0, max(1, len(ids) - n)))
        prompt = (ids[start:start + n] * (n // max(1, len(ids)) + 1))[:n]
        out.append(TraceRequest(0.0, prompt, int(rng.integers(output_len[0], output_len[1] + 1))))
    return out


def point(timings, elapsed: float, cpu: dict[str, float] | None = None) -> dict:
    result = summarize(timings, elapsed)
    if cpu:
        result["cpu_percent"] = {name: round(100 * seconds / elapsed, 1) for name, seconds in cpu.items()}
    return result


async def warm(client, requests: list[TraceRequest]) -> None:
    await asyncio.gather(*(client.send(TraceRequest(0.0, r.prompt_ids, 4)) for r in requests[:4]))


def run_in_process(args, levels: list[int], requests: list[TraceRequest]) -> dict[int, dict]:
    import torch

    from pagedweight.engine.async_engine import AsyncEngine
    from pagedweight.worker.server import load_runtime

    runtime = load_runtime(worker_config(args))

    async def main():
        engine = AsyncEngine(runtime.engine)
        client = InProcessClient(engine)
        await warm(client, requests)
        out = {}
        for c in levels:
            timings, elapsed = await closed_loop(c, args.duration, requests, client.send)
            out[c] = point(timings, elapsed)
            print(f"c{c} in-process   {out[c]['output_tokens_per_s']:9.1f} tok/s", flush=True)
        await engine.close()
        return out

    try:
        return asyncio.run(main())
    finally:
        runtime.close()
        del runtime
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the worker process needs the device memory next


def run_cluster(args, levels: list[int], requests: list[TraceRequest], layers: set[str]) -> tuple[dict, dict]:
    services, url, _, worker_address = start_cluster(args)
    gateway_pid, worker_pid = services[2].process.pid, services[1].process.pid
    host, port = url.removeprefix("http://").split(":")

    async def measure(client, c: int, pids: dict[str, int]) -> dict:
        before = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
        timings, elapsed = await closed_loop(c, args.duration, requests, client.send)
        return point(timings, elapsed, {n: process_cpu_seconds(p) - before[n] for n, p in pids.items()})

    async def main():
        grpc_client = WorkerStreamClient(worker_address) if "worker_grpc" in layers else None
        http_client = GatewayHttpClient(host, int(port), args.served_model_name)
        if grpc_client is not None:
            await warm(grpc_client, requests)
        await warm(http_client, requests)
        worker_grpc, gateway_http = {}, {}
        for c in levels:
            if grpc_client is not None:
                worker_grpc[c] = await measure(grpc_client, c, {"worker": worker_pid})
                print(f"c{c} worker gRPC  {worker_grpc[c]['output_tokens_per_s']:9.1f} tok/s", flush=True)
            if "gateway_http" in layers:
                gateway_http[c] = await measure(http_client, c, {"gateway": gateway_pid, "worker": worker_pid})
                print(f"c{c} gateway HTTP {gateway_http[c]['output_tokens_per_s']:9.1f} tok/s "
                      f"(gateway CPU {gateway_http[c]['cpu_percent']['gateway']}%)", flush=True)
        if grpc_client is not None:
            await grpc_client.close()
        return worker_grpc, gateway_http

    try:
        return asyncio.run(main())
    finally:
        for service in reversed(services):
            service.stop(30)


def run_sweep(args) -> Path:
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.max_num_seqs is None:
        args.max_num_seqs = max(levels)  # the engine batches every request in flight
    requests = real_text_requests(args.model, max(args.num_prompts, 4 * max(levels)), lengths(args.prompt_len),
                                  lengths(args.output_len), args.seed)
    layers = set(args.layers.split(","))
    unknown = layers - {"in_process", "worker_grpc", "gateway_http"}
    if unknown or not layers:
        raise SystemExit(f"--layers: unknown {sorted(unknown)} (in_process, worker_grpc, gateway_http)")
    started = time.monotonic()
    in_process = run_in_process(args, levels, requests) if "in_process" in layers else {}
    worker_grpc, gateway_http = ({}, {}) if layers == {"in_process"} else run_cluster(args, levels, requests, layers)
    table = []
    for c in levels:
        base = in_process.get(c)
        row = {"concurrency": c}
        for name, runs in (("in_process", in_process), ("worker_grpc", worker_grpc), ("gateway_http", gateway_http)):
            if c not in runs:
                continue
            r = runs[c]
            row[name] = {"output_tok_s": r["output_tokens_per_s"], "ttft_p50_ms": r["ttft_ms"].get("p50"),
                         "itl_p50_ms": r["itl_ms"].get("p50"),
                         "ratio_to_in_process": round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 4)
                         if base else None}
            if "cpu_percent" in r:
                row[name]["cpu_percent"] = r["cpu_percent"]
                row[name]["cpu_ms_per_output_token"] = {
                    n: round(10 * pct * r["elapsed_s"] / max(1, r["output_tokens"]), 4)
                    for n, pct in r["cpu_percent"].items()}
        if c in gateway_http:
            row["gateway_cpu_percent"] = gateway_http[c]["cpu_percent"]["gateway"]
        table.append(row)
    name = f"serve_sweep_{Path(args.model).resolve().name}" + (f"_{args.tag}" if args.tag else "")
    payload = {
        "model": str(args.model), "device": args.device, "dtype": args.dtype, "memory_budget": args.memory_budget,
        "policy": args.policy, "max_num_seqs": args.max_num_seqs, "duration_s": args.duration,
        "layers": sorted(layers),
        "prompt_len": args.prompt_len, "output_len": args.output_len, "seed": args.seed,
        "prompts": "windows of data/sample.txt, the model's tokenizer", "threads": args.threads,
        "targets": {"gateway_http_ratio": 0.9, "worker_grpc_ratio": 0.95},
        "table": table, "in_process": in_process, "worker_grpc": worker_grpc, "gateway_http": gateway_http,
        "wall_s": round(time.monotonic() - started, 1),
    }
    path = write_result(name, payload)
    if args.out:
        Path(args.out).write_text(path.read_text())
        if path.parent == RESULTS_DIR and args.tag is None:
            path.unlink()  # asked for one place: do not also leave it in bench/results
        path = Path(args.out)
    print(format_table(table))
    print(f"wrote {path}")
    return path


def format_table(table: list[dict]) -> str:
    lines = ["| output tok/s (TTFT p50 / ITL p50, ms) | " + " | ".join(f"c{r['concurrency']}" for r in table) + " |",
             "|---|" + "---|" * len(table)]
    for name, label in (("in_process", "in-process `AsyncEngine`"), ("worker_grpc", "worker over gRPC"),
                        ("gateway_http", "gateway over HTTP")):
        if name not in table[0]:
            continue
        cells = []
        for r in table:
            x = r[name]
            ratio = "" if x["ratio_to_in_process"] in (None, 1.0) else f", {x['ratio_to_in_process']:.2f}x"
            cells.append(f"{x['output_tok_s']:.0f}{ratio} ({x['ttft_p50_ms']} / {x['itl_p50_ms']})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if "gateway_cpu_percent" in table[0]:
        lines.append("| gateway CPU % (ms per output token) | " + " | ".join(
            f"{r['gateway_cpu_percent']} ({r['gateway_http']['cpu_ms_per_output_token']['gateway']})"
            for r in table) + " |")
    return "\n".join(lines)
