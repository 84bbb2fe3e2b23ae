"""Log-probabilities in OpenAI's two shapes, as vLLM fills them.

The worker returns, per generated token, its log-probability and the k most likely
tokens' (from the raw logits). Completions want `{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}` (the sampled token is in each top
dict too); chat wants `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
Token text is each id decoded alone; -inf becomes -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import math

from pagedweight.gateway.generation import TokenLogprob


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


class CompletionLogprobs:
    """One choice's accumulating completions logprobs; `take()` returns what came since."""

    def __init__(self, decode, text_offset: int = 0):
        self.decode, self.offset = decode, text_offset

    def part(self, entries: tuple[TokenLogprob, ...]) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for entry in entries:
            token = self.decode([entry.token_id])
            tokens.append(token)
            token_logprobs.append(_finite(entry.logprob))
            ranked = {self.decode([t]): _finite(lp) for t, lp in entry.top}
            ranked.setdefault(token, _finite(entry.logprob))
            top.append(ranked)
            offsets.append(self.offset)
            self.offset += len(token)
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


def merge_completion(parts: list[dict]) -> dict:
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for part in parts:
        for key in out:
            out[key].extend(part[key])
    return out


def chat_content(decode, entries: tuple[TokenLogprob, ...], num_top: int) -> list[dict]:
    def item(token_id: int, logprob: float) -> dict:
        token = decode([token_id])
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}

    return [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top[:num_top]]}
            for e in entries]
