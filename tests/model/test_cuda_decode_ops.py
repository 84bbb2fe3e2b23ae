"""The CUDA decode path's fewer-launch forms against the forms the CPU runs: RMSNorm
through one kernel (decode_ops.rms_norm), RoPE with its sign folded into sin. The same
arithmetic, so fp32 agrees to rounding and bf16 within a rounding step or two."""

import copy

import pytest
import torch

from pagedweight.model.layers import RMSNorm, rms_normalize


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scale_in_fp32", [False, True])
def test_gemma4_norms_on_cuda_equal_the_cpu(scale_in_fp32):
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(2048, 1e-6, scale_in_fp32=scale_in_fp32)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(2048, generator=gen) * 2 + 0.1)
    norm = norm.to(torch.bfloat16)
    x = torch.randn(64, 2048, generator=gen).to(torch.bfloat16)
    heads = torch.randn(5, 4, 2048, generator=gen).to(torch.bfloat16).transpose(0, 1)  # q/k norms: strided heads
    on_cuda = copy.deepcopy(norm).cuda()  # .cuda() moves in place: the CPU rows keep the CPU module
    for cpu, cuda in ((norm(x), on_cuda(x.cuda())), (rms_normalize(x, 1e-6), rms_normalize(x.cuda(), 1e-6)),
                      (norm(heads), on_cuda(heads.cuda()))):
        assert cuda.shape == cpu.shape
        want, got = cpu.float(), cuda.float().cpu()
        assert ((got - want).abs() / want.abs().clamp_min(1e-3)).max().item() <= 2 ** -7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rms_norm_on_cuda_equals_the_cpu():
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(2048, 1e-6).to(torch.bfloat16)
    x = torch.randn(64, 2048, generator=gen).to(torch.bfloat16)
    want = norm(x).float()
    got = copy.deepcopy(norm).cuda()(x.cuda()).float().cpu()
    assert ((got - want).abs() / want.abs().clamp_min(1e-3)).max().item() <= 2 ** -7


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_signed_rotary_equals_apply_rotary(dtype, tol):
    """The CUDA decode path's RoPE (sign folded into sin once per step) against the
    rotate-half reference, at a real head dim and odd positions."""
    from pagedweight.model.layers import RotaryEmbedding, apply_rotary, apply_rotary_signed, signed_sin

    gen = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(128, 1e6)
    cos, sin = rope.cos_sin(torch.tensor([[0, 5, 17, 4095]]), dtype)
    x = torch.randn(1, 16, 4, 128, generator=gen).to(dtype)
    want = apply_rotary(x, cos, sin).float()
    got = apply_rotary_signed(x, cos, signed_sin(sin)).float()
    assert not torch.equal(want, x.float())
    assert ((got - want).abs().max() / want.abs().max()).item() <= tol


def fused_output_unchanged(model, fuse, run):
    """Run, fuse, run again: the state dict keeps its keys and the output stays (the
    unfused output is returned for later checks)."""
    want = run()
    keys = sorted(model.state_dict())
    fuse()
    assert sorted(model.state_dict()) == keys
    torch.testing.assert_close(run(), want, rtol=1e-5, atol=1e-5)
    return want


def test_fused_qkv_computes_the_same_and_stays_the_parameters():
    """fuse_qkv (the engine does it on CUDA): the same logits, the projections' parameters
    are views of the fused weight (a later in-place load reaches the fused product), and
    the state dict keeps its keys."""
    from pagedweight.model import load_model
    from tests.conftest import BUNDLED_MODEL

    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    ids = torch.randint(1, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = fused_output_unchanged(model, model.fuse_projections, lambda: model(ids))
        attn = model.layers[0].self_attn
        assert attn._qkv is not None and attn.k_proj.weight.data_ptr() != attn._qkv[0].data_ptr()
        attn.k_proj.weight.mul_(0)  # written through the view: the fused product sees it
        assert not torch.allclose(model(ids), want, rtol=1e-3, atol=1e-3)


def test_fused_moe_inputs_compute_the_same_and_stay_the_parameters():
    """SparseMoeBlock.fuse_inputs (the CUDA decode path's one product for the router and the
    shared expert): the block's output is unchanged, its parameters are views of the fused
    weight, and the state dict keeps its keys."""
    from pagedweight.offline import real_shape_models as rs
    from pagedweight.format.model_config import ModelConfig

    torch.manual_seed(0)
    hf, raw = rs.build_hf_model("tiny-qwen-moe", torch.device("cpu"), torch.float32)
    model = rs.ours_from_hf(hf, ModelConfig.from_dict(raw))
    block = model.layers[0].moe
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fused_output_unchanged(model, block.fuse_inputs, lambda: block(x))
        weight, sizes = block._inputs
        assert weight.shape[0] % 8 == 0 and sum(sizes) == weight.shape[0]
        assert block.gate.weight.data_ptr() == weight[sizes[0] + sizes[1]].data_ptr()
        block.shared_expert_gate.weight.mul_(0)  # written through the view: the fused product sees it
        assert weight[sum(sizes[:3])].abs().sum() == 0
