"""`pagedweight quantize`: turn a checkpoint into a paged any-precision model directory."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from pagedweight.common.errors import UserError
from pagedweight.cli.config_defaults import default_of
from pagedweight.format.apl_format import BIT_WIDTHS
from pagedweight.offline.apl_quantizer import QuantizerConfig
from pagedweight.offline.calib_text import BUNDLED_NAME, USER_NAME, bundled_calib_files
from pagedweight.offline.calibrate import CalibConfig
from pagedweight.offline.quantize import QuantizeConfig, quantize_model


def register(subparsers) -> None:
    parser = subparsers.add_parser("quantize", help="calibrate and quantise experts into the APL paged format")
    parser.add_argument("--model", required=True, help="checkpoint directory (Hugging Face layout)")
    parser.add_argument("--out", required=True, help="output paged model directory")
    parser.add_argument("--calib", nargs="+", default=None, metavar="FILE",
                        help="calibration text files, one domain each (default: the small mixed text bundled with "
                             "the package; text like your traffic gives better low-bit quality)")
    parser.add_argument("--calib-tokens", type=int, default=default_of(CalibConfig, "max_tokens_per_file"),
                        help="tokens taken from each file")
    parser.add_argument("--seq-len", type=int, default=default_of(CalibConfig, "seq_len"),
                        help="tokens per calibration chunk")
    parser.add_argument("--device", default=default_of(QuantizeConfig, "device"),
                        help="where k-means runs: cpu or cuda[:N]")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; 1 is much faster on a busy machine)")
    parser.add_argument("--keep-bf16", action="store_true",
                        help="also store the original experts in bf16 (default: the unquantised reference "
                             "is read from --model, recorded in the artifact)")
    parser.add_argument("--scale-tokens", type=int, default=default_of(QuantizeConfig, "scale_tokens"),
                        help="calibration tokens per file for the planner's loss scales (0: skip them; "
                             "the planner then ranks by raw sensitivity)")
    parser.add_argument("--dtype", default=default_of(QuantizeConfig, "dtype"),
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="compute dtype of the streamed layers (auto: the checkpoint's on cuda, float32 on cpu)")
    parser.add_argument("--error-feedback", action=argparse.BooleanOptionalAction,
                        default=default_of(QuantizerConfig, "error_feedback"),
                        help="choose the 3-bit seed codes with GPTQ error feedback through each expert's full "
                             "input Hessian (recorded by the calibration; the wider codes stay nested; on by "
                             "default, --no-error-feedback --lut-refit-bits: the plain k-means quantiser)")
    parser.add_argument("--feedback-damp", type=float, default=default_of(QuantizerConfig, "feedback_damp"),
                        help="error feedback's dampening: this fraction of the Hessian's mean diagonal is added "
                             "(default: %(default)s)")
    parser.add_argument("--lut-refit-bits", type=int, nargs="*", metavar="BITS",
                        default=list(default_of(QuantizerConfig, "lut_refit_bits")),
                        help="stored LUTs (3 and 4 bits; wider widths derive from LUT_4) refitted by least squares "
                             "under each expert's full input Hessian, codes unchanged (default: %(default)s; "
                             "none given: no refit)")
    parser.add_argument("--lut-ridge", type=float, default=default_of(QuantizerConfig, "lut_ridge"),
                        help="the LUT refit's ridge toward the bucket means, in units of each bucket's "
                             "Hessian-diagonal mass (larger: closer to the plain means; default: %(default)s)")
    parser.add_argument("--work-dir", default=None,
                        help="per-layer results, so an interrupted run resumes where it stopped "
                             "(default: .NAME.quantize-work beside --out; removed when the artifact is written)")
    parser.add_argument("--restart", action="store_true",
                        help="discard what --work-dir holds instead of resuming from it")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or lines on stderr")
    parser.add_argument("--force", action="store_true",
                        help="replace a non-empty --out (only once the new artifact is complete)")
    parser.set_defaults(handler=run_quantize)


def default_calib_files() -> list[Path]:
    """The bundled calibration text (offline/calib_text/README.md says what and why)."""
    return bundled_calib_files()


def run_quantize(args) -> int:
    """Every flag and path is checked before calibration starts; the artifact is written
    into a temporary sibling of --out and renamed into place only when complete."""
    from pagedweight.cli.eval_cmd import read_text
    from pagedweight.cli.model_args import parse_device
    from pagedweight.offline.atomic_output import atomic_output_dir, check_output_dir

    model, out = Path(args.model).resolve(), Path(args.out).absolute()
    if args.work_dir:  # before the (possibly long) checks below
        check_work_dir(Path(args.work_dir), model, out, [])
    if not model.is_dir():
        raise UserError(f"{args.model}: model directory does not exist")
    if out.resolve() == model or out.resolve().is_relative_to(model) or model.is_relative_to(out.resolve()):
        raise UserError("--out must be outside --model (and must not contain it)")
    check_output_dir(out, args.force)
    device = parse_device(args.device)
    if args.threads is not None:
        if not 1 <= args.threads <= 1024:
            raise UserError(f"--threads must be in 1..1024, got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)
    if args.scale_tokens < 0 or args.scale_tokens == 1:
        raise UserError(f"--scale-tokens must be 0 or >= 2, got {args.scale_tokens}")
    files = [Path(f) for f in args.calib] if args.calib else default_calib_files()
    for f in files:
        read_text(str(f))  # exists and is UTF-8, before hours of work
    calib = CalibConfig(seq_len=args.seq_len, max_tokens_per_file=args.calib_tokens)
    if not (math.isfinite(args.feedback_damp) and args.feedback_damp > 0):
        raise UserError(f"--feedback-damp must be a finite number > 0, got {args.feedback_damp}")
    if not set(args.lut_refit_bits) <= set(BIT_WIDTHS):
        raise UserError(f"--lut-refit-bits must be among {list(BIT_WIDTHS)}, got {args.lut_refit_bits}")
    if not (math.isfinite(args.lut_ridge) and args.lut_ridge >= 0):  # inf: NaN LUTs after the whole run
        raise UserError(f"--lut-ridge must be a finite number >= 0, got {args.lut_ridge}")
    quantizer = QuantizerConfig(error_feedback=args.error_feedback, feedback_damp=args.feedback_damp,
                                lut_refit_bits=tuple(sorted(set(args.lut_refit_bits))), lut_ridge=args.lut_ridge)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    config = QuantizeConfig(calib=calib, quantizer=quantizer, device=str(device), keep_bf16=args.keep_bf16,
                            scale_tokens=args.scale_tokens, dtype=args.dtype,
                            calib_text_name=USER_NAME if args.calib else BUNDLED_NAME)
    work_dir = Path(args.work_dir) if args.work_dir else out.parent / f".{out.name}.quantize-work"
    check_work_dir(work_dir, model, out, files)
    with atomic_output_dir(out, args.force) as tmp:
        quantize_model(args.model, tmp, files, config, log, work_dir=work_dir, restart=args.restart,
                       progress=None if args.quiet else sys.stderr)
    log(f"wrote {out}")
    print(args.out)
    return 0


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def check_work_dir(work_dir: Path, model: Path, out: Path, calib_files: list[Path]) -> None:
    """The work directory is emptied (--restart) and removed at the end: it must share
    nothing with what the command reads or writes, in either direction (a work directory
    that is the model's parent would otherwise take the model with it)."""
    work = work_dir.resolve()
    if _overlap(work, model):
        raise UserError(f"--work-dir {work_dir}: overlaps --model {model} (neither may contain the other)")
    if _overlap(work, out.resolve()):
        raise UserError(f"--work-dir {work_dir}: overlaps --out {out} (neither may contain the other)")
    for f in calib_files:
        if Path(f).resolve().is_relative_to(work):
            raise UserError(f"--work-dir {work_dir}: contains the calibration file {f}")
    if Path.home().resolve().is_relative_to(work) or Path.cwd().resolve().is_relative_to(work):
        raise UserError(f"--work-dir {work_dir}: contains the home or current directory")
