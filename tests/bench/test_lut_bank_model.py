"""bench/lut_bank_model: wavefronts of one LUT lookup by bank, exact on hand-made codes."""

import random

import pytest

from bench.lut_bank_model import main, mean_wavefronts, row_start, wavefronts


def test_row_starts_follow_the_kernels_stagger():
    assert [row_start(r, 5, 256, True) for r in range(3)] == [0, 256 + 32, 512]
    assert [row_start(r, 5, 32, True) for r in range(2)] == [0, 32]  # own rows: nothing to stagger
    assert row_start(1, 6, 256, True) == 256  # 6 bits already cover every bank


def test_wavefronts_count_distinct_words_per_bank():
    same = [[0, 0, 1, 1]] + [[0] * 4 for _ in range(7)]
    # rooms of 256 entries: every row's entries 0-1 are bank 0's word, 8 distinct words
    assert wavefronts(same, 8, 256, False) == 8
    assert wavefronts(same, 5, 256, True) == 4  # odd rows moved to bank 16
    assert wavefronts([[0, 1, 2, 3]] + [[] for _ in range(7)], 8, 256, False) == 1  # one row: no conflict


def test_the_stagger_brings_5_bit_rooms_to_the_5_bit_kernels_rate():
    rng = random.Random(1)
    own, room, staggered = (mean_wavefronts(5, r, s, 3000, rng) for r, s in ((32, False), (256, False), (256, True)))
    assert room > 1.3 * own and abs(staggered - own) < 0.1


def test_staged_lookups_of_32_rows_in_rooms_of_256_meet_in_half_the_banks():
    """32 rows x 1 lane (the staged producers): 5-bit rows of their own size cover every bank, in
    rooms of 256 entries all start at bank 0 and their 16 words meet in banks 0-15."""
    assert wavefronts([[0]] * 32, 5, 256, False) == 32  # every row's entry 0: bank 0, 32 words
    assert wavefronts([[0]] * 32, 5, 32, False) == 16  # rows 16 words apart: banks 0 and 16
    rng = random.Random(2)
    own, room = (mean_wavefronts(5, r, False, 3000, rng, 32, 1) for r in (32, 256))
    assert room > 1.3 * own


def test_main_rejects_no_trials(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--trials", "0"])
    assert exc.value.code == 2
