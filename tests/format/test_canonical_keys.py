"""Bits-file keys: only the canonical spelling names a block."""

from __future__ import annotations

import json

import pytest

from pagedweight.common.errors import UserError
from pagedweight.format.apl_format import BlockId
from pagedweight.format.bit_assignment import read_bits_file
from pagedweight.format.model_config import ModelConfig
from tests.conftest import BUNDLED_MODEL


@pytest.mark.parametrize("key", ["L 0.E0.down", "L+0.E0.down", "L00.E0.down", "L\u0660.E0.down",
                                 "L0.E\uff10.down", "L-0.E0.down", "L0.E0.down\n", " L0.E0.down",
                                 "l0.e0.down", "L0.E0.DOWN", "L" + "1" * 5000 + ".E0.down"])
def test_non_canonical_spellings_are_not_block_keys(key):
    with pytest.raises(ValueError, match="not a block key"):
        BlockId.parse(key)


@pytest.mark.parametrize("block", [BlockId(0, 0, "down"), BlockId(10, 7, "gate_up"), BlockId(123, 45, "down")])
def test_canonical_keys_round_trip(block):
    assert BlockId.parse(block.key()) == block


def test_a_bits_file_cannot_name_one_block_twice(tmp_path):
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    path = tmp_path / "bits.json"
    path.write_text(json.dumps({"default": 4, "L0.E0.down": 8, "L00.E0.down": 3}))
    with pytest.raises(UserError, match="L00.E0.down"):
        read_bits_file(path, config)
    path.write_text(json.dumps({"default": 4, "L0.E0.down": 8}))
    assert read_bits_file(path, config)[BlockId(0, 0, "down")] == 8


@pytest.mark.parametrize("text, fragment", [
    ("[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ('{"default": ' + "9" * 5000 + "}", "not valid JSON"),
    ('{"default": 4, "L0.E0.down": 1e400}', "bit-width must be an integer"),
    ('{"default": [[[[4]]]]}', "bit-width must be an integer"),
])
def test_hostile_bits_files_are_one_user_error(tmp_path, text, fragment):
    path = tmp_path / "bits.json"
    path.write_text(text)
    with pytest.raises(UserError, match=fragment):
        read_bits_file(path, ModelConfig.from_dir(BUNDLED_MODEL))
