"""The experts operator boundary: the reference combine against a direct computation."""

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
