"""`pagedweight generate`: complete one prompt; prints the completion text only."""

from __future__ import annotations

import sys

from pagedweight.cli.model_args import add_model_args, load_from_args, utf8_text
from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="complete one prompt")
    add_model_args(parser)
    parser.add_argument("--prompt", required=True, type=utf8_text, help="prompt text")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], type=utf8_text, help="stop string (repeatable)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
    )
    model, tokenizer = load_from_args(args)
    completion = generate(model, tokenizer, tokenizer.encode(args.prompt), params)
    sys.stdout.write(completion.text + "\n")
    return 0
