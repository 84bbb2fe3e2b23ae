"""Single-stream generation over a contiguous KV cache.

The reference decoding loop: prefill the prompt, then one token per step until EOS, a
stop string or `max_tokens`. The serving engine batches many such streams; this loop is
what it must agree with, and what the CLI uses for one prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.common.errors import ContextLengthError
from pagedweight.engine.sampler import SamplingParams, make_generator, sample
from pagedweight.model.contiguous_kv import ContiguousKVCache
from pagedweight.model.transformer import MoECausalLM


@dataclass
class Completion:
    token_ids: list[int]  # generated tokens (a stop string's tokens included)
    text: str  # decoded text, cut before the first stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length"


def check_context(model: MoECausalLM, num_prompt_tokens: int, max_tokens: int) -> None:
    limit = model.config.max_position_embeddings
    if num_prompt_tokens + max_tokens > limit:
        raise ContextLengthError(
            f"prompt of {num_prompt_tokens} tokens plus max_tokens {max_tokens} exceeds the "
            f"model's context of {limit} tokens"
        )


def find_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index of the earliest stop string in text, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


@torch.inference_mode()
def generate(model: MoECausalLM, tokenizer, prompt_ids: list[int], params: SamplingParams) -> Completion:
    if not prompt_ids:
        raise ContextLengthError("the prompt is empty: give at least one token")
    check_context(model, len(prompt_ids), params.max_tokens)
    device = model.device
    cache = ContiguousKVCache(
        model.config, 1, len(prompt_ids) + params.max_tokens, model.dtype, device
    )
    generator = make_generator(params, device)
    eos_ids = set(model.config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)

    tokens = torch.tensor([prompt_ids], device=device)
    start_pos, out_ids = 0, []
    finish_reason, text = "length", ""
    while len(out_ids) < params.max_tokens:
        logits = model(tokens, start_pos, cache)[:, -1]
        start_pos += tokens.shape[1]
        next_id = int(sample(logits, params, generator)[0])
        if next_id in eos_ids and not params.ignore_eos:
            finish_reason = "stop"
            break
        out_ids.append(next_id)
        if params.stop and tokenizer is not None:
            text = tokenizer.decode(out_ids)
            cut = find_stop(text, params.stop)
            if cut >= 0:
                return Completion(out_ids, text[:cut], "stop")
        tokens = torch.tensor([[next_id]], device=device)
    text = tokenizer.decode(out_ids) if tokenizer is not None else ""
    return Completion(out_ids, text, finish_reason)
