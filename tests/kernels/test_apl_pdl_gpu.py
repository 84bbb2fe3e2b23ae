"""Programmatic dependent launch of the two projections (GEMV_PDL with the .cu's APL_GEMV_PDL),
on the GPU: down starts while gate_up finishes and waits for h inside, gate_up (GEMV_PDL 2)
waits for the kernel before it. A wait placed too late reads h before gate_up wrote it; the
workspaces are NaN-poisoned (check_case), so that shows as NaN or as outputs that differ from
the serial launches' bit for bit."""

import pytest
import torch

import pagedweight_kernels.apl_moe as op
import pagedweight_kernels.programmatic_launch as pl
from pagedweight_kernels.apl_moe import apl_moe, kernel_available, plan_launch
from pagedweight_kernels.synthetic import ragged_routing, random_layer
from tests.kernels.test_apl_moe_gpu import CASES, TOLERANCE, _bits, check_case, reference_fp32, relative_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not kernel_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs cupy and a CUDA GPU of compute capability 9.0 or later"),
              pytest.mark.usefixtures("tiles_regime")]  # (tests/kernels/conftest.py)


QWEN_4 = (60, 4, 2048, 1408, 4, 60, torch.bfloat16)  # 1216 CTAs: down CTAs start while gate_up's still run
# (case, bits): odd word counts, idle experts (fp16), column splits, Qwen size at 1 and 4 tokens,
# mixed widths (the merged kernel), tiles (64 per pass, fp16) and Qwen-size tiles.
PDL_CASES = [(CASES[0], None), (CASES[1], 4), (CASES[4], 3), (CASES[9], 4), (QWEN_4, 4), (CASES[3], None),
             (CASES[7], None), (CASES[10], 4)]


@pytest.fixture(scope="module", autouse=True)
def pdl_instances_compiled():
    """Every instance compiled first, in threads (the waits are compiled in by default: these are
    the default instances, which a sharded suite run has compiled already)."""
    assert op.KERNEL_DEFINES["APL_GEMV_PDL"] == 1
    for dtype in (torch.bfloat16, torch.float16):
        op.precompile(dtype, max_workers=16)


def _uniform(E, bits):
    return {(e, m): bits for e in range(E) for m in ("gate_up", "down")} if bits else None


def _count_programmatic(monkeypatch) -> list:
    launched = []
    real = pl.launch_programmatic

    def counting(kernel, grid, *args):
        launched.append(tuple(grid))
        return real(kernel, grid, *args)

    monkeypatch.setattr(pl, "launch_programmatic", counting)
    return launched


@pytest.mark.parametrize("pdl", [1, 2])
@pytest.mark.parametrize("case,bits", PDL_CASES, ids=lambda v: str(v) if isinstance(v, (int, type(None))) else
                         "-".join(str(x).replace("torch.", "") for x in v))
def test_programmatic_launches_equal_serial_launches(case, bits, pdl, monkeypatch):
    E, k, H, I, T = case[:5]
    assert plan_launch(T, k, E, H, I, 8).gate_up.regime in ("gemv", "tiles")
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_PDL", 1)
    monkeypatch.setattr(op, "GEMV_PDL", 0)
    serial = check_case(case, bits=bits)
    monkeypatch.setattr(op, "GEMV_PDL", pdl)
    launched = _count_programmatic(monkeypatch)
    assert torch.equal(check_case(case, bits=bits), serial)
    # check_case calls the layer twice: a down launch per call where its class takes it (and
    # gate_up's with GEMV_PDL 2)
    layer = random_layer(E, H, I, seed=T, device=torch.device("cuda"), bits=_uniform(E, bits))
    plan = plan_launch(T, k, E, H, I, layer.max_bits)
    downs = sum(op.programmatic_down(cls, plan.down.tiles) for cls, _ in layer.decode_launches("down"))
    assert len(launched) == 2 * (downs + (pdl == 2) * len(layer.decode_launches("gate_up")))


def test_programmatic_launches_with_one_launch_per_bit_class(monkeypatch):
    """Two gate_up and two down launches per call (GEMV_MERGE_CLASSES off, mixed widths)."""
    monkeypatch.setattr(op, "GEMV_MERGE_CLASSES", False)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_PDL", 1)
    monkeypatch.setattr(op, "GEMV_PDL", 0)
    serial = check_case(CASES[3])
    monkeypatch.setattr(op, "GEMV_PDL", 2)
    launched = _count_programmatic(monkeypatch)
    assert torch.equal(check_case(CASES[3]), serial)
    assert len(launched) == 2 * 3  # both gate_up launches, the 3-4-bit down


def test_programmatic_decode_with_no_valid_expert_writes_zeros(monkeypatch):
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_PDL", 1)
    monkeypatch.setattr(op, "GEMV_PDL", 2)
    device = torch.device("cuda")
    layer = random_layer(8, 256, 384, seed=9, device=device)
    x = torch.randn(2, 256, device=device, dtype=torch.bfloat16)
    ids = torch.full((2, 2), 8, dtype=torch.int64, device=device)  # out of range: dropped
    out = apl_moe(x, ids, torch.ones(2, 2, device=device), layer, out=torch.full_like(x, float("nan")))
    assert torch.equal(out, torch.zeros_like(out))


def test_programmatic_layers_replayed_in_a_cuda_graph_follow_new_inputs(monkeypatch):
    """Three layers chained (each one's output the next one's input, so every gate_up depends on
    the down before it) captured with GEMV_PDL 2 and replayed on new tokens and routing: each
    replay equals serial eager calls bit for bit, and no counter is left set."""
    E, k, H, I, T = 16, 4, 256, 192, 3
    device = torch.device("cuda")
    layers = [random_layer(E, H, I, seed=20 + i, device=device, bits=_bits(E, 34, seed=i)) for i in range(3)]
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    ids, w = ragged_routing(T, E, k, seed=1, device=device)
    w = w.to(torch.bfloat16)
    outs = [torch.empty_like(x) for _ in layers]

    def chain():
        inp = x
        for layer, out in zip(layers, outs):
            apl_moe(inp, ids, w, layer, out=out)
            inp = out

    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_PDL", 1)
    monkeypatch.setattr(op, "GEMV_PDL", 2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()  # warms the allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for seed in range(2, 5):
        new_ids, new_w = ragged_routing(T, E, k, seed=seed, num_used=5 + seed, device=device)
        x.copy_(torch.randn(T, H, device=device, dtype=torch.bfloat16))
        ids.copy_(new_ids)
        w.copy_(new_w.to(torch.bfloat16))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not any(layer.counters.any() for layer in layers), "a replay left a counter set"
        monkeypatch.setattr(op, "GEMV_PDL", 0)
        inp = x
        for layer, out in zip(layers, outs):
            eager = apl_moe(inp, ids, w, layer)
            assert torch.equal(out, eager)
            assert relative_error(out, reference_fp32(inp, ids, w, layer)) < TOLERANCE[torch.bfloat16]
            inp = eager
        monkeypatch.setattr(op, "GEMV_PDL", 2)


@pytest.mark.parametrize("case,bits", [(CASES[0], None), (CASES[9], 4), (QWEN_4, 3)],
                         ids=lambda v: str(v) if isinstance(v, (int, type(None))) else
                         "-".join(str(x).replace("torch.", "") for x in v))
def test_first_planes_loaded_before_the_wait_keep_the_output(case, bits, monkeypatch):
    """APL_GEMV_PDL_PLANES: down's first step of plane words comes in before it waits for h."""
    serial = check_case(case, bits=bits)
    monkeypatch.setitem(op.KERNEL_DEFINES, "APL_GEMV_PDL_PLANES", 1)
    assert torch.equal(check_case(case, bits=bits), serial)
