"""`pagedweight plan`: a static bit-width plan for a paged model at an expert-weight budget.

    pagedweight plan --model PAGED_DIR (--expert-bytes N | --avg-bits B) [--policy P]
                     [--prompt-file FILE] --out PLAN.json

The plan file is the JSON bits map `pagedweight eval ppl --bits-file` reads (block key
-> bits). `--avg-bits B` is the byte count of the uniform B-bit model, LUTs included (a
fractional B interpolates between the two neighbouring widths). With `--prompt-file`,
the prompt is prefilled once (every block at 8 bits) and its routing feeds the routing
statistics and the prompt-residual heads, as the online planner's would; the plan is for
a steady stream of such traffic (the moving average sees it for four half-lives). Prints one JSON
line: budget, the plan's bytes, and its predicted damage under the full damage model.
The sensitivity table is put in loss units by the artifact's loss scales (measured by
`quantize`); `--scales raw` plans with the unscaled table (an ablation), `--scales FILE`
with scales from `pagedweight plan-scales`.

    pagedweight plan-scales --model PAGED_DIR --out SCALES.json [--calib FILE...] [--tokens N]

measures those loss scales (offline, once): for each (layer, module) group, the mean KL
divergence from the 8-bit model when the group drops to 3 bits, on calibration text
(planner/loss_scale.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pagedweight.common.atomic_file import check_output_file, write_output_file
from pagedweight.common.errors import UserError
from pagedweight.planner.policies import POLICY_NAMES


SENSITIVITY_TABLES = ("sensitivity", "sensitivity_gn")  # output-space, Gauss-Newton


def register(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="bit-width plan for a paged model at a memory budget")
    add_model_and_out(parser, "where to write the JSON bits map")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--expert-bytes", type=int, help="expert-weight budget in bytes (planes + LUTs)")
    budget.add_argument("--avg-bits", type=float, help="budget = bytes of the uniform B-bit model (3..8)")
    parser.add_argument("--policy", default="pagedweight", choices=POLICY_NAMES, help="default: pagedweight")
    parser.add_argument("--prompt-file", default=None, help="UTF-8 text whose routing the plan adapts to")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="use at most N prompt tokens")
    parser.add_argument("--scales", default=None,
                        help="loss scales: default the artifact's (measured by quantize); 'raw' for the "
                             "unscaled table (ablation); or a file from `pagedweight plan-scales`")
    parser.set_defaults(handler=run_plan)

    parser = subparsers.add_parser("plan-scales", help="measure the planner's per-group loss scales")
    add_model_and_out(parser, "where to write the scales JSON")
    parser.add_argument("--calib", nargs="+", default=None, metavar="FILE",
                        help="calibration text files (default: the corpus *.calib.txt)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens taken from each file")
    parser.set_defaults(handler=run_plan_scales)


def add_model_and_out(parser, out_help: str) -> None:
    parser.add_argument("--model", required=True, help="paged model directory (pagedweight quantize)")
    parser.add_argument("--out", required=True, help=out_help)
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    parser.add_argument("--sensitivity", default="sensitivity", choices=SENSITIVITY_TABLES,
                        help="the artifact's S table: output-space (default) or Gauss-Newton "
                             "(plan and plan-scales must use the same)")


def check_model_dir(model: str) -> None:
    if not Path(model).is_dir():
        raise UserError(f"{model}: paged model directory does not exist")


def resolve_budget(table, expert_bytes: int | None, avg_bits: float | None) -> int:
    if avg_bits is not None:
        if not 3 <= avg_bits <= 8:
            raise UserError(f"--avg-bits must be in 3..8, got {avg_bits}")
        return table.uniform_bytes(avg_bits)
    minimum = table.uniform_bytes(3)
    if expert_bytes < minimum:
        raise UserError(f"--expert-bytes {expert_bytes} is below the smallest plan: every block at "
                        f"3 bits needs {minimum} bytes")
    return expert_bytes


def run_plan(args) -> int:
    from pagedweight.cli.eval_cmd import read_text
    from pagedweight.planner.artifact import choose_scales, load_planner_inputs
    from pagedweight.planner.policies import PlanContext, make_policy
    from pagedweight.planner.planner import plan_damage

    check_model_dir(args.model)
    if args.prompt_tokens < 1:
        raise UserError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    prepare_output(Path(args.out), args.force)  # before the work, not after it
    inputs = load_planner_inputs(args.model, sensitivity=args.sensitivity)
    table = inputs.table
    budget = resolve_budget(table, args.expert_bytes, args.avg_bits)
    context = PlanContext()
    if args.prompt_file is not None:
        context = context_from_prompt(args.model, read_text(args.prompt_file), inputs, args.prompt_tokens)
    scales, scales_label = choose_scales(inputs.scales, args.scales, args.sensitivity)
    plan = make_policy(args.policy, table, scales=scales).plan(budget, context)
    # one damage model, the full one, as the yardstick for every policy's plan
    yardstick = make_policy("pagedweight", table, scales=scales)
    damage = yardstick.model.damage(yardstick.inputs(context))
    write_plan(Path(args.out), table.bits_map(plan.bits), args.force)
    print(json.dumps({
        "model": args.model, "policy": args.policy, "budget_bytes": budget, "plan_bytes": plan.num_bytes,
        "uniform_bytes": {str(b): table.uniform_bytes(b) for b in range(3, 9)},
        "predicted_damage": plan_damage(damage, plan.bits),
        "bits_histogram": {str(b): int(n) for b, n in enumerate(np.bincount(plan.bits, minlength=9)) if b >= 3},
        "floors_relaxed": plan.floors_relaxed, "prompt_file": args.prompt_file, "scales": scales_label,
        "sensitivity": args.sensitivity,
        "out": args.out,
    }))
    return 0


def run_plan_scales(args) -> int:
    import torch

    from pagedweight.cli.eval_cmd import read_text
    from pagedweight.cli.quantize_cmd import default_calib_files
    from pagedweight.planner.artifact import load_planner_inputs
    from pagedweight.offline.group_scales import measure_group_scales
    from pagedweight.frontend.tokenizer import Tokenizer
    from pagedweight.model.dequantized_experts import build_paged_lm, set_model_bits
    from pagedweight.format.paged_model import load_paged_model

    check_model_dir(args.model)
    if args.tokens < 2:
        raise UserError(f"--tokens must be >= 2, got {args.tokens}")
    check_output_file(Path(args.out), args.force)  # before the work, not after it
    table = load_planner_inputs(args.model, with_heads=False, sensitivity=args.sensitivity).table
    files = [Path(f) for f in args.calib] if args.calib else default_calib_files()
    tokenizer = Tokenizer(args.model)
    windows = [tokenizer.encode(read_text(str(f)))[: args.tokens] for f in files]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise UserError("the calibration files have no text")
    model = build_paged_lm(load_paged_model(args.model, with_bf16=False), dtype=torch.float32)

    def set_bits(bits):
        set_model_bits(model, {b: int(v) for b, v in zip(table.block_ids, bits)})

    scales = measure_group_scales(model, table, windows, set_bits)
    record = {"model": args.model, "calib_files": [str(f) for f in files], **scales.to_json(),
              "sensitivity": args.sensitivity}
    write_output_file(Path(args.out), json.dumps(record, indent=1) + "\n", args.force)
    print(json.dumps({"out": args.out, "num_groups": len(scales.scales), "num_tokens": scales.num_tokens}))
    return 0


def context_from_prompt(model_dir: str, text: str, inputs, max_tokens: int):
    import torch

    from pagedweight.offline.prompt_routing import record_prompt_routing
    from pagedweight.planner.prompt_context import prompt_context, steady_traffic_tokens
    from pagedweight.frontend.tokenizer import Tokenizer
    from pagedweight.model.dequantized_experts import build_paged_lm
    from pagedweight.format.paged_model import load_paged_model

    ids = Tokenizer(model_dir).encode(text)[:max_tokens]
    if not ids:
        raise UserError("--prompt-file has no tokens")
    paged = load_paged_model(model_dir, with_bf16=False)
    if len(ids) > paged.config.max_position_embeddings:  # one prefill: it must fit the context
        raise UserError(f"--prompt-file has {len(ids)} tokens, more than the model's context of "
                        f"{paged.config.max_position_embeddings}: lower --prompt-tokens")
    model = build_paged_lm(paged, dtype=torch.float32)
    recorder = record_prompt_routing(model, ids, inputs.table.num_experts)
    # a static plan is for a steady stream of traffic like the prompt file
    return prompt_context(recorder, inputs, traffic_tokens=steady_traffic_tokens())


def prepare_output(path: Path, force: bool) -> None:
    """The --out file's directory (made when missing), and a refusal of a file not ours to replace."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {path}: cannot create its directory ({err.strerror})") from None
    check_output_file(path, force)


def write_plan(path: Path, bits_map: dict[str, int], force: bool = False) -> None:
    prepare_output(path, force)
    write_output_file(path, json.dumps(bits_map, indent=1) + "\n", force)
