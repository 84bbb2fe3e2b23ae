"""The staged regime (apl_staged.cu, sm_90a: a producer warpgroup dequantises plane tiles into a
ring of shared-memory buffers for a consumer warpgroup's wgmma) against the torch reference, on a
Hopper GPU (`make test-gpu`).

Every case runs with STAGED_PREFILL on, so the calls the tiles and prefill regimes would take run
the staged kernels instead (the test asserts it does): every width and the merged class, 16-byte and 4-byte
plane loads (column counts of 128k and of 32 + 64k, so a last step of one word), hot experts in
several passes and in several pass groups (grid z > 1), partial row tiles, bf16 and fp16,
GELU-tanh. check_case poisons the workspaces and outputs with NaN and wants two bit-identical runs.
"""

import dataclasses

import pytest
import torch

from pagedweight_kernels.apl_moe import apl_moe, kernel_available
from pagedweight_kernels.synthetic import ragged_routing, random_layer
from pagedweight_kernels.config import DEFAULT_CONFIG
from pagedweight_kernels.plan import plan_launch, staged_plan, use_staged
from tests.kernels.test_apl_moe_gpu import CASES, TILES_CASES, TOLERANCE, _case_id, check_case, reference_fp32, relative_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not kernel_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs a compute-capability 9.0 GPU (sm_90a) and cupy")]

# (experts, top_k, hidden, intermediate, tokens, experts used, dtype)
STAGED_CASES = [case for case, _ in TILES_CASES] + [
    CASES[8],                                       # hot expert in 3 passes of 64, fp16
    (8, 2, 256, 384, 400, 8, torch.bfloat16),       # 100 tokens an expert: passes of 64 in 2 groups (grid z 2)
    (8, 2, 288, 352, 48, 8, torch.bfloat16),        # 4-byte plane loads, a last step of one word, partial row tiles
    (16, 4, 512, 192, 40, 12, torch.float16),      # 10 tokens an expert: passes of 16
    (8, 2, 256, 384, 1000, 8, torch.bfloat16),      # the prefill regime's size: passes of 64 in 4 groups
]


# Every layer's tiles and prefill calls in the staged regime, whatever its widths and size.
STAGED = dataclasses.replace(DEFAULT_CONFIG, staged_every_layer=True)


@pytest.fixture
def staged():
    return STAGED


def _assert_staged(case):
    E, k, H, I, T = case[:5]
    plan = plan_launch(T, k, E, H, I, 8)
    layer = random_layer(E, H, I, seed=T, device=torch.device("cuda"))
    assert use_staged(plan, layer, torch.device("cuda"), config=STAGED), "the case must take the staged regime"


@pytest.mark.parametrize("case", STAGED_CASES, ids=_case_id)
def test_staged_matches_reference(case, staged):
    _assert_staged(case)
    check_case(case, config=staged)


@pytest.mark.parametrize("bits", (3, 4, 5, 6, 7, 8))
@pytest.mark.parametrize("case", [STAGED_CASES[1], STAGED_CASES[-2]], ids=_case_id)
def test_staged_uniform_width_layers_match_reference(case, bits, staged):
    check_case(case, bits=bits, config=staged)


@pytest.mark.parametrize("case", [CASES[7], STAGED_CASES[-1]], ids=_case_id)
def test_staged_gelu_tanh_matches_reference(case, staged):
    check_case(case, activation="gelu_tanh", config=staged)


def test_staged_matches_the_tiles_regime(staged):
    case = TILES_CASES[1][0]
    tiles = check_case(case, config=dataclasses.replace(DEFAULT_CONFIG, staged_classes=frozenset()))
    assert relative_error(check_case(case, config=staged), tiles) < TOLERANCE[case[6]]


def test_staged_block_of_a_width_its_class_lacks_gives_nan(staged):
    """A descriptor row whose bits the launch's class does not hold (a commit racing the plan)
    yields NaN rows for that expert's tokens, never a silent wrong number."""
    device = torch.device("cuda")
    bits = {(e, m): 4 for e in range(8) for m in ("gate_up", "down")}
    layer = random_layer(8, 256, 384, seed=3, device=device, bits=bits)
    x = torch.randn(60, 256, device=device, dtype=torch.bfloat16)
    ids, w = ragged_routing(60, 8, 2, seed=3, device=device)
    layer.gate_up_desc[2, 0] = 6  # the host still plans the 3-4-bit class
    out = apl_moe(x, ids, w, layer, config=staged)
    hit = (ids == 2).any(dim=1)
    assert out[hit].isnan().all() and not out[~hit].isnan().any()


def test_staged_no_host_sync(staged):
    device = torch.device("cuda")
    layer = random_layer(8, 256, 384, seed=5, device=device)
    x = torch.randn(100, 256, device=device, dtype=torch.bfloat16)
    ids, w = ragged_routing(100, 8, 2, seed=100, device=device)
    apl_moe(x, ids, w, layer, config=staged)  # compile outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = apl_moe(x, ids, w, layer, config=staged)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert relative_error(out, reference_fp32(x, ids, w, layer)) < TOLERANCE[torch.bfloat16]


def test_a_ring_of_two_buffers_keeps_the_output_bit_for_bit(staged):
    case = STAGED_CASES[-1]  # passes of 64 in 4 groups: the ring turns many times
    default = check_case(case, config=staged)
    assert torch.equal(check_case(case, config=dataclasses.replace(staged, staged_stages=2)), default)


@pytest.mark.parametrize("bits", (3, 4, None))
@pytest.mark.parametrize("case", [(8, 2, 256, 384, 300, 8, torch.bfloat16), (8, 2, 512, 256, 280, 6, torch.float16)],
                         ids=_case_id)
def test_128_token_passes_match_reference(case, bits, staged):
    """staged_wide_nt8 16 (the default): the 3-4-bit class in passes of 128 tokens (m64n128
    wgmma) where 64-85 tokens an expert are the mean (75 and 70 here; a hotter expert takes a
    second pass). A mixed layer (bits None) keeps its other classes' passes and must still match."""
    E, k, H, I, T = case[:5]
    if bits is not None:
        assert staged_plan(0, T, k, E, 2 * I, 0, 0, E, config=staged).tokens == 128
    check_case(case, bits=bits, config=staged)


@pytest.mark.parametrize("bits", (8, None))
def test_lut_rows_in_passes_of_128_tokens_keep_the_output_bit_for_bit(bits, staged):
    """staged_lut_wide_nt8 (16): the 5-8-bit and merged classes in passes of 128 tokens (m64n128) where
    80 tokens an expert want more than 64, against passes of 64 (hot experts in two)."""
    case = (8, 2, 256, 384, 320, 8, torch.bfloat16)
    E, k, H, I, T = case[:5]
    narrow = dataclasses.replace(staged, staged_lut_wide_nt8=0)
    assert staged_plan(0, T, k, E, I, 1, 8, E, config=narrow).tiles == 8
    out_narrow = check_case(case, bits=bits, config=narrow)
    assert staged_plan(0, T, k, E, I, 1, 8, E, config=staged).tiles == 16
    assert torch.equal(check_case(case, bits=bits, config=staged), out_narrow)
