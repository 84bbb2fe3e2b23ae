"""Perplexity over a text file.

The text is tokenised once and cut into non-overlapping windows of `seq_len` scored
tokens: window i feeds tokens [i*L, i*L + L) and scores their successors, so every token
but the file's first is scored exactly once and each scored token sees only its own
window as context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedweight.common.errors import UserError


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # scored tokens
    windows: int
    seq_len: int


def token_windows(ids: list[int], seq_len: int, max_tokens: int | None) -> list[list[int]]:
    """Windows of seq_len + 1 ids overlapping by one (the last input is the next's first target)."""
    limit = len(ids) - 1 if max_tokens is None else min(len(ids) - 1, max_tokens)
    windows = []
    for start in range(0, limit, seq_len):
        scored = min(seq_len, limit - start)
        windows.append(ids[start : start + scored + 1])
    return windows


@torch.inference_mode()
def perplexity(model, ids: list[int], seq_len: int = 512, max_tokens: int | None = None,
               batch_size: int = 4) -> PerplexityResult:
    if seq_len < 1:
        raise UserError(f"--seq-len must be >= 1, got {seq_len}")
    if seq_len > model.config.max_position_embeddings:
        raise UserError(
            f"--seq-len {seq_len} exceeds the model's context of "
            f"{model.config.max_position_embeddings} tokens"
        )
    windows = token_windows(ids, seq_len, max_tokens)
    if not windows:
        raise UserError("the text has fewer than two tokens: nothing to score")
    if max(max(w) for w in windows) >= model.config.vocab_size:
        raise UserError(f"the tokenizer produced token id {max(max(w) for w in windows)}, outside the "
                        f"model's vocabulary of {model.config.vocab_size}: tokenizer and config disagree")
    total_nll, total_tokens = 0.0, 0
    for i in range(0, len(windows), batch_size):
        for group in _same_length_groups(windows[i : i + batch_size]):
            batch = torch.tensor(group, device=model.device)
            logits = model(batch[:, :-1]).float()
            nll = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            total_nll += nll.item()
            total_tokens += batch[:, 1:].numel()
    mean = total_nll / total_tokens
    # NaN/inf would print as `"ppl": NaN` (not even JSON) with exit 0; exp overflows past ~709
    if not math.isfinite(mean) or mean > MAX_NLL:
        raise NonFiniteResult(f"perplexity is not a finite number (mean NLL {mean}): the model's outputs "
                              f"are NaN or infinite; check its weights and --dtype")
    return PerplexityResult(math.exp(mean), mean, total_tokens, len(windows), seq_len)


MAX_NLL = 700.0  # nats: exp(700) is near the largest float64


class NonFiniteResult(UserError):
    """An evaluation produced NaN or infinity: reported as an error, never as a result."""


def _same_length_groups(windows: list[list[int]]) -> list[list[list[int]]]:
    """Only the file's last window can be shorter: batch it on its own."""
    full = [w for w in windows if len(w) == len(windows[0])]
    rest = [w for w in windows if len(w) != len(windows[0])]
    return [full] + ([rest] if rest else [])
