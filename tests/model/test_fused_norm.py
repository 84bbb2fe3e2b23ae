"""The CUDA path of RMSNorm (torch's rms_norm for the normalisation, issue 12) against the
composed form the CPU runs: the same arithmetic, so fp32 agrees to rounding and bf16
outputs differ by at most one rounding step."""

import pytest
import torch

from pagedweight.model.layers import RMSNorm, rms_norm_cast_then_scale


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
def test_rms_norm_cast_then_scale_equals_the_composed_norm(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=gen) * 2 + 0.1)
    norm = norm.to(dtype)
    x = (torch.randn(5, 7, 96, generator=gen) * 3).to(dtype)
    want = norm(x)  # the CPU: composed
    got = rms_norm_cast_then_scale(x, norm.weight, norm.eps)
    assert got.dtype == want.dtype and got.shape == want.shape
    rel = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max().item()
    assert rel <= tol, rel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rms_norm_on_cuda_equals_the_cpu():
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(2048, 1e-6).to(torch.bfloat16)
    x = torch.randn(64, 2048, generator=gen).to(torch.bfloat16)
    want = norm(x).float()
    got = norm.cuda()(x.cuda()).float().cpu()
    assert ((got - want).abs() / want.abs().clamp_min(1e-3)).max().item() <= 2 ** -7
