"""Text in and out of the gateway: the one place that knows where the tokenizer lives.

The workers speak token ids only. Here text becomes prompt ids (chat template included)
and streamed ids become text, through `pagedweight.frontend`: its incremental
detokeniser emits only complete characters, and its stop strings cut the text, holding
back the tail that could still grow into one, so a stream never sends what a later token
would take back.
"""

from __future__ import annotations

from pathlib import Path

from pagedweight.format.model_config import ModelConfig
from pagedweight.frontend.detokenizer import RequestDetokenizer
from pagedweight.frontend.tokenizer import Tokenizer


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

    def detokenizer(self, prompt_ids: list[int], stops: tuple[str, ...]) -> RequestDetokenizer:
        """One choice's text stream: `push(ids)` / `finish()` give `TextDelta(text, stopped)`."""
        return RequestDetokenizer(self.tokenizer, prompt_ids, stops)
