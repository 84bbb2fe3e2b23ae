"""Single-stream generation over a contiguous KV cache, token ids in and out.

The reference decoding loop: prefill the prompt, then one token per step until EOS, a
stop token id or `max_tokens`. The serving engine batches many such streams; this loop is
what it must agree with, and what the CLI uses for one prompt. Text (detokenisation, stop
strings) is the caller's business: `stream_generate` yields token ids as they come so a
front end (pagedweight.frontend.RequestDetokenizer) can stop it early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from pagedweight.common.errors import ContextLengthError, UserError
from pagedweight.engine.sampler import SamplingParams, make_generator, sample
from pagedweight.model.contiguous_kv import ContiguousKVCache
from pagedweight.model.transformer import MoECausalLM


@dataclass
class Completion:
    token_ids: list[int]  # generated tokens (EOS / stop token ids not included)
    finish_reason: str  # "stop" (EOS or a stop token id) or "length"


def check_context(model: MoECausalLM, num_prompt_tokens: int, max_tokens: int) -> None:
    limit = model.config.max_position_embeddings
    if num_prompt_tokens + max_tokens > limit:
        raise ContextLengthError(
            f"prompt of {num_prompt_tokens} tokens plus max_tokens {max_tokens} exceeds the "
            f"model's context of {limit} tokens"
        )


def stream_generate(
    model: MoECausalLM, prompt_ids: list[int], params: SamplingParams, eos_token_ids: Iterable[int] = ()
) -> Iterator[int]:
    """Yield each new token id; returns (StopIteration.value) the finish reason."""
    if not prompt_ids:
        raise ContextLengthError("the prompt is empty: give at least one token")
    if params.stop:
        raise UserError("generate takes token ids only: match stop strings in the front end")
    check_context(model, len(prompt_ids), params.max_tokens)
    device = model.device
    cache = ContiguousKVCache(model.config, 1, len(prompt_ids) + params.max_tokens, model.dtype, device)
    generator = make_generator(params, device)
    eos_ids = set(model.config.eos_token_ids) | {int(t) for t in eos_token_ids}
    finishing = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)

    with torch.inference_mode():
        tokens = torch.tensor([prompt_ids], device=device)
        start_pos, num_out = 0, 0
        while num_out < params.max_tokens:
            logits = model(tokens, start_pos, cache)[:, -1]
            start_pos += tokens.shape[1]
            if num_out < params.min_tokens:  # the engine's ModelRunner does the same
                banned = [t for t in finishing if t < logits.shape[-1]]
                if banned:
                    logits[:, banned] = float("-inf")
            next_id = int(sample(logits, params, generator)[0])
            if next_id in finishing:
                return "stop"
            num_out += 1
            yield next_id
            tokens = torch.tensor([[next_id]], device=device)
    return "length"


def generate(
    model: MoECausalLM, prompt_ids: list[int], params: SamplingParams, eos_token_ids: Iterable[int] = ()
) -> Completion:
    stream = stream_generate(model, prompt_ids, params, eos_token_ids)
    out_ids = []
    while True:
        try:
            out_ids.append(next(stream))
        except StopIteration as done:
            return Completion(out_ids, done.value)
