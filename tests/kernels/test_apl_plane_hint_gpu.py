"""The plane words' cache qualifiers (APL_PLANE_HINT: L2::256B on column splits of at least
APL_PLANE_L2_MIN_WORDS words, by default; L1::no_allocate; L2::128B) change where the caches keep
the planes, never the bytes loaded: every hinted launch must match the reference and equal the
unhinted one bit for bit, on splits long enough for the hint (whole rows of 160 and 176 words: one
split per row tile, from a launch target of one CTA), on splits that straddle the threshold, in
every kernel class (3-4 bits, 5-8 bits, both in the merged kernel, stable launches) and in the
tiles regime, with 4-byte plane loads too (an odd word count per row)."""

import pytest
import torch

import pagedweight_kernels.apl_moe as op
from pagedweight_kernels.apl_moe import kernel_available, plan_launch
from pagedweight_kernels.synthetic import mixed_bits
from tests.kernels.test_apl_moe_gpu import check_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernel_available(), reason="needs a CUDA GPU and cupy")]

# (experts, top_k, hidden, intermediate, tokens, experts used, dtype): gate_up reads rows of 130
# words (hidden 4160), down of 130 or 129 (intermediate 4160 / 4128: 4-byte loads); decode at 1
# and 3 tokens, the tiles regime at 32 (16 tokens a pass: whole rows)
CASES = [(4, 2, 4160, 4160, 1, 4, torch.bfloat16), (4, 2, 4160, 4128, 3, 3, torch.float16),
         (4, 2, 4160, 4160, 32, 4, torch.bfloat16)]
HINTS = ((2, 128), (3, 0))  # (APL_PLANE_HINT, APL_PLANE_L2_MIN_WORDS): the default; no_allocate + 256B everywhere


def _id(v):
    return "-".join(str(x).replace("torch.", "") for x in v) if isinstance(v, tuple) else str(v)


@pytest.mark.parametrize("bits,stable", [(4, False), (8, False), ("mixed", False), (3, True)], ids=_id)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_hinted_plane_loads_equal_plain_ones(case, bits, stable, monkeypatch):
    E, k, H, I, T = case[:5]
    # one column split per row tile: the splits are whole rows, long enough for every hint
    monkeypatch.setattr(op, "GEMV_TARGET_CTAS", 1)
    monkeypatch.setattr(op, "GEMV_WIDE_TARGET_CTAS", 1)
    plan = plan_launch(T, k, E, H, I, 8 if bits == "mixed" else bits, stable_launches=stable)
    assert plan.gate_up.regime in ("gemv", "tiles") and plan.gate_up.splits == plan.down.splits == 1
    assignment = mixed_bits(E) if bits == "mixed" else bits
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_PLANE_HINT", 0)
    plain = check_case(case, bits=assignment, stable=stable)
    for hint, min_words in HINTS:
        monkeypatch.setitem(op.KERNEL_DEFINES, "APL_PLANE_HINT", hint)
        monkeypatch.setitem(op.KERNEL_DEFINES, "APL_PLANE_L2_MIN_WORDS", min_words)
        assert torch.equal(check_case(case, bits=assignment, stable=stable), plain), (hint, min_words)


def test_splits_around_the_threshold_equal_plain_ones(monkeypatch):
    """The default planner's splits on a long-row layer: some CTAs of a launch take the hint and
    others not (the last split of a row is shorter), mixed widths, the default hint against none."""
    case = (4, 2, 4160, 4160, 4, 4, torch.bfloat16)
    E, k, H, I, T = case[:5]
    plan = plan_launch(T, k, E, H, I, 8)
    words = [plan.gate_up.split_cols // 32, plan.down.split_cols // 32]
    assert plan.down.splits > 1 and words[1] * (plan.down.splits - 1) < I // 32  # a shorter last split
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_PLANE_HINT", 0)
    plain = check_case(case, bits=mixed_bits(E))
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_PLANE_HINT", 2)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_PLANE_L2_MIN_WORDS", min(words))
    assert torch.equal(check_case(case, bits=mixed_bits(E)), plain)
