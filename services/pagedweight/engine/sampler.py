"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedweight.common.errors import UserError


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
