"""Text in and out of the gateway: the one place that knows where the tokenizer lives.

The workers speak token ids only. Here text becomes prompt ids (chat template included)
and streamed ids become text: an incremental detokeniser emits only complete characters,
and stop strings cut the text, holding back the tail that could still grow into one so a
stream never sends what a later token would take back.
"""

from __future__ import annotations

from pathlib import Path

from pagedweight.format.model_config import ModelConfig
# The tokenizer's home until pagedweight.frontend lands (then this import is the one
# line that changes).
from pagedweight.model.tokenizer import Tokenizer


class TextCodec:
    """Tokenizer, chat template and the model's context length, for one model directory."""

    def __init__(self, model_dir: str | Path):
        self.tokenizer = Tokenizer(model_dir)
        config = ModelConfig.from_dir(Path(model_dir))
        self.max_model_len = config.max_position_embeddings
        self.vocab_size = config.vocab_size  # token ids the model accepts: 0..vocab_size-1

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def detokenizer(self, prompt_ids: list[int]) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self.decode, prompt_ids)


class IncrementalDetokenizer:
    """Token ids in, new text out. Decodes a short window (the previous token(s) as
    context, so a leading space or a multi-byte character comes out right) and waits while
    the window ends in an incomplete UTF-8 sequence (U+FFFD)."""

    CONTEXT_TOKENS = 4

    def __init__(self, decode, prompt_ids: list[int]):
        self._decode = decode
        self._ids = list(prompt_ids[-self.CONTEXT_TOKENS:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this are already emitted as text

    def push(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        delta = after[len(before):]
        self._prefix = max(self._read - self.CONTEXT_TOKENS, 0)
        self._read = len(self._ids)
        return delta


class StopStringFilter:
    """Cuts generated text at the first stop string; in a stream, holds back the last
    (longest stop - 1) characters until they can no longer start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._text = ""
        self._sent = 0  # characters of _text already released
        self.hit: str | None = None  # the stop string that ended the text

    def push(self, delta: str) -> str:
        """Add new text; return what may be released now (empty once a stop hit)."""
        if self.hit is not None:
            return ""
        start = max(len(self._text) - self._holdback, 0)
        self._text += delta
        cut, hit = -1, None
        for stop in self.stops:
            i = self._text.find(stop, start)
            if i >= 0 and (cut < 0 or i < cut):
                cut, hit = i, stop
        if hit is not None:
            self.hit = hit
            self._text = self._text[:cut]
            return self._release(len(self._text))
        return self._release(len(self._text) - self._holdback)

    def flush(self) -> str:
        """The held-back tail, once the stream has ended without a stop string."""
        return self._release(len(self._text))

    @property
    def text(self) -> str:
        return self._text

    def _release(self, end: int) -> str:
        end = max(end, self._sent)
        out, self._sent = self._text[self._sent:end], end
        return out
