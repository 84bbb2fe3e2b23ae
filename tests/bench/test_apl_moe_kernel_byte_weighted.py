"""The layer benchmark's byte-weighted prediction for a mixed layer (bench/apl_moe_kernel.py), on the CPU."""

from bench.apl_moe_kernel import add_byte_weighted, bit_assignment
from pagedweight_kernels.synthetic import random_layer


def _mixed_layer(E=6, H=64, I=96):
    return random_layer(E, H, I, seed=3, bits=bit_assignment("mixed", E, 17))


def test_bytes_by_width_splits_what_the_kernel_reads():
    layer = _mixed_layer()
    experts = [0, 2, 5]
    split = layer.nbytes_by_width(experts)
    assert sum(split.values()) == layer.nbytes_active(experts)
    tensors = [(b.bits, [*b.planes, b.lut]) for e in experts for b in (layer.gate_up[e], layer.down[e])]
    for bits in split:  # the bytes the blocks' plane and LUT tensors hold, width by width
        assert split[bits] == sum(t.numel() * t.element_size() for b, ts in tensors if b == bits for t in ts)
    assert set(split) == {layer.gate_up[e].bits for e in experts} | {layer.down[e].bits for e in experts}


def test_byte_weighted_time_reads_each_width_at_its_own_rate():
    layer = _mixed_layer()
    active, pairs, io = [[0, 1, 2], [3, 4, 5]], [(0, 0), (0, 1)], 512
    shares = [layer.nbytes_by_width(a) for a in active]
    widths = set(shares[0]) | set(shares[1])
    # each uniform width at 1 us per 1000 bytes, except 8 bits at twice that
    rate = {b: (2e-3 if b == 8 else 1e-3) for b in widths}
    row = {"model": "m", "tokens": 1, "bits_mixed": {"fused_us": 50.0}}
    for b in widths:
        row[f"bits_{b}"] = {"bytes": 10_000 + io, "fused_us": 10_000 * rate[b]}
    add_byte_weighted(row, [layer], active, pairs, io)
    expected = sum(rate[b] * (shares[0].get(b, 0) + shares[1].get(b, 0)) / 2 for b in widths)
    assert abs(row["bits_mixed"]["byte_weighted_us"] - expected) < 1e-9
    assert abs(row["bits_mixed"]["over_byte_weighted"] - 50.0 / expected) < 1e-9


def test_no_prediction_when_a_width_of_the_mix_was_not_timed():
    layer = _mixed_layer()
    row = {"model": "m", "tokens": 1, "bits_mixed": {"fused_us": 50.0}, "bits_4": {"bytes": 1000, "fused_us": 1.0}}
    add_byte_weighted(row, [layer], [[0, 1, 2, 3, 4, 5]], [(0, 0)], 0)
    assert "byte_weighted_us" not in row["bits_mixed"]
