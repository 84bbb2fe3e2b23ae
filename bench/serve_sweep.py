"""`bench/serve_load.py --mode sweep`: in-process, worker gRPC and gateway HTTP side by side.

At each concurrency the same closed loop (bench/serve_clients.py) runs for `--duration`
seconds against each layer: first the engine in this process, which is then closed (its
device memory freed), then planner + worker + gateway started here with the same flags.
Prompts are windows of real text tokenised by the model's tokenizer; every request
ignores EOS, so it generates exactly its drawn output length. A short warm-up precedes each
layer. Targets: gateway >= 0.9x and worker >= 0.95x in-process output tok/s.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from bench.bench_meta import RESULTS_DIR, write_result
from bench.serve_clients import (
    GatewayHttpClient, InProcessClient, TraceRequest, WorkerStreamClient, closed_loop, process_cpu_seconds,
    start_cluster, summarize, worker_config,
)

TEXT = Path(__file__).resolve().parents[1] / "data" / "sample.txt"


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
    lo_hi = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    requests = real_text_requests(args.model, max(args.num_prompts, 4 * max(levels)), lo_hi(args.prompt_len),
                                  lo_hi(args.output_len), args.seed)
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
