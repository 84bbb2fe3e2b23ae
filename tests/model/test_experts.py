"""The experts operator boundary: the reference combine against a direct computation."""

import pytest
import torch
import torch.nn.functional as F

from pagedweight.model.experts import DenseExperts


def test_dense_experts_equal_per_token_sum():
    torch.manual_seed(0)
    E, H, I, T, k = 6, 16, 24, 9, 2
    experts = DenseExperts(E, H, I)
    with torch.no_grad():
        experts.gate_up.normal_()
        experts.down.normal_()
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ids[0] = torch.tensor([5, 5 - 1])  # experts with no tokens and ragged counts are fine
    weights = torch.rand(T, k)
    out = experts(x, ids, weights)
    expected = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            gate, up = (experts.gate_up[e] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (experts.down[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-4)


def _routing(T, E, k, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    return ids, torch.rand(T, k, generator=gen)


def test_grouped_path_equals_the_per_expert_loop():
    """The sort + grouped-product path against the loop it replaces, with idle experts,
    one expert taking every token, and one token."""
    gen = torch.Generator().manual_seed(1)
    E, H, I, k = 8, 32, 48, 3
    experts = DenseExperts(E, H, I)
    with torch.no_grad():
        experts.gate_up.copy_(torch.randn(E, 2 * I, H, generator=gen))
        experts.down.copy_(torch.randn(E, H, I, generator=gen))
    for T in (1, 5, 33):
        x = torch.randn(T, H, generator=gen)
        ids, weights = _routing(T, E, k, gen)
        if T == 33:
            ids[:, 0] = 2  # expert 2 gets every token
        experts.grouped = True
        got = experts(x, ids, weights)
        experts.grouped = False
        want = experts(x, ids, weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    experts.grouped = True
    assert experts(torch.zeros(0, H), torch.zeros(0, k, dtype=torch.int64), torch.zeros(0, k)).shape == (0, H)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_path_on_cuda_bf16_has_no_host_sync():
    gen = torch.Generator().manual_seed(2)
    E, H, I, k, T = 60, 256, 128, 4, 16
    experts = DenseExperts(E, H, I).to("cuda", torch.bfloat16)
    with torch.no_grad():
        experts.gate_up.copy_(torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5)
        experts.down.copy_(torch.randn(E, H, I, generator=gen) / I ** 0.5)
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    ids, weights = _routing(T, E, k, gen)
    ids, weights = ids.cuda(), weights.to("cuda", torch.bfloat16)
    experts(x, ids, weights)  # warm-up (library handles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = experts(x, ids, weights)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    experts.grouped = False
    want = experts(x, ids, weights)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, err
