"""The plane words' cache qualifiers (APL_PLANE_HINT: L2::256B by default, in the tiles instances
of 64-token passes, APL_PLANE_HINT_MIN_NT8; L1::no_allocate and L2::128B as knobs) change where
the caches keep the planes, never the bytes loaded: every hinted launch must match the reference
and equal the unhinted one bit for bit, in every kernel class (3-4 bits, 5-8 bits, both in the
merged kernel, stable launches), at decode (hinted only with APL_PLANE_HINT_MIN_NT8 1) and in the
tiles regime at 64 tokens a pass, with 4-byte plane loads too (an odd word count per row)."""

import pytest
import torch

import pagedweight_kernels.apl_moe as op
from pagedweight_kernels.apl_moe import kernel_available, plan_launch
from pagedweight_kernels.synthetic import mixed_bits
from tests.kernels.test_apl_moe_gpu import check_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernel_available(), reason="needs a CUDA GPU and cupy"),
              pytest.mark.usefixtures("tiles_regime")]  # (tests/kernels/conftest.py)


# (experts, top_k, hidden, intermediate, tokens, experts used, dtype): decode at 1 and 3 tokens
# (down's rows of 129 words at 3: 4-byte loads), the tiles regime at 64 (32 tokens an expert:
# 8-token tiles per pass 8, the instances hinted by default)
CASES = [(4, 2, 1024, 2048, 1, 4, torch.bfloat16), (4, 2, 1024, 4128, 3, 3, torch.float16),
         (4, 2, 1024, 2048, 64, 4, torch.bfloat16)]
HINTS = ((2, 1), (3, 1))  # (APL_PLANE_HINT, APL_PLANE_HINT_MIN_NT8): L2::256B, with L1::no_allocate, everywhere


def _id(v):
    return "-".join(str(x).replace("torch.", "") for x in v) if isinstance(v, tuple) else str(v)


@pytest.mark.parametrize("bits,stable", [(4, False), (8, False), ("mixed", False), (3, True)], ids=_id)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_hinted_plane_loads_equal_plain_ones(case, bits, stable, monkeypatch):
    E, k, H, I, T = case[:5]
    plan = plan_launch(T, k, E, H, I, 8 if bits == "mixed" else bits, stable_launches=stable)
    assert plan.gate_up.regime == ("tiles" if T > 8 else "gemv")
    assert T <= 8 or plan.gate_up.tiles >= op.KERNEL_DEFINES["APL_PLANE_HINT_MIN_NT8"]  # the default hints it
    assignment = mixed_bits(E) if bits == "mixed" else bits
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_PLANE_HINT", 0)
    plain = check_case(case, bits=assignment, stable=stable)
    for hint, min_nt8 in HINTS:
        monkeypatch.setitem(op.KERNEL_DEFINES, "APL_PLANE_HINT", hint)
        monkeypatch.setitem(op.KERNEL_DEFINES, "APL_PLANE_HINT_MIN_NT8", min_nt8)
        assert torch.equal(check_case(case, bits=assignment, stable=stable), plain), (hint, min_nt8)


@pytest.mark.parametrize("bits,stable", [(4, False), (8, False), ("mixed", False), (3, True)], ids=_id)
@pytest.mark.parametrize("case", CASES[:2], ids=_id)
def test_long_split_instances_equal_plain_ones(case, bits, stable, monkeypatch):
    """The decode instances compiled for long splits (apl_gemv's LONG, the host's long_split) load
    the same bytes with L2::256B: forced onto every decode launch of these small layers, they must
    match the reference and equal the instances without the qualifier bit for bit."""
    E = case[0]
    assignment = mixed_bits(E) if bits == "mixed" else bits
    launched = []
    launch = op._launch
    monkeypatch.setattr(op, "_launch", lambda name, *args, **kw: (launched.append(name), launch(name, *args, **kw)))
    monkeypatch.setattr(op, "GEMV_LONG_SPLIT_WORDS", 1 << 30)  # no launch takes a long-split instance
    plain = check_case(case, bits=assignment, stable=stable)
    assert launched and not any(name.endswith(", 1, true>") for name in launched)
    launched.clear()
    monkeypatch.setattr(op, "GEMV_LONG_SPLIT_WORDS", 1)  # every decode launch does
    monkeypatch.setattr(op, "GEMV_LONG_ROW_WORDS", 1)
    monkeypatch.setattr(op, "GEMV_LONG_MIN_TOKENS", 1)
    assert torch.equal(check_case(case, bits=assignment, stable=stable), plain)
    assert launched and all(name.endswith(", 1, true>") for name in launched), launched
