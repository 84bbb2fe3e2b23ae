"""The expert GEMV (decode_ops.experts_gemv, expert_gemv.cu) against the torch chain it
replaces at few tokens per expert: per assignment x gate_up_e^T rounded, act(gate) * up
rounded as gated_rows rounds it, h down_e^T rounded, then the weighted sum over k
(grouped_moe_forward's roundings, computed here per assignment in fp32 on upcast weights);
bf16, fp16 and fp32, odd shapes (the one-element-per-lane path), ragged routing with empty
experts and experts of more rows than a pass takes, outputs poisoned with NaN, reruns
bit-identical; then the dense experts and a whole model with the kernel on and off."""

from __future__ import annotations

import pytest
import torch

from pagedweight_kernels import decode_ops
from pagedweight_kernels.moe_reference import gated, grouped_moe_forward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not decode_ops.available(), reason="needs a CUDA GPU and cupy"),
]

# max |got - want| against the chain, relative to max |want|: an fp32 accumulation order
# apart, a last-bit flip of an intermediate rounding at most (16-bit dtypes)
ELEMENT_TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}
NORM_TOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).cuda()


def _experts(E, H, I, dtype, seed):
    gate_up = _randn(E, 2 * I, H, dtype=dtype, seed=seed, scale=H ** -0.5)
    down = _randn(E, H, I, dtype=dtype, seed=seed + 1, scale=I ** -0.5)
    return gate_up, down


def _routing(T, k, E, seed, crowd=None):
    """k distinct experts per token; `crowd`: every token's first choice is that expert (one
    expert with T rows: several passes) and the rest come from the first 2k experts (the
    others get no rows)."""
    gen = torch.Generator().manual_seed(seed)
    pool = E if crowd is None else min(E, 2 * k + 1)
    ids = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(T)])
    if crowd is not None:
        for t in range(T):
            row = [crowd] + [e for e in ids[t].tolist() if e != crowd][: k - 1]
            ids[t] = torch.tensor(row)
    w = torch.rand(T, k, generator=gen) + 0.05
    return ids.cuda(), w / w.sum(-1, keepdim=True)


def chain(x, ids, w, gate_up, down, activation="silu"):
    """The torch chain's values, one assignment at a time: products in fp32 over upcast
    weights, rounded where grouped_moe_forward's tensors are stored."""
    T, k = ids.shape
    dt = x.dtype
    flat = ids.reshape(-1)
    xa = x.float().repeat_interleave(k, dim=0)  # [T k, H]: assignment t k + j reads token t
    gu = torch.einsum("nh,nrh->nr", xa, gate_up.float()[flat]).to(dt)
    h = gated(*gu.chunk(2, dim=-1), activation)
    y = torch.einsum("ni,nhi->nh", h.float(), down.float()[flat]).to(dt)
    return (y.view(T, k, -1) * w.to(dt)[..., None]).sum(dim=1)


def _check(got, want, dtype):
    assert torch.isfinite(got).all()
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= ELEMENT_TOL[dtype] * scale
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < NORM_TOL[dtype]


def _poisoned_run(x, ids, w, gate_up, down, activation):
    """Both kernels into NaN-filled outputs: every element they own must be written."""
    n, I = ids.numel(), down.shape[2]
    h = torch.full((n, I), float("nan"), dtype=x.dtype, device="cuda")
    out = torch.full((x.shape[0], down.shape[1]), float("nan"), dtype=x.dtype, device="cuda")
    decode_ops.expert_gate_up(x, ids, gate_up, activation, out=h)
    assert torch.isfinite(h).all()
    decode_ops.expert_down_combine(h, ids, w, down, out=out)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,k,E,H,I", [
    (1, 4, 60, 2048, 1408),  # Qwen1.5-MoE-A2.7B's experts at one token (16-byte vectors, 5.5 per lane)
    (16, 4, 60, 256, 96),    # a decode batch: ~1 row per expert, some experts empty
    (3, 2, 7, 203, 37),      # odd H and I: one element per lane
    (5, 1, 3, 96, 64),       # top-1
    (64, 4, 16, 128, 72),    # 256 assignments (the kernels' limit): many rows per expert
])
def test_experts_gemv_equals_the_chain(dtype, T, k, E, H, I):
    gate_up, down = _experts(E, H, I, dtype, seed=T + E)
    x = _randn(T, H, dtype=dtype, seed=3)
    ids, w = _routing(T, k, E, seed=T)
    w = w.to(dtype).cuda()
    want = chain(x, ids, w, gate_up, down)
    got = _poisoned_run(x, ids, w, gate_up, down, "silu")
    _check(got, want, dtype)
    assert torch.equal(_poisoned_run(x, ids, w, gate_up, down, "silu"), got)  # bit-identical rerun


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_ragged_routing_with_crowded_and_empty_experts(dtype, activation):
    """Expert 5 gets all 13 tokens (four passes of 4 rows), most experts none; x is a strided
    view (the rows of a wider product)."""
    T, k, E, H, I = 13, 3, 32, 512, 200
    gate_up, down = _experts(E, H, I, dtype, seed=21)
    x = _randn(T, H + 24, dtype=dtype, seed=22)[:, 8:8 + H]  # row stride H + 24, 16-byte aligned
    ids, w = _routing(T, k, E, seed=23, crowd=5)
    w = w.to(dtype).cuda()
    assert (ids == 5).sum().item() == T and len(set(ids.flatten().tolist())) < E
    want = chain(x, ids, w, gate_up, down, activation)
    got = _poisoned_run(x, ids, w, gate_up, down, activation)
    _check(got, want, dtype)
    torch.testing.assert_close(decode_ops.experts_gemv(x, ids, w, gate_up, down, activation), got, rtol=0, atol=0)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")
@pytest.mark.parametrize("T", [1, 4, 16])
def test_experts_gemv_equals_grouped_moe_forward(T):
    """The path it replaces in the model, at Qwen1.5-MoE's expert shape."""
    E, k, H, I = 60, 4, 2048, 1408
    gate_up, down = _experts(E, H, I, torch.bfloat16, seed=31)
    x = _randn(T, H, dtype=torch.bfloat16, seed=32)
    ids, w = _routing(T, k, E, seed=33)
    w = w.to(torch.bfloat16).cuda()
    want = grouped_moe_forward(x, ids, w, gate_up, down)
    _check(decode_ops.experts_gemv(x, ids, w, gate_up, down), want, torch.bfloat16)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")
@pytest.mark.parametrize("T", [1, 4])
def test_fp32_routing_weights_combine_in_fp32(T):
    """Gemma-4's router keeps its weights in fp32: the GEMV and the fused grouped chain weight and
    sum in fp32 as grouped_moe_forward does, and differ from rounding each product to bf16."""
    E, k, H, I = 128, 8, 512, 96
    gate_up, down = _experts(E, H, I, torch.bfloat16, seed=41)
    x = _randn(T, H, dtype=torch.bfloat16, seed=42)
    ids, w = _routing(T, k, E, seed=43)
    w = w.float().cuda()
    want = grouped_moe_forward(x, ids, w, gate_up, down)
    _check(decode_ops.experts_gemv(x, ids, w, gate_up, down), want, torch.bfloat16)
    _check(decode_ops.grouped_moe_fused(x, ids, w, gate_up, down), want, torch.bfloat16)
    rounded = grouped_moe_forward(x, ids, w.to(torch.bfloat16), gate_up, down)
    assert not torch.equal(rounded, want)  # (the fp32 combine is what is checked)


def test_bad_input_is_refused_with_one_clear_error():
    gate_up, down = _experts(4, 64, 32, torch.bfloat16, seed=0)
    x = _randn(2, 64, dtype=torch.bfloat16, seed=1)
    ids = torch.zeros(2, 2, dtype=torch.int64, device="cuda")
    w = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="gate_up"):
        decode_ops.expert_gate_up(x, ids, gate_up.half())
    with pytest.raises(ValueError, match="assignments"):
        decode_ops.expert_gate_up(x, torch.zeros(2, 200, dtype=torch.int64, device="cuda"), gate_up)
    with pytest.raises(ValueError, match="topk_ids"):
        decode_ops.expert_gate_up(x, ids.int(), gate_up)
    h = decode_ops.expert_gate_up(x, ids, gate_up)
    with pytest.raises(ValueError, match="down"):
        decode_ops.expert_down_combine(h, ids, w, down[:, :, :16].contiguous())
    most = decode_ops.gemv_max_tokens(4, 60)
    assert most * 4 <= decode_ops.GEMV_MAX_TOKENS_PER_EXPERT * 60 < (most + 1) * 4
    assert decode_ops.gemv_supported(most, 4, 60, torch.bfloat16)
    assert not decode_ops.gemv_supported(most + 1, 4, 60, torch.bfloat16)


def test_dense_experts_take_the_gemv_for_few_tokens_only():
    """DenseExperts with few_rows_kernel: the GEMV up to gemv_max_tokens (its values), the
    grouped path above (its values); off, or with grouped=False, never."""
    from pagedweight.model.experts import DenseExperts

    E, k, H, I = 16, 4, 256, 96
    experts = DenseExperts(E, H, I).to(torch.bfloat16).cuda()
    with torch.no_grad():
        experts.gate_up.copy_(_experts(E, H, I, torch.bfloat16, seed=41)[0])
        experts.down.copy_(_experts(E, H, I, torch.bfloat16, seed=41)[1])
    experts.few_rows_kernel = True
    most = decode_ops.gemv_max_tokens(k, E)
    for T in (1, most, most + 1):
        x = _randn(T, H, dtype=torch.bfloat16, seed=T)
        ids, w = _routing(T, k, E, seed=T)
        w = w.to(torch.bfloat16).cuda()
        few = T <= most
        assert experts.takes_gemv(x, ids, w) is few
        want = decode_ops.experts_gemv(x, ids, w, experts.gate_up, experts.down) if few else \
            decode_ops.grouped_moe_fused(x, ids, w, experts.gate_up, experts.down)
        torch.testing.assert_close(experts(x, ids, w), want, rtol=0, atol=0)
    experts.grouped = False
    assert not experts.takes_gemv(x[:1], ids[:1], w[:1])
    experts.grouped, experts.few_rows_kernel = None, False
    assert not experts.takes_gemv(x[:1], ids[:1], w[:1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_with_the_gemv_equals_the_model_without(dtype):
    """A whole model's logits (Qwen2-MoE shape with the shared expert, a prompt of
    gemv_max_tokens tokens, so every layer's experts take the GEMV) with the kernel on and off
    (off: the grouped product in bf16, the per-expert loop in fp16)."""
    from pagedweight.offline import real_shape_models as rs
    from pagedweight.format.model_config import ModelConfig

    torch.manual_seed(0)
    hf, raw = rs.build_hf_model("tiny-qwen-moe", torch.device("cuda"), torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model = rs.ours_from_hf(hf.to(dtype), ModelConfig.from_dict(raw))
    T = decode_ops.gemv_max_tokens(model.config.num_experts_per_tok, model.config.num_experts)
    assert T >= 2
    ids = torch.randint(1, 500, (1, T), generator=torch.Generator().manual_seed(1)).cuda()
    logits = {}
    for on in (True, False):
        for block in model.moe_blocks:
            block.experts.few_rows_kernel = on
        probe = torch.empty(T, 2, dtype=dtype, device="cuda")  # T tokens, top-2
        assert model.moe_blocks[0].experts.takes_gemv(probe, probe.long(), probe) is on
        with torch.no_grad():
            logits[on] = model(ids)[0].float()
    rel = ((logits[True] - logits[False]).norm() / logits[False].norm()).item()
    agree = (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean().item()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3) and agree >= (T - 1) / T, (rel, agree)
