"""decode_ops' fused kernels against the torch chains they replace, which are the
forms the CPU runs: RMSNorm, SparseMoeBlock's routing, `gated`, grouped_moe_forward's sort,
products and combine, RoPE and PagedKVCache's row write; then whole models on CUDA with the
kernels on and off (`make test-gpu`)."""

from __future__ import annotations

import pytest
import torch

from pagedweight_kernels import decode_ops
from pagedweight_kernels.moe_reference import gated, grouped_moe_forward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not decode_ops.available(), reason="needs a CUDA GPU and cupy"),
]

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7)}


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["norm", "add", "add_shared"])
@pytest.mark.parametrize("T,H", [(1, 2048), (7, 96), (64, 4096), (2, 5000)])  # 8, 8, 16 per thread; 320 threads
def test_add_rms_norm_equals_add_then_rmsnorm(dtype, mode, T, H):
    from pagedweight.model.layers import RMSNorm

    norm = RMSNorm(H, 1e-6).to(dtype).cuda()
    with torch.no_grad():
        norm.weight.copy_(_randn(H, dtype=dtype, seed=1) * 0.3 + 1)
    x = _randn(T, H, dtype=dtype, seed=2, scale=3)
    delta = _randn(T, H, dtype=dtype, seed=3) if mode != "norm" else None
    wide = _randn(T, 5, dtype=dtype, seed=4, scale=2)  # the gate logit as a strided column
    shared, gate = (_randn(T, H, dtype=dtype, seed=5), wide[:, 3:4]) if mode == "add_shared" else (None, None)
    want_res = x
    if delta is not None:
        d = delta if shared is None else delta + torch.sigmoid(gate) * shared  # SparseMoeBlock.forward
        want_res = x + d  # DecoderLayer.forward_paged
    want = norm(want_res)
    res, got = decode_ops.add_rms_norm(x, norm.weight, norm.eps, delta, shared, gate)
    # the same roundings, element by element (a last-bit difference of sigmoid at most; atol:
    # x + d cancels in places, so a last bit of d can be a large relative difference there)
    torch.testing.assert_close(res, want_res, **TOL[dtype])
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert not torch.equal(got, x)


@pytest.mark.parametrize("E,k,renorm", [(60, 4, False), (128, 8, True), (8, 2, True), (64, 8, False)])
@pytest.mark.parametrize("T", [1, 5, 64])
def test_route_topk_equals_softmax_topk(E, k, renorm, T):
    from pagedweight.model.moe_block import SparseMoeBlock

    block = SparseMoeBlock.__new__(SparseMoeBlock)  # only its routing arithmetic
    torch.nn.Module.__init__(block)
    block.top_k, block.norm_topk_prob = k, renorm
    gen = torch.Generator().manual_seed(E + T)
    distinct = torch.stack([torch.randperm(E + 9, generator=gen) for _ in range(T)]) * 0.05 - 3  # no ties
    logits = distinct.to(torch.bfloat16).cuda()[:, 3:3 + E]  # strided rows, as a view of the fused product
    want_ids, want_w = block._route_logits(logits, torch.bfloat16)
    ids, w = decode_ops.route_topk(logits, k, renorm, torch.bfloat16)
    assert ids.dtype == torch.int64 and w.dtype == torch.bfloat16
    torch.testing.assert_close(ids, want_ids, rtol=0, atol=0)
    torch.testing.assert_close(w, want_w, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rows_equals_gated(activation, dtype):
    gu = _randn(6, 2 * 96 + 8, dtype=dtype, seed=7, scale=2)[:, :2 * 96]  # strided rows
    want = gated(*gu.chunk(2, dim=-1), activation)
    torch.testing.assert_close(decode_ops.gated_rows(gu, activation), want, **TOL[dtype])


@pytest.mark.parametrize("T,k,E", [(1, 4, 60), (3, 2, 8), (64, 4, 60), (256, 4, 128), (128, 8, 64)])
def test_group_rows_sorts_stably_by_expert(T, k, E):
    gen = torch.Generator().manual_seed(T * k + E)
    ids = torch.randint(0, min(E, 12), (T, k), generator=gen).cuda()  # few experts: many ties
    x = _randn(T, 80, dtype=torch.bfloat16, seed=9)
    rows, inv, offs = decode_ops.group_rows(x, ids, E)
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    torch.testing.assert_close(rows, x[order // k], rtol=0, atol=0)
    torch.testing.assert_close(inv.long()[order], torch.arange(T * k, device="cuda"), rtol=0, atol=0)
    want_offs = torch.searchsorted(sorted_ids, torch.arange(E, device="cuda"), right=True, out_int32=True)
    torch.testing.assert_close(offs, want_offs, rtol=0, atol=0)


def test_combine_rows_equals_place_weight_sum():
    T, k, H = 9, 4, 64
    y = _randn(T * k, H, dtype=torch.bfloat16, seed=11)
    inv = torch.randperm(T * k, generator=torch.Generator().manual_seed(1)).int().cuda()
    w = _randn(T, k, dtype=torch.bfloat16, seed=12).abs()
    placed = y[inv.long()]  # row of assignment a is y[inv[a]]
    want = (placed.view(T, k, H) * w[..., None]).sum(dim=1)
    torch.testing.assert_close(decode_ops.combine_rows(y, inv, w), want, rtol=2 ** -7, atol=0)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")
@pytest.mark.parametrize("T", [1, 4, 64])
def test_grouped_moe_fused_equals_grouped_moe_forward(T):
    E, k, H, I = 60, 4, 256, 96
    x = _randn(T, H, dtype=torch.bfloat16, seed=13)
    gate_up = _randn(E, 2 * I, H, dtype=torch.bfloat16, seed=14, scale=H ** -0.5)
    down = _randn(E, H, I, dtype=torch.bfloat16, seed=15, scale=I ** -0.5)
    gen = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).cuda()
    w = torch.rand(T, k, generator=gen).to(torch.bfloat16).cuda()
    want = grouped_moe_forward(x, ids, w, gate_up, down)
    got = decode_ops.grouped_moe_fused(x, ids, w, gate_up, down)
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,G,D", [(1, 16, 16, 128), (5, 4, 2, 64), (64, 32, 8, 128)])
def test_rope_write_equals_rotary_then_cache_write(dtype, T, N, G, D):
    from pagedweight.model.layers import RotaryEmbedding, apply_rotary_signed, signed_sin

    width = (N + 2 * G) * D
    qkv = _randn(T, width + 16, dtype=dtype, seed=T + N, scale=2)[:, :width]  # strided rows (a bias pad)
    positions = torch.randint(0, 4000, (1, T), generator=torch.Generator().manual_seed(T)).cuda()
    cos, sin = RotaryEmbedding(D, 1e6).cos_sin(positions, dtype)  # [1, 1, T, D]
    ssin = signed_sin(sin)
    rows_total = 3 * T + 5
    rows = torch.randperm(rows_total, generator=torch.Generator().manual_seed(2))[:2 * T].cuda()
    rows_k, rows_v = rows[:T].contiguous(), rows[T:].contiguous()
    cache = torch.full((rows_total * G * D,), float("nan"), dtype=dtype, device="cuda")
    q = decode_ops.rope_write(qkv, cos.reshape(T, D), ssin.reshape(T, D), N, G, D, cache,
                              rows_k * (G * D), rows_v * (G * D))  # element starts of whole token rows
    heads = qkv.reshape(T, N + 2 * G, D).transpose(0, 1)[None]  # [1, heads, T, D]
    rotated = apply_rotary_signed(heads[:, :N + G], cos, ssin)[0].transpose(0, 1)  # [T, N + G, D]
    torch.testing.assert_close(q, rotated[:, :N], **TOL[dtype])
    view = cache.view(rows_total, G * D)
    torch.testing.assert_close(view[rows_k], rotated[:, N:].reshape(T, G * D), **TOL[dtype])
    torch.testing.assert_close(view[rows_v], qkv[:, (N + G) * D:], rtol=0, atol=0)
    untouched = torch.ones(rows_total, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    assert view[untouched].isnan().all()


def test_bad_input_is_refused_with_one_clear_error():
    x = _randn(2, 64, dtype=torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="weight"):
        decode_ops.add_rms_norm(x, torch.ones(32, dtype=torch.bfloat16, device="cuda"), 1e-6)
    with pytest.raises(ValueError, match="k <="):
        decode_ops.route_topk(x[:, :8], 9, False, torch.bfloat16)
    with pytest.raises(ValueError, match="assignments"):
        decode_ops.group_rows(x, torch.zeros(2, 1000, dtype=torch.int64, device="cuda"), 8)


@pytest.mark.parametrize("name", ["tiny-qwen-moe", "tiny-qwen3-moe", "tiny-olmoe"])
def test_engine_with_kernels_equals_engine_without(name):
    """Whole models (fp32, CUDA): the paged steps through the fused kernels give the tokens
    the torch chains give; the Qwen2-MoE shape has the gated shared expert, Qwen3 q/k norms
    (the RoPE kernel steps aside), OLMoE full-projection norms and 16 experts."""
    from pagedweight.offline import real_shape_models as rs
    from pagedweight.engine.engine import Engine, EngineConfig
    from pagedweight.engine.sampler import SamplingParams
    from pagedweight.engine.scheduler import SchedulerConfig
    from pagedweight.format.model_config import ModelConfig
    from pagedweight.memory.kv_cache import KVCacheConfig

    torch.manual_seed(0)
    hf, raw = rs.build_hf_model(name, torch.device("cuda"), torch.float32)
    with torch.no_grad():  # a wider spread than the init's, so greedy tokens depend on the model
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model = rs.ours_from_hf(hf, ModelConfig.from_dict(raw))
    prompts = [torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 9)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = []
    for kernels in (True, False):
        engine = Engine(model, config=EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                                                   kv=KVCacheConfig(block_size=4), num_kv_blocks=256))
        model.fuse_projections(kernels=kernels)  # the engine turned them on
        assert model.fused_kernels is kernels
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        out = engine.run_to_completion()
        outputs.append([out[str(i)] for i in range(len(prompts))])
    assert outputs[0] == outputs[1]
    assert len(set(map(tuple, outputs[0]))) > 1
