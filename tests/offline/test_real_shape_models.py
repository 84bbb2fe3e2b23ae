"""What the real-shape benchmarks rest on: our model assembled over transformers'
tensors computes transformers' function, the fast quantiser writes the real format
(the planes decode to the nested codes, within half a bucket of the weights), and the
layer-by-layer build (models too large for the device) gives the artifact of the whole-model
build with the same seed."""

from __future__ import annotations

import pytest
import torch

from pagedweight.offline import real_shape_models as rs
from pagedweight.format.apl_format import BIT_WIDTHS, MAX_BITS, unpack_codes
from pagedweight.format.model_config import ModelConfig


@pytest.mark.parametrize("name", ["tiny-qwen-moe", "tiny-mixtral", "tiny-gemma4"])
def test_assembled_model_matches_transformers(name):
    torch.manual_seed(0)
    hf, raw = rs.build_hf_model(name, torch.device("cpu"), torch.float32)
    config = ModelConfig.from_dict(raw)
    ours = rs.ours_from_hf(hf, config)
    assert ours.layers[0].moe.experts.gate_up.data_ptr() in {p.data_ptr() for p in hf.parameters()}
    result = rs.parity(hf, ours, config.vocab_size, torch.device("cpu"))
    assert result["positions"] == rs.PARITY_POSITIONS
    assert result["max_abs_diff"] < 1e-4 * max(1.0, result["ref_abs_max"]) and result["argmax_agree"] == 1.0
    assert 0.0 <= result["relative_error_mean"] <= result["relative_error_max"] < 1e-5


def test_parity_reports_a_model_that_computes_something_else():
    """The check can fail: one expert's weights changed in our model only (a copy, not the
    shared tensor) moves the relative error far past rounding."""
    torch.manual_seed(0)
    hf, raw = rs.build_hf_model("tiny-qwen-moe", torch.device("cpu"), torch.float32)
    config = ModelConfig.from_dict(raw)
    ours = rs.ours_from_hf(hf, config)
    experts = ours.layers[0].moe.experts
    experts.gate_up = torch.nn.Parameter(experts.gate_up.detach().clone() * 1.5)
    result = rs.parity(hf, ours, config.vocab_size, torch.device("cpu"), positions=32)
    assert result["positions"] == 32 and result["relative_error_max"] > 1e-3


def test_nested_uniform_planes_decode_to_the_weights():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(3, 16, 64, generator=gen)
    lp = rs.nested_uniform_planes(w, group=2)  # groups of 2 over 3 experts: a partial last group
    assert lp.planes.shape == (3, 8, 16, 8) and lp.planes.dtype == torch.uint8
    for e in range(3):
        block = lp.block(e)
        span = (w[e].amax(1, keepdim=True) - w[e].amin(1, keepdim=True))
        for bits in BIT_WIDTHS:
            codes = unpack_codes(block.planes, bits)
            if bits < MAX_BITS:  # nesting: the b-bit code is the top b bits of the 8-bit one
                assert torch.equal(codes, unpack_codes(block.planes, MAX_BITS) >> (MAX_BITS - bits))
            decoded = block.dequantize(bits).float()
            # 5-8 bits come from LUT_4's fp16 centroids and extent: the grid's centres within fp16 rounding
            half_bucket = span / (1 << bits) / 2 + (span * 2.0 ** -9 if bits > 4 else 0)
            assert ((decoded - w[e]).abs() <= half_bucket * 1.01 + 1e-3).all(), bits



def _same_artifact(a, b) -> bool:
    da, db = a.dense_state, b.dense_state
    return (list(da) == list(db) and all(torch.equal(da[k], db[k]) for k in da)
            and set(a.apl) == set(b.apl)
            and all(torch.equal(a.apl[k].planes, b.apl[k].planes) for k in a.apl)
            and all(torch.equal(a.apl[k].luts[w], b.apl[k].luts[w]) for k in a.apl for w in a.apl[k].luts)
            and a.meta == b.meta)


@pytest.mark.parametrize("name", ["tiny-qwen-moe", "tiny-mixtral", "tiny-gemma4", "tiny-olmoe"])
def test_layer_by_layer_build_gives_the_whole_model_artifact(name):
    """Same seed: the layer-by-layer artifact equals the whole model's, every dense tensor,
    plane and LUT; another seed gives other planes."""
    cpu = torch.device("cpu")
    hf, raw = rs.build_hf_model(name, cpu, torch.bfloat16, seed=3)
    config = ModelConfig.from_dict(raw)
    whole = rs.paged_in_memory(rs.ours_from_hf(hf, config), config, raw)
    lines = []
    by_layer, stats = rs.paged_by_layer(name, cpu, torch.bfloat16, seed=3, log=lines.append)
    assert _same_artifact(whole, by_layer)
    assert len(lines) == config.num_layers and stats["peak_host_anon_bytes"] > 0
    other, _ = rs.paged_by_layer(name, cpu, torch.bfloat16, seed=4, log=lines.append)
    assert not torch.equal(other.apl[(0, "down")].planes, whole.apl[(0, "down")].planes)
