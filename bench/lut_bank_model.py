"""How many shared-memory wavefronts one LDS.U16 of the 5-8-bit decode path costs, by model (no GPU):
a warp's 32 lanes are 8 weight rows x 4 lanes (apl_gemv.cu's g, t), each looking up a random code
of its row's LUT; a wavefront serves one 4-byte word per bank, so the lookup takes as many
wavefronts as the most distinct words any one bank is asked for (lanes reading the same word
share it). Layouts: rows of exactly 2^bits entries (the 5-8-bit kernel of a one-width layer), rows
in rooms of 256 entries (the merged kernel's), and those rooms with odd 5-bit rows 64 bytes in
(APL_LUT_STAGGER). The staged regime's producers (apl_staged.cu) look up 32 rows x 1 lane (thread
i owns row i), in rows of 2^bits entries for a one-width launch or of 256 for a launch whose widest
block has 8 bits (no stagger). Prints the mean wavefronts per LDS and the weights per cycle and SM
that one wavefront per cycle allows (32 per LDS over that mean).

    python -m bench.lut_bank_model [--trials N] [--seed S]
"""

from __future__ import annotations

import argparse
import random

ROWS_PER_LDS, LANES_PER_ROW, BANKS = 8, 4, 32


def row_start(row: int, bits: int, room: int, stagger: bool) -> int:
    """The row's first entry (apl_gemv.cu's lut_row_start): rooms of `room` entries, odd 5-bit rows 32 in."""
    return row * room + (32 if stagger and row & 1 and bits == 5 and room >= 64 else 0)


def wavefronts(codes: list[list[int]], bits: int, room: int, stagger: bool) -> int:
    """Wavefronts of one LDS.U16: codes[row][lane] looked up in 2-byte entries."""
    words_by_bank: dict[int, set[int]] = {}
    for row, lanes in enumerate(codes):
        for code in lanes:
            word = (row_start(row, bits, room, stagger) + code) * 2 // 4
            words_by_bank.setdefault(word % BANKS, set()).add(word)
    return max(len(words) for words in words_by_bank.values())


STAGED_ROWS_PER_LDS, STAGED_LANES_PER_ROW = 32, 1


def mean_wavefronts(bits: int, room: int, stagger: bool, trials: int, rng: random.Random,
                    rows: int = ROWS_PER_LDS, lanes: int = LANES_PER_ROW) -> float:
    total = 0
    for _ in range(trials):
        codes = [[rng.randrange(1 << bits) for _ in range(lanes)] for _ in range(rows)]
        total += wavefronts(codes, bits, room, stagger)
    return total / trials


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    rng = random.Random(args.seed)
    print("bits  own rows        rooms of 256      rooms of 256, staggered   staged: own rows  staged: rooms of 256"
          "   (wavefronts per LDS; weights/cycle/SM)")
    staged = (STAGED_ROWS_PER_LDS, STAGED_LANES_PER_ROW)
    for bits in (5, 6, 7, 8):
        cells = []
        for room, stagger, shape in ((1 << bits, False, ()), (256, False, ()), (256, True, ()),
                                     (1 << bits, False, staged), (256, False, staged)):
            w = mean_wavefronts(bits, room, stagger, args.trials, rng, *shape)
            cells.append(f"{w:5.2f} ({32 / w:4.1f})")
        print(f"{bits:4d}  " + "      ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
