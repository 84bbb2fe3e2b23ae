"""The serving cluster under a Poisson load, against the same trace on the in-process engine.

One trace (seeded): arrivals form a Poisson process of `--request-rate` requests/s, at most
`--max-concurrency` in flight (later arrivals wait, as `vllm bench serve
--max-concurrency` does); prompt and output lengths are drawn uniformly from
`--prompt-len LO:HI` and `--output-len LO:HI` tokens; prompts are random token ids and
EOS is ignored, so every request generates exactly its drawn output length.

1. in-process: the trace against `AsyncEngine` over `build_runtime` (same model, budget,
   policy, scheduler, torch threads as the worker);
2. cluster: the trace over HTTP against the OpenAI-compatible endpoint
   (`POST /v1/completions`, streamed, token-id prompts) of planner + worker + gateway
   processes started here on free ports (or an already running one: `--url`).

3. worker gRPC: the same trace straight against the worker's `Generate` (no gateway), to
   split the overhead between the worker's gRPC layer and the gateway.

Each run reports requests/s, output tokens/s, TTFT and ITL percentiles (client side),
preemptions, and the worker's memory split sampled every `--sample-every` seconds.
`overhead` is 1 - cluster output tok/s / in-process output tok/s, means over `--rounds`
alternating runs (the service layers' cost; target < 0.10 at concurrency 16). Writes bench/results/serve_load_<model>.json.

    python -m bench.serve_load --model PAGED_DIR [--memory-budget 32MiB] [--url http://127.0.0.1:8000]

`--mode sweep` puts the three layers side by side in one run (bench/serve_sweep.py): at
each of `--concurrency 16,64,256` a closed loop keeps that many requests in flight for
`--duration` seconds, first in process (the engine in this process), then, with planner +
worker + gateway started here, straight to the worker's GenerateStream and through the
gateway's HTTP. Prompts are windows of real text (data/sample.txt) tokenised by the
model's tokenizer, so the gateway detokenises real output. The result records each
point's output tok/s, TTFT/ITL percentiles, the ratios to in-process, and the CPU the
gateway and worker processes used; JSON with date, machine (GPU) and commit.

    python -m bench.serve_load --mode sweep --model PAGED_DIR --device cuda --memory-budget 0.85 \
        --concurrency 16,64,256 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.bench_meta import write_result
from bench.serve_sweep import (Arrivals, InProcessClient, RequestTiming, TraceRequest, lengths, run_sweep,
                               start_cluster, summarize, worker_config)


def make_trace(num: int, rate: float, prompt_len: tuple[int, int], output_len: tuple[int, int],
               vocab: int, seed: int) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num)) if rate > 0 else np.zeros(num)
    out = []
    for t in arrivals:
        n = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        out.append(TraceRequest(float(t), rng.integers(1, vocab, size=n).tolist(),
                                int(rng.integers(output_len[0], output_len[1] + 1))))
    return out


class Sampler:
    """Calls `sample()` every `every_s` seconds on a thread; keeps (t, value) pairs."""

    def __init__(self, sample, every_s: float):
        self.sample, self.every_s, self.points = sample, every_s, []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.points.append({"t_s": round(time.monotonic() - self._t0, 2), **self.sample()})
            except OSError:
                pass
            self._stop.wait(self.every_s)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.points


# ---- in-process ---------------------------------------------------------------------------
def run_in_process(args, trace: list[TraceRequest]) -> dict:
    import torch

    from pagedweight.engine.async_engine import AsyncEngine
    from pagedweight.worker.server import load_runtime

    runtime = load_runtime(worker_config(args))
    engine = AsyncEngine(runtime.engine)
    client = InProcessClient(engine)

    def memory():
        pool = engine.stats().pool
        return {"expert_weights": sum(pool["expert_bytes_by_bits"].values()), "kv_used": pool["kv_used_bytes"],
                "kv_free": pool["kv_free_bytes"], "in_transit": pool["transit_bytes"],
                "free": pool["budget_bytes"] - pool["reserved_bytes"]}

    async def one(req: TraceRequest, start: float, gate: asyncio.Semaphore) -> RequestTiming:
        await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
        async with gate:
            return await client.send(req)

    async def main():
        for warm in trace[:2]:  # first steps pay one-off costs
            await one(TraceRequest(0.0, warm.prompt_ids, 4), time.monotonic(), asyncio.Semaphore(1))
        preempt0 = engine.stats().num_preemptions
        sampler = Sampler(memory, args.sample_every)
        gate, start = asyncio.Semaphore(args.max_concurrency), time.monotonic()
        timings = await asyncio.gather(*[one(r, start, gate) for r in trace])
        elapsed = time.monotonic() - start
        result = summarize(timings, elapsed)
        result["preemptions"] = engine.stats().num_preemptions - preempt0
        result["memory_bytes_over_time"] = sampler.stop()
        await engine.close()
        return result

    torch.set_num_threads(args.threads)
    try:
        return asyncio.run(main())
    finally:
        runtime.close()


# ---- cluster over HTTP --------------------------------------------------------------------
def stream_completion(url: str, model: str, req: TraceRequest) -> RequestTiming:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    body = json.dumps({"model": model, "prompt": req.prompt_ids, "max_tokens": req.output_len,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    arrivals = Arrivals(time.monotonic())
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    reason = ""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        now = time.monotonic()
        for choice in chunk.get("choices", []):
            # Every chunk with a choice carries new tokens. The gateway sends no chunk for
            # tokens that decode to no text yet (EOS with ignore_eos, partial characters), so
            # those tokens' latency folds into the next chunk's: client-side ITL as
            # `vllm bench serve` measures it.
            arrivals.arrived(now, 0)
            reason = choice.get("finish_reason") or reason
        if chunk.get("usage"):
            arrivals.tokens = chunk["usage"]["completion_tokens"]
    conn.close()
    return arrivals.timing(reason)


def scrape(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def worker_memory(port: int) -> dict:
    out = {"expert_weights": 0.0}
    for series, value in scrape(port).items():
        if series.startswith("pagedweight:gpu_memory_bytes{"):
            component = series.split('component="', 1)[1].split('"', 1)[0]
            if component == "expert_weights":
                out["expert_weights"] += value
            elif component in ("kv_used", "kv_free", "in_transit", "free"):
                out[component] = value
    return out


def preemptions(port: int) -> float:
    return sum(v for k, v in scrape(port).items() if k.startswith("vllm:num_preemptions_total"))


def run_cluster(args, trace: list[TraceRequest], url: str, model: str, worker_http: int) -> dict:
    for warm in trace[:2]:
        stream_completion(url, model, TraceRequest(0.0, warm.prompt_ids, 4))
    preempt0 = preemptions(worker_http)
    sampler = Sampler(lambda: worker_memory(worker_http), args.sample_every)
    start = time.monotonic()

    def one(req: TraceRequest) -> RequestTiming:
        return stream_completion(url, model, req)

    with ThreadPoolExecutor(args.max_concurrency) as pool:  # at most max_concurrency in flight
        futures = []
        for req in trace:
            time.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
            futures.append(pool.submit(one, req))
        timings = [f.result() for f in futures]
    elapsed = time.monotonic() - start
    result = summarize(timings, elapsed)
    result["preemptions"] = preemptions(worker_http) - preempt0
    result["memory_bytes_over_time"] = sampler.stop()
    return result


def run_worker_grpc(args, trace: list[TraceRequest], address: str) -> dict:
    """The trace straight against the worker's gRPC API: the worker's share of the overhead."""
    import grpc

    from pagedweight.common.rpc_security import RpcSecurity
    from pagedweight.rpc import worker_pb2, worker_pb2_grpc

    async def one(stub, req: TraceRequest, start: float, gate: asyncio.Semaphore) -> RequestTiming:
        await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
        async with gate:
            arrivals, reason = Arrivals(time.monotonic()), ""
            request = worker_pb2.GenerateRequest(prompt_token_ids=req.prompt_ids, sampling=worker_pb2.SamplingParams(
                max_tokens=req.output_len, ignore_eos=True))
            async for m in stub.Generate(request, metadata=metadata):
                if m.token_ids:
                    arrivals.arrived(time.monotonic(), len(m.token_ids))
                reason = m.finish_reason or reason
            return arrivals.timing(reason)

    metadata = RpcSecurity.from_settings().metadata()  # the token of $PAGEDWEIGHT_RPC_TOKEN, if any

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            start, gate = time.monotonic(), asyncio.Semaphore(args.max_concurrency)
            timings = await asyncio.gather(*[one(stub, r, start, gate) for r in trace])
            return summarize(timings, time.monotonic() - start)

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="paged model directory")
    parser.add_argument("--memory-budget", default="32MiB")
    parser.add_argument("--policy", default="pagedweight")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=8.0,
                        help="Poisson arrivals per second (0: all at once, so --max-concurrency is the limit)")
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", default="32:128", help="LO:HI tokens, uniform")
    parser.add_argument("--output-len", default="16:64", help="LO:HI tokens, uniform")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (worker and in-process)")
    parser.add_argument("--sample-every", type=float, default=0.5, help="memory split sampling period, s")
    parser.add_argument("--url", default=None, help="a running gateway (default: start a cluster here)")
    parser.add_argument("--worker-metrics-port", type=int, default=9091, help="with --url: the worker's /metrics")
    parser.add_argument("--served-model-name", default="bench")
    parser.add_argument("--rounds", type=int, default=2, help="alternating in-process / cluster runs")
    parser.add_argument("--tag", default=None, help="suffix of the result file name")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (in process and the worker)")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: the worker's)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the engine's batch limit (default: the worker's; the sweep: the largest concurrency)")
    parser.add_argument("--mode", choices=("trace", "sweep"), default="trace",
                        help="trace: the Poisson trace (rounds); sweep: closed loops at --concurrency, three layers")
    parser.add_argument("--concurrency", default="16,64,256", help="sweep: requests in flight per point")
    parser.add_argument("--duration", type=float, default=30.0, help="sweep: seconds per point and layer")
    parser.add_argument("--layers", default="in_process,worker_grpc,gateway_http",
                        help="sweep: which layers to run (gateway_http alone also runs a cluster without "
                             "GenerateStream, e.g. an older tree on PYTHONPATH, for a before/after)")
    parser.add_argument("--out", default=None, help="result path (default bench/results/serve_<mode>_<model>.json)")
    args = parser.parse_args()
    if args.mode == "sweep":
        run_sweep(args)
        return

    from pagedweight.format.model_config import ModelConfig

    vocab = ModelConfig.from_dir(Path(args.model)).vocab_size
    trace = make_trace(args.num_prompts, args.request_rate, lengths(args.prompt_len), lengths(args.output_len),
                       vocab, args.seed)
    # Rounds alternate in-process and cluster runs, so a busy spell of a shared machine
    # does not land on one side only; the cluster stays up between its rounds.
    in_process, worker, cluster, services = [], [], [], []
    try:
        for round_index in range(args.rounds):
            in_process.append(run_in_process(args, trace))
            print(f"round {round_index}: in-process {in_process[-1]['output_tokens_per_s']} tok/s", flush=True)
            if round_index == 0:
                if args.url:
                    url, worker_http, worker_grpc = args.url, args.worker_metrics_port, None
                else:
                    services, url, worker_http, worker_grpc = start_cluster(args)
            if worker_grpc is not None:
                worker.append(run_worker_grpc(args, trace, worker_grpc))
                print(f"round {round_index}: worker gRPC {worker[-1]['output_tokens_per_s']} tok/s", flush=True)
            cluster.append(run_cluster(args, trace, url, args.served_model_name, worker_http))
            print(f"round {round_index}: cluster    {cluster[-1]['output_tokens_per_s']} tok/s", flush=True)
    finally:
        for service in reversed(services):
            service.stop(30)
    mean = lambda runs: float(np.mean([r["output_tokens_per_s"] for r in runs]))  # noqa: E731
    overhead = 1.0 - mean(cluster) / mean(in_process)
    name = f"serve_load_{Path(args.model).resolve().name}" + (f"_{args.tag}" if args.tag else "")
    path = write_result(name, {
        "model": str(args.model), "memory_budget": args.memory_budget, "policy": args.policy,
        "trace": {"num_prompts": args.num_prompts, "request_rate": args.request_rate,
                  "max_concurrency": args.max_concurrency, "prompt_len": args.prompt_len,
                  "output_len": args.output_len, "seed": args.seed, "distribution": "uniform lengths, Poisson arrivals"},
        "threads": args.threads, "rounds": args.rounds, "load_average_after": list(os.getloadavg()),
        "in_process_output_tok_s_mean": round(mean(in_process), 2), "cluster_output_tok_s_mean": round(mean(cluster), 2),
        "worker_grpc_output_tok_s_mean": round(mean(worker), 2) if worker else None,
        "overhead_worker_grpc_only": round(1.0 - mean(worker) / mean(in_process), 4) if worker else None,
        "in_process": in_process, "worker_grpc": worker, "cluster": cluster,
        "overhead_output_tok_s": round(overhead, 4), "target_overhead": 0.10,
    })
    print(f"overhead {overhead:.1%} (target < 10%); wrote {path}")


if __name__ == "__main__":
    main()
