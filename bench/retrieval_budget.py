"""Long-context retrieval under a memory budget: bf16 against the elastic policy and the widest
uniform width that fits (docs/quality.md's last section, rendered by `markdown`, which says how).

The checkpoint is a small MoE trained for key-value retrieval (tools/train_retrieval_moe.py,
bench/retrieval_task.py), quantised on task text of a seed the evaluation does not use. Every
row answers the same held-out examples. At a budget all are sent at once and each request
decodes as many tokens as the prefills of concurrency - 1 requests take steps, so that many
hold KV together: the pressure the budget is set for.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.bench_meta import arg_parser, md_header, md_row, write_result
from bench.retrieval_task import eval_examples, to_text
from pagedweight.cli.main import build_parser
from pagedweight.common.paths import REPO_ROOT
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.engine.sequence import SequenceStatus
from pagedweight.format.apl_format import BIT_WIDTHS
from pagedweight.format.blocks import lut_bytes, plane_bytes
from pagedweight.format.paged_model import block_shape, load_paged_model
from pagedweight.memory.arena import DEFAULT_PAGE_BYTES
from pagedweight.memory.kv_cache import KVCacheConfig, blocks_for, kv_tile_bytes
from pagedweight.model import load_model
from pagedweight.planner.sizing import fitting_uniform_bits
from pagedweight.runtime import RuntimeConfig, build_runtime, workspace_bytes

DEFAULT_MODEL = REPO_ROOT / "models" / "retrieval-moe"
CALIB_SEED = 1  # the evaluation uses --seed (0); training never draws from the evaluation's seeds
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval
BF16_BYTES = 2  # bf16 experts are charged 2 bytes a weight whatever the compute dtype


def quantize(args, paged_dir: Path) -> None:
    """The checkpoint quantised on task text of CALIB_SEED."""
    calib = paged_dir.parent / "calib.txt"
    calib.parent.mkdir(parents=True, exist_ok=True)
    calib.write_text("\n".join(to_text(e.ids) for e in eval_examples(
        CALIB_SEED, args.calib_length, args.calib_examples, args.records)) + "\n")
    cli = build_parser().parse_args([
        "quantize", "--model", args.model, "--out", str(paged_dir), "--calib", str(calib),
        "--calib-tokens", str(args.calib_tokens), "--seq-len", str(args.calib_seq_len), "--threads",
        str(args.threads), "--device", args.device, "--quiet", "--force"])
    cli.handler(cli)


def wilson(correct: int, n: int, z: float = Z95) -> list[float]:
    """The Wilson score interval of a proportion correct / n (exact at 0 and n: no clipping
    needed, unlike the normal approximation)."""
    p = correct / n
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return [max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))]  # rounding kept off p


def budget_parts(paged, engine, dtype: torch.dtype, request_tokens: int, concurrency: int) -> dict:
    """What the runtime charges its pool, in bytes (every allocation in whole arena pages):
    dense weights, workspace, the KV of `concurrency` requests of request_tokens tokens, the
    experts at each width and in bf16."""

    def pages(n: int) -> int:
        return -(-n // DEFAULT_PAGE_BYTES) * DEFAULT_PAGE_BYTES

    c = paged.config
    elem = torch.empty((), dtype=dtype).element_size()
    experts = {b: 0 for b in BIT_WIDTHS}
    bf16 = 0
    for bid in paged.block_ids:
        rows, cols = block_shape(c, bid.module)
        bf16 += rows * cols * BF16_BYTES
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


def budget_point(parts: dict, fixed: int, expert_bits: float) -> dict:
    """One budget: its bytes, the widest uniform width fitting it, what bf16 would need and
    the KV blocks bf16 experts leave in it."""
    budget = fixed + experts_at(parts, expert_bits)
    room = budget - parts["dense"] - parts["workspace"] - parts["experts_bf16"]
    return {"expert_bits": expert_bits, "budget_bytes": budget, "bf16_needs_bytes": fixed + parts["experts_bf16"],
            "fitting_uniform_bits": fitting_uniform_bits(parts["experts"], fixed, 0, budget),
            "bf16_kv_blocks": max(room, 0) // parts["kv_block"]}


class PromptBits:
    """The bits every prompt token was computed at, per block: after each step, the bits that
    step read (committed before it) weighted by the prompt tokens it computed (recomputes after
    a preemption count again)."""

    def __init__(self, table):
        self.table = table
        self.seqs: list = []  # the requests' sequences (send_all sets them)
        self.block_ids = list(table.entries)
        self.weights = [table.entries[b].num_weights for b in self.block_ids]
        self.token_bits = [0.0] * len(self.block_ids)  # block -> sum over steps of tokens x bits
        self.tokens = 0
        self.means: list[float] = []  # mean committed bits before each step

    def before_step(self) -> None:
        self._bits = [self.table.entries[b].committed_bits for b in self.block_ids]
        self._done = [min(s.num_computed_tokens, len(s.prompt_ids)) for s in self.seqs]
        self.means.append(self.table.mean_committed_bits())

    def after_step(self) -> None:
        n = sum(max(0, min(s.num_computed_tokens, len(s.prompt_ids)) - d) for s, d in zip(self.seqs, self._done))
        self.tokens += n
        self.token_bits = [t + n * b for t, b in zip(self.token_bits, self._bits)]

    def summary(self, routing_fraction: list[list[float]], top_k: int) -> dict:
        per_block = {b: t / max(self.tokens, 1) for b, t in zip(self.block_ids, self.token_bits)}
        weight = dict(zip(self.block_ids, self.weights))

        def mean(keep) -> float:
            ids = [b for b in self.block_ids if keep(b)]
            return round(sum(per_block[b] * weight[b] for b in ids) / sum(weight[b] for b in ids), 3)

        ranked = [sorted(range(len(f)), key=lambda e: -f[e]) for f in routing_fraction]
        most = {(layer, e) for layer, order in enumerate(ranked) for e in order[:top_k]}
        least = {(layer, e) for layer, order in enumerate(ranked) for e in order[-top_k:]}
        layers = sorted({b.layer for b in self.block_ids})
        return {"mean": mean(lambda b: True), "mean_min": round(min(self.means), 3),
                "by_layer": {str(layer): mean(lambda b: b.layer == layer) for layer in layers},
                "most_routed": mean(lambda b: (b.layer, b.expert) in most),
                "least_routed": mean(lambda b: (b.layer, b.expert) in least),
                "per_block": {b.key(): round(v, 3) for b, v in per_block.items()}}


def send_all(eng, examples, decode_tokens: int, bits: PromptBits | None = None) -> tuple[list[list[int]], dict]:
    """Every example sent at once to `eng` (greedy, EOS ignored); its outputs and how it served them."""
    params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
    for i, e in enumerate(examples):
        eng.add_request(str(i), e.ids[:e.prompt_len].tolist(), params)
    seqs = [eng.seqs[str(i)] for i in range(len(examples))]
    if bits is not None:
        bits.seqs = seqs
    outputs: dict[str, list[int]] = {}
    max_running = peak_kv_tokens = 0
    start = time.perf_counter()
    while eng.has_work:
        if bits is not None:
            bits.before_step()
        step = eng.step()
        for out in step:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if bits is not None:
            bits.after_step()
        # what the step held: the sequences still running and those it finished
        done = {out.request_id for out in step if out.finished}
        held = [s for s in seqs if s.status is SequenceStatus.RUNNING or s.request_id in done]
        max_running = max(max_running, len(held))
        peak_kv_tokens = max(peak_kv_tokens, sum(s.num_computed_tokens for s in held))
    seconds = time.perf_counter() - start
    stats = eng.stats()
    prompt_tokens = sum(e.prompt_len for e in examples)
    served = {"seconds": round(seconds, 1), "steps": stats.num_steps, "preemptions": stats.num_preemptions,
              "memory_short_steps": stats.memory_short_steps, "max_running": max_running,
              "peak_kv_tokens": peak_kv_tokens,
              "prompt_tokens_per_s": round(prompt_tokens / seconds, 1),
              "output_tokens_per_s": round(stats.num_output_tokens / seconds, 1)}
    return [outputs.get(str(i), []) for i in range(len(examples))], served


def reference(model, examples) -> tuple[list[list[int]], list[float]]:
    """The unquantised model with unlimited memory, one prompt at a time (no cache): the greedy
    answer (answers are one token: the argmax of the prompt's last logits) and its margin, the
    logit above the runner-up's (how near a tie the answer is)."""
    outputs, margins = [], []
    with torch.inference_mode():
        for e in examples:
            ids = torch.as_tensor(e.ids[:e.prompt_len], device=model.device)[None]
            top = torch.topk(model(ids)[0, -1].float(), 2)
            outputs.append([int(top.indices[0])])
            margins.append(round(float(top.values[0] - top.values[1]), 3))
    return outputs, margins


def bf16_in_budget(model, engine, point: dict, examples, decode_tokens: int, ref: list[bool]) -> dict:
    """The engine over the unquantised experts with the KV blocks the budget leaves beside them
    (refused where they do not hold one request), scored."""
    num_blocks = int(point["bf16_kv_blocks"])
    need = blocks_for(max(e.prompt_len for e in examples) + decode_tokens, engine.kv.block_size)
    if num_blocks < need:
        return {"refused": f"bf16 experts leave {num_blocks} KV blocks, one request needs {need}"}
    outputs, served = send_all(Engine(model, replace(engine, num_kv_blocks=num_blocks)), examples, decode_tokens)
    return {**score(outputs, examples, ref), **served, "kv_blocks": num_blocks, "bits": {"mean": 16.0}}


def served(paged_dir: Path, policy: str, budget: int, engine, device, dtype, examples, decode_tokens: int,
           routing: list[list[float]], top_k: int) -> tuple[list[list[int]], dict]:
    """Every example sent at once to a runtime of `policy` at `budget`; its outputs and counters."""
    runtime = build_runtime(paged_dir, RuntimeConfig(budget, policy, str(device), dtype, engine=engine))
    try:
        bits = PromptBits(runtime.table)
        outputs, counters = send_all(runtime.engine, examples, decode_tokens, bits)
        counters["peak_pool_bytes"] = runtime.pool.snapshot().peak_in_use_bytes
    finally:
        runtime.close()
    return outputs, {**counters, "bits": bits.summary(routing, top_k)}


def score(outputs, examples, reference_right: list[bool] | None = None) -> dict:
    """Exact match with its 95% interval, and against the reference (paired) what was lost and gained."""
    right = [o[:len(e.answer)] == e.answer for o, e in zip(outputs, examples)]
    row = {"correct": sum(right), "accuracy": sum(right) / len(right), "ci95": wilson(sum(right), len(right)),
           "right": [int(r) for r in right]}
    if reference_right is not None:
        row["lost"] = sum(r and not x for r, x in zip(reference_right, right))
        row["gained"] = sum(x and not r for r, x in zip(reference_right, right))
    return row


def run_length(args, paged, paged_dir: Path, model, length: int, device, dtype) -> dict:
    examples = eval_examples(args.seed, length, args.count, args.records)
    engine = EngineConfig(scheduler=SchedulerConfig(args.concurrency, args.max_batched_tokens),
                          kv=KVCacheConfig(args.block_size))
    prompt_len = max(e.prompt_len for e in examples)
    decode_tokens = max(1, (args.concurrency - 1) * -(-prompt_len // args.max_batched_tokens))
    request_tokens = prompt_len + decode_tokens
    parts = budget_parts(paged, engine, dtype, request_tokens, args.concurrency)
    fixed = parts["dense"] + parts["workspace"] + parts["kv"] + parts["kv_block"]
    routing, top_k = paged.meta["routing"]["routing_fraction"], paged.config.num_experts_per_tok
    t0 = time.perf_counter()
    outputs, margins = reference(model, examples)
    unlimited = {**score(outputs, examples), "margins": margins, "seconds": round(time.perf_counter() - t0, 1)}
    log(length, "unlimited", "bf16", unlimited)
    ref = [bool(r) for r in unlimited["right"]]
    points = []
    for expert_bits in args.expert_bits:
        point = budget_point(parts, fixed, expert_bits)
        rows = {"bf16": bf16_in_budget(model, engine, point, examples, decode_tokens, ref)}
        log(length, expert_bits, "bf16", rows["bf16"])
        uniform = [f"static-{point['fitting_uniform_bits']}"] if point["fitting_uniform_bits"] else []
        for policy in ["pagedweight", *uniform]:
            outputs, counters = served(paged_dir, policy, point["budget_bytes"], engine, device, dtype, examples,
                                       decode_tokens, routing, top_k)
            rows[policy] = {**score(outputs, examples, ref), **counters}
            log(length, expert_bits, policy, rows[policy])
        points.append({**point, "results": rows})
    return {"length": length, "examples": len(examples), "decode_tokens": decode_tokens,
            "request_tokens": request_tokens, "parts": {k: v for k, v in parts.items() if k != "experts"},
            "expert_bytes_by_bits": parts["experts"], "bf16_unlimited": unlimited, "budgets": points}


def log(length: int, budget, name: str, row: dict) -> None:
    """One line per row: its score and what serving it took (not its per-example series)."""
    brief = {k: v for k, v in row.items() if k not in ("right", "margins", "bits")}
    print(length, budget, name, json.dumps({**brief, "bits": row.get("bits", {}).get("mean")}), flush=True)


# ---- the report: docs/quality.md's section ------------------------------------------------------------
def accuracy_cell(row: dict, paired: bool) -> str:
    if "refused" in row:
        return "refused"
    lo, hi = row["ci95"]
    cell = f"{100 * row['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"
    return cell + (f" (-{row['lost']} / +{row['gained']})" if paired else "")


def accuracy_table(payload: dict) -> list[str]:
    """Exact match per row and context length, unlimited bf16 first, then each budget's rows."""
    lengths = payload["lengths"]
    lines = md_header("budget", "row", *(f"{r['length']} tokens" for r in lengths))
    lines.append(md_row("unlimited", "bf16", *(accuracy_cell(r["bf16_unlimited"], False) for r in lengths)))
    for i, point in enumerate(lengths[0]["budgets"]):
        lines += [md_row(f"{point['expert_bits']:g} expert bits", "bf16" if name == "bf16" else f"`{name}`",
                         *(accuracy_cell(r["budgets"][i]["results"][name], True) for r in lengths))
                  for name in point["results"]]
    return lines


def serving_table(payload: dict) -> list[str]:
    """How each budget row was served: memory, the bits its prompt tokens saw, what it paid."""
    lines = md_header("expert bits", "context", "row", "budget MiB (bf16 needs)", "mean bits (lowest)", "per layer",
                      "most / least routed", "requests (KV tokens) held, most", "preemptions", "steps short of KV",
                      "prompt tok/s")
    for r in payload["lengths"]:
        for point in r["budgets"]:
            head = (f"{point['expert_bits']:g}", r["length"])
            mib = f"{point['budget_bytes'] / 2**20:.2f} ({point['bf16_needs_bytes'] / 2**20:.2f})"
            for name, x in point["results"].items():
                if "refused" in x:
                    lines.append(md_row(*head, name, mib, x["refused"], *[""] * 6))
                    continue
                b = x["bits"]
                bits = ["16 (bf16)", "", ""] if "by_layer" not in b else [
                    f"{b['mean']:.2f} ({b['mean_min']:.2f})", " / ".join(f"{v:.2f}" for v in b["by_layer"].values()),
                    f"{b['most_routed']:.2f} / {b['least_routed']:.2f}"]
                lines.append(md_row(*head, name, mib, *bits, f"{x['max_running']} ({x['peak_kv_tokens']:,})",
                                    x["preemptions"], x["memory_short_steps"], f"{x['prompt_tokens_per_s']:,.0f}"))
    return lines


def target_rows(payload: dict) -> list[str]:
    """The targets: the elastic policy within 1 point of unlimited bf16 at every length and
    budget, and 10 points above the fitting uniform width at the tightest budget."""
    lengths = payload["lengths"]
    lines = md_header("target", "budget", *(f"{r['length']} tokens" for r in lengths))
    tight = min(p["expert_bits"] for p in lengths[0]["budgets"])

    def gaps(i: int, name: str, against, points: float, label: str) -> str:
        cells = [r["budgets"][i]["results"][name]["accuracy"] - against(r)["accuracy"] for r in lengths]
        return md_row(label, f"{lengths[0]['budgets'][i]['expert_bits']:g}", *(
            f"{100 * g:+.1f} points: {'yes' if round(100 * g, 9) >= points else '**no**'}" for g in cells))

    for i, point in enumerate(lengths[0]["budgets"]):
        for policy in [n for n in point["results"] if n != "bf16" and not n.startswith("static-")]:
            lines.append(gaps(i, policy, lambda r: r["bf16_unlimited"], -1,
                              f"`{policy}` within 1 point of unlimited bf16"))
            if point["expert_bits"] == tight:
                lines += [gaps(i, policy, lambda r, u=u: r["budgets"][i]["results"][u], 10,
                               f"`{policy}` 10 points above `{u}`")
                          for u in point["results"] if u.startswith("static-")]
    return lines


def account(payload: dict) -> list[str]:
    """What one example weighs, and each example a budget row lost against unlimited bf16: which
    rows lost it and how near a tie unlimited bf16's answer was (its margin beside the median)."""
    lost = []
    for r in payload["lengths"]:
        ref = r["bf16_unlimited"]
        median = sorted(ref["margins"])[len(ref["margins"]) // 2]
        for i, margin in enumerate(ref["margins"]):
            rows = [f"{p['expert_bits']:g} `{n}`" for p in r["budgets"] for n, x in p["results"].items()
                    if "right" in x and ref["right"][i] and not x["right"][i]]
            if rows:
                lost.append(f"- {r['length']} tokens, example {i}: bf16 margin {margin:.2f} (median {median:.2f}), "
                            f"lost by {', '.join(rows)}")
    n = payload["lengths"][0]["examples"]
    return [f"One example is {100 / n:.1f} points at {n} examples per length."] + ([
        "", "Examples a budget row lost (the margin: unlimited bf16's logit of its answer above the runner-up's):",
        "", *lost] if lost else [])


def markdown(payload: dict) -> str:
    """The retrieval section of docs/quality.md (bench/tables.py renders it from the result)."""
    a, first = payload["args"], payload["lengths"][0]
    budgets = ", ".join(f"{p['expert_bits']:g} (the widest uniform width that fits: {p['fitting_uniform_bits']})"
                        for p in first["budgets"])
    decode = ", ".join(f"{r['decode_tokens']} at {r['length']}" for r in payload["lengths"])
    lines = ["", "## Long-context retrieval under a memory budget", "",
             f"`{payload['model']}` (Mixtral architecture, {payload['model_config']['num_local_experts']} experts, "
             f"top-{payload['model_config']['num_experts_per_tok']}; docs/retrieval.md) answers one query among "
             f"{a['records']} key-value records in filler text; exact match of the value under greedy decoding, "
             f"{first['examples']} held-out examples per context length, the same examples in every row. `bf16`, "
             "unlimited memory: the unquantised checkpoint, one request at a time. A budget of B expert bits holds "
             f"the dense weights, the workspace, the KV of {a['concurrency']} whole requests and the experts at B "
             f"mean bits: {budgets}; bf16 experts do not fit beside that KV. At a budget every example is sent at "
             f"once and each request decodes a few tokens after its prompt ({decode}; the first is the answer "
             f"scored), so up to {a['concurrency']} requests hold KV together. Rows there: `bf16` (the unquantised "
             "experts with the KV blocks the budget leaves: it holds fewer requests at once and queues the rest "
             "or preempts), `pagedweight` (the elastic policy) and `static-B` (the widest uniform width that "
             "fits). Cells: exact match, % [95% Wilson interval] (examples lost / gained against unlimited bf16). "
             f"Computed in {payload['dtype']} on the CPU. Numbers: "
             f"bench/results/retrieval_budget_{payload['model']}_cpu.json.", "",
             *accuracy_table(payload), "",
             "How each budget row was served. Bits: the mean width the prompt tokens were computed at (the "
             f"lowest mean at any step), per layer, and over the {payload['model_config']['num_experts_per_tok']} "
             "experts per layer the calibration routed to most and to least. Held: the most requests holding "
             "KV in one step, and their KV tokens.", "",
             *serving_table(payload), "", "### Targets", "", *target_rows(payload), "", *account(payload)]
    load = payload["load_average"]
    lines += ["", "### How the retrieval numbers were made", "",
              f"On {payload['machine']['cpu']} ({payload['machine']['cpu_count']} CPUs, load average "
              f"{load[0]:.1f} at the start and {load[1]:.1f} at the end), torch threads: {a['threads']}; "
              f"{payload['seconds']:.0f} s in all ({payload['cpu_seconds']:.0f} s of CPU time), quantisation "
              f"{payload['quantize_seconds']:.0f} s of it:", "",
              "```", "python -m bench run retrieval-budget", "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = arg_parser(__doc__)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="the trained checkpoint (Hugging Face layout)")
    p.add_argument("--work", default="/tmp/retrieval-budget", help="calibration text and the paged model")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--count", type=int, default=48, help="held-out examples per length")
    p.add_argument("--records", type=int, default=16, help="key-value records per context")
    p.add_argument("--concurrency", type=int, default=8, help="requests holding KV at once (max_num_seqs)")
    p.add_argument("--expert-bits", type=float, nargs="+", default=[3.5, 4.5],
                   help="one budget each: the mean expert bits it leaves beside the KV of --concurrency requests")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="new tokens per step (prefill chunks)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--calib-examples", type=int, default=32)
    p.add_argument("--calib-length", type=int, default=1024)
    p.add_argument("--calib-tokens", type=int, default=32768)
    p.add_argument("--calib-seq-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-name", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]  # the machine's other work, beside the wall times
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    paged_dir, started = Path(args.work) / "paged", time.perf_counter()
    if not (paged_dir / "config.json").is_file():  # quantised once per work folder
        quantize(args, paged_dir)
    quantize_s = round(time.perf_counter() - started, 1)
    paged = load_paged_model(paged_dir, with_bf16=False)
    model = load_model(Path(args.model), dtype=dtype, device=device)
    lengths = [run_length(args, paged, paged_dir, model, n, device, dtype) for n in args.lengths]
    config = json.loads((Path(args.model) / "config.json").read_text())
    print("wrote", write_result(args.out_name or f"retrieval_budget_{Path(args.model).name}", {
        "model": Path(args.model).name, "args": vars(args), "dtype": str(dtype)[6:],
        "model_config": {k: config.get(k) for k in ("hidden_size", "num_hidden_layers", "num_local_experts",
                                                     "num_experts_per_tok", "intermediate_size",
                                                     "num_key_value_heads")},
        "quantize_seconds": quantize_s, "lengths": lengths, "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time(), 1),
        "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
