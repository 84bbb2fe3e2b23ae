"""CheckpointLayers checks a decoder layer's finiteness on the device, after the conversion
to the compute dtype (the host check is skipped for those tensors): a poisoned expert or
attention weight is still refused, naming the parameter, and a clean layer loads."""

from __future__ import annotations

import pytest
import torch

from pagedweight.common.errors import CheckpointError
from pagedweight.offline.checkpoint_layers import CheckpointLayers
from tests.model.test_loader_errors import model_copy  # noqa: F401 - fixture
from tests.model.test_loader_trust import edit_tensors


@pytest.mark.parametrize("key, param", [("model.layers.1.block_sparse_moe.experts.2.w1.weight", "moe.experts.gate_up"),
                                        ("model.layers.1.self_attn.k_proj.weight", "self_attn.k_proj.weight")])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_layer_weight_is_refused_on_the_device(model_copy, key, param, value):  # noqa: F811
    def poison(t):
        t[key] = t[key].clone()
        t[key][3, 5] = value
    edit_tensors(model_copy, poison)
    layers = CheckpointLayers(model_copy, "cpu")
    layers.decoder_layer(0)  # the other layers are clean
    with pytest.raises(CheckpointError, match=rf"layer 1's .*{param.replace('.', '[.]')}.* NaN or infinite"):
        layers.decoder_layer(1)


def test_a_value_the_compute_dtype_cannot_hold_is_refused(model_copy):  # noqa: F811
    key = "model.layers.0.block_sparse_moe.experts.0.w2.weight"

    def big(t):
        t[key] = t[key].float().clone()
        t[key][0, 0] = 1e6  # finite in float32, infinite in float16
    edit_tensors(model_copy, big)
    assert torch.isfinite(CheckpointLayers(model_copy, "cpu", "float32").decoder_layer(0).moe.experts.down).all()
    with pytest.raises(CheckpointError, match="layer 0's moe.experts.down hold NaN or infinite values .in float16"):
        CheckpointLayers(model_copy, "cpu", "float16").decoder_layer(0)
