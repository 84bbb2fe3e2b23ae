"""The tiles regime on wgmma (APL_TILES_WGMMA, sm_90a) against the torch reference and the
mma.sync path, on a Hopper GPU (`make test-gpu`).

The wgmma path stages the activations in another shared-memory layout (the B operand's core
matrices) and multiplies a pass's tokens by one warpgroup instruction per k16 slice, so every
tiles case is re-run with it: every NT8 (2, 4, 8), several passes per hot expert, partial
steps and partial 8-token tiles, column splits, every width and the merged kernel, bf16 and
fp16, GELU-tanh. Outputs are poisoned with NaN first (every element written) and two runs must
be bit-identical.
"""

import pytest
import torch

import pagedweight_kernels.apl_moe as op
from pagedweight_kernels.apl_moe import apl_moe, kernel_available, plan_launch
from pagedweight_kernels.synthetic import ragged_routing, random_layer
from tests.kernels.test_apl_moe_gpu import (CASES, TILES_CASES, TOLERANCE, _case_id, check_case, reference_fp32,
                                            relative_error)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not kernel_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs a compute-capability 9.0 GPU (sm_90a) and cupy"),
              pytest.mark.usefixtures("tiles_regime")]  # (tests/kernels/conftest.py)


WGMMA_CASES = [case for case, _ in TILES_CASES] + [CASES[8]]  # + hot expert in 3 passes of 64, fp16


@pytest.fixture
def wgmma(monkeypatch):
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_TILES_WGMMA", 1)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_TILES_ASYNC", 1)


@pytest.mark.parametrize("case", WGMMA_CASES, ids=_case_id)
def test_wgmma_tiles_match_reference_and_mma_sync(case, monkeypatch):
    E, k, H, I, T = case[:5]
    assert plan_launch(T, k, E, H, I, 8).gate_up.regime == "tiles"
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_TILES_WGMMA", 0)
    mma_sync = check_case(case)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_TILES_WGMMA", 1)
    out = check_case(case)
    assert relative_error(out, mma_sync) < TOLERANCE[case[6]]


@pytest.mark.parametrize("bits", (3, 4, 5, 6, 8))
def test_wgmma_tiles_uniform_width_layers_match_reference(bits, wgmma):
    check_case((8, 2, 160, 224, 40, 6, torch.bfloat16), bits=bits)


@pytest.mark.parametrize("case", [CASES[7], CASES[10]], ids=_case_id)
def test_wgmma_tiles_gelu_tanh_match_reference(case, wgmma):
    check_case(case, activation="gelu_tanh")


def test_wgmma_tiles_no_host_sync(wgmma):
    device = torch.device("cuda")
    layer = random_layer(8, 256, 384, seed=5, device=device)
    x = torch.randn(100, 256, device=device, dtype=torch.bfloat16)
    ids, w = ragged_routing(100, 8, 2, seed=100, device=device)
    apl_moe(x, ids, w, layer)  # compile outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = apl_moe(x, ids, w, layer)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert relative_error(out, reference_fp32(x, ids, w, layer)) < TOLERANCE[torch.bfloat16]


# APL_TILES_PAIR (apl_gemv_pair, off by default: measured slower): clusters of 2 CTAs that
# each stage half a step into both CTAs' shared memory. The B operand and the wgmma sequence are
# those of one CTA staging alone, so the output must be the same bit for bit: every tiles case
# (odd row-tile counts, whose padded CTA writes nothing; gate_up in two column splits; hot
# experts in several passes), every width and the merged kernel.
@pytest.mark.parametrize("case", WGMMA_CASES, ids=_case_id)
def test_wgmma_cluster_pair_equals_one_cta_staging(case, wgmma, monkeypatch):
    alone = check_case(case)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_TILES_PAIR", 1)
    assert torch.equal(check_case(case), alone)


@pytest.mark.parametrize("bits", (3, 4, 6, 8))
def test_wgmma_cluster_pair_uniform_widths_equal_one_cta_staging(bits, wgmma, monkeypatch):
    case = (8, 2, 160, 224, 40, 6, torch.bfloat16)  # 7 gate_up row tiles: a padded CTA
    alone = check_case(case, bits=bits)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_TILES_PAIR", 1)
    assert torch.equal(check_case(case, bits=bits), alone)


# APL_TILES_WS (apl_gemv_ws): producer warps stage every step straight into the B layout, in a ring
# of buffers handed over by mbarrier, while the 4 consumer warps dequantise and run the steps before.
# The slices and the wgmma sequence are those of one CTA staging alone, so the output must be the
# same bit for bit: every tiles case (hot experts in several passes, so the ring turns across
# passes; gate_up in two column splits; partial steps), every width and the merged kernel; with one
# producer warp and 2 buffers, and with 2 warps (each its own rounds of 8 tokens) and 3 buffers.
WS_CONFIGS = {"1warp_2stages": {"APL_TILES_WS_WARPS": 1, "APL_TILES_WS_STAGES": 2},
              "2warps_3stages": {"APL_TILES_WS_WARPS": 2, "APL_TILES_WS_STAGES": 3}}


def _producer_warps(monkeypatch, config):
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_TILES_WS", 1)
    for name, value in WS_CONFIGS[config].items():
        monkeypatch.setitem(op.KERNEL_DEFINES, name, value)


@pytest.mark.parametrize("config", WS_CONFIGS)
@pytest.mark.parametrize("case", WGMMA_CASES, ids=_case_id)
def test_wgmma_producer_warps_equal_one_cta_staging(case, config, wgmma, monkeypatch):
    alone = check_case(case)
    _producer_warps(monkeypatch, config)
    assert torch.equal(check_case(case), alone)


@pytest.mark.parametrize("config", WS_CONFIGS)
@pytest.mark.parametrize("bits", (3, 4, 5, 6, 8))
def test_wgmma_producer_warps_uniform_widths_equal_one_cta_staging(bits, config, wgmma, monkeypatch):
    case = (8, 2, 160, 224, 40, 6, torch.bfloat16)
    alone = check_case(case, bits=bits)
    _producer_warps(monkeypatch, config)
    assert torch.equal(check_case(case, bits=bits), alone)


# TILES_WIDE_NT8 (the host's, 12 when set): a 3-4-bit layer whose passes would want more than 8
# tiles takes passes of 96 tokens (wgmma m64n96k16; 48 accumulators a thread). Against the
# reference, NaN-poisoned outputs, bit-identical reruns: one pass per expert, a hot expert in two
# passes of 96, partial K steps, bf16 and fp16, both widths, and the mma.sync path at the same NT8.
WIDE_CASES = [CASES[8],                                      # 50 per expert, hot expert 176 tokens: 2 passes
              (8, 2, 160, 224, 180, 6, torch.bfloat16),     # partial K steps (5 words), hot expert
              (8, 2, 1024, 256, 240, 8, torch.bfloat16)]    # 60 per expert, longer rows


@pytest.mark.parametrize("bits", (3, 4))
@pytest.mark.parametrize("case", WIDE_CASES, ids=_case_id)
def test_wide_passes_match_reference(case, bits, wgmma, monkeypatch):
    monkeypatch.setattr(op, "TILES_WIDE_NT8", 12)
    E, k, H, I, T = case[:5]
    assert plan_launch(T, k, E, H, I, bits).gate_up.tiles == 12
    check_case(case, bits=bits)


def test_wide_passes_on_mma_sync_match_reference(monkeypatch):
    monkeypatch.setattr(op, "TILES_WIDE_NT8", 12)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_TILES_WGMMA", 0)
    check_case(CASES[8], bits=4)
