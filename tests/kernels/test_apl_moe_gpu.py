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

from pagedweight_kernels.apl_moe import APLLayer, apl_moe, apl_moe_reference, kernel_available
from pagedweight_kernels.synthetic import quantize_experts
from tests.kernels.resident_experts import APLExperts
from tests.conftest import BUNDLED_MODEL, CORPUS_DIR, SHARED_MODELS
from pagedweight_kernels.synthetic import mixed_bits, ragged_routing, random_block, random_layer
from pagedweight_kernels.layer import resident_block
from pagedweight_kernels.plan import plan_launch

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
# The prefill kernel (apl_moe.cu), run by size only above TILES_MAX_TOKENS_PER_EXPERT tokens per
# expert or GEMV_MAX_ASSIGN assignments; regime="prefill" reaches it from fewer.
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


# Decode on layers of one width (one launch per projection) and of one class each.
UNIFORM_CASES = [((8, 2, 160, 224, 3, 6, torch.bfloat16), b) for b in (3, 4, 5, 8)] + \
                [((60, 4, 2048, 1408, 4, 60, torch.bfloat16), 4)]


def _case_id(c):
    return f"E{c[0]}k{c[1]}H{c[2]}I{c[3]}T{c[4]}used{c[5]}-{str(c[6])[6:]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_reference(case):
    check_case(case)


@pytest.mark.parametrize("case,nt8", TILES_CASES, ids=lambda v: str(v) if isinstance(v, int) else _case_id(v))
def test_tiles_regime_matches_reference(case, nt8):
    E, k, H, I, T = case[:5]
    plan = plan_launch(T, k, E, H, I, 8)
    assert plan.gate_up.regime == plan.down.regime == "tiles" and plan.gate_up.tiles == nt8
    check_case(case)


@pytest.mark.parametrize("bits", (3, 4, 5, 8))
def test_tiles_regime_uniform_width_layers_match_reference(bits):
    check_case((8, 2, 160, 224, 40, 6, torch.bfloat16), bits=bits)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_case_id)
def test_prefill_kernel_matches_reference(case):
    E, k, H, I, T = case[:5]
    assert plan_launch(T, k, E, H, I, 8, regime="prefill").gate_up.regime == "prefill"
    check_case(case, regime="prefill")


@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[9]], ids=_case_id)
def test_one_launch_for_both_bit_classes_matches_reference(case):
    E, H, I = case[0], case[2], case[3]
    layer = random_layer(E, H, I, seed=case[4], device=torch.device("cuda"))
    assert layer.decode_launches("gate_up") == [(2, layer.classes["gate_up"][1])]  # the merged kernel, once
    check_case(case)


@pytest.mark.parametrize("case,bits", UNIFORM_CASES, ids=lambda v: str(v) if isinstance(v, int) else _case_id(v))
def test_uniform_width_layers_match_reference(case, bits):
    check_case(case, bits=bits)


# Stable launches (a pager's layers): mixed and uniform widths, decode and tiles, Qwen's layer.
STABLE_CASES = [(CASES[0], None), (CASES[3], 3), (CASES[6], 8), (CASES[9], 4), (CASES[10], None)]


@pytest.mark.parametrize("case,bits", STABLE_CASES, ids=lambda v: str(v) if isinstance(v, (int, type(None))) else _case_id(v))
def test_stable_launches_match_reference_at_any_widths(case, bits):
    check_case(case, bits=bits, stable=True)


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


def check_case(case, regime=None, bits=None, activation="silu", stable=False, config=None, in_graph=False):
    """The kernel's output for `case` against the fp32 reference, twice (deterministic);
    in_graph: also captured in a CUDA graph and replayed, which must give the eager output bit
    for bit (a launch that reads its predecessor's output before its programmatic wait, or a
    workspace the capture does not reset, shows here)."""
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
        apl_moe(x, ids, w, layer, out=out, regime=regime, config=config)
        torch.cuda.synchronize()
        assert not out.isnan().any(), "some outputs were never written"
        assert not layer.counters.any(), "the decode kernel left a last-CTA counter set"
        outs.append(out)
    err = relative_error(outs[0], ref)
    assert err < TOLERANCE[dtype], f"kernel error {err:.2e} (reference in {dtype}: {relative_error(ref_act, ref):.2e})"
    assert torch.equal(outs[0], outs[1]), "two runs differ: the reduction is not deterministic"
    if in_graph:
        assert torch.equal(replayed(x, ids, w, layer, regime, config), outs[0]), "a graph replay differs from the eager run"
    return outs[0]


def replayed(x, ids, w, layer, regime=None, config=None) -> torch.Tensor:
    """apl_moe captured once in a CUDA graph (after a warm-up on a side stream, as the engine
    captures) and replayed twice into a NaN-filled output."""
    out = torch.full_like(x, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        apl_moe(x, ids, w, layer, out=out, regime=regime, config=config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apl_moe(x, ids, w, layer, out=out, regime=regime, config=config)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    return out


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
    # the stored LUT the format keeps at new_bits (LUT_3, or LUT_4 with its extent entry), from a fresh block
    gen = torch.Generator(device=device).manual_seed(11)
    lut = resident_block(random_block(rows, cols, gen, device), new_bits, device).lut
    experts.commit_block(e, "gate_up", type(old)(new_bits, planes, lut))
    out = experts(x, ids, w)
    assert relative_error(out, reference_fp32(x, ids, w, layer)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("lut_offset_bytes", [0, 2], ids=["lut-16-byte-aligned", "lut-at-2-bytes"])
def test_register_lut_loads_take_any_lut_alignment(lut_offset_bytes):
    """A 3-4-bit block's LUT rows are read by 2-byte loads, so a LUT at any 2-byte offset of a pool
    gives the output of the LUTs where they were allocated, bit for bit, and the reference's."""
    device = torch.device("cuda")
    E, H, I, T = 8, 256, 384, 3
    layer = random_layer(E, H, I, seed=5, device=device, bits={(e, m): 3 + (e % 2) for e in range(E) for m in ("gate_up", "down")})
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    ids, w = ragged_routing(T, E, 2, seed=4, device=device)
    w = w.to(torch.bfloat16)
    allocated = apl_moe(x, ids, w, layer)
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
    out = apl_moe(x, ids, w, layer)
    assert torch.equal(out, allocated)
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
