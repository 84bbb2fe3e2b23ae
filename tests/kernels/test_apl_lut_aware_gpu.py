"""Decode launches that reserve shared LUT rows (5-8-bit, merged and stable launches) with their
column split capped so GEMV_LUT_AWARE_CTAS (4 here; off by default, measured slower) CTAs fit an
SM: on shapes where the cap binds (the plan differs from the uncapped one), the kernel against
the fp32 reference, every output written, no counter left set, reruns bit for bit equal
(check_case). Passed on the H200 at 1fe6f5e, where 4 was the default (9 tests)."""

import pytest
import torch

import pagedweight_kernels.apl_moe as op
from pagedweight_kernels.apl_moe import kernel_available, plan_launch
from pagedweight_kernels.synthetic import mixed_bits
from tests.kernels.test_apl_moe_gpu import check_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernel_available(), reason="needs a CUDA GPU and cupy")]

# (experts, top_k, hidden, intermediate, tokens, experts used, dtype): gate_up rows enough for one
# split a row tile uncapped, 2048 and 4096 columns staged for 8 and 4 tokens a pass (64 and 128
# words a split uncapped; down too at 16 tokens)
CASES = [(8, 2, 2048, 4096, 16, 8, torch.bfloat16), (8, 2, 4096, 4096, 4, 6, torch.bfloat16),
         (8, 2, 2048, 2560, 9, 8, torch.float16)]


def _capped(case, max_bits, stable, monkeypatch):
    """(capped, uncapped) plans of the case; the cap stays on for the test's launches."""
    E, k, H, I, T = case[:5]
    monkeypatch.setattr(op, "GEMV_LUT_AWARE_CTAS", 0)
    uncapped = plan_launch(T, k, E, H, I, max_bits, stable_launches=stable)
    monkeypatch.setattr(op, "GEMV_LUT_AWARE_CTAS", 4)
    capped = plan_launch(T, k, E, H, I, max_bits, stable_launches=stable)
    return capped, uncapped


@pytest.mark.parametrize("bits,stable", [(8, False), ("mixed", False), (4, True)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_capped_splits_match_the_reference(case, bits, stable, monkeypatch):
    E = case[0]
    assignment = mixed_bits(E) if bits == "mixed" else bits
    max_bits = max(assignment.values()) if isinstance(assignment, dict) else bits
    capped, uncapped = _capped(case, max_bits, stable, monkeypatch)
    assert capped.gate_up.regime == "gemv"
    assert capped.down.splits > uncapped.down.splits or capped.gate_up.splits > uncapped.gate_up.splits
    check_case(case, bits=assignment, stable=stable)
