"""The fused kernel at the seed models' layer shapes against the fp32 torch reference.

The smoke set's layers are small (H 256, I 384), so they never reach what only the real sizes
do: many splits a row and long planes in decode, several passes and tiles an expert in the
tiles and staged regimes, Mixtral's 14336-wide rows, Gemma-4's 128 experts at top-8. The
kernel-layer benchmark times these shapes without checking them; this checks them at token
counts that reach each regime (1 and 16: decode; 32: decode, tiles on Mixtral; 256: tiles, the
staged regime on Hopper), at 4 and 8 bits and a mixed plan. On the GPU machine: `make test-gpu`
(and `tools/kernel_change_gpu.sh`, after the smoke set).
"""

import pytest
import torch

from bench.apl_moe_kernel import MODELS
from pagedweight_kernels.apl_moe import kernel_available
from pagedweight_kernels.synthetic import mixed_bits
from tests.kernels.test_apl_moe_gpu import check_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernel_available(), reason="needs a CUDA GPU and cupy")]

ACTIVATIONS = {"gemma-4-26b-a4b": "gelu_tanh"}  # the others' experts are SiLU-gated
TOKENS = (1, 16, 32, 256)
WIDTHS = (4, 8, "mixed")


@pytest.mark.parametrize("bits", WIDTHS, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("model", tuple(MODELS))
def test_the_seed_shapes_match_the_reference(model, tokens, bits):
    experts, top_k, hidden, intermediate = MODELS[model]
    assignment = mixed_bits(experts) if bits == "mixed" else bits
    case = (experts, top_k, hidden, intermediate, tokens, experts, torch.bfloat16)
    # and through a captured graph, as the engine's steps run it: replays equal the eager run
    check_case(case, bits=assignment, activation=ACTIVATIONS.get(model, "silu"), in_graph=True)
    torch.cuda.empty_cache()  # the next shape's layer and its fp32 reference need the room
