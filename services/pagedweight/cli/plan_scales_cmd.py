"""`pagedweight plan-scales`: measure the planner's loss scales for a paged model (offline, once).

    pagedweight plan-scales --model PAGED_DIR --out SCALES.json [--calib FILE...] [--tokens N]

For each (layer, module) group, the mean KL divergence from the 8-bit model when the
group drops to 3 bits, on calibration text; `pagedweight plan --scales SCALES.json` then
ranks blocks across groups in loss units (services/planner/loss_scale.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedweight.common.atomic_file import check_output_file, write_output_file
from pagedweight.common.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("plan-scales", help="measure the planner's per-group loss scales")
    parser.add_argument("--model", required=True, help="paged model directory")
    parser.add_argument("--out", required=True, help="where to write the scales JSON")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    parser.add_argument("--calib", nargs="+", default=None, metavar="FILE",
                        help="calibration text files (default: the corpus *.calib.txt)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens taken from each file")
    parser.add_argument("--sensitivity", default="sensitivity", choices=("sensitivity", "sensitivity_gn"),
                        help="the artifact's S table the scales are for (plan must use the same)")
    parser.set_defaults(handler=run_plan_scales)


def run_plan_scales(args) -> int:
    import torch

    from pagedweight.cli.eval_cmd import read_text
    from pagedweight.cli.quantize_cmd import default_calib_files
    from pagedweight.planner.artifact import load_planner_inputs
    from pagedweight.offline.group_scales import measure_group_scales
    from pagedweight.frontend.tokenizer import Tokenizer
    from pagedweight.model.dequantized_experts import build_paged_lm, set_model_bits
    from pagedweight.format.paged_model import load_paged_model

    if not Path(args.model).is_dir():
        raise UserError(f"{args.model}: paged model directory does not exist")
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
