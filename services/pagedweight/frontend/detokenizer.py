"""Incremental detokenisation and stop strings for one request's token stream.

The engine is tokens in, tokens out; this module turns its output ids into text deltas a
streaming front end can send as they come (the gateway and `pagedweight generate` both
use it). One `RequestDetokenizer` per request:

    detok = RequestDetokenizer(tokenizer, stop=["\\n\\n"], include_stop_str_in_output=False)
    for out in engine_stream:                  # each with new_token_ids
        delta = detok.push(out.new_token_ids)  # -> TextDelta(text, stopped)
        send(delta.text)
        if delta.stopped:                      # a stop string matched: abort the request
            break
    else:
        send(detok.finish().text)              # the engine finished: release held text

Guarantees:
- The deltas of a request that ran to its end, concatenated, equal
  `tokenizer.decode(output_ids)` exactly (skip_special_tokens, as `decode` does).
- Text is held back while it may still change: a trailing U+FFFD (a multi-byte UTF-8
  character split over byte tokens) and any suffix that could be the start of a stop
  string. `finish()` releases what is held (minus nothing: no stop string matched).
- A stop string is matched on the detokenised text, so it is found however the tokenizer
  splits it. The first stop string to complete wins (as a character stream would see it,
  whatever the chunking); the output is cut before it (or just after it with
  `include_stop_str_in_output`), and nothing after it is ever sent. `stop_reason` names it.

Cost: each push decodes a short window of recent tokens (vLLM's prefix/read offsets), not
the whole output; `finish()` decodes the output once to make the final text exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from pagedweight.common.errors import UserError

_REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text to send (may be empty)
    stopped: bool = False  # a stop string matched: the request's text is complete


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """(index, stop string) of the first stop string to complete in text[start:], or None.

    "First to complete" (the smallest end index; on a tie the longer string) is what a
    character-by-character stream would see, so the result does not depend on how the
    text arrived in chunks.
    """
    best = None  # (end, -len, index, stop)
    for stop in stops:
        i = text.find(stop, start)
        if i >= 0:
            key = (i + len(stop), -len(stop), i, stop)
            best = key if best is None or key < best else best
    return None if best is None else (best[2], best[3])


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class IncrementalDetokenizer:
    """Token ids in, stable text out: deltas that concatenate to decode(all ids)."""

    def __init__(self, tokenizer: Decoder):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # stable text so far
        self._prefix = 0  # window start: tokens before it are never re-decoded
        self._read = 0  # tokens whose text is already in self.text

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read])
        window_text = self.tokenizer.decode(self.ids[self._prefix :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""  # nothing yet, or a character still being assembled from bytes
        if not window_text.startswith(prefix_text):
            return ""  # the decoder rewrote earlier text: wait, finish() reconciles
        delta = window_text[len(prefix_text) :]
        self.text += delta
        self._prefix, self._read = self._read, len(self.ids)
        return delta

    def finish(self) -> str:
        """The rest of the text, exact against one full decode."""
        full = self.tokenizer.decode(self.ids)
        if not full.startswith(self.text):  # cannot happen for byte-level or piece decoders
            raise RuntimeError("incremental detokenisation diverged from the full decode")
        delta = full[len(self.text) :]
        self.text = full
        self._prefix = self._read = len(self.ids)
        return delta


class RequestDetokenizer:
    """One request's text stream: incremental detokenisation plus stop strings.

    `prompt_ids` is kept for callers that want it (usage counts); the text is the output's
    own decode, as `tokenizer.decode(output_ids)` gives it.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise UserError("stop strings must be non-empty strings")
        self.prompt_ids = list(prompt_ids)
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self._detok = IncrementalDetokenizer(tokenizer)
        self._sent = 0  # characters of self._detok.text already returned
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that matched

    @property
    def output_ids(self) -> list[int]:
        return self._detok.ids

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return self._detok.text[: self._sent]

    def push(self, new_ids: Sequence[int]) -> TextDelta:
        if self.stopped:
            return TextDelta("", True)
        self._detok.push(new_ids)
        return self._release(final=False)

    def finish(self) -> TextDelta:
        """The engine finished the request (EOS, a stop token, length): release the rest."""
        if self.stopped:
            return TextDelta("", True)
        self._detok.finish()
        return self._release(final=True)

    def _release(self, final: bool) -> TextDelta:
        text = self._detok.text
        if self.stop:
            # A match can start up to len(stop) - 1 characters before the unsent text.
            start = max(0, self._sent - max(len(s) for s in self.stop) + 1)
            hit = find_stop(text, self.stop, start)
            if hit is not None:
                index, stop = hit
                end = index + len(stop) if self.include_stop else index
                delta = text[self._sent : end] if end > self._sent else ""
                self._sent = max(self._sent, end)
                self.stopped, self.stop_reason = True, stop
                return TextDelta(delta, True)
        hold = 0 if final else partial_stop_len(text, self.stop)
        end = max(self._sent, len(text) - hold)
        delta, self._sent = text[self._sent : end], end
        return TextDelta(delta)
