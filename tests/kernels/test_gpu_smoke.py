"""The kernel's smoke set (`make test-gpu-smoke`): every regime x width x dtype against the torch
reference, small enough to run in every device call that changes kernels/.

Regimes are reached by token counts on small layers (8 experts, top-2, H=256, I=384): decode
(1 token), tiles (40 tokens, 10 an expert), staged (320 tokens on compute capability 9.0; the
prefill kernel elsewhere) and the prefill kernel (asked for by apl_moe's regime="prefill"). Each
case asserts the regime it means to cover, so a planning change cannot silently skip one.
"""

import pytest
import torch

from pagedweight_kernels.apl_moe import kernel_available
from pagedweight_kernels.synthetic import mixed_bits, random_layer
from tests.kernels.test_apl_moe_gpu import check_case
from pagedweight_kernels.plan import plan_launch, use_staged

pytestmark = [pytest.mark.gpu, pytest.mark.smoke,
              pytest.mark.skipif(not kernel_available(), reason="needs a CUDA GPU and cupy")]

E, K, H, I = 8, 2, 256, 384
TOKENS = {"decode": 1, "tiles": 40, "staged": 320, "prefill": 320}
WIDTHS = (3, 4, 5, 6, 7, 8, "mixed")


def planned_regime(regime: str, tokens: int, bits) -> str:
    """The regime apl_moe will run for this case (staged only on a 9.0 device)."""
    forced = "prefill" if regime == "prefill" else None
    max_bits = 8 if bits == "mixed" else bits
    plan = plan_launch(tokens, K, E, H, I, max_bits, regime=forced)
    assignment = mixed_bits(E) if bits == "mixed" else {(e, m): bits for e in range(E) for m in ("gate_up", "down")}
    layer = random_layer(E, H, I, device="cuda", bits=assignment)
    if use_staged(plan, layer, torch.device("cuda"), tokens, K, forced):
        return "staged"
    return plan.gate_up.regime


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("bits", WIDTHS, ids=str)
@pytest.mark.parametrize("regime", tuple(TOKENS))
def test_every_regime_width_and_dtype_matches_the_reference(regime, bits, dtype):
    tokens = TOKENS[regime]
    got = planned_regime(regime, tokens, bits)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    expected = {"decode": "gemv", "tiles": "tiles", "prefill": "prefill",
                "staged": "staged" if hopper else "prefill"}[regime]
    assert got == expected, f"{regime} case planned as {got}"
    case = (E, K, H, I, tokens, E, dtype)
    check_case(case, regime="prefill" if regime == "prefill" else None,
               bits=mixed_bits(E) if bits == "mixed" else bits)
