"""After `precompile`, no shape, bit mix or layout the fused kernel meets compiles anything
(compiles met inside decode-graph captures cost 0.05-0.4 s each on the H200)."""

import pytest
import torch

from pagedweight_kernels.apl_moe import apl_moe, compile_stats, kernel_available, precompile
from pagedweight_kernels.synthetic import ragged_routing, random_layer
from tests.kernels.test_apl_moe_gpu import TOLERANCE, reference_fp32, relative_error
from pagedweight_kernels.plan import plan_launch, tiles_choices

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not kernel_available(), reason="needs a CUDA GPU and cupy")]

E, K = 8, 2
# (hidden, intermediate): the first has cols % 64 != 0 (4-byte plane loads), the second 8-byte ones
SHAPES = [(160, 224), (256, 384)]
# E=8, K=2 gives T/4 tokens per expert: gemv (<= 4), the tiles regime with NT8 2, 4 and 8 (and 12
# for 3-4-bit layers at 200 tokens; up to 128 per expert), then the prefill kernel's largest tile
TOKENS = [1, 16, 20, 80, 200, 600]


def _bits(kind: str) -> dict:
    widths = {"low": (3, 4), "high": (5, 8), "mixed": (3, 8)}[kind]
    return {(e, m): widths[(e + i) % 2] for e in range(E) for i, m in enumerate(("gate_up", "down"))}


def test_nothing_compiles_after_precompile():
    device = torch.device("cuda")
    precompile(torch.bfloat16, "silu", device)
    assert precompile(torch.bfloat16, "silu", device) == 0  # the second call finds every instance
    before = compile_stats()
    regimes = set()
    for hidden, inter in SHAPES:
        for kind in ("low", "high", "mixed"):
            layer = random_layer(E, hidden, inter, seed=hidden, device=device, bits=_bits(kind))
            for tokens in TOKENS:
                plan = plan_launch(tokens, K, E, hidden, inter, layer.max_bits).gate_up
                regimes.add((plan.regime, plan.tiles if plan.regime != "prefill" else plan.tokens))
                gen = torch.Generator().manual_seed(tokens)
                x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
                ids, w = ragged_routing(tokens, E, K, seed=tokens, device=device)
                w = w.to(torch.bfloat16)
                out = apl_moe(x, ids, w, layer)
                err = relative_error(out, reference_fp32(x, ids, w, layer))
                assert err < TOLERANCE[torch.bfloat16], (hidden, kind, tokens, err)
    torch.cuda.synchronize()
    assert {r for r, _ in regimes} == {"gemv", "tiles", "prefill"}
    # every NT8 the plan can pick was met (12: the 3-4-bit layers' 96-token passes at 200 tokens)
    assert {t for r, t in regimes if r == "tiles"} == set(tiles_choices(0)) - {1}
    assert {t for r, t in regimes if r == "prefill"} == {128}
    after = compile_stats()
    assert after.count == before.count, f"{after.count - before.count} kernel instances compiled after precompile"
