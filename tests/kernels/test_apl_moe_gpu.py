"""The fused APL MoE kernel against its torch reference, on the GPU (`make test-gpu`).

Random layers with every bit-width 3..8 across blocks, ragged routing with idle experts,
every regime (decode GEMV, the tiles regime, the prefill kernel), bf16 and fp16, outputs and
workspaces poisoned with NaN before each run; then a quantized model whose perplexity
must not move when the kernel replaces the reference. Runnable without pytest's command
line too: `python3 -m tests.kernels.test_apl_moe_gpu`.
"""

import sys

import pytest
import torch

from pagedweight_kernels.apl_moe import APLLayer, apl_moe, apl_moe_reference, kernel_available, plan_launch
from pagedweight_kernels.synthetic import quantize_experts
from pagedweight_kernels.resident_experts import APLExperts
from pagedweight_kernels.apl_moe import resident_block
from tests.conftest import BUNDLED_MODEL, CORPUS_DIR, SHARED_MODELS
from pagedweight_kernels.synthetic import mixed_bits, ragged_routing, random_layer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not kernel_available(), reason="needs a CUDA GPU and cupy")]

# Relative error ||out - ref|| / ||ref|| against an fp32 reference on the same
# (act-dtype-rounded) weights: bf16 and fp16 rounding of h and of the output.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}

# (experts, top_k, hidden, intermediate, tokens, experts used, dtype)
CASES = [
    (8, 2, 160, 224, 1, 8, torch.bfloat16),      # decode, 1 token, odd word counts (partial steps)
    (8, 2, 160, 224, 3, 5, torch.float16),       # decode, idle experts
    (8, 2, 128, 256, 2, 8, torch.bfloat16),      # decode, micro-mixtral shapes
    (16, 4, 256, 192, 7, 9, torch.bfloat16),     # decode, tiny-qwen-moe shapes
    (8, 2, 512, 384, 8, 6, torch.bfloat16),      # decode, column splits
    (8, 2, 512, 384, 16, 6, torch.bfloat16),     # decode, the hot expert takes several passes of 8
    (8, 2, 160, 224, 40, 6, torch.bfloat16),     # tiles (16 per pass), partial K steps, hot expert: 3 passes
    (8, 2, 256, 384, 100, 7, torch.float16),     # tiles (64 per pass), hot expert 90 tokens: 2 passes
    (8, 2, 256, 384, 200, 7, torch.float16),     # tiles (64 per pass), hot expert 176 tokens: 3 passes
    (60, 4, 2048, 1408, 1, 60, torch.bfloat16),  # Qwen1.5-MoE layer, decode
    (60, 4, 2048, 1408, 64, 40, torch.bfloat16),  # Qwen1.5-MoE layer, tiles (16 per pass)
]
# The tiles regime beyond CASES: (case, 8-token tiles per pass the plan must pick).
TILES_CASES = [
    ((8, 2, 256, 384, 60, 8, torch.bfloat16), 4),   # 32 per pass, hot expert 53 tokens: 2 passes
    ((8, 2, 1024, 256, 120, 8, torch.bfloat16), 8),  # gate_up in two column splits
    (CASES[6], 2), (CASES[7], 8), (CASES[10], 2),
]
# The prefill kernel (apl_moe.cu), now run only above TILES_MAX_TOKENS_PER_EXPERT tokens per
# expert or GEMV_MAX_ASSIGN assignments; legacy_decode=True reaches it from fewer.
PREFILL_CASES = [CASES[6], CASES[7], CASES[8], CASES[10]]


def poison_allocator(device):
    """Fill freed cached blocks with NaN so the operator's workspaces start poisoned."""
    junk = [torch.full((1 << n,), float("nan"), device=device) for n in range(10, 27)]
    del junk


def relative_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference_fp32(x, ids, w, layer):
    """The reference on weights rounded to x's dtype (as the kernel reads them), in fp32."""
    return apl_moe_reference(x.float(), ids, w.float(), layer, weight_dtype=x.dtype)


# The first decode kernel, kept as the benchmark's baseline: (case, uniform bits or None).
LEGACY_CASES = [CASES[1], CASES[4]]
# Decode on layers of one width (one launch per projection) and of one class each.
UNIFORM_CASES = [((8, 2, 160, 224, 3, 6, torch.bfloat16), b) for b in (3, 4, 5, 8)] + \
                [((60, 4, 2048, 1408, 4, 60, torch.bfloat16), 4)]


def _case_id(c):
    return f"E{c[0]}k{c[1]}H{c[2]}I{c[3]}T{c[4]}used{c[5]}-{str(c[6])[6:]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_reference(case):
    check_case(case)


@pytest.mark.parametrize("case", LEGACY_CASES, ids=_case_id)
def test_legacy_decode_matches_reference(case):
    check_case(case, legacy_decode=True)


@pytest.mark.parametrize("case,nt8", TILES_CASES, ids=lambda v: str(v) if isinstance(v, int) else _case_id(v))
def test_tiles_regime_matches_reference(case, nt8):
    E, k, H, I, T = case[:5]
    plan = plan_launch(T, k, E, H, I, 8)
    assert plan.gate_up.regime == plan.down.regime == "tiles" and plan.gate_up.tiles == nt8
    check_case(case)


@pytest.mark.parametrize("case", [TILES_CASES[0][0], CASES[7]], ids=_case_id)
def test_tiles_regime_with_staging_at_each_step_matches_reference(case, monkeypatch):
    """APL_TILES_ASYNC 0: activations loaded at each step instead of by cp.async a step ahead."""
    import pagedweight_kernels.apl_moe as op

    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_TILES_ASYNC", 0)
    check_case(case)


@pytest.mark.parametrize("bits", (3, 4, 5, 8))
def test_tiles_regime_uniform_width_layers_match_reference(bits):
    check_case((8, 2, 160, 224, 40, 6, torch.bfloat16), bits=bits)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_case_id)
def test_prefill_kernel_matches_reference(case):
    E, k, H, I, T = case[:5]
    assert plan_launch(T, k, E, H, I, 8, legacy_decode=True).gate_up.regime == "prefill"
    check_case(case, legacy_decode=True)


@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[9]], ids=_case_id)
def test_one_launch_for_both_bit_classes_matches_reference(case, monkeypatch):
    import pagedweight_kernels.apl_moe as op

    monkeypatch.setattr(op, "GEMV_MERGE_CLASSES", True)
    check_case(case)


@pytest.mark.parametrize("case,bits", UNIFORM_CASES, ids=lambda v: str(v) if isinstance(v, int) else _case_id(v))
def test_uniform_width_layers_match_reference(case, bits):
    check_case(case, bits=bits)


# Stable launches (a pager's layers): mixed and uniform widths, decode and tiles, Qwen's layer.
STABLE_CASES = [(CASES[0], None), (CASES[3], 3), (CASES[6], 8), (CASES[9], 4), (CASES[10], None)]


@pytest.mark.parametrize("case,bits", STABLE_CASES, ids=lambda v: str(v) if isinstance(v, (int, type(None))) else _case_id(v))
def test_stable_launches_match_reference_at_any_widths(case, bits):
    check_case(case, bits=bits, stable=True)


# APL_GEMV_PIPE: more steps of plane words in flight changes when words are loaded, not what
# is summed in which order, so the output must equal the ping-pong's bit for bit. It applies
# to the 3-4-bit kernel with 8-byte plane loads: (case, bits, one column split?); H=1216 /
# I=832 are 38 / 26 words per row, 5 / 4 steps in one split (partial last steps, step
# counts no multiple of 3 or 4).
PIPE_CASES = [((8, 2, 1216, 832, 3, 6, torch.bfloat16), 4, True), ((8, 2, 1216, 832, 2, 8, torch.float16), 3, True),
              ((8, 2, 1216, 832, 5, 7, torch.bfloat16), 3, True), (CASES[4], 3, False), (CASES[5], 4, False),
              (UNIFORM_CASES[-1][0], 4, False), (CASES[9], 3, False)]


@pytest.mark.parametrize("pipe,early,min_blocks", [(3, 0, 4), (3, 1, 4), (4, 1, 3)])
@pytest.mark.parametrize("case,bits,one_split", PIPE_CASES, ids=lambda v: _case_id(v) if isinstance(v, tuple) else str(v))
def test_decode_register_pipeline_equals_ping_pong(case, bits, one_split, pipe, early, min_blocks, monkeypatch):
    import pagedweight_kernels.apl_moe as op

    if one_split:
        monkeypatch.setattr(op, "GEMV_TARGET_CTAS", 1)
    E, k, H, I, T = case[:5]
    plan = plan_launch(T, k, E, H, I, bits)
    assert plan.gate_up.regime == "gemv" and (plan.gate_up.splits == 1 or not one_split)
    layer = random_layer(E, H, I, seed=T, device=torch.device("cuda"),
                         bits={(e, m): bits for e in range(E) for m in ("gate_up", "down")})
    assert all(layer.aligned8.values()) and set(layer.classes["down"]) == {0}  # the pipelined kernel runs
    ping_pong = check_case(case, bits=bits)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_PIPE", pipe)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_PIPE_EARLY", early)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_MIN_BLOCKS", min_blocks)
    assert torch.equal(check_case(case, bits=bits), ping_pong)


# The one-launch decode (apl_gemv_fused, layers of 3-4-bit blocks): the same sums in the same
# order as the two launches, so the output must equal theirs bit for bit. (case, bits): 34 =
# 3 or 4 bits per block. Odd word counts, idle experts, column splits, a hot expert taking
# passes of 8, Qwen1.5-MoE at 1, 2 and 4 tokens (4 tokens: 1216 CTAs, more than one wave, so
# down CTAs start while gate_up CTAs still wait to start).
FUSED_CASES = [(CASES[0], 4), (CASES[1], 3), (CASES[3], 34), (CASES[4], 4), (CASES[5], 3), (CASES[9], 4),
               (UNIFORM_CASES[-1][0], 34), ((60, 4, 2048, 1408, 2, 60, torch.float16), 3)]


def _bits(E, bits, seed=0):
    if bits != 34:
        return {(e, m): bits for e in range(E) for m in ("gate_up", "down")}
    gen = torch.Generator().manual_seed(seed)
    return {(e, m): 3 + int(torch.randint(0, 2, (1,), generator=gen)) for e in range(E) for m in ("gate_up", "down")}


@pytest.mark.parametrize("case,bits", FUSED_CASES, ids=lambda v: str(v) if isinstance(v, int) else _case_id(v))
def test_fused_decode_equals_two_launches(case, bits, monkeypatch):
    import pagedweight_kernels.apl_moe as op

    E, k, H, I, T = case[:5]
    bits_map = _bits(E, bits)
    layer = random_layer(E, H, I, seed=T, device=torch.device("cuda"), bits=bits_map)
    plan = plan_launch(T, k, E, H, I, layer.max_bits)
    launches = {m: layer.decode_launches(m) for m in ("gate_up", "down")}
    assert plan.gate_up.regime == "gemv"
    monkeypatch.setattr(op, "GEMV_FUSED", True)
    assert op.fused_class(launches, plan.gate_up.tiles) == 0
    fused = check_case(case, bits=bits_map)
    monkeypatch.setattr(op, "GEMV_FUSED", False)
    assert op.fused_class(launches, plan.gate_up.tiles) is None
    assert torch.equal(check_case(case, bits=bits_map), fused)


def test_fused_decode_replayed_in_a_cuda_graph_follows_new_inputs(monkeypatch):
    """A captured fused launch replayed on new tokens and routing: each replay equals the eager
    call bit for bit, and the flags, ticket and counters it leaves are zero (the next replay
    starts from them)."""
    import pagedweight_kernels.apl_moe as op

    monkeypatch.setattr(op, "GEMV_FUSED", True)
    E, k, H, I, T = 16, 4, 256, 192, 3
    device = torch.device("cuda")
    layer = random_layer(E, H, I, seed=11, device=device, bits=_bits(E, 4))
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    ids, w = ragged_routing(T, E, k, seed=1, device=device)
    w = w.to(torch.bfloat16)
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        apl_moe(x, ids, w, layer, out=out)  # compiles, warms the allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apl_moe(x, ids, w, layer, out=out)
    for seed in range(2, 5):
        new_ids, new_w = ragged_routing(T, E, k, seed=seed, num_used=5 + seed, device=device)
        x.copy_(torch.randn(T, H, device=device, dtype=torch.bfloat16))
        ids.copy_(new_ids)
        w.copy_(new_w.to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not layer.counters.any(), "a replay left a flag, the ticket or a counter set"
        eager = apl_moe(x, ids, w, layer)
        assert torch.equal(out, eager)
        assert relative_error(out, reference_fp32(x, ids, w, layer)) < TOLERANCE[torch.bfloat16]


# APL_GEMV_COMPACT (a bit per kernel class): the decode step's code once (two words in a
# rolled loop, no unrolled ping-pong): the same loads and mma in the same order, so the output
# equals the ping-pong's bit for bit. Merged kernel (mixed bits) with 4-byte loads (H=160), with
# column splits, at Qwen size; the 3-4-bit kernel (4 bits).
@pytest.mark.parametrize("case,bits", [(CASES[0], None), (CASES[4], None), (CASES[9], None), UNIFORM_CASES[1]],
                         ids=lambda v: str(v) if isinstance(v, (int, type(None))) else _case_id(v))
def test_compact_decode_loop_equals_ping_pong(case, bits, monkeypatch):
    import pagedweight_kernels.apl_moe as op

    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_COMPACT", 0)
    ping_pong = check_case(case, bits=bits)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_COMPACT", 7)
    assert torch.equal(check_case(case, bits=bits), ping_pong)


# Knobs that move work between pipes or reorder the last-CTA counter's synchronisation, not
# what is summed: APL_FMA_SHIFTS_MIN_BITS (from which width the code transposes are bitfield
# merges with their shifts by IMAD), APL_PRMT_SELECT (the 4-bit top-bit select by PRMT),
# APL_SHIFT_MODE (5-8-bit LUT offsets by IMAD.HI), APL_GEMV_ACQREL (one acq_rel atomic instead
# of fences), APL_GEMV_STAGE16 (decode activations by 16-byte loads), APL_GEMV_LUT16 (aligned
# register-LUT rows by 16-byte loads), APL_GEMV_BATCHED_LOADS (routing, reductions and the tiles'
# copies with their loads in flight together). All flipped from their defaults at once (the FMA shifts on at 3 bits for a 3-bit
# layer, off at every width otherwise), the output equals the defaults' bit for bit in every
# regime and class: decode at 3, 4, 5, 8 bits and mixed, column splits, Qwen size, tiles,
# prefill, legacy decode.
KNOB_CASES = [(c, b, False) for c, b in UNIFORM_CASES[:4]] + [
    (CASES[0], None, False), (CASES[4], None, False), (CASES[9], 4, False), (CASES[7], None, False),
    (CASES[7], None, True), (CASES[1], None, True)]


def _flipped_knobs(bits):
    import pagedweight_kernels.apl_moe as op

    fma_from = op.KERNEL_DEFINES["APL_FMA_SHIFTS_MIN_BITS"]
    flipped = {k: 1 - op.KERNEL_DEFINES[k]
               for k in ("APL_PRMT_SELECT", "APL_SHIFT_MODE", "APL_GEMV_ACQREL", "APL_GEMV_STAGE16", "APL_GEMV_LUT16",
                         "APL_GEMV_BATCHED_LOADS")}
    flipped["APL_FMA_SHIFTS_MIN_BITS"] = 3 if bits == 3 and fma_from > 3 else 9 if fma_from <= 8 else 3
    return flipped


@pytest.mark.parametrize("case,bits,legacy", KNOB_CASES,
                         ids=lambda v: str(v) if isinstance(v, (int, bool, type(None))) else _case_id(v))
def test_integer_pipe_knobs_keep_the_output_bit_for_bit(case, bits, legacy, monkeypatch):
    import pagedweight_kernels.apl_moe as op

    default = check_case(case, bits=bits, legacy_decode=legacy)
    for knob, value in _flipped_knobs(bits).items():
        monkeypatch.setitem(op.KERNEL_DEFINES, knob, value)
    assert torch.equal(check_case(case, bits=bits, legacy_decode=legacy), default)


# GELU-tanh experts (Gemma-4): both regimes, both dtypes, merged and uniform-width decode.
GELU_CASES = [CASES[0], CASES[3], CASES[5], CASES[7], CASES[8]]


@pytest.mark.parametrize("case", GELU_CASES, ids=_case_id)
def test_gelu_tanh_kernel_matches_reference(case):
    check_case(case, activation="gelu_tanh")


def test_gelu_tanh_uniform_width_decode_matches_reference():
    check_case((8, 2, 160, 224, 3, 6, torch.bfloat16), bits=4, activation="gelu_tanh")


def test_activation_changes_the_kernel_output():
    """The switch reaches the kernel: SiLU and GELU-tanh layers on the same planes differ, and
    each matches its own reference (a kernel ignoring the switch fails one of them)."""
    E, k, H, I, T = 8, 2, 128, 256, 2
    device = torch.device("cuda")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    ids, w = ragged_routing(T, E, k, seed=0, device=device)
    w = w.to(torch.bfloat16)
    outs = {}
    for act in ("silu", "gelu_tanh"):
        layer = random_layer(E, H, I, seed=3, device=device, activation=act)
        outs[act] = apl_moe(x, ids, w, layer)
        assert relative_error(outs[act], reference_fp32(x, ids, w, layer)) < TOLERANCE[torch.bfloat16]
    assert relative_error(outs["silu"], outs["gelu_tanh"]) > 0.05


def check_case(case, legacy_decode=False, bits=None, activation="silu", stable=False):
    E, k, H, I, T, used, dtype = case
    device = torch.device("cuda")
    uniform = bits if isinstance(bits, dict) else \
        {(e, m): bits for e in range(E) for m in ("gate_up", "down")} if bits else None
    layer = random_layer(E, H, I, seed=T, device=device, bits=uniform, activation=activation)
    if stable:  # the same blocks, decode through the merged kernel at the 8-bit LUT size
        layer = APLLayer(layer.gate_up, layer.down, layer.activation, stable_launches=True)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(device, dtype)
    ids, w = ragged_routing(T, E, k, seed=T, num_used=used, device=device)
    w = w.to(dtype)
    ref = reference_fp32(x, ids, w, layer)
    ref_act = apl_moe_reference(x, ids, w, layer)
    outs = []
    for _ in range(2):
        poison_allocator(device)
        out = torch.full_like(x, float("nan"))
        apl_moe(x, ids, w, layer, out=out, legacy_decode=legacy_decode)
        torch.cuda.synchronize()
        assert not out.isnan().any(), "some outputs were never written"
        assert not layer.counters.any(), "the decode kernel left a last-CTA counter set"
        outs.append(out)
    err = relative_error(outs[0], ref)
    assert err < TOLERANCE[dtype], f"kernel error {err:.2e} (reference in {dtype}: {relative_error(ref_act, ref):.2e})"
    assert torch.equal(outs[0], outs[1]), "two runs differ: the reduction is not deterministic"
    return outs[0]


def test_decode_with_no_valid_expert_writes_zeros():
    device = torch.device("cuda")
    layer = random_layer(8, 256, 384, seed=9, device=device)
    x = torch.randn(2, 256, device=device, dtype=torch.bfloat16)
    ids = torch.full((2, 2), 8, dtype=torch.int64, device=device)  # out of range: dropped
    assert plan_launch(2, 2, 8, 256, 384, layer.max_bits).gate_up.regime == "gemv"
    out = apl_moe(x, ids, torch.ones(2, 2, device=device), layer, out=torch.full_like(x, float("nan")))
    assert torch.equal(out, torch.zeros_like(out))


def test_no_host_sync_and_current_stream():
    device = torch.device("cuda")
    layer = random_layer(8, 256, 384, seed=5, device=device)
    for T in (2, 100, 1000):  # decode, tiles, prefill
        x = torch.randn(T, 256, device=device, dtype=torch.bfloat16)
        ids, w = ragged_routing(T, 8, 2, seed=T, device=device)
        apl_moe(x, ids, w, layer)  # compile outside the checks
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                out = apl_moe(x, ids, w, layer)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        side.synchronize()
        assert relative_error(out, reference_fp32(x, ids, w, layer)) < TOLERANCE[torch.bfloat16]


def test_commit_moves_a_block_anywhere_in_a_pool():
    """Planes of one block scattered through a shared pool buffer at odd 4-byte offsets."""
    device = torch.device("cuda")
    E, H, I = 8, 256, 384
    layer = random_layer(E, H, I, seed=7, device=device)
    experts = APLExperts(layer, use_kernel=True)
    x = torch.randn(4, H, device=device, dtype=torch.bfloat16)
    ids, w = ragged_routing(4, E, 2, seed=3, device=device)
    e = ids[0, 0].item()
    old = layer.gate_up[e]
    pool = torch.zeros(16 << 20, dtype=torch.uint8, device=device)
    rows, cols = old.shape
    planes, offset = [], 4 * 1000
    for p in range(old.bits + 1 if old.bits < 8 else old.bits):  # one plane more (raise) when possible
        src = old.planes[p] if p < old.bits else torch.randint(0, 256, (rows, cols // 8), dtype=torch.uint8, device=device)
        view = pool[offset: offset + src.numel()].view(rows, cols // 8)
        view.copy_(src)
        planes.append(view)
        offset += src.numel() + 4 * 777
    new_bits = len(planes)
    lut = torch.randn(rows, 1 << new_bits, device=device).sort(1).values.half() * H ** -0.5
    experts.commit_block(e, "gate_up", type(old)(new_bits, planes, lut))
    out = experts(x, ids, w)
    assert relative_error(out, reference_fp32(x, ids, w, layer)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("lut_offset_bytes", [0, 2], ids=["lut-16-byte-aligned", "lut-at-2-bytes"])
def test_register_lut_loads_take_any_lut_alignment(lut_offset_bytes, monkeypatch):
    """APL_GEMV_LUT16: a 3-4-bit block's LUT rows by 16-byte loads where the LUT is 16-byte
    aligned, by 2-byte loads where it is not (a LUT view at a 2-byte offset of a pool); the
    output is the 2-byte path's bit for bit and the reference's within tolerance."""
    import pagedweight_kernels.apl_moe as op

    device = torch.device("cuda")
    E, H, I, T = 8, 256, 384, 3
    layer = random_layer(E, H, I, seed=5, device=device, bits={(e, m): 3 + (e % 2) for e in range(E) for m in ("gate_up", "down")})
    pool = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    offset = 4096 + lut_offset_bytes
    for e in range(E):
        for m in ("gate_up", "down"):
            block = getattr(layer, m)[e]
            nbytes = block.lut.numel() * 2
            view = pool[offset: offset + nbytes].view(torch.float16).view(block.lut.shape)
            view.copy_(block.lut)
            layer.set_block(e, m, type(block)(block.bits, block.planes, view))
            offset += nbytes + 64
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    ids, w = ragged_routing(T, E, 2, seed=4, device=device)
    w = w.to(torch.bfloat16)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_LUT16", 0)
    two_byte = apl_moe(x, ids, w, layer)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_LUT16", 1)
    out = apl_moe(x, ids, w, layer)
    assert torch.equal(out, two_byte)
    assert relative_error(out, reference_fp32(x, ids, w, layer)) < TOLERANCE[torch.bfloat16]


def model_dirs():
    dirs = [BUNDLED_MODEL]
    if SHARED_MODELS.is_dir():
        dirs += sorted(p for p in SHARED_MODELS.iterdir() if (p / "config.json").is_file() and p.name != BUNDLED_MODEL.name)
    return dirs


@pytest.mark.parametrize("model_dir", model_dirs(), ids=lambda p: p.name)
def test_perplexity_with_kernel_equals_reference(model_dir):
    from pagedweight.offline.perplexity import perplexity
    from pagedweight.model import load_model
    from pagedweight.frontend.tokenizer import Tokenizer

    device = torch.device("cuda")
    model = load_model(model_dir, dtype=torch.bfloat16, device=device)
    for block in model.moe_blocks:
        dense = block.experts
        gate_up, down = quantize_experts(dense.gate_up, dense.down)
        bits = mixed_bits(dense.num_experts)
        block.experts = APLExperts.from_blocks(gate_up, down, bits, device, use_kernel=True)
    text = (CORPUS_DIR / "kjv.valid.txt").read_text()[:6000] if CORPUS_DIR.is_dir() else \
        "In the beginning God created the heaven and the earth. " * 40
    ids = Tokenizer(model_dir).encode(text)
    kernel = perplexity(model, ids, seq_len=128, max_tokens=1024, batch_size=4)
    for block in model.moe_blocks:
        block.experts.use_kernel = False
    reference = perplexity(model, ids, seq_len=128, max_tokens=1024, batch_size=4)
    assert abs(kernel.ppl - reference.ppl) / reference.ppl < 5e-3, (kernel.ppl, reference.ppl)
    # Decode-shaped calls (one new token per sequence) go through the GEMV regime.
    batch = torch.tensor([ids[:1], ids[1:2], ids[2:3], ids[3:4]], device=device)
    with torch.inference_mode():
        ref_logits = model(batch).float()
        for block in model.moe_blocks:
            block.experts.use_kernel = True
        kernel_logits = model(batch).float()
    assert relative_error(kernel_logits, ref_logits) < 2e-2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-m", "gpu", *sys.argv[1:]]))
