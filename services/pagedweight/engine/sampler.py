"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedweight.common.errors import UserError

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # new tokens at most
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # fixes the sampled sequence
    # Stop strings are text: the front end (pagedweight.frontend) matches them and aborts
    # the request; the engine refuses params that carry any (it never sees text).
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # finish like EOS (not in output)
    ignore_eos: bool = False  # keep going past EOS (benchmarks); stop_token_ids still stop
    min_tokens: int = 0  # EOS and stop token ids cannot be sampled before this many tokens
    # The sampled token's log-probability and the `logprobs` most likely tokens' (0..20),
    # from the raw logits (vLLM's default logprobs mode); None: none returned.
    logprobs: int | None = None
    # vLLM's penalties: presence and frequency over output tokens, repetition over prompt
    # and output tokens (1.0: off); logit_bias: (token id, bias) pairs added to the logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise UserError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise UserError(f"seed must be in 0..2^63-1, got {self.seed}")
        if any(not s for s in self.stop):
            raise UserError("stop strings must not be empty")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise UserError("stop_token_ids must be non-negative integers")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise UserError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise UserError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise UserError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise UserError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise UserError(f"logit_bias: token {token} bias {bias}: ids >= 0, biases in [-100, 100]")

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before sampling (penalties, bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    if params.greedy or params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    # float64 and the max subtracted first: a tiny temperature (1e-300) then sends every
    # other logit to -inf instead of overflowing to inf/NaN (float32 would round T to 0)
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_ids = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        drop[:, 0] = False  # the most likely token stays, however small top_p is
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, sorted_ids, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """vLLM's order and formulas, one row [1, V]: logit_bias added, then repetition (prompt
    and output tokens: positive logits divided, others multiplied), frequency (times each
    output token's count) and presence (once per output token seen) subtracted."""
    vocab = logits.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=logits.dtype, device=logits.device)
        logits[0, ids] += bias
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        row = logits[0, seen]
        logits[0, seen] = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=logits.device),
                                minlength=vocab)[:vocab].to(logits.dtype)
        logits[0] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits
