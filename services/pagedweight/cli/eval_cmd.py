"""`pagedweight eval ppl`: perplexity of a model on a text file, as one JSON line."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from pagedweight.cli.model_args import add_bits_args, add_model_args, load_from_args
from pagedweight.common.errors import UserError
from pagedweight.offline.perplexity import perplexity


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="evaluate a model")
    evals = parser.add_subparsers(dest="eval_command", required=True)
    ppl = evals.add_parser("ppl", help="perplexity on a text file")
    add_model_args(ppl)
    add_bits_args(ppl)
    ppl.add_argument("--text", required=True, help="UTF-8 text file")
    ppl.add_argument("--seq-len", type=int, default=512, help="scored tokens per window")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score at most N tokens")
    ppl.set_defaults(handler=run_ppl)


def read_text(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{file}: text file does not exist")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{file}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def run_ppl(args) -> int:
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    text = read_text(args.text)
    model, tokenizer = load_from_args(args)
    result = perplexity(model, tokenizer.encode(text), args.seq_len, args.max_tokens)
    bits = {"bits": args.bits, "bits_file": args.bits_file}
    print(json.dumps({"model": args.model, "text": args.text, **bits, **asdict(result)}))
    return 0
