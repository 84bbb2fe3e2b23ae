"""Tokenizer and chat template from a model directory (`tokenizers` + a sandboxed Jinja).

Torch-free: the gateway imports it. EOS ids here are the tokenizer's; the engine gets
the model's own from config.json (see pagedweight.format.model_config) and callers that
hold a tokenizer pass its ids in addition.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from pagedweight.common.errors import CheckpointError, UserError
from pagedweight.common.json_files import read_json_object
from pagedweight.common.safe_paths import model_file
from pagedweight.frontend.chat_template import render_chat_template


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_file(model_dir, "tokenizer.json")
        if path is None:
            raise CheckpointError(f"{model_dir / 'tokenizer.json'}: no tokenizer.json in the model directory")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as err:  # the Rust library raises a bare Exception
            raise CheckpointError(f"{path}: unreadable tokenizer ({err})") from None
        self._config_path = model_dir / "tokenizer_config.json"
        settings = _read_json(model_dir, "tokenizer_config.json")
        self.chat_template: str | None = settings.get("chat_template")
        eos = settings.get("eos_token")
        if isinstance(eos, dict):  # an AddedToken written out as {"content": ...}
            eos = eos.get("content")
        self.eos_token_id = self._tok.token_to_id(eos) if isinstance(eos, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return () if self.eos_token_id is None else (self.eos_token_id,)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            max_chars: int | None = None) -> str:
        if not self.chat_template:
            raise UserError("this model has no chat template in tokenizer_config.json")
        return render_chat_template(
            self.chat_template, str(self._config_path), messages, add_generation_prompt, max_chars=max_chars
        )


def _read_json(model_dir: Path, name: str) -> dict:
    path = model_file(model_dir, name)
    if path is None:
        return {}
    return read_json_object(path, name, CheckpointError)  # deep nesting, NaN, huge ints: one error
