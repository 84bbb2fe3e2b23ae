"""The CTA order of the 5-8-bit and merged kernels (APL_GEMV_ORDER), on the GPU: widest experts
first and expert-major CTA numbering change which CTA does which (expert, row tile, split), never
what is summed or in which order, so every ordered launch must equal the natural one bit for bit,
with NaN-poisoned workspaces (check_case), ragged routing, layers of more than 32 and 64 experts
(the pick walks the experts 32 at a time) and a block whose descriptor holds bad bits."""

import pytest
import torch

import pagedweight_kernels.apl_moe as op
from pagedweight_kernels.apl_moe import apl_moe, kernel_available, plan_launch
from pagedweight_kernels.synthetic import mixed_bits, ragged_routing, random_layer
from tests.kernels.test_apl_moe_gpu import CASES, check_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernel_available(), reason="needs a CUDA GPU and cupy"),
              pytest.mark.usefixtures("tiles_regime")]  # (tests/kernels/conftest.py)


ORDERS = (3, 7)  # decode only; decode and the tiles regime (bit 0 and bit 1 alone: bench only)
# Mixed widths (the merged kernel) at decode: odd words, idle experts, column splits, several
# passes, Qwen size; in the tiles regime (bit 2): 16 and 64 tokens a pass, Qwen-size tiles; and a
# 100-expert layer whose tokens go to experts past 32 and 64, at decode and in the tiles regime.
# All bf16: each order is a compile of every instance (the fixture), fp16 would double it.
WIDE = (100, 4, 256, 384, 6, 100, torch.bfloat16)
WIDE_TILES = (100, 4, 256, 384, 300, 90, torch.bfloat16)
ORDER_CASES = [c[:6] + (torch.bfloat16,) for c in (CASES[0], CASES[1], CASES[4], CASES[5], CASES[9], CASES[6],
                                                   CASES[7], CASES[10])] + [WIDE, WIDE_TILES]
FIVE_TO_EIGHT = {(e, m): (5, 6, 8, 7)[(e + (m == "down")) % 4] for e in range(8) for m in ("gate_up", "down")}


@pytest.fixture(scope="module", autouse=True)
def ordered_instances_compiled():
    """The bf16 instances at the natural order and at each of ORDERS, compiled first in threads."""
    natural = op.KERNEL_DEFINES["APL_GEMV_ORDER"]
    try:
        for order in (0,) + ORDERS:
            op.KERNEL_DEFINES["APL_GEMV_ORDER"] = order
            op.precompile(torch.bfloat16, max_workers=16)
    finally:
        op.KERNEL_DEFINES["APL_GEMV_ORDER"] = natural


def _id(v):
    return "-".join(str(x).replace("torch.", "") for x in v) if isinstance(v, tuple) else str(v)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("case", ORDER_CASES, ids=_id)
def test_ordered_launches_equal_natural_ones(case, order, monkeypatch):
    E, k, H, I, T = case[:5]
    assert plan_launch(T, k, E, H, I, 8).gate_up.regime in ("gemv", "tiles")
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_ORDER", 0)
    natural = check_case(case)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_ORDER", order)
    assert torch.equal(check_case(case), natural)


@pytest.mark.parametrize("order", (3, 15))
def test_five_to_eight_bit_layer_in_order(order, monkeypatch):
    """A layer of 5-8-bit blocks only: the 5-8-bit kernel's launch (CLS 1), widths per expert, in
    its natural order at 3 and ordered at 15 (bit 3)."""
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_ORDER", 0)
    natural = check_case(CASES[4], bits=FIVE_TO_EIGHT)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_ORDER", order)
    assert torch.equal(check_case(CASES[4], bits=FIVE_TO_EIGHT), natural)


@pytest.mark.parametrize("tokens", (3, 60))
def test_bad_bits_block_in_order(tokens, monkeypatch):
    """A descriptor row with bits 9 (the heavy order puts it first): its tokens come out NaN, the
    rest as in the natural order, bit for bit."""
    device = torch.device("cuda")
    E, k, H, I = 8, 2, 256, 384
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).to(device, torch.bfloat16)
    ids, w = ragged_routing(tokens, E, k, seed=tokens, device=device)
    bad = int(ids[0, 1])
    outs = {}
    for order in (0, 3, 7):
        monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_ORDER", order)
        layer = random_layer(E, H, I, seed=4, device=device, bits=mixed_bits(E))
        layer.down_desc[bad, op.DESC_BITS] = 9
        outs[order] = apl_moe(x, ids, w.to(torch.bfloat16), layer)
        assert not layer.counters.any()
    hit = (ids == bad).any(dim=1)
    assert outs[0][hit].isnan().all() and not outs[0][~hit].isnan().any()
    for order in (3, 7):
        torch.testing.assert_close(outs[order], outs[0], rtol=0, atol=0, equal_nan=True)
