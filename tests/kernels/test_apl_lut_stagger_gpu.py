"""5-bit LUT rows staggered in rooms sized for wider blocks (APL_LUT_STAGGER, apl_gemv.cu's lut_row):
odd rows keep their 32 entries 64 bytes into the room, so a warp's LDS lookups spread over both
halves of the banks. Only where the entries live changes, never which entries a weight reads: every
launch that holds 5-bit blocks in a room of 64+ entries (the merged kernel, the 5-8-bit kernel with
wider blocks beside them, stable launches, the tiles regime) must match the reference and equal the
unstaggered launch bit for bit, with a last row tile half full."""

import pytest
import torch

import pagedweight_kernels.apl_moe as op
from pagedweight_kernels.apl_moe import kernel_available
from pagedweight_kernels.synthetic import mixed_bits
from tests.kernels.test_apl_moe_gpu import check_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernel_available(), reason="needs a CUDA GPU and cupy"),
              pytest.mark.usefixtures("tiles_regime")]  # (tests/kernels/conftest.py)


# (experts, top_k, hidden, intermediate, tokens, experts used, dtype): decode at 1 and 3 tokens (down's
# last row tile of 64 half full at hidden 544), the tiles regime at 64 tokens
CASES = [(4, 2, 1024, 2048, 1, 4, torch.bfloat16), (4, 2, 544, 736, 3, 3, torch.float16),
         (4, 2, 1024, 2048, 64, 4, torch.bfloat16)]


def _five_and_eight(num_experts):
    """# (expert, module) -> bits: 5 and 8 bits alternating, so the 5-8-bit kernel's rooms hold 256 entries."""
    return {(e, m): 5 if (e + i) % 2 == 0 else 8 for e in range(num_experts) for i, m in enumerate(("gate_up", "down"))}


def _id(v):
    return "-".join(str(x).replace("torch.", "") for x in v) if isinstance(v, tuple) else str(v)


@pytest.mark.parametrize("bits,stable", [("mixed", False), ("five_eight", False), (5, True)], ids=_id)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_staggered_lut_rows_equal_plain_ones(case, bits, stable, monkeypatch):
    E = case[0]
    assignment = mixed_bits(E) if bits == "mixed" else _five_and_eight(E) if bits == "five_eight" else bits
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_LUT_STAGGER", 0)
    plain = check_case(case, bits=assignment, stable=stable)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_LUT_STAGGER", 1)
    assert torch.equal(check_case(case, bits=assignment, stable=stable), plain)
