"""Tokenizer and chat template from a checkpoint directory (`tokenizers` + Jinja)."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as _HFTokenizer

from pagedweight.common.errors import CheckpointError, UserError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: no tokenizer.json in the model directory")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as err:  # the Rust library raises a bare Exception
            raise CheckpointError(f"{path}: unreadable tokenizer ({err})") from None
        settings = _read_json(model_dir / "tokenizer_config.json")
        self.chat_template: str | None = settings.get("chat_template")
        eos = settings.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(eos) if isinstance(eos, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise UserError("this model has no chat template in tokenizer_config.json")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt
            )
        except jinja2.TemplateError as err:
            raise UserError(f"chat template failed on these messages: {err}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
