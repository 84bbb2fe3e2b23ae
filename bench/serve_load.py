"""The serving layers under load, each against the engine in this process: the in-process
`AsyncEngine`, the worker's `GenerateStream` (requests multiplexed on one stream by the gateway's
own client) and the gateway's streamed `POST /v1/completions` (one raw asyncio connection per
request: at c256 a client library's per-event cost would measure the client). Requests ignore
EOS; TTFT and inter-token gaps are the client's (a message with tokens is one arrival, as
`vllm bench serve` counts ITL). `--mode trace` (serve-load) runs Poisson arrivals for `--rounds`
rounds of the three layers, so a busy spell of a shared machine does not land on one side only;
`--mode sweep` (serve-sweep, docs/serving_bench.md) a closed loop per concurrency.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch

from bench.bench_meta import REPO, arg_parser, free_memory, md_header, md_row, write_result
from pagedweight.cluster.processes import Service, ServiceExited, grpc_serving, stop_together, wait_until
from pagedweight.common.rpc_security import RpcSecurity
from pagedweight.engine.async_engine import AsyncEngine
from pagedweight.engine.sampler import SamplingParams
from pagedweight.format.model_config import ModelConfig
from pagedweight.frontend.tokenizer import Tokenizer
from pagedweight.gateway.workers import WorkerStream
from pagedweight.rpc import worker_pb2 as pb
from pagedweight.rpc.worker_pb2_grpc import WorkerStub
from pagedweight.worker.config import WorkerConfig
from pagedweight.worker.server import load_runtime

TEXT = REPO / "data" / "sample.txt"
LAYERS = ("in_process", "worker_grpc", "gateway_http")
MODEL_NAME = "bench"  # the served model name the gateway answers to


@dataclass(frozen=True)
class Request:
    arrival_s: float  # offset from the start of the run (a closed loop ignores it)
    prompt_ids: list[int]
    output_len: int


@dataclass
class Arrivals:
    sent: float = field(default_factory=time.monotonic)
    times: list[float] = field(default_factory=list)  # of each message with tokens: TTFT, then the ITLs
    tokens: int = 0
    reason: str = ""

    def arrived(self, now: float, num_tokens: int) -> None:
        self.times.append(now)
        self.tokens += num_tokens


def percentiles(ms: np.ndarray) -> dict:
    if not len(ms):
        return {}
    return {f"p{p}": round(float(np.percentile(ms, p)), 2) for p in (50, 90, 99)} | {"mean": round(float(ms.mean()), 2)}


def summarize(timings: list[Arrivals], elapsed_s: float, cpu: dict[str, float] | None = None) -> dict:
    tokens = sum(t.tokens for t in timings)
    out = {"completed": len(timings), "finish_reasons": sorted({t.reason for t in timings}),
           "elapsed_s": round(elapsed_s, 3), "requests_per_s": round(len(timings) / elapsed_s, 3),
           "output_tokens": tokens, "output_tokens_per_s": round(tokens / elapsed_s, 2),
           "ttft_ms": percentiles(np.array([t.times[0] - t.sent for t in timings]) * 1000),
           "itl_ms": percentiles(np.concatenate([np.diff(t.times) for t in timings]) * 1000)}
    if cpu:
        out["cpu_percent"] = {name: round(100 * seconds / elapsed_s, 1) for name, seconds in cpu.items()}
    return out


def make_requests(args, num: int, trace: bool) -> list[Request]:
    """Seeded requests: the trace's random ids arrive at --request-rate (0: all at once), the
    sweep's are windows of data/sample.txt."""
    vocab = ModelConfig.from_dir(Path(args.model)).vocab_size
    text = None if trace else [t for t in Tokenizer(args.model).encode(TEXT.read_text()) if t < vocab]
    rng = np.random.default_rng(args.seed)
    (p_lo, p_hi), (o_lo, o_hi) = ([int(x) for x in s.split(":")] for s in (args.prompt_len, args.output_len))
    gaps = rng.exponential(1.0 / args.request_rate, num) if trace and args.request_rate > 0 else np.zeros(num)
    out = []
    for arrival in np.cumsum(gaps):
        n = int(rng.integers(p_lo, p_hi + 1))
        if text is None:
            prompt = rng.integers(1, vocab, size=n).tolist()
        else:
            start = int(rng.integers(0, max(1, len(text) - n)))
            prompt = (text[start:start + n] * (n // max(1, len(text)) + 1))[:n]
        out.append(Request(float(arrival), prompt, int(rng.integers(o_lo, o_hi + 1))))
    return out


async def open_loop(requests: list[Request], max_concurrency: int, send) -> tuple[list, float]:
    start, gate = time.monotonic(), asyncio.Semaphore(max_concurrency)

    async def one(req: Request):
        await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
        async with gate:
            return await send(req)

    timings = await asyncio.gather(*(one(r) for r in requests))
    return list(timings), time.monotonic() - start


async def closed_loop(concurrency: int, duration_s: float, requests: list[Request], send) -> tuple[list, float]:
    start = time.monotonic()
    deadline, timings = start + duration_s, []

    async def user(first: int) -> None:
        i = first
        while time.monotonic() < deadline:
            timings.append(await send(requests[i % len(requests)]))
            i += concurrency

    await asyncio.gather(*(user(u) for u in range(concurrency)))
    return timings, time.monotonic() - start


def in_process_send(engine):
    async def send(request: Request) -> Arrivals:
        arrivals, params = Arrivals(), SamplingParams(max_tokens=request.output_len, ignore_eos=True)
        async for out in engine.add_request(request.prompt_ids, params):
            if out.new_token_ids:
                arrivals.arrived(time.monotonic(), len(out.new_token_ids))
            arrivals.reason = out.finish_reason or arrivals.reason
        return arrivals

    return send


@dataclass
class StreamHandler:
    """One request on the gateway's own GenerateStream client (gateway/workers.py): its
    arrivals, handed over when it finishes."""

    arrivals: Arrivals
    done: asyncio.Future

    def on_output(self, out) -> None:
        if out.token_ids:
            self.arrivals.arrived(time.monotonic(), len(out.token_ids))
        if out.finished:
            self.arrivals.reason = out.finish_reason
            self.done.set_result(self.arrivals)

    def on_error(self, code, details: str) -> None:
        if not self.done.done():  # (an error after the request finished changes nothing)
            self.done.set_exception(RuntimeError(f"worker stream: {code.name} {details}"))


def worker_send(stream):
    """Requests multiplexed on one GenerateStream, as the gateway sends them."""
    ids = itertools.count()

    async def send(request: Request) -> Arrivals:
        handler = StreamHandler(Arrivals(), asyncio.get_running_loop().create_future())
        sampling = pb.SamplingParams(max_tokens=request.output_len, ignore_eos=True)
        stream.submit(pb.GenerateRequest(request_id=f"bench-{next(ids)}", prompt_token_ids=request.prompt_ids,
                                         sampling=sampling), handler)
        return await handler.done

    return send


def gateway_send(port: int):
    async def send(request: Request) -> Arrivals:
        body = json.dumps({"model": MODEL_NAME, "prompt": request.prompt_ids, "max_tokens": request.output_len,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        arrivals = Arrivals()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        try:
            status = await reader.readline()
            while (await reader.readline()) not in (b"\r\n", b""):  # the headers
                pass
            if b" 200 " not in status:
                raise RuntimeError(f"HTTP {status.decode().strip()}: {(await reader.read(300))!r}")
            await read_events(reader, arrivals)
        finally:
            writer.close()
        return arrivals

    return send


async def read_events(reader, arrivals: Arrivals) -> None:
    """One completion's SSE stream, in HTTP/1.1 chunks (uvicorn streams a body of no length so):
    every event with a choice carries new tokens."""
    buffer, tokens = b"", 0
    while size := int((await reader.readline()).strip() or b"0", 16):
        data = (await reader.readexactly(size + 2))[:-2]
        now = time.monotonic()
        *events, buffer = (buffer + data).split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            chunk = json.loads(event[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk["choices"]:
                arrivals.arrived(now, 0)
                arrivals.reason = choice.get("finish_reason") or arrivals.reason
            tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
    arrivals.tokens = tokens


def start_cluster(args, attempts: int = 3):
    """planner + worker + gateway on free ports: (services, gateway port, worker address).

    A port found free can be taken by another process before our service binds it; that service
    then exits with a taken-port error, and the cluster starts again on fresh ports. A service
    that is still starting when its wait times out is not retried (another wait would not help)."""
    for attempt in range(1, attempts + 1):
        try:
            return _start_cluster_once(args)
        except ServiceExited as err:
            if attempt == attempts:
                raise
            print(f"cluster start failed ({err}); again on fresh ports", flush=True)


def _start_cluster_once(args):
    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def serves_our_model(url: str) -> bool:
        """The gateway's model list names ours: a /health answer alone could come from another
        process's server that took the port first."""
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return any(m.get("id") == MODEL_NAME for m in json.load(response).get("data", []))
        except (OSError, ValueError, AttributeError):
            return False

    p, ph, w, wh, g = (free_port() for _ in range(5))
    seqs = [] if args.max_num_seqs is None else ["--max-num-seqs", str(args.max_num_seqs)]
    services = [
        Service("planner", ["planner", "--port", str(p), "--http-port", str(ph)]),
        Service("worker", ["worker", "--model", args.model, "--port", str(w), "--http-port", str(wh),
                           "--memory-budget", args.memory_budget, "--threads", str(args.threads),
                           "--planner", f"127.0.0.1:{p}", "--served-model-name", MODEL_NAME,
                           "--device", args.device, *seqs]),
        Service("gateway", ["gateway", "--model", args.model, "--port", str(g), "--workers", f"127.0.0.1:{w}",
                            "--served-model-name", MODEL_NAME, "--max-queued-requests", "4096",
                            "--log-level", "warning"]),
    ]
    checks = [lambda: grpc_serving(f"127.0.0.1:{p}"), lambda: grpc_serving(f"127.0.0.1:{w}", "pagedweight.v1.Worker"),
              lambda: serves_our_model(f"http://127.0.0.1:{g}/v1/models")]
    try:
        for service, ready in zip(services, checks):
            service.start()
            wait_until(ready, service, 300)
    except BaseException:
        stop_together(services, 10)
        raise
    return services, g, f"127.0.0.1:{w}"


def process_cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def warm(send, requests: list[Request]) -> None:
    await asyncio.gather(*(send(Request(0.0, r.prompt_ids, 4)) for r in requests[:4]))


def run_in_process(args, loads: dict, requests: list[Request]) -> dict:
    """Each load (name -> async run(send)) on the engine in this process."""
    torch.set_num_threads(args.threads)
    extra = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    runtime = load_runtime(WorkerConfig(model_dir=args.model, memory_budget=args.memory_budget,
                                        threads=args.threads, device=args.device, **extra))

    async def main():
        engine = AsyncEngine(runtime.engine)
        send, out = in_process_send(engine), {}
        await warm(send, requests)
        for name, load in loads.items():
            out[name] = summarize(*await load(send))
            print(f"{name} in-process   {out[name]['output_tokens_per_s']:9.1f} tok/s", flush=True)
        await engine.close()
        return out

    try:
        return asyncio.run(main())
    finally:
        runtime.close()
        del runtime
        free_memory(torch.device(args.device))  # the worker process needs the device memory next


def run_cluster(args, loads: dict, requests: list[Request], layers: set[str]) -> tuple[dict, dict]:
    """Each load against the worker's gRPC and the gateway's HTTP, with their processes' CPU."""
    services, port, worker_address = start_cluster(args)
    pids = {"gateway": services[2].process.pid, "worker": services[1].process.pid}

    async def measure(load, send, names: tuple[str, ...]) -> dict:
        before = {n: process_cpu_seconds(pids[n]) for n in names}
        timings, elapsed = await load(send)
        return summarize(timings, elapsed, {n: process_cpu_seconds(pids[n]) - before[n] for n in names})

    async def main():
        # the RPC token, when $PAGEDWEIGHT_RPC_TOKEN gives the workers one
        channel = grpc.aio.insecure_channel(worker_address)
        stream = WorkerStream(worker_address, WorkerStub(channel), RpcSecurity.from_settings().metadata())
        grpc_send = worker_send(stream) if "worker_grpc" in layers else None
        http_send = gateway_send(port)
        for send in filter(None, (grpc_send, http_send)):
            await warm(send, requests)
        worker, gateway = {}, {}
        for name, load in loads.items():
            if grpc_send is not None:
                worker[name] = await measure(load, grpc_send, ("worker",))
                print(f"{name} worker gRPC  {worker[name]['output_tokens_per_s']:9.1f} tok/s", flush=True)
            if "gateway_http" in layers:
                gateway[name] = await measure(load, http_send, ("gateway", "worker"))
                print(f"{name} gateway HTTP {gateway[name]['output_tokens_per_s']:9.1f} tok/s "
                      f"(gateway CPU {gateway[name]['cpu_percent']['gateway']}%)", flush=True)
        await stream.close()
        await channel.close()
        return worker, gateway

    try:
        return asyncio.run(main())
    finally:
        for service in reversed(services):
            service.stop(30)


def run_layers(args, loads: dict, requests: list[Request], layers: set[str]) -> dict[str, dict]:
    in_process = run_in_process(args, loads, requests) if "in_process" in layers else {}
    worker, gateway = ({}, {}) if layers == {"in_process"} else run_cluster(args, loads, requests, layers)
    return {"in_process": in_process, "worker_grpc": worker, "gateway_http": gateway}


def run_trace(args) -> Path:
    trace = make_requests(args, args.num_prompts, trace=True)
    load = {"trace": lambda send: open_loop(trace, args.max_concurrency, send)}
    rounds = [run_layers(args, load, trace, set(LAYERS)) for _ in range(args.rounds)]
    mean = {layer: round(float(np.mean([r[layer]["trace"]["output_tokens_per_s"] for r in rounds])), 2)
            for layer in LAYERS}
    overhead = 1.0 - mean["gateway_http"] / mean["in_process"]
    path = write_result(f"serve_load_{Path(args.model).resolve().name}", {
        "model": str(args.model), "memory_budget": args.memory_budget,
        "trace": {"num_prompts": args.num_prompts, "request_rate": args.request_rate,
                  "max_concurrency": args.max_concurrency, "prompt_len": args.prompt_len,
                  "output_len": args.output_len, "seed": args.seed,
                  "distribution": "uniform lengths, Poisson arrivals"},
        "threads": args.threads, "rounds": args.rounds, "load_average_after": list(os.getloadavg()),
        "in_process_output_tok_s_mean": mean["in_process"], "worker_grpc_output_tok_s_mean": mean["worker_grpc"],
        "cluster_output_tok_s_mean": mean["gateway_http"],
        "overhead_worker_grpc_only": round(1.0 - mean["worker_grpc"] / mean["in_process"], 4),
        "overhead_output_tok_s": round(overhead, 4), "target_overhead": 0.10,
        **{layer: [r[layer]["trace"] for r in rounds] for layer in LAYERS}})
    print(f"overhead {overhead:.1%} (target < 10%); wrote {path}")
    return path


def run_sweep(args) -> Path:
    levels = [int(c) for c in args.concurrency.split(",")]
    args.max_num_seqs = max(levels)  # the engine batches every request in flight
    requests = make_requests(args, max(args.num_prompts, 4 * max(levels)), trace=False)
    loads = {c: (lambda send, c=c: closed_loop(c, args.duration, requests, send)) for c in levels}
    started = time.monotonic()
    runs = run_layers(args, loads, requests, set(args.layers))
    table = [sweep_row(c, runs) for c in levels]
    path = write_result(f"serve_sweep_{Path(args.model).resolve().name}", {
        "model": str(args.model), "device": args.device, "memory_budget": args.memory_budget,
        "max_num_seqs": args.max_num_seqs, "duration_s": args.duration, "layers": sorted(set(args.layers)),
        "prompt_len": args.prompt_len, "output_len": args.output_len, "seed": args.seed,
        "prompts": "windows of data/sample.txt, the model's tokenizer", "threads": args.threads,
        "targets": {"gateway_http_ratio": 0.9, "worker_grpc_ratio": 0.95}, "table": table, **runs,
        "wall_s": round(time.monotonic() - started, 1)}, Path(args.out) if args.out else None)
    print(format_table(table))
    print(f"wrote {path}")
    return path


def sweep_row(c: int, runs: dict) -> dict:
    """One concurrency: each layer's tok/s, TTFT and ITL p50, ratio to in-process, CPU."""
    base, row = runs["in_process"].get(c), {"concurrency": c}
    for layer in (x for x in LAYERS if c in runs[x]):
        r = runs[layer][c]
        row[layer] = {"output_tok_s": r["output_tokens_per_s"], "ttft_p50_ms": r["ttft_ms"].get("p50"),
                      "itl_p50_ms": r["itl_ms"].get("p50"), "ratio_to_in_process":
                      round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 4) if base else None}
        if "cpu_percent" in r:
            row[layer]["cpu_percent"] = r["cpu_percent"]
            row[layer]["cpu_ms_per_output_token"] = {n: round(10 * pct * r["elapsed_s"] / max(1, r["output_tokens"]), 4)
                                                     for n, pct in r["cpu_percent"].items()}
    if c in runs["gateway_http"]:
        row["gateway_cpu_percent"] = runs["gateway_http"][c]["cpu_percent"]["gateway"]
    return row


def format_table(table: list[dict]) -> str:
    lines = md_header("output tok/s (TTFT p50 / ITL p50, ms)", *(f"c{r['concurrency']}" for r in table))
    labels = {"in_process": "in-process `AsyncEngine`", "worker_grpc": "worker over gRPC",
              "gateway_http": "gateway over HTTP"}
    for layer in (x for x in LAYERS if x in table[0]):
        cells = []
        for x in (r[layer] for r in table):
            ratio = "" if x["ratio_to_in_process"] in (None, 1.0) else f", {x['ratio_to_in_process']:.2f}x"
            cells.append(f"{x['output_tok_s']:.0f}{ratio} ({x['ttft_p50_ms']} / {x['itl_p50_ms']})")
        lines.append(md_row(labels[layer], *cells))
    if "gateway_cpu_percent" in table[0]:
        lines.append(md_row("gateway CPU % (ms per output token)", *(
            f"{r['gateway_cpu_percent']} ({r['gateway_http']['cpu_ms_per_output_token']['gateway']})" for r in table)))
    return "\n".join(lines)


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--model", required=True, help="paged model directory")
    parser.add_argument("--mode", choices=("trace", "sweep"), default="trace")
    parser.add_argument("--memory-budget", default="32MiB")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (in process and the worker)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (worker and in-process)")
    parser.add_argument("--prompt-len", default="32:128", help="LO:HI tokens, uniform")
    parser.add_argument("--output-len", default="16:64", help="LO:HI tokens, uniform")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=64, help="trace: its requests (sweep: prompts at least)")
    parser.add_argument("--request-rate", type=float, default=8.0,
                        help="trace: Poisson arrivals per second (0: all at once, so --max-concurrency is the limit)")
    parser.add_argument("--max-concurrency", type=int, default=16, help="trace: requests in flight at most")
    parser.add_argument("--rounds", type=int, default=2, help="trace: rounds of the three layers")
    parser.add_argument("--concurrency", default="16,64,256", help="sweep: requests in flight per point")
    parser.add_argument("--duration", type=float, default=30.0, help="sweep: seconds per point and layer")
    parser.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS),
                        help="sweep: the layers to run (gateway_http alone runs a cluster without GenerateStream)")
    parser.add_argument("--out", default=None, help="sweep: write the result here instead")
    args = parser.parse_args()
    args.max_num_seqs = None  # the engine's batch limit: the worker's (the sweep sets its largest concurrency)
    (run_sweep if args.mode == "sweep" else run_trace)(args)


if __name__ == "__main__":
    main()
