"""Flags shared by every command that loads a model, and the loading itself."""

from __future__ import annotations

import argparse

import torch

from pagedweight.cli.config_defaults import default_of
from pagedweight.common.errors import UserError
from pagedweight.model.dtypes import DTYPES
from pagedweight.runtime import RuntimeConfig


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="checkpoint directory, or a paged model directory (pagedweight quantize)")
    parser.add_argument("--device", default=default_of(RuntimeConfig, "device"),
                        help="cpu or cuda[:N] (default: %(default)s)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None,
        help="activation and weight dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )


def utf8_text(value: str) -> str:
    """argparse type for text flags: Python hands undecodable argv bytes over as lone
    surrogates, which the tokenizer cannot take; refuse them at parse time."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise argparse.ArgumentTypeError(f"not UTF-8 text (undecodable byte at position {err.start})") from None
    return value


def parse_device(name: str, flag: str = "--device") -> torch.device:
    """`cpu` or `cuda[:N]` that exists here; anything else (meta, foo, cuda:99) is a UserError
    now, before any work, not a traceback later."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"{flag} {name[:40]!r} is not a device name (cpu or cuda[:N])") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        raise UserError(f"{flag} {name[:40]!r}: PagedWeight runs on cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{flag} {name}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def resolve_device_dtype(args) -> tuple[torch.device, torch.dtype]:
    device = parse_device(args.device)
    if args.dtype is not None:
        return device, DTYPES[args.dtype]
    return device, torch.float32 if device.type == "cpu" else torch.bfloat16


def add_bits_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bits", type=int, default=None,
                        help="paged models: run every expert block at B bits (3..8); default: bf16 experts")
    parser.add_argument("--bits-file", default=None,
                        help="paged models: JSON map from block key ('L3.E5.gate_up') to bits "
                             "(docs/paged_model.md); --bits fills blocks it does not name")


def load_from_args(args):
    """Load the model and tokenizer named by --model (a checkpoint or a paged model)."""
    from pagedweight.model import load_model
    from pagedweight.frontend.tokenizer import Tokenizer
    from pagedweight.format.paged_model import is_paged_model_dir

    device, dtype = resolve_device_dtype(args)
    bits, bits_file = getattr(args, "bits", None), getattr(args, "bits_file", None)
    if is_paged_model_dir(args.model):
        model = load_paged_from_args(args.model, bits, bits_file, dtype, device)
    elif bits is not None or bits_file is not None:
        raise UserError(f"--bits/--bits-file need a paged model directory; {args.model} is a plain "
                        f"checkpoint (run `pagedweight quantize` first)")
    else:
        model = load_model(args.model, dtype=dtype, device=device)
    return model, Tokenizer(args.model)


def load_paged_from_args(path: str, bits: int | None, bits_file: str | None, dtype, device):
    from pagedweight.format.bit_assignment import check_width, read_bits_file
    from pagedweight.model.dequantized_experts import build_paged_lm, set_model_bits, uniform_bits
    from pagedweight.format.paged_model import load_paged_model

    if bits is not None:
        check_width(bits, "--bits")
    paged = load_paged_model(path, with_bf16=bits is None and bits_file is None)
    if bits is None and bits_file is None:  # the unquantised reference
        from pagedweight.model.source_experts import attach_source_experts

        attach_source_experts(paged)
    model = build_paged_lm(paged, dtype=dtype, device=device)
    if bits_file is not None:
        set_model_bits(model, read_bits_file(bits_file, paged.config, default=bits))
    elif bits is not None:
        set_model_bits(model, uniform_bits(paged.config, bits))
    return model
