"""The fused kernel's torch reference, launch planning and argument checks (CPU)."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from pagedweight_kernels.apl_moe import APLKernelError, APLLayer, ResidentBlock, apl_moe_reference, check_inputs
from pagedweight_kernels.synthetic import quantize_nested, random_block
from tests.kernels.resident_experts import APLExperts
from pagedweight.format.apl_format import BIT_WIDTHS, dequantize, lut_entries, unpack_codes
from pagedweight_kernels.synthetic import mixed_bits, ragged_routing, random_layer
from pagedweight_kernels.compile import (
    GEMV_SOURCE, SOURCE, STAGED_SOURCE, gemv_name, instance_tiles, kernel_instances, prefill_name, staged_instances,
    staged_name, wgmma_build, wgmma_instance,
)
from pagedweight_kernels.config import ACT_CODES, DEFAULT_CONFIG, config_for
from pagedweight_kernels.layer import counter_words, resident_block
from pagedweight_kernels.plan import (
    gemv_extra_shared, long_split, plan_launch, staged_class, staged_layer, staged_min_stages, staged_plan,
    staged_plane_ring_bytes, tiles_choices, tiles_per_pass, use_staged,
)


def test_reference_equals_dense_experts_on_dequantised_weights():
    E, H, I, T, k = 6, 64, 96, 9, 2
    layer = random_layer(E, H, I, seed=1)
    x = torch.randn(T, H)
    ids, w = ragged_routing(T, E, k, num_used=4)
    out = apl_moe_reference(x, ids, w, layer)
    expected = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = ids[t, j].item()
            gate_up = dequantize(torch.stack(layer.gate_up[e].planes), layer.gate_up[e].lut, layer.gate_up[e].bits)
            gate, up = F.linear(x[t], gate_up.float()).chunk(2)
            down = layer.down[e].dequantize().float()
            expected[t] += w[t, j] * F.linear(F.silu(gate) * up, down)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation, act", [
    ("silu", F.silu),
    ("gelu_tanh", lambda g: 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)))),
])
def test_reference_applies_the_layers_activation(activation, act):
    """The reference computes act(gate) * up with the layer's activation (GELU-tanh written out
    from its formula here, not through the function under test)."""
    E, H, I, T, k = 4, 32, 64, 5, 2
    layer = random_layer(E, H, I, seed=3, activation=activation)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    ids, w = ragged_routing(T, E, k, num_used=3)
    expected = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = ids[t, j].item()
            gate, up = F.linear(x[t], layer.gate_up[e].dequantize().float()).chunk(2)
            expected[t] += w[t, j] * F.linear(act(gate) * up, layer.down[e].dequantize().float())
    torch.testing.assert_close(apl_moe_reference(x, ids, w, layer), expected, rtol=1e-5, atol=1e-5)


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="relu"):
        random_layer(2, 32, 32, activation="relu")


def test_every_block_reads_only_its_own_bits():
    layer = random_layer(6, 32, 32, seed=2)
    widths = {b.bits for b in layer.gate_up + layer.down}
    assert widths == set(BIT_WIDTHS)
    for block in layer.gate_up + layer.down:
        assert len(block.planes) == block.bits and block.lut.shape[1] == lut_entries(block.bits)
        desc = block.descriptor()
        assert desc[0] == block.bits and desc[1] == block.lut.data_ptr()
        assert desc[2:2 + block.bits] == [p.data_ptr() for p in block.planes]
        assert desc[2 + block.bits:] == [0] * (8 - block.bits)
    assert layer.gate_up_desc.shape == (6, 10) and layer.gate_up_desc[3].tolist() == layer.gate_up[3].descriptor()


def test_nested_quantizer_luts_are_cluster_means():
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    block = quantize_nested(w)
    for b in (3, 4):  # the stored LUTs
        codes = unpack_codes(block.planes, b)
        for r in range(5):
            for c in codes[r].unique().tolist():
                mean = w[r][codes[r] == c].mean()
                assert abs(block.luts[b][r, c].float() - mean) <= 1e-3 * max(1.0, abs(mean))  # fp16
    # 5-8 bits: each weight takes the nearest of its 4-bit cell's values, so errors shrink with width
    errors = [(block.dequantize(b).float() - w).abs().mean().item() for b in BIT_WIDTHS]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    step = (w.max(1).values - w.min(1).values) / 255
    assert (block.dequantize(8).float() - w).abs().median() <= step.max()


def test_plan_picks_decode_for_few_tokens_per_expert_and_tensor_cores_for_many():
    qwen = dict(num_experts=60, hidden=2048, intermediate=1408, max_bits=8)
    mixtral = dict(num_experts=8, hidden=4096, intermediate=14336, max_bits=4)
    one = plan_launch(1, 4, **qwen)
    assert one.gate_up.regime == one.down.regime == "gemv" and one.gate_up.tokens == 1
    assert one.max_active == 4 and one.gate_up.grid[:2] == (1408 // 32, 4) and one.down.grid[:2] == (2048 // 64, 4)
    sixteen = plan_launch(16, 2, **mixtral)  # 4 tokens per expert: still decode, passes of 8
    assert sixteen.gate_up.regime == "gemv" and sixteen.gate_up.tokens == 8
    # more tokens per expert: the tiles regime, a pass sized for 1.5x the mean per expert
    qwen64 = plan_launch(64, 4, **qwen)
    assert qwen64.gate_up.regime == qwen64.down.regime == "tiles" and qwen64.gate_up.tiles == 2
    big = plan_launch(256, 2, **mixtral)
    # (a 3-4-bit layer at 64 per expert: passes of 96 tokens, TILES_WIDE_NT8)
    assert big.gate_up.regime == "tiles" and big.gate_up.tokens == 96 and big.gate_up.tiles == 12
    assert big.max_active == 8 and big.gate_up.splits == 1  # K whole: partials stay small
    assert plan_launch(256, 4, **qwen).down.tokens == 32
    assert [tiles_per_pass(n) for n in (4.3, 16, 30, 64, 128)] == [2, 4, 8, 8, 8]
    # wide passes (TILES_WIDE_NT8) only where more than TILES_MAX_NT8 and at most 12 tiles are wanted
    assert [tiles_per_pass(n, 12) for n in (4.3, 16, 30, 42, 43, 64, 65, 128)] == [2, 4, 8, 8, 12, 12, 8, 8]
    # and the staged regime's 128-token passes (STAGED_WIDE_NT8) past 12, whatever order they come in
    assert [tiles_per_pass(n, 12, 16) for n in (30, 64, 65, 85, 86)] == [8, 12, 16, 16, 8]
    assert [tiles_per_pass(n, 16, 12) for n in (64, 65)] == [12, 16] and tiles_per_pass(65, 0, 12) == 8
    # beyond the tiles regime: the prefill kernel
    assert plan_launch(1024, 2, **mixtral).gate_up.regime == "prefill"  # 256 tokens per expert
    assert plan_launch(2048, 4, **qwen).gate_up.regime == "prefill"  # 8192 assignments
    for T in (64, 256):  # staging one step per token: within shared memory with an 8-bit LUT
        for model in (qwen, mixtral):
            plan = plan_launch(T, 2 if model is mixtral else 4, **model)
            for gemm in (plan.gate_up, plan.down):
                assert gemm.shared_bytes + gemv_extra_shared(1, gemm.tiles) <= 227 * 1024
    for T in (1, 4, 16):  # column splits: enough CTAs, whole words, activations within budget
        for model in (qwen, mixtral):
            plan = plan_launch(T, 2, **model)
            for gemm, cols in ((plan.gate_up, model["hidden"]), (plan.down, model["intermediate"])):
                assert gemm.split_cols % 256 == 0 and gemm.splits * gemm.split_cols >= cols
                assert (gemm.splits - 1) * gemm.split_cols < cols  # no empty split
                assert gemm.shared_bytes + 64 * 256 * 2 <= 227 * 1024
                assert gemm.grid[2] == gemm.splits
    # the prefill kernel asked for by regime, at any size (a baseline; the tests' way to reach it)
    for T in (1, 4, 16):
        forced = plan_launch(T, 2, **mixtral, regime="prefill")
        assert forced.gate_up.regime == forced.down.regime == "prefill" and forced.gate_up.tokens == 16
        assert forced.max_active == min(8, 2 * T) and forced.down.shared_bytes <= 227 * 1024
    with pytest.raises(APLKernelError, match="regime"):
        plan_launch(1, 2, **mixtral, regime="decode")


def test_decode_splits_fill_whole_waves():
    """3-4-bit decode splits are chosen by whole waves of gemv_target_ctas: a small layer splits
    until one wave is full; a grid just past a wave takes fewer, longer splits, not a tail."""
    wave = DEFAULT_CONFIG.gemv_target_ctas
    qwen = dict(num_experts=60, hidden=2048, intermediate=1408, max_bits=4)
    mixtral = dict(num_experts=8, hidden=4096, intermediate=14336, max_bits=4)
    small = plan_launch(1, 4, **qwen).gate_up  # 44 row tiles x 4 experts: 3 splits fill the wave
    assert small.splits == 3 and math.prod(small.grid) == wave
    down = plan_launch(1, 2, **mixtral).down  # 5 splits would be 640 CTAs, 1.21 waves
    assert down.splits == 4 and math.prod(down.grid) <= wave and down.split_cols * 4 >= 14336
    assert plan_launch(1, 4, **qwen).down.splits == 2  # 44 words: at least two warp steps a split
    # the kernels holding 5-8-bit blocks (3 CTAs an SM) and stable launches split to about
    # gemv_cell_target_ctas: 396 CTAs over 64 row tiles x 2 experts take 4 splits
    cell_wave = DEFAULT_CONFIG.gemv_cell_target_ctas
    assert plan_launch(1, 2, **dict(mixtral, max_bits=8)).down.splits == math.ceil(cell_wave / 128) == 4
    assert plan_launch(1, 2, **mixtral, stable_launches=True).down.splits == 4
    # a smaller wave (a configuration for a GPU of fewer SMs) takes fewer splits
    half = dataclasses.replace(DEFAULT_CONFIG, gemv_target_ctas=wave // 2)
    assert plan_launch(1, 4, **qwen, config=half).gate_up.splits < small.splits


def test_layers_know_their_bit_classes():
    layer = random_layer(6, 32, 32, seed=2)  # every width 3..8
    assert layer.classes == {"gate_up": {0: 3, 1: 7}, "down": {0: 4, 1: 8}}  # see mixed_bits
    uniform = random_layer(4, 32, 32, bits={(e, m): 3 for e in range(4) for m in ("gate_up", "down")})
    assert uniform.classes == {"gate_up": {0: 3}, "down": {0: 3}}
    block = uniform.down[1]
    raised = resident_block(random_block(32, 32, torch.Generator().manual_seed(1)), 6, "cpu")
    uniform.set_block(1, "down", raised)
    assert uniform.classes == {"gate_up": {0: 3}, "down": {0: 3, 1: 6}}
    assert block.bits == 3 and not uniform.counters.any()
    assert uniform.aligned8 == {"gate_up": False, "down": False}  # 32 columns: one word per row
    wide = random_layer(2, 64, 64, seed=3)
    assert wide.aligned8 == {"gate_up": True, "down": True}
    pool = torch.zeros(4 + 64 * 8, dtype=torch.uint8)
    old = wide.down[0]
    shifted = [pool[4:4 + 64 * 8].view(64, 8)] + old.planes[1:]  # plane 0 at a 4-byte offset
    wide.set_block(0, "down", ResidentBlock(old.bits, shifted, old.lut))
    assert wide.aligned8 == {"gate_up": True, "down": False}


def test_a_batch_of_block_updates_equals_one_at_a_time():
    bits = {(e, m): 3 + (e % 3) for e in range(4) for m in ("gate_up", "down")}
    batched, single = random_layer(4, 32, 32, bits=bits, seed=5), random_layer(4, 32, 32, bits=bits, seed=5)
    gen = torch.Generator().manual_seed(7)
    updates = [(1, "down", resident_block(random_block(32, 32, gen), 8, "cpu")),
               (3, "gate_up", resident_block(random_block(64, 32, gen), 6, "cpu")),
               (1, "down", resident_block(random_block(32, 32, gen), 5, "cpu"))]  # the last one wins
    batched.set_blocks(updates)
    for e, m, block in updates:
        single.set_block(e, m, block)
    for module in ("gate_up", "down"):  # every row shows its block, the updated ones included
        desc = batched.gate_up_desc if module == "gate_up" else batched.down_desc
        assert desc.tolist() == [b.descriptor() for b in getattr(batched, module)]
    assert batched.down[1] is updates[2][2] and batched.gate_up[3] is updates[1][2]
    assert batched.classes == single.classes and batched.max_bits == single.max_bits == 6
    before = batched.down_desc.clone()
    wrong = resident_block(random_block(16, 32, gen), 4, "cpu")
    with pytest.raises(APLKernelError):  # one bad block: nothing of the batch is applied
        batched.set_blocks([(0, "down", updates[0][2]), (2, "down", wrong)])
    assert torch.equal(batched.down_desc, before) and batched.down[0] is not updates[0][2]


def test_a_layer_of_both_classes_takes_the_merged_kernel_once():
    from pagedweight_kernels.layer import class_launches

    assert class_launches({0: 4, 1: 8}) == [(2, 8)] and class_launches({1: 6}) == [(1, 6)]
    assert class_launches({0: 3}) == [(0, 3)]


def test_apl_gemv_launches_add_the_cell_table_and_the_tiles_raw_rows():
    """Kernels holding 5-8-bit blocks add the cell table (a 2 KB column per warp, lane and row
    half: 4 warps x 2 halves x 2 KB, from a 2 KB boundary); the tiles regime adds the raw activation
    rows of one step, 528 bytes a token (the .cu's RAW_ROW on wgmma), plus each token's row offset,
    from a 512-byte boundary. Decode of 3-4 bits adds nothing."""
    assert gemv_extra_shared(0, tiles=8) == 512 + 64 * (528 + 4)
    assert gemv_extra_shared(1, tiles=2) == gemv_extra_shared(2, tiles=2) == 4 * 2 * 2048 + 2048 + 512 + 16 * (528 + 4)
    assert gemv_extra_shared(0, tiles=1) == 0
    assert gemv_extra_shared(1) == gemv_extra_shared(2) == 4 * 2 * 2048 + 2048


def test_only_tiles_and_staged_instances_on_a_hopper_device_compile_for_wgmma(monkeypatch):
    """wgmma_instance: an apl_gemv instance with NT8 > 1 (or apl_staged) and a compute-capability
    9.0 device; anything else compiles for the device's plain architecture."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert wgmma_instance(gemv_name(0, 0, "true", "true", 8))
    assert wgmma_instance(gemv_name(2, 1, "false", "false", 2))
    assert wgmma_instance(staged_name(0, 0, "true", "true", 4))
    assert not wgmma_instance(gemv_name(0, 0, "true", "true", 1))  # decode
    assert not wgmma_instance(prefill_name(64, 0, "true"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert not wgmma_instance(gemv_name(0, 0, "true", "true", 8))
    assert wgmma_build(gemv_name(0, 0, "true", "true", 8))  # what bench/sass_mix compiles for the H200
    assert instance_tiles(gemv_name(1, 1, "false", "true", 4)) == 4


def test_checks_name_the_bad_argument():
    layer = random_layer(4, 32, 32)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    ids, w = ragged_routing(3, 4, 2)
    with pytest.raises(APLKernelError, match="bfloat16 or float16"):
        check_inputs(x.float(), ids, w, layer)
    with pytest.raises(APLKernelError, match=r"\[tokens, 32\]"):
        check_inputs(torch.randn(3, 64, dtype=torch.bfloat16), ids, w, layer)
    with pytest.raises(APLKernelError, match="contiguous"):
        check_inputs(torch.randn(32, 3, dtype=torch.bfloat16).t(), ids, w, layer)
    with pytest.raises(APLKernelError, match="topk_ids"):
        check_inputs(x, ids.float(), w, layer)
    with pytest.raises(APLKernelError, match="topk_weights"):
        check_inputs(x, ids, w[:, :1], layer)
    with pytest.raises(APLKernelError, match="CUDA"):
        check_inputs(x, ids, w, layer)


def test_resident_blocks_reject_bad_layouts():
    block = random_block(8, 64, torch.Generator().manual_seed(0))
    with pytest.raises(APLKernelError, match="planes 0..3"):
        ResidentBlock(4, [block.planes[p] for p in range(3)], block.luts[4])
    with pytest.raises(APLKernelError, match="LUT must be"):
        ResidentBlock(4, [block.planes[p] for p in range(4)], block.luts[3])
    with pytest.raises(APLKernelError, match="contiguous uint8"):
        ResidentBlock(3, [block.planes[p].t() for p in range(3)], block.luts[3])


def test_apl_experts_on_cpu_runs_the_reference_and_commits_new_bits():
    E, H, I = 4, 32, 64
    gen = torch.Generator().manual_seed(3)
    gate_up = [random_block(2 * I, H, gen) for _ in range(E)]
    down = [random_block(H, I, gen) for _ in range(E)]
    experts = APLExperts.from_blocks(gate_up, down, mixed_bits(E), "cpu")
    assert not experts.use_kernel or torch.cuda.is_available()
    x = torch.randn(5, H)
    ids, w = ragged_routing(5, E, 2)
    before = experts(x, ids, w)
    torch.testing.assert_close(before, apl_moe_reference(x, ids, w, experts.layer))
    e = ids[0, 0].item()
    experts.commit_block(e, "down", resident_block(down[e], 8, "cpu"))
    assert experts.layer.down_desc[e, 0].item() == 8 and experts.layer.max_bits == 8
    after = experts(x, ids, w)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, apl_moe_reference(x, ids, w, experts.layer))


def test_kernel_instances_cover_every_class_layout_and_tile_once():
    from pagedweight_kernels.plan import PREFILL_LARGEST_TILE, PREFILL_TILES

    names = kernel_instances(torch.bfloat16, "gelu_tanh")
    assert len(names) == len(set(names))
    gemv = {n for n, _ in names if n.startswith("apl_gemv<")}
    assert gemv == {f"apl_gemv<{c}, {m}, true, {v}, {t}>" for c in (0, 1, 2) for m in (0, 1)
                    for v in ("true", "false") for t in (1, 2, 4, 8)} | {
        f"apl_gemv<0, {m}, true, {v}, 12>" for m in (0, 1) for v in ("true", "false")} | {  # tiles_wide_nt8
        f"apl_gemv<{c}, {m}, true, {v}, 1, true>" for c in (0, 1, 2) for m in (0, 1)
        for v in ("true", "false")}  # the long-split decode instances (long_split)
    tiles = [t for _, t in PREFILL_TILES] + [PREFILL_LARGEST_TILE]
    assert {n for n, _ in names if n.startswith("apl_prefill<")} == {
        f"apl_prefill<{t}, {m}, true>" for t in tiles for m in (0, 1)}
    # gate_up applies the layer's activation; down, routing and combine are compiled with the default
    assert {a for n, a in names if ", 0, true" in n} == {"gelu_tanh"}
    assert {a for n, a in names if ", 0, true" not in n} == {"silu"}
    assert all("false" not in n.split(",")[-2] for n, _ in names if n.startswith("apl_prefill<"))
    assert "moe_combine<false>" in dict(kernel_instances(torch.float16))
    with pytest.raises(APLKernelError, match="float32"):
        kernel_instances(torch.float32)


def test_launch_signature_follows_the_launches_not_the_widths():
    """A graph of a step bakes in the launches: in a layer with both bit classes one merged
    launch runs whatever the 3-4-bit class's widest width is, so 3 <-> 4 there is no change,
    while the 5-8 class's widest (its LUT size) and a class appearing are."""
    E = 4

    def signature(bits_of):
        bits = {(e, m): bits_of(e) for e in range(E) for m in ("gate_up", "down")}
        return random_layer(E, 32, 32, seed=1, bits=bits).launch_signature()

    mixed_3 = signature(lambda e: 3 if e == 0 else 8)
    mixed_4 = signature(lambda e: 4 if e == 0 else 8)
    assert mixed_3 == mixed_4
    assert signature(lambda e: 8) != mixed_4  # one class -> both: another kernel
    assert signature(lambda e: 3 if e == 0 else 7) != mixed_4  # widest 5-8 bits: another LUT size
    assert signature(lambda e: 3) != signature(lambda e: 4)  # widest bits (prefill's LUT) moved


def test_stable_launches_keep_one_signature_and_one_merged_launch_at_any_bits():
    """A pager's layers decode through the merged kernel at the 8-bit LUT size whatever
    their widths, and their prefill launches accept every width, so no bit change alters what a
    captured graph holds; the plane alignment still counts."""
    E = 4

    def layer(bits_of, stable=True):
        bits = {(e, m): bits_of(e) for e in range(E) for m in ("gate_up", "down")}
        base = random_layer(E, 32, 64, seed=1, bits=bits)
        return APLLayer(base.gate_up, base.down, base.activation, stable_launches=stable)

    layers = [layer(lambda e: 8), layer(lambda e: 3), layer(lambda e: 3 if e else 7), layer(lambda e: 5 + e % 2)]
    assert len({x.launch_signature() for x in layers}) == 1
    assert all(x.decode_launches(m) == [(2, 8)] for x in layers for m in ("gate_up", "down"))
    assert layer(lambda e: 8, stable=False).decode_launches("gate_up") == [(1, 8)]
    # a prefill launch captured at 3-7 bits still takes blocks the pager raises to 8 (not NaN rows)
    assert all(x.prefill_widest_bits() == 8 for x in layers)
    assert layer(lambda e: 5 + e % 2, stable=False).prefill_widest_bits() == 6
    assert layers[0].launch_signature() != layer(lambda e: 8, stable=False).launch_signature()
    odd = random_layer(E, 32, 32, seed=1)  # 32 columns: no 8-byte loads for down (cols % 64)
    assert APLLayer(odd.gate_up, odd.down, stable_launches=True).launch_signature() != layers[0].launch_signature()


def test_every_planned_tiles_count_is_one_precompile_covers():
    # precompile compiles kernel_instances; a plan whose NT8 it misses would compile inside a capture

    for max_bits, cls in ((4, 0), (8, 1)):
        seen = set()
        for tokens in list(range(1, 300)) + [511, 1024, 4096]:
            for top_k, experts in ((2, 8), (4, 60), (8, 128)):
                plan = plan_launch(tokens, top_k, experts, 2048, 1408, max_bits)
                seen |= {plan.gate_up.tiles, plan.down.tiles}
        assert seen <= set(tiles_choices(cls))
        assert {1, 2, 8} <= seen
    assert 12 in tiles_choices(0) and 12 not in tiles_choices(1)


def test_counters_hold_one_per_gate_up_row_tile_of_each_expert_or_one_per_down_tile():
    # Qwen1.5-MoE: 60 experts, 2048 / 1408: 44 gate_up row tiles of 32, 32 down tiles of 64
    assert counter_words(60, 2048, 1408) == 60 * 44
    assert counter_words(1, 8192, 64) == 128  # one expert, a wide down: the down tiles
    layer = random_layer(4, 64, 96, bits={(e, m): 4 for e in range(4) for m in ("gate_up", "down")})
    assert layer.counters.numel() == counter_words(layer.num_experts, layer.hidden, layer.intermediate)
    plan = plan_launch(1, 4, 60, 2048, 1408, 4)  # every CTA's counter index is inside the buffer
    assert plan.gate_up.grid[0] * plan.gate_up.grid[1] <= counter_words(60, 2048, 1408)
    assert plan.down.grid[0] <= counter_words(60, 2048, 1408)


def test_every_compile_time_knob_is_planned_with_the_value_the_source_defaults_to():
    """The host compiles every module with the activation's APL_ACT alone and plans shared memory and
    launches from apl_gemv.cu's defaults (GEMV_SOURCE_DEFAULTS) and apl_staged.cu's constants; a
    source default that differs would make the source (what the SASS counts of docs/kernel.md are
    read from) and what the host plans for differ."""
    import re

    from pagedweight_kernels.plan import GEMV_SOURCE_DEFAULTS

    source = SOURCE.read_text() + GEMV_SOURCE.read_text() + STAGED_SOURCE.read_text()
    knobs = {k: int(v) for k, v in re.findall(r"#ifndef (APL_\w+)\s*\n#define \1 (-?\d+)", source)}
    assert knobs.pop("APL_ACT") == 0  # one module per expert activation (ACT_CODES)
    assert {k: knobs[k] for k in GEMV_SOURCE_DEFAULTS} == GEMV_SOURCE_DEFAULTS
    assert not re.search(r"#ifndef APL_\w+", SOURCE.read_text().replace("#ifndef APL_ACT", ""))  # apl_moe.cu: none
    assert not re.search(r"#ifndef APL_\w+", STAGED_SOURCE.read_text())  # apl_staged.cu: none


def test_a_module_s_compile_key_is_its_activation():
    assert DEFAULT_CONFIG.defines() == (("APL_ACT", ACT_CODES["silu"]),)
    assert DEFAULT_CONFIG.defines("gelu_tanh") == (("APL_ACT", ACT_CODES["gelu_tanh"]),)
    assert config_for(2048, 1408) is DEFAULT_CONFIG  # no per-shape entry: the defaults


def test_long_split_instances_are_chosen_by_shapes_and_tokens_never_by_bits():
    """Decode launches over long rows (GEMV_LONG_ROW_WORDS: Mixtral's 128- and 448-word rows), in
    splits of GEMV_LONG_SPLIT_WORDS or more, staging GEMV_LONG_MIN_TOKENS tokens or more, take the
    `, true` (LONG) instance, whose plane loads carry L2::256B; 1-token launches, Qwen1.5-MoE's 44-64-word
    rows and the tiles regime never do. The choice reads the plan only, so a stable launch keeps its
    instance whatever the bits."""
    from pagedweight_kernels.plan import GEMV_LONG_ROW_WORDS, GEMV_LONG_SPLIT_WORDS

    def mixtral(tokens, bits, stable=False):
        return plan_launch(tokens, 2, 8, 4096, 14336, bits, stable_launches=stable)

    for T in (2, 4, 8, 16):
        plan = mixtral(T, 8, stable=True)
        assert all(long_split(cls, p, cols) for cls in (0, 1, 2)
                   for p, cols in ((plan.gate_up, 4096), (plan.down, 14336))), T
        # stable launches: the same plan, so the same instances, at every width
        assert all(mixtral(T, bits, stable=True) == plan for bits in (3, 4, 5, 6, 7))
    one = mixtral(1, 4)
    assert one.gate_up.split_cols // 32 == 128 and not long_split(0, one.gate_up, 4096)  # 1 token: no
    for T in (1, 4, 16):
        qwen = plan_launch(T, 4, 60, 2048, 1408, 8)
        assert not any(long_split(cls, p, cols) for cls in (0, 1, 2)
                       for p, cols in ((qwen.gate_up, 2048), (qwen.down, 1408))), T
    assert qwen.gate_up.split_cols // 32 == GEMV_LONG_SPLIT_WORDS  # a long split, but the whole (short) row
    tiles = mixtral(256, 4).gate_up
    assert tiles.tiles > 1 and tiles.split_cols // 32 >= GEMV_LONG_ROW_WORDS
    assert not long_split(0, tiles, 4096)  # (the tiles' hint is APL_PLANE_HINT_MIN_NT8's)
    gate_up = mixtral(4, 8).gate_up
    assert long_split(2, gate_up, 4096) and long_split(1, gate_up, 4096)
    assert not long_split(2, gate_up, 32 * (GEMV_LONG_ROW_WORDS - 1))  # a long split of a short row
    assert gemv_name(2, 1, "true", "false", 1, True) == "apl_gemv<2, 1, true, false, 1, true>"
    assert instance_tiles("apl_gemv<2, 1, true, false, 1, true>") == 1
    assert instance_tiles(gemv_name(1, 0, "true", "true", 4)) == 4


def test_wide_passes_only_for_3_4_bit_layers_without_stable_launches():
    """tiles_wide_nt8 (12 by default): the 96-token passes are compiled for the 3-4-bit kernel only,
    so the plan takes them for layers of at most 4 bits, and never under stable launches (whose plan
    may not depend on the bits); off (0), the plan is the powers of two's."""
    mixtral = dict(num_experts=8, hidden=4096, intermediate=14336)
    assert DEFAULT_CONFIG.tiles_wide_nt8 == 12
    assert plan_launch(256, 2, max_bits=4, **mixtral).gate_up.tiles == 12
    assert plan_launch(256, 2, max_bits=4, **mixtral).down.tokens == 96
    assert plan_launch(256, 2, max_bits=5, **mixtral).gate_up.tiles == 8
    assert plan_launch(256, 2, max_bits=3, stable_launches=True, **mixtral).gate_up.tiles == 8
    assert plan_launch(64, 2, max_bits=4, **mixtral).gate_up.tiles == 4  # 16 per expert: no wide pass
    names = {name for name, _ in kernel_instances(torch.bfloat16)}
    assert {"apl_gemv<0, 0, true, true, 12>", "apl_gemv<0, 1, true, false, 12>"} <= names
    assert not any(name.startswith(("apl_gemv<1,", "apl_gemv<2,")) and name.endswith(", 12>") for name in names)
    off = dataclasses.replace(DEFAULT_CONFIG, tiles_wide_nt8=0)
    assert plan_launch(256, 2, max_bits=4, **mixtral, config=off).gate_up.tiles == 8
    assert not any(name.endswith(", 12>") for name, _ in kernel_instances(torch.bfloat16, config=off))


def test_staged_plan_passes_grid_and_a_ring_that_leaves_two_ctas_per_sm():
    """The staged regime's launches: passes as the tiles regime picks them (96 tokens for 3-4-bit
    layers where it would), row tiles of 64 gate + 64 up rows (gate_up) or 128 rows (down), and
    shared memory (the ring of A + B tiles, then the producers' plane ring; before them the producers'
    cell tables in the classes holding 5-8-bit blocks) for 2 CTAs an SM with at least 2 buffers (3-4-bit
    class), or for one (the classes holding 5-8-bit blocks, compiled for one CTA an SM: staged_blocks)."""
    from pagedweight_kernels.plan import STAGED_ALIGN_PAD, STAGED_ROWS, STAGED_STEP, staged_blocks, staged_cell_tables

    config = DEFAULT_CONFIG
    gate_up = staged_plan(0, 256, 2, 8, 14336, 0, 0, 8)  # Mixtral-size prefill, 256 tokens, 3-4 bits
    assert (gate_up.regime, gate_up.tiles, gate_up.tokens, gate_up.grid) == ("staged", 12, 96, (224, 8, 1))
    assert staged_plan(1, 256, 2, 8, 4096, 0, 0, 8).grid == (32, 8, 1)
    plans = [(gate_up, 0, 0), (staged_plan(1, 256, 2, 8, 4096, 0, 0, 8), 0, 0),
             (staged_plan(0, 256, 2, 8, 14336, 1, 8, 8), 1, 8), (staged_plan(0, 256, 2, 8, 14336, 2, 5, 8), 2, 5),
             (staged_plan(0, 64, 4, 60, 1408, 1, 6, 60), 1, 6)]
    for plan, cls, lut_bits in plans:
        stage = (STAGED_ROWS + plan.tokens) * STAGED_STEP * 2
        assert staged_min_stages(cls) <= plan.stages <= config.staged_stages
        planes = staged_plane_ring_bytes(cls, lut_bits)
        tables = staged_cell_tables(cls)  # a producer warpgroup's 128 rows x 16 cells x 4 bytes, from 2 KB
        assert tables == (0 if cls == 0 else 2 * 128 * 16 * 4 + 1024)
        assert plan.shared_bytes == STAGED_ALIGN_PAD + plan.stages * stage + planes + tables
        assert plan.shared_bytes <= config.staged_cta_shared[0 if staged_blocks(cls) == 2 else -1]
    assert staged_blocks(0) == 2 and staged_blocks(1) == staged_blocks(2) == 1
    assert staged_plan(0, 256, 2, 8, 14336, 1, 8, 8).stages == config.staged_stages  # (one CTA: room for all)
    # at 5-8 bits passes of 128 tokens (staged_lut_wide_nt8), not 96; with 4-byte plane loads none wider than 64
    assert staged_plan(0, 256, 2, 8, 14336, 1, 8, 8).tiles == 16
    assert staged_plan(0, 256, 2, 8, 14336, 1, 8, 8, aligned16=False).tiles == 8
    # nor with 4-byte plane loads (those instances spill at 96 tokens, nvcc 13.0)
    assert staged_plan(0, 256, 2, 8, 14336, 0, 0, 8, aligned16=False).tiles == 8
    assert staged_plan(0, 400, 2, 8, 384, 0, 0, 8).grid[2] == 2  # 100 tokens an expert: 2 groups of passes of 64


def test_staged_plan_refuses_a_ring_of_one_buffer():
    """One buffer would deadlock (the consumers return a buffer after the next one's wgmma are
    issued): where shared memory holds fewer than 2, the plan is an error, not a launch."""
    from pagedweight_kernels.plan import STAGED_ALIGN_PAD, STAGED_ROWS, STAGED_STEP

    # (the 3-4-bit class, one producer warpgroup: with two, a class needs 3 buffers,
    # test_two_producer_warpgroups_need_a_ring_of_three)
    stage = (STAGED_ROWS + 64) * STAGED_STEP * 2  # (128 tokens, 32 an expert: passes of 64)
    fixed = STAGED_ALIGN_PAD + staged_plane_ring_bytes(0)
    short = dataclasses.replace(DEFAULT_CONFIG, staged_cta_shared=(fixed + 2 * stage - 1,))
    with pytest.raises(APLKernelError, match="2 ring buffers"):
        staged_plan(0, 128, 2, 8, 4096, 0, 0, 8, config=short)
    enough = dataclasses.replace(DEFAULT_CONFIG, staged_cta_shared=(fixed + 2 * stage,))
    assert staged_plan(0, 128, 2, 8, 4096, 0, 0, 8, config=enough).stages == 2


def test_staged_instances_are_every_launch_staged_plan_can_make():
    """Every (class, projection, alignment, tokens) staged_plan and staged_projection can pick is
    listed, so precompile covers it, and nothing else (no 96-token 4-byte-load instances)."""
    listed = staged_instances("true")
    picked = set()
    for mode in (0, 1):
        for cls, lut_bits in ((0, 0), (1, 8), (2, 5)):
            for aligned16 in (True, False):
                for tokens in (1, 16, 40, 100, 256, 300, 1000, 5000):
                    plan = staged_plan(mode, tokens, 2, 8, 4096, cls, lut_bits, 8, aligned16)
                    picked.add(staged_name(cls, mode, "true", "true" if aligned16 else "false", plan.tiles))
    assert picked <= set(listed) and len(set(listed)) == len(listed)
    assert "apl_staged<0, 0, true, true, 12>" in picked and "apl_staged<0, 0, true, false, 12>" not in listed
    assert "apl_staged<0, 0, true, true, 16>" in picked and "apl_staged<0, 0, true, false, 16>" not in listed
    assert "apl_staged<1, 0, true, true, 16>" in picked and "apl_staged<1, 0, true, false, 16>" not in listed
    # projections x (alignments x the classes' powers of two, + the 3-4-bit class's 96 and 128 tokens and
    # the other classes' 128 (staged_lut_wide_nt8), 16-byte loads only)
    assert len(listed) == 2 * (2 * (3 + 3 + 3) + 2 + 2)
    assert staged_instances("false", (1,)) == [n.replace("true, ", "false, ", 1) for n in listed
                                                  if n.startswith(("apl_staged<0, 1,", "apl_staged<1, 1,",
                                                                   "apl_staged<2, 1,"))]


def test_staged_class_and_the_rule_that_takes_the_staged_regime(monkeypatch):
    every = dataclasses.replace(DEFAULT_CONFIG, staged_every_layer=True)
    assert staged_class({0: 4}) == (0, 0)
    assert staged_class({1: 6}) == (1, 6)
    assert staged_class({0: 3, 1: 8}) == (2, 8)
    layer = random_layer(8, 64, 96, seed=1)
    tiles = plan_launch(100, 2, 8, 64, 96, 8)
    assert tiles.gate_up.regime == "tiles"
    cpu = torch.device("cpu")
    assert not use_staged(tiles, layer, cpu, config=every)  # no CUDA device: never
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    hopper = torch.device("cuda", 0)
    assert use_staged(tiles, layer, hopper, config=every)  # staged_every_layer: any bits, any number of tokens
    assert not use_staged(plan_launch(2, 2, 8, 64, 96, 8), layer, hopper, config=every)  # decode stays on apl_gemv
    prefill = plan_launch(1000, 2, 8, 64, 96, 8)
    assert prefill.gate_up.regime == "prefill" and use_staged(prefill, layer, hopper, config=every)
    forced = plan_launch(1000, 2, 8, 64, 96, 8, regime="prefill")
    assert not use_staged(forced, layer, hopper, regime="prefill", config=every)  # the prefill kernel asked for
    # stable launches: by the merged class's rule (16 assignments an expert) at any widths, the
    # merged kernel at 8 bits launched whatever the blocks hold
    low = APLLayer(*(random_layer(8, 64, 96, seed=1, bits={(e, m): 3 for e in range(8) for m in ("gate_up", "down")})
                     .__dict__[k] for k in ("gate_up", "down")), stable_launches=True)
    assert use_staged(tiles, low, hopper, num_tokens=100, top_k=2)
    assert not use_staged(tiles, low, hopper, num_tokens=60, top_k=2)
    from pagedweight_kernels.plan import staged_launch

    assert staged_launch(low, "gate_up") == staged_launch(low, "down") == (2, 8)
    assert staged_launch(layer, "gate_up") == staged_class(layer.classes["gate_up"])
    # mixed bits: by default from 16 assignments an expert (100 tokens x 2 over 8 experts: 25)
    assert use_staged(tiles, layer, hopper, num_tokens=100, top_k=2)
    assert not use_staged(tiles, layer, hopper, num_tokens=60, top_k=2)


def test_the_default_staged_rule_takes_3_4_bit_layers_from_256_assignments_others_from_16_an_expert(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    hopper = torch.device("cuda", 0)
    uniform = {(e, m): 3 + e % 2 for e in range(8) for m in ("gate_up", "down")}
    low = random_layer(8, 64, 96, seed=1, bits=uniform)
    with_8 = random_layer(8, 64, 96, seed=1, bits={**uniform, (3, "down"): 8})
    tiles = plan_launch(128, 2, 8, 64, 96, 4)
    prefill = plan_launch(1000, 2, 8, 64, 96, 4)
    assert tiles.gate_up.regime == "tiles" and prefill.gate_up.regime == "prefill"
    assert staged_layer(low, 128, 2) and use_staged(tiles, low, hopper, num_tokens=128, top_k=2)
    assert use_staged(prefill, low, hopper, num_tokens=1000, top_k=2)
    # below the threshold the tiles regime was faster (Mixtral 32 and 64 tokens)
    assert not staged_layer(low, 127, 2) and staged_layer(low, 64, 4)
    assert not use_staged(tiles, low, hopper, num_tokens=127, top_k=2)
    # one 5-8-bit block anywhere in the layer (the merged class): from 16 assignments an expert (staged_lut_min_per_expert)
    assert staged_layer(with_8, 1000, 2) and staged_layer(with_8, 64, 2)
    assert not staged_layer(with_8, 63, 2) and not staged_layer(with_8, 32, 2)
    assert use_staged(prefill, with_8, hopper, num_tokens=1000, top_k=2)
    # not on other GPUs, not for decode; under stable launches by the merged class's rule (16 an expert)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not use_staged(tiles, low, hopper, num_tokens=128, top_k=2)  # (the same device, now sm_80)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    low.stable_launches = True
    assert use_staged(tiles, low, hopper, num_tokens=128, top_k=2)  # 32 an expert
    assert not staged_layer(low, 63, 2) and staged_layer(low, 64, 2)
    low.stable_launches = False
    assert not use_staged(plan_launch(2, 2, 8, 64, 96, 4), low, hopper, num_tokens=256, top_k=2)
    # no staged classes: never staged
    assert not staged_layer(low, 1000, 2, dataclasses.replace(DEFAULT_CONFIG, staged_classes=frozenset()))
    # the instances precompile compiles for the default rule: class 0 only
    assert {n.split(",")[0] for n in staged_instances("true", (0, 1), frozenset({0}))} == {"apl_staged<0"}
    assert {n.split(",")[0] for n in staged_instances("true", (0, 1), frozenset({0, 1}))} == \
        {"apl_staged<0", "apl_staged<1", "apl_staged<2"}
