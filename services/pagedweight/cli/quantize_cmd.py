"""`pagedweight quantize`: turn a checkpoint into a paged any-precision model directory."""

from __future__ import annotations

import sys
from pathlib import Path

from pagedweight.common.errors import UserError
from pagedweight.cli.config_defaults import default_of
from pagedweight.common.paths import corpus_dir
from pagedweight.offline.calibrate import CalibConfig
from pagedweight.offline.quantize import QuantizeConfig, quantize_model

DEFAULT_CORPUS = corpus_dir()


def register(subparsers) -> None:
    parser = subparsers.add_parser("quantize", help="calibrate and quantise experts into the APL paged format")
    parser.add_argument("--model", required=True, help="checkpoint directory (Hugging Face layout)")
    parser.add_argument("--out", required=True, help="output paged model directory")
    parser.add_argument("--calib", nargs="+", default=None, metavar="FILE",
                        help=f"calibration text files (default: {DEFAULT_CORPUS}/*.calib.txt)")
    parser.add_argument("--calib-tokens", type=int, default=default_of(CalibConfig, "max_tokens_per_file"),
                        help="tokens taken from each file")
    parser.add_argument("--seq-len", type=int, default=default_of(CalibConfig, "seq_len"),
                        help="tokens per calibration chunk")
    parser.add_argument("--device", default=default_of(QuantizeConfig, "device"),
                        help="where k-means runs: cpu or cuda[:N]")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; 1 is much faster on a busy machine)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(handler=run_quantize)


def default_calib_files() -> list[Path]:
    files = sorted(DEFAULT_CORPUS.glob("*.calib.txt"))
    if not files:
        raise UserError(f"no --calib files given and none found in {DEFAULT_CORPUS}")
    return files


def run_quantize(args) -> int:
    if not Path(args.model).is_dir():
        raise UserError(f"{args.model}: model directory does not exist")
    if Path(args.out).resolve() == Path(args.model).resolve():
        raise UserError("--out must differ from --model")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be >= 1, got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)
    files = [Path(f) for f in args.calib] if args.calib else default_calib_files()
    calib = CalibConfig(seq_len=args.seq_len, max_tokens_per_file=args.calib_tokens)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = quantize_model(args.model, args.out, files, QuantizeConfig(calib=calib, device=args.device), log)
    print(out)
    return 0
