"""Flags shared by every command that loads a model, and the loading itself."""

from __future__ import annotations

import argparse

import torch

from services.common.errors import UserError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None,
        help="activation and weight dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )


def resolve_device_dtype(args) -> tuple[torch.device, torch.dtype]:
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UserError(f"--device {args.device!r} is not a device name") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: CUDA is not available on this machine")
    if args.dtype is not None:
        return device, DTYPES[args.dtype]
    return device, torch.float32 if device.type == "cpu" else torch.bfloat16


def load_from_args(args):
    """Load the model and tokenizer named by --model."""
    from services.worker.model import load_model
    from services.worker.model.tokenizer import Tokenizer

    device, dtype = resolve_device_dtype(args)
    model = load_model(args.model, dtype=dtype, device=device)
    return model, Tokenizer(args.model)
