"""The APL bit-plane format: packing, nested codes and byte counts, exactly."""

import pytest
import torch

from pagedweight.format.apl_format import (
    APLBlock, BIT_WIDTHS, BlockId, block_bytes, dequantize, pack_planes, unpack_codes,
)


def random_codes(rows=5, cols=64, seed=0):
    return torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_plane_bit_layout_is_lsb_first_msb_plane_first():
    codes = torch.zeros(1, 32, dtype=torch.uint8)
    codes[0, 9] = 0b1000_0001  # column 9: bit 7 (plane 0) and bit 0 (plane 7)
    planes = pack_planes(codes)
    assert planes.shape == (8, 1, 4)
    assert planes[0, 0].tolist() == [0, 0b10, 0, 0]  # byte 1, bit 1 -> column 9
    assert planes[7, 0].tolist() == [0, 0b10, 0, 0]
    assert planes[1:7].sum() == 0
    words = planes[0].contiguous().view(torch.int32)  # little-endian uint32 view
    assert words[0, 0].item() == 1 << 9


@pytest.mark.parametrize("bits", BIT_WIDTHS)
def test_b_bit_code_is_the_top_b_bits(bits):
    codes = random_codes()
    planes = pack_planes(codes)
    assert torch.equal(unpack_codes(planes, bits), codes.to(torch.int64) >> (8 - bits))


def test_dequantize_reads_the_lut():
    codes = random_codes(rows=3, cols=32)
    planes = pack_planes(codes)
    lut = torch.randn(3, 16, dtype=torch.float16)
    w = dequantize(planes, lut, 4)
    expected = torch.stack([lut[r, (codes[r].long() >> 4)] for r in range(3)])
    assert torch.equal(w, expected)


def test_bytes_count_planes_and_luts():
    # 8-bit row of 256 weights: 256 bytes of planes + 256 * 2 bytes of LUT (DESIGN.md's example).
    assert block_bytes(1, 256, 8) == 256 + 512
    assert block_bytes(10, 64, 3) == 10 * 64 * 3 // 8 + 10 * 8 * 2
    rows, cols = 7, 96
    block = APLBlock(rows, cols, pack_planes(random_codes(rows, cols)),
                     {b: torch.zeros(rows, 1 << b, dtype=torch.float16) for b in BIT_WIDTHS})
    for b in BIT_WIDTHS:
        resident = block.planes[:b].numel() * 1 + block.luts[b].numel() * 2
        assert block.nbytes(b) == resident


def test_block_keys_round_trip():
    block = BlockId(3, 11, "gate_up")
    assert block.key() == "L3.E11.gate_up" and BlockId.parse(block.key()) == block
    with pytest.raises(ValueError):
        BlockId.parse("L3.E11.up")


def test_unaligned_columns_are_rejected():
    with pytest.raises(ValueError, match="cols"):
        pack_planes(torch.zeros(2, 40, dtype=torch.uint8))
