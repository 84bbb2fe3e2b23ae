"""The tiles regime on wgmma (sm_90a) against the torch reference, on a Hopper GPU (`make test-gpu`).

The wgmma path stages the activations in the B operand's core-matrix layout and multiplies a
pass's tokens by one warpgroup instruction per k16 slice: every tiles case runs on it, every NT8
(2, 4, 8, 12), several passes per hot expert, partial steps and partial 8-token tiles, column
splits, every width and the merged kernel, bf16 and fp16, GELU-tanh. Outputs are poisoned with NaN
first (every element written) and two runs must be bit-identical (check_case). The staged regime
is kept off (tiles_regime's configuration), so these calls stay in the tiles regime.
"""

import pytest
import torch

from pagedweight_kernels.apl_moe import apl_moe, kernel_available
from pagedweight_kernels.synthetic import ragged_routing, random_layer
from tests.kernels.test_apl_moe_gpu import CASES, TILES_CASES, TOLERANCE, _case_id, check_case, reference_fp32, relative_error
from pagedweight_kernels.plan import plan_launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not kernel_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs a compute-capability 9.0 GPU (sm_90a) and cupy")]


WGMMA_CASES = [case for case, _ in TILES_CASES] + [CASES[8]]  # + hot expert in 3 passes of 64, fp16


@pytest.mark.parametrize("case", WGMMA_CASES, ids=_case_id)
def test_wgmma_tiles_match_reference(case, tiles_regime):
    E, k, H, I, T = case[:5]
    assert plan_launch(T, k, E, H, I, 8, config=tiles_regime).gate_up.regime == "tiles"
    check_case(case, config=tiles_regime)


@pytest.mark.parametrize("bits", (3, 4, 5, 6, 8))
def test_wgmma_tiles_uniform_width_layers_match_reference(bits, tiles_regime):
    check_case((8, 2, 160, 224, 40, 6, torch.bfloat16), bits=bits, config=tiles_regime)


@pytest.mark.parametrize("case", [CASES[7], CASES[10]], ids=_case_id)
def test_wgmma_tiles_gelu_tanh_match_reference(case, tiles_regime):
    check_case(case, activation="gelu_tanh", config=tiles_regime)


def test_wgmma_tiles_no_host_sync(tiles_regime):
    device = torch.device("cuda")
    layer = random_layer(8, 256, 384, seed=5, device=device)
    x = torch.randn(100, 256, device=device, dtype=torch.bfloat16)
    ids, w = ragged_routing(100, 8, 2, seed=100, device=device)
    apl_moe(x, ids, w, layer, config=tiles_regime)  # compile outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = apl_moe(x, ids, w, layer, config=tiles_regime)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert relative_error(out, reference_fp32(x, ids, w, layer)) < TOLERANCE[torch.bfloat16]


# tiles_wide_nt8: 3-4-bit layers with 64-96 tokens an expert take passes of 96 tokens (wgmma m64n96k16;
# 48 accumulators a thread). Against the reference: one pass per expert, a hot expert in two passes of
# 96, partial K steps, bf16 and fp16, both widths.
WIDE_CASES = [CASES[8],                                      # 50 per expert, hot expert 176 tokens: 2 passes
              (8, 2, 160, 224, 180, 6, torch.bfloat16),     # partial K steps (5 words), hot expert
              (8, 2, 1024, 256, 240, 8, torch.bfloat16)]    # 60 per expert, longer rows


@pytest.mark.parametrize("bits", (3, 4))
@pytest.mark.parametrize("case", WIDE_CASES, ids=_case_id)
def test_wide_passes_match_reference(case, bits, tiles_regime):
    E, k, H, I, T = case[:5]
    assert plan_launch(T, k, E, H, I, bits, config=tiles_regime).gate_up.tiles == 12
    check_case(case, bits=bits, config=tiles_regime)
