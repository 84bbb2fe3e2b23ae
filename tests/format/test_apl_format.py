"""The APL bit-plane format: packing, nested codes and byte counts, exactly."""

import pytest
import torch

from pagedweight.format.apl_format import (
    APLBlock, BIT_WIDTHS, LUT_WIDTHS, BlockId, block_bytes, cell_bounds, dequantize, expand_lut, lut_bytes, lut_entries,
    lut_width, pack_planes, plane_bytes, unpack_codes,
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
    lut = torch.randn(3, 17, dtype=torch.float16)  # 16 centroids and the extent
    w = dequantize(planes, lut, 4)
    expected = torch.stack([lut[r, (codes[r].long() >> 4)] for r in range(3)])
    assert torch.equal(w, expected)


def test_bytes_count_planes_and_the_stored_lut():
    # 8-bit row of 256 weights: 256 bytes of planes + LUT_4's 17 * 2 bytes (not 256 * 2).
    assert block_bytes(1, 256, 8) == 256 + 34
    assert block_bytes(10, 64, 3) == 10 * 64 * 3 // 8 + 10 * 8 * 2
    rows, cols = 7, 96
    block = APLBlock(rows, cols, pack_planes(random_codes(rows, cols)),
                     {b: torch.zeros(rows, lut_entries(b), dtype=torch.float16) for b in LUT_WIDTHS})
    for b in BIT_WIDTHS:
        resident = block.planes[:b].numel() * 1 + block.lut(b).numel() * 2
        assert block.nbytes(b) == resident


@pytest.mark.parametrize("cols", [704, 1408, 4096])
def test_lut_bytes_at_8_bits_stay_under_5_percent_of_the_planes(cols):
    # The target the format exists for: Gemma-4's 704- and Qwen1.5-MoE's 1408-input rows.
    assert lut_bytes(1, 8) <= 0.05 * 8 * plane_bytes(1, cols)


def test_wider_widths_read_lut_4():
    assert [lut_width(b) for b in BIT_WIDTHS] == [3, 4, 4, 4, 4, 4]
    with pytest.raises(ValueError):
        lut_width(9)


def sorted_lut4(rows=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    centroids = torch.randn(rows, 16, generator=gen).sort(dim=1).values
    return torch.cat([centroids, torch.rand(rows, 1, generator=gen)], dim=1).to(torch.float16)


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
def test_derived_values_split_each_cell_in_equal_parts(bits):
    lut4 = sorted_lut4()
    values = expand_lut(lut4, bits).float()
    low, high = cell_bounds(lut4)
    n = 1 << (bits - 4)
    for p in range(16):
        part = values[:, p * n:(p + 1) * n]
        expected = low[:, p:p + 1] + (high - low)[:, p:p + 1] * (torch.arange(n) * 2 + 1) / (2 * n)
        torch.testing.assert_close(part, expected, rtol=1e-3, atol=1e-3)  # fp16 rounding
        assert (part >= low[:, p:p + 1] - 1e-3).all() and (part <= high[:, p:p + 1] + 1e-3).all()
    # inner bounds are the midpoints between neighbouring centroids; cells tile the row's range
    l4 = lut4.float()
    torch.testing.assert_close(high[:, :-1], (l4[:, :15] + l4[:, 1:16]) / 2)
    torch.testing.assert_close(low[:, 1:], high[:, :-1])


def test_derived_values_nest_a_b_bit_value_is_its_children_s_mean():
    lut4 = sorted_lut4(seed=1)
    for bits in (5, 6, 7, 8):
        wide, narrow = expand_lut(lut4, bits).float(), expand_lut(lut4, bits - 1).float()
        children_mean = wide.view(wide.shape[0], -1, 2).mean(-1)
        if bits > 5:
            torch.testing.assert_close(children_mean, narrow, rtol=2e-3, atol=2e-3)


def test_uniform_lut_4_derives_the_uniform_grid():
    # centres of 16 equal buckets of [0, 1): every width's derived value is its bucket centre
    lut4 = torch.cat([(torch.arange(16) + 0.5) / 16, torch.tensor([1 / 32])]).to(torch.float16)[None]
    for bits in (5, 6, 7, 8):
        n = 1 << bits
        torch.testing.assert_close(expand_lut(lut4, bits).float()[0], (torch.arange(n) + 0.5) / n, rtol=0, atol=1e-3)


def test_dequantize_above_4_bits_reads_derived_values():
    codes = random_codes(rows=6, cols=64, seed=3)
    lut4 = sorted_lut4()
    w = dequantize(pack_planes(codes), lut4, 8)
    table = expand_lut(lut4, 8)
    assert torch.equal(w, torch.gather(table, 1, codes.long()))
    with pytest.raises(ValueError, match="LUT"):
        dequantize(pack_planes(codes), torch.zeros(6, 256, dtype=torch.float16), 8)  # a format-1 LUT_8


def test_a_block_refuses_per_width_luts():
    rows, cols = 2, 32
    with pytest.raises(ValueError, match="stores LUTs"):
        APLBlock(rows, cols, pack_planes(random_codes(rows, cols)),
                 {b: torch.zeros(rows, 1 << b, dtype=torch.float16) for b in BIT_WIDTHS})


def test_block_keys_round_trip():
    block = BlockId(3, 11, "gate_up")
    assert block.key() == "L3.E11.gate_up" and BlockId.parse(block.key()) == block
    with pytest.raises(ValueError):
        BlockId.parse("L3.E11.up")


def test_unaligned_columns_are_rejected():
    with pytest.raises(ValueError, match="cols"):
        pack_planes(torch.zeros(2, 40, dtype=torch.uint8))


def test_round_to_rounds_fp64_once_to_the_16_bit_formats():
    """round_to is the one rounding an FMA in the activation dtype makes: numpy's fp64 -> fp16 is
    correctly rounded (subnormals and ties to even included); for bf16, an fp32 input is rounded
    once by torch's own cast, and ties that fp64 -> fp32 -> bf16 would round twice stay single."""
    import numpy as np

    from pagedweight.format.apl_format import round_to

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(20000, generator=gen, dtype=torch.float64) * torch.logspace(-9, 4, 20000, dtype=torch.float64)
    x = torch.cat([x, torch.tensor([0.0, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -25, 3 * 2.0 ** -26])])
    assert torch.equal(round_to(x, torch.float16), torch.from_numpy(x.numpy().astype(np.float16)))
    x32 = x.float().double()
    assert torch.equal(round_to(x32, torch.bfloat16), x32.float().to(torch.bfloat16))
    # 1 + 2^-8 + 2^-30: just above a bf16 tie; via fp32 it would land on the tie and round to even (down)
    assert round_to(torch.tensor([1 + 2.0 ** -8 + 2.0 ** -30], dtype=torch.float64), torch.bfloat16).item() == 1 + 2.0 ** -7


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_derived_values_are_one_fma_of_the_cell_s_offset_and_width(dtype):
    from pagedweight.format.apl_format import cell_affine, round_to

    lut4 = sorted_lut4(rows=8, seed=5)
    for bits in (5, 6, 7, 8):
        offset, width = cell_affine(lut4, bits, dtype)
        n = 1 << (bits - 4)
        values = expand_lut(lut4, bits, dtype).view(8, 16, n)
        exact = offset.double()[:, :, None] + width.double()[:, :, None] * (1 + torch.arange(n, dtype=torch.float64) / n)
        assert torch.equal(values, round_to(exact, dtype))
        # the value sits at its sub-interval's centre to within the dtype's rounding
        low, high = cell_bounds(lut4)
        centre = low[:, :, None] + (high - low)[:, :, None] * ((2 * torch.arange(n) + 1) / (2 * n))
        tolerance = 4 * torch.finfo(dtype).eps * (low.abs() + (high - low).abs())[:, :, None]
        assert ((values.float() - centre).abs() <= tolerance).all()
