"""The shared expert on a side stream, concurrent with routing and the routed experts
(SparseMoeBlock._forward_parts_overlapped). On the CPU: nothing overlaps (no
fused kernels, no streams). On CUDA (`make test-gpu`): the overlapped layer computes the
serial layer's parts, eagerly and replayed from a CUDA graph that follows new inputs,
without a host synchronisation; whole engines with it on and off give the same greedy
tokens, and every step replays a graph (a fork/join that broke capture would turn the
graphs off with a warning, not fail)."""

from __future__ import annotations

import pytest
import torch

from pagedweight.offline import real_shape_models as rs
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.format.model_config import ModelConfig
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight_kernels import decode_ops

needs_cuda = pytest.mark.skipif(not decode_ops.available(), reason="needs a CUDA GPU and cupy")


def _qwen_moe(device: str, dtype: torch.dtype):
    """tiny-qwen-moe (gated shared expert) with weights spread wide enough that greedy
    tokens depend on the model."""
    torch.manual_seed(0)
    hf, raw = rs.build_hf_model("tiny-qwen-moe", torch.device(device), dtype)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model = rs.ours_from_hf(hf, ModelConfig.from_dict(raw))
    for block in model.moe_blocks:  # the grouped experts (CUDA's default, what graphs need; no host sync)
        block.experts.grouped = True
    return model


def _engine(model, overlap: bool) -> Engine:
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                          kv=KVCacheConfig(block_size=4), num_kv_blocks=256, overlap_shared_experts=overlap)
    return Engine(model, config=config)


def test_on_the_cpu_nothing_overlaps():
    model = _qwen_moe("cpu", torch.float32)
    model.fuse_projections()
    assert not model.fused_kernels
    assert model.overlap_shared_experts(True) is False
    assert all(block.shared_stream is None for block in model.moe_blocks)


def _parts_sum(parts):
    routed, shared, gate = parts
    return routed.float() + torch.sigmoid(gate.float()) * shared.float()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_overlapped_layer_computes_the_serial_layer_eagerly_and_in_a_graph(dtype, tol):
    model = _qwen_moe("cuda", dtype)
    model.fuse_projections()
    assert model.overlap_shared_experts(True)
    block = model.layers[0].moe
    stream = block.shared_stream
    H = model.config.hidden_size
    xs = [torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to("cuda", dtype) for T in (1, 3, 16)]
    with torch.no_grad():
        block.shared_stream = None
        want = [_parts_sum(block.forward_parts(x)) for x in xs]
        block.shared_stream = stream
        # bf16: the routed experts' grouped/GEMV path, no host sync anywhere; fp32 takes the
        # per-expert loop, which reads routing counts on the host (and keeps graphs off)
        torch.cuda.set_sync_debug_mode("error" if dtype == torch.bfloat16 else 0)
        try:
            got = [_parts_sum(block.forward_parts(x)) for x in xs]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)

        # captured once at 3 rows, replayed on new inputs: the graph holds both branches
        static = xs[1].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            block.forward_parts(static)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block.forward_parts(static)
        for seed in (7, 8):
            x = torch.randn(3, H, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype)
            static.copy_(x)
            graph.replay()
            block.shared_stream = None
            serial = _parts_sum(block.forward_parts(x))
            block.shared_stream = stream
            torch.testing.assert_close(_parts_sum(out), serial, rtol=tol, atol=tol)


@pytest.mark.gpu
@needs_cuda
def test_engines_with_and_without_the_overlap_give_the_same_tokens_and_replay_every_step():
    """bf16: graphs need the grouped experts, which fp32 does not have. At the real shape
    the split product gave the fused one's values to every digit (docs/real_shape.md), so
    the tokens are held equal, not just close."""
    model = _qwen_moe("cuda", torch.bfloat16)
    prompts = [torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 9)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = {}
    for overlap in (True, False):
        engine = _engine(model, overlap)
        assert all((b.shared_stream is not None) is overlap for b in model.moe_blocks)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        out = engine.run_to_completion()
        graphs = engine.runner.graphs
        assert graphs is not None and not graphs.disabled and not graphs.prefill_disabled
        assert graphs.num_replays == engine.stats().num_steps  # every step, the prefills too
        outputs[overlap] = [out[str(i)] for i in range(len(prompts))]
    assert outputs[True] == outputs[False]
    assert len(set(map(tuple, outputs[True]))) > 1
