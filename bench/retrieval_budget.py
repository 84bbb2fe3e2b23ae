"""Long-context retrieval under a tight memory budget: elastic bits against bf16 and uniform bits.

The checkpoint is a small MoE trained for key-value retrieval among long filler text
(tools/train_retrieval_moe.py, bench/retrieval_task.py). Per context length, held-out
examples (one query each) are answered by greedy decoding and scored by exact match of the
value:
- bf16: the unquantised checkpoint in the project's model with unlimited memory (the
  contiguous-KV reference loop, one request at a time);
- under a budget that holds the dense weights, the workspace, the KV of `--concurrency`
  whole requests and the experts at `--expert-bits` mean bits, so bf16 experts plus that KV
  do not fit (a bf16 server would have to preempt or queue), every request sent at once:
  `pagedweight` (the elastic policy: bits move with the KV the requests hold) and
  `static-B` for the widest uniform B whose experts fit beside that KV.
The paged model is made by `pagedweight quantize` calibrated on task text (examples of a
seed the evaluation does not use).

Writes bench/results/retrieval_budget_<model>_<device>.json and the table of
docs/retrieval.md between its marks (bench/tables.py renders it).

    python -m bench.retrieval_budget --model models/retrieval-moe --lengths 2048 --count 40
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from bench.bench_meta import write_result
from bench.retrieval_task import eval_examples, to_text
from pagedweight.common.paths import REPO_ROOT

DEFAULT_MODEL = REPO_ROOT / "models" / "retrieval-moe"
CALIB_SEED = 1  # the evaluation uses --seed (0); training never draws from the evaluation's seeds


def write_calib(path: Path, length: int, count: int, records: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(to_text(e.ids) for e in eval_examples(CALIB_SEED, length, count, records)) + "\n")
    return path


def quantize(model: Path, out: Path, calib: Path, args) -> None:
    from pagedweight.cli.main import build_parser

    cli = build_parser().parse_args([
        "quantize", "--model", str(model), "--out", str(out), "--calib", str(calib),
        "--calib-tokens", str(args.calib_tokens), "--seq-len", str(args.calib_seq_len), "--threads",
        str(args.threads), "--device", args.device, "--quiet", "--force"])
    cli.handler(cli)


def budget_parts(paged_dir: Path, engine, dtype: torch.dtype, request_tokens: int, concurrency: int) -> dict:
    """What the runtime charges its pool, in bytes (every allocation in whole arena pages):
    dense weights, workspace, the KV of `concurrency` requests of request_tokens tokens, the
    experts at each width and in bf16."""
    from pagedweight.format.apl_format import BIT_WIDTHS
    from pagedweight.format.blocks import lut_bytes, plane_bytes
    from pagedweight.format.paged_model import block_shape, load_paged_model
    from pagedweight.memory.arena import DEFAULT_PAGE_BYTES
    from pagedweight.memory.kv_cache import blocks_for, kv_tile_bytes
    from pagedweight.runtime import workspace_bytes

    def pages(n: int) -> int:
        return -(-n // DEFAULT_PAGE_BYTES) * DEFAULT_PAGE_BYTES

    paged = load_paged_model(paged_dir, with_bf16=False)
    c = paged.config
    elem = torch.empty((), dtype=dtype).element_size()
    experts = {b: 0 for b in BIT_WIDTHS}
    bf16 = 0
    for bid in paged.block_ids:
        rows, cols = block_shape(c, bid.module)
        bf16 += rows * cols * 2
        for b in BIT_WIDTHS:
            experts[b] += b * pages(plane_bytes(rows, cols)) + pages(lut_bytes(rows, b))
    kv_block = c.num_layers * pages(kv_tile_bytes(c, engine.kv.block_size, dtype))
    return {"dense": sum(t.numel() for t in paged.dense_state.values()) * elem,
            "workspace": workspace_bytes(c, engine, dtype),
            "kv": concurrency * blocks_for(request_tokens, engine.kv.block_size) * kv_block,
            "experts": experts, "experts_bf16": bf16, "kv_block": kv_block}


def experts_at(parts: dict, bits: float) -> int:
    """Expert bytes at a mean width between two whole widths (linear in the planes)."""
    lo, hi = math.floor(bits), math.ceil(bits)
    return int(parts["experts"][lo] + (bits - lo) * (parts["experts"][hi] - parts["experts"][lo]))


def reference(model_dir: Path, examples, device: torch.device, dtype: torch.dtype) -> list[list[int]]:
    from pagedweight.engine.generate import generate
    from pagedweight.engine.sampler import SamplingParams
    from pagedweight.model import load_model

    model = load_model(model_dir, dtype=dtype, device=device)
    return [generate(model, e.ids[:e.prompt_len].tolist(),
                     SamplingParams(max_tokens=len(e.answer), ignore_eos=True)).token_ids for e in examples]


def served(paged_dir: Path, policy: str, budget: int, engine, device: torch.device, dtype: torch.dtype,
           examples) -> tuple[list[list[int]], dict]:
    """Every example sent at once to a runtime of `policy` at `budget`; its outputs and counters."""
    from pagedweight.cli.load_bench import mean_committed_bits
    from pagedweight.engine.sampler import SamplingParams
    from pagedweight.runtime import RuntimeConfig, build_runtime

    runtime = build_runtime(paged_dir, RuntimeConfig(budget, policy, str(device), dtype, engine=engine))
    try:
        eng = runtime.engine
        for i, e in enumerate(examples):
            eng.add_request(str(i), e.ids[:e.prompt_len].tolist(),
                            SamplingParams(max_tokens=len(e.answer), ignore_eos=True))
        outputs: dict[str, list[int]] = {}
        bits = [mean_committed_bits(runtime)]
        start = time.perf_counter()
        while eng.has_work:
            for out in eng.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            bits.append(mean_committed_bits(runtime))
        stats = eng.stats()
        counters = {"preemptions": stats.num_preemptions, "steps": stats.num_steps,
                    "seconds": round(time.perf_counter() - start, 1), "bits_mean_start": round(bits[0], 3),
                    "bits_mean_min": round(min(bits), 3), "bits_mean_avg": round(sum(bits) / len(bits), 3),
                    "peak_pool_bytes": runtime.pool.snapshot().peak_in_use_bytes}
    finally:
        runtime.close()
    return [outputs.get(str(i), []) for i in range(len(examples))], counters


def score(outputs, examples) -> float:
    return sum(o[:len(e.answer)] == e.answer for o, e in zip(outputs, examples)) / len(examples)


def run_length(args, paged_dir: Path, length: int, device, dtype) -> dict:
    from pagedweight.engine.engine import EngineConfig
    from pagedweight.engine.scheduler import SchedulerConfig
    from pagedweight.format.apl_format import BIT_WIDTHS
    from pagedweight.memory.kv_cache import KVCacheConfig

    examples = eval_examples(args.seed, length, args.count, args.records)
    engine = EngineConfig(scheduler=SchedulerConfig(args.concurrency, args.max_batched_tokens),
                          kv=KVCacheConfig(args.block_size))
    request_tokens = max(e.prompt_len + len(e.answer) for e in examples)
    parts = budget_parts(paged_dir, engine, dtype, request_tokens, args.concurrency)
    fixed = parts["dense"] + parts["workspace"] + parts["kv"] + args.slack_pages * parts["kv_block"]
    budget = fixed + experts_at(parts, args.expert_bits)
    fitting = max((b for b in BIT_WIDTHS if fixed + parts["experts"][b] <= budget), default=None)
    t0 = time.perf_counter()
    rows = {"bf16": {"accuracy": score(reference(Path(args.model), examples, device, dtype), examples),
                     "memory": "unlimited", "seconds": round(time.perf_counter() - t0, 1)}}
    print(length, "bf16", rows["bf16"], flush=True)
    policies = [*args.policies, *([f"static-{fitting}"] if fitting else [])]
    for policy in policies:
        outputs, counters = served(paged_dir, policy, budget, engine, device, dtype, examples)
        rows[policy] = {"accuracy": score(outputs, examples), **counters}
        print(length, policy, rows[policy], flush=True)
    return {"length": length, "examples": len(examples), "request_tokens": request_tokens,
            "budget_bytes": budget, "bf16_needs_bytes": fixed + parts["experts_bf16"],
            "fitting_uniform_bits": fitting, "expert_bits_at_full_load": args.expert_bits,
            "parts": {k: v for k, v in parts.items() if k != "experts"},
            "expert_bytes_by_bits": parts["experts"], "results": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="the trained checkpoint (Hugging Face layout)")
    p.add_argument("--work", default="/tmp/retrieval-budget", help="calibration text and the paged model")
    p.add_argument("--requantize", action="store_true", help="quantize even where WORK/paged exists")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048])
    p.add_argument("--count", type=int, default=48, help="held-out examples per length")
    p.add_argument("--records", type=int, default=16, help="key-value records per context")
    p.add_argument("--concurrency", type=int, default=8, help="requests holding KV at once")
    p.add_argument("--expert-bits", type=float, default=3.5,
                   help="mean expert bits the budget leaves beside the KV of --concurrency whole requests")
    p.add_argument("--slack-pages", type=int, default=1, help="KV blocks of room beyond the requests'")
    p.add_argument("--policies", nargs="+", default=["pagedweight"], help="elastic policies (static-B is added)")
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--calib-examples", type=int, default=32)
    p.add_argument("--calib-length", type=int, default=1024)
    p.add_argument("--calib-tokens", type=int, default=32768)
    p.add_argument("--calib-seq-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-name", default=None)
    p.add_argument("--no-docs", action="store_true", help="leave docs/retrieval.md as it is")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = json.loads((Path(args.model) / "config.json").read_text())
    work = Path(args.work)
    paged_dir = work / "paged"
    started = time.perf_counter()
    if args.requantize or not (paged_dir / "config.json").is_file():
        calib = write_calib(work / "calib.txt", args.calib_length, args.calib_examples, args.records)
        quantize(Path(args.model), paged_dir, calib, args)
    quantize_s = round(time.perf_counter() - started, 1)
    lengths = [run_length(args, paged_dir, n, device, dtype) for n in args.lengths]
    name = args.out_name or f"retrieval_budget_{Path(args.model).name}"
    path = write_result(name, {"model": Path(args.model).name, "args": vars(args), "dtype": str(dtype)[6:],
                               "model_config": {k: config.get(k) for k in (
                                   "hidden_size", "num_hidden_layers", "num_local_experts", "num_experts_per_tok",
                                   "intermediate_size", "num_key_value_heads")},
                               "quantize_seconds": quantize_s, "lengths": lengths})
    print(f"wrote {path}")
    if not args.no_docs:
        from bench import tables

        page = tables.DOCS / "retrieval.md"
        page.write_text(tables.render(page.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
