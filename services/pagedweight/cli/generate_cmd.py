"""`pagedweight generate`: complete one prompt; prints the completion text only.

Token ids come from the single-stream loop (engine/generate.py); text and stop strings
from the front end (pagedweight.frontend), the same path the gateway streams through.
"""

from __future__ import annotations

import sys

from pagedweight.cli.config_defaults import default_of
from pagedweight.cli.model_args import add_model_args, load_from_args, utf8_text
from pagedweight.engine.generate import stream_generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.format.model_config import read_eos_token_ids
from pagedweight.frontend.detokenizer import RequestDetokenizer


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="complete one prompt")
    add_model_args(parser)
    parser.add_argument("--prompt", required=True, type=utf8_text, help="prompt text")
    # The command's own length default (a reader wants a paragraph); the sampling defaults
    # are the library's.
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=default_of(SamplingParams, "temperature"),
                        help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=default_of(SamplingParams, "top_p"))
    parser.add_argument("--top-k", type=int, default=default_of(SamplingParams, "top_k"))
    parser.add_argument("--seed", type=int, default=default_of(SamplingParams, "seed"))
    parser.add_argument("--stop", action="append", default=[], type=utf8_text, help="stop string (repeatable)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )
    model, tokenizer = load_from_args(args)
    prompt_ids = tokenizer.encode(args.prompt)
    detok = RequestDetokenizer(tokenizer, prompt_ids, stop=args.stop)
    eos_ids = (*read_eos_token_ids(args.model), *tokenizer.eos_token_ids)
    for token in stream_generate(model, prompt_ids, params, eos_ids):
        if detok.push([token]).stopped:
            break
    else:
        detok.finish()
    sys.stdout.write(detok.text + "\n")
    return 0
