"""Launches of a planned layer call on PyTorch's current stream, no host synchronisation:

  launch_gemv      the decode and tiles regimes: per projection one apl_gemv launch per bit
                   class launch (APLLayer.decode_launches); the kernels route, reduce their column
                   splits and combine the top-k outputs themselves.
  four_launches    the prefill and staged regimes: moe_align, gate_up, down, moe_combine, with
                   `prefill_projection` or `staged_projection` launching the two projections.
"""

from __future__ import annotations

import math

import torch

from pagedweight_kernels.compile import flag, gemv_name, kernel, mode_activation, prefill_name, staged_name
from pagedweight_kernels.config import DEFAULT_CONFIG, KernelConfig
from pagedweight_kernels.cuda_packages import launch_on_torch_stream
from pagedweight_kernels.layer import APLLayer
from pagedweight_kernels.plan import GEMV_THREADS, STAGED_STEP, THREADS, GemmPlan, LaunchPlan, gemv_extra_shared, long_split, \
    programmatic_down, staged_launch, staged_plan, staged_threads

_WEIGHT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def launch(name: str, grid, args, shared: int = 0, block: int = THREADS, activation: str = "silu",
           programmatic: bool = False, config: KernelConfig = DEFAULT_CONFIG):
    function = kernel(name, activation, config)
    if shared > 48 * 1024 and function.max_dynamic_shared_size_bytes < shared:
        function.max_dynamic_shared_size_bytes = shared
    launch_on_torch_stream(function, grid, block, args, shared, programmatic)


def programmatic_projections() -> tuple[bool, bool]:
    """(gate_up, down): which projection launches may overlap the kernel before them, on a device
    of compute capability 9.0 or later (the kernels' griddepcontrol waits). Down overlaps gate_up
    (docs/kernel.md, "What we tried"); gate_up overlapping the kernel before it gains nothing, so it
    waits."""
    return False, torch.cuda.get_device_capability() >= (9, 0)


def launch_gemv(x, ids, topk_weights, layer: APLLayer, plan: LaunchPlan, out: torch.Tensor,
                config: KernelConfig = DEFAULT_CONFIG):
    """Decode and the tiles regime: per bit class launch, one gate_up and one down launch."""
    T, H = x.shape
    k, E, I = ids.shape[1], layer.num_experts, layer.intermediate
    num_assign = T * k
    w_kind = _WEIGHT_KINDS.get(topk_weights.dtype)
    weights = topk_weights.contiguous() if w_kind is not None else topk_weights.to(torch.float32).contiguous()
    w_kind = w_kind or 0
    f = flag(x.dtype)
    gu, dn = plan.gate_up, plan.down
    part_gu = torch.empty(gu.splits * num_assign * 2 * I, dtype=torch.float32, device=x.device)
    part_dn = torch.empty(dn.splits * num_assign * H, dtype=torch.float32, device=x.device)
    h = torch.empty(num_assign, I, dtype=x.dtype, device=x.device)
    v2 = {m: "true" if layer.aligned8[m] else "false" for m in ("gate_up", "down")}
    launches = {m: layer.decode_launches(m) for m in ("gate_up", "down")}
    pdl_gate_up, pdl_down = programmatic_projections()
    for cls, widest in launches["gate_up"]:
        lut = 0  # (the cell table's room is gemv_extra_shared's; its place, the kernel's)
        launch(gemv_name(cls, 0, f, v2["gate_up"], gu.tiles, long_split(cls, gu, H)), gu.grid,
               (layer.gate_up_desc, ids, num_assign, k, E, x, I, H, gu.split_cols // 32, lut, gu.tokens,
                part_gu, layer.counters, h, weights, w_kind, T, out, 0),
               gu.shared_bytes + gemv_extra_shared(cls, gu.tiles), block=GEMV_THREADS,
               activation=layer.activation, programmatic=pdl_gate_up, config=config)
    for i, (cls, widest) in enumerate(launches["down"]):
        lut = 0
        launch(gemv_name(cls, 1, f, v2["down"], dn.tiles, long_split(cls, dn, I)), dn.grid,
               (layer.down_desc, ids, num_assign, k, E, h, H, I, dn.split_cols // 32, lut, dn.tokens,
                part_dn, layer.counters, None, weights, w_kind, T, out, int(i == 0)),
               dn.shared_bytes + gemv_extra_shared(cls, dn.tiles), block=GEMV_THREADS,
               programmatic=pdl_down and programmatic_down(cls, dn.tiles), config=config)
    return out


def four_launches(x, ids, topk_weights, layer: APLLayer, max_active: int, out: torch.Tensor, projection,
                  splits: int = 1, config: KernelConfig = DEFAULT_CONFIG):
    """moe_align, the two projections (`projection(mode, desc, active, num_active, sorted_slot,
    src, rows_out, cols, h_out, y_out)` launches one), then moe_combine: the prefill and staged
    regimes. Down writes `splits` fp32 rows per assignment."""
    T, H = x.shape
    k, E, I = ids.shape[1], layer.num_experts, layer.intermediate
    num_slots = T * k
    device = x.device
    weights = topk_weights.to(torch.float32).contiguous()
    sorted_slot = torch.empty(num_slots, dtype=torch.int32, device=device)
    active = torch.empty(max_active * 3, dtype=torch.int32, device=device)
    num_active = torch.empty(1, dtype=torch.int32, device=device)
    h = torch.empty(num_slots, I, dtype=x.dtype, device=device)
    y = torch.empty(splits, num_slots, H, dtype=torch.float32, device=device)
    launch("moe_align", (1,), (ids, num_slots, E, sorted_slot, active, num_active), block=1024, config=config)
    projection(0, layer.gate_up_desc, active, num_active, sorted_slot, x, I, H, h, None)
    projection(1, layer.down_desc, active, num_active, sorted_slot, h, H, I, None, y)
    launch(f"moe_combine<{flag(x.dtype)}>", (math.ceil(T * H / THREADS),),
           (y, splits, num_slots, ids, weights, E, T, k, H, out), config=config)
    return out


def launch_prefill(mode: int, plan: GemmPlan, desc, active, num_active, sorted_slot, top_k: int, x, rows_out: int,
                   cols: int, max_bits: int, h_out=None, y_out=None, activation: str = "silu",
                   config: KernelConfig = DEFAULT_CONFIG):
    """One projection of the prefill kernel for the experts moe_align listed (active, num_active,
    sorted_slot): mode 0 gate_up (+act(gate)*up -> h_out), 1 down (-> y_out)."""
    launch(prefill_name(plan.tokens, mode, flag(x.dtype)), plan.grid,
           (desc, active, num_active, sorted_slot, top_k, x, rows_out, cols, max_bits, h_out, y_out),
           plan.shared_bytes, activation=mode_activation(mode, activation), config=config)


def prefill_projection(layer: APLLayer, plan: LaunchPlan, top_k: int, config: KernelConfig = DEFAULT_CONFIG):
    """four_launches' projection for the prefill kernel (apl_moe.cu's apl_prefill)."""
    def projection(mode, desc, active, num_active, sorted_slot, src, rows_out, cols, h_out, y_out):
        launch_prefill(mode, plan.gate_up if mode == 0 else plan.down, desc, active, num_active, sorted_slot, top_k,
                       src, rows_out, cols, layer.prefill_widest_bits(), h_out, y_out, layer.activation, config)
    return projection


def staged_projection(layer: APLLayer, num_tokens: int, top_k: int, max_active: int, f: str,
                      config: KernelConfig = DEFAULT_CONFIG):
    """four_launches' projection for the staged regime: per projection the kernel class of its
    blocks (staged_launch) and their 16-byte alignment pick the instance, staged_plan the launch."""
    def projection(mode, desc, active, num_active, sorted_slot, src, rows_out, cols, h_out, y_out):
        module = "gate_up" if mode == 0 else "down"
        cls, lut_bits = staged_launch(layer, module)
        aligned16 = layer.aligned16[module]
        plan = staged_plan(mode, num_tokens, top_k, layer.num_experts, rows_out, cls, lut_bits, max_active,
                           aligned16, config)
        name = staged_name(cls, mode, f, "true" if aligned16 else "false", plan.tiles)
        act_map = staged_activation_map(mode, src, sorted_slot, top_k, plan.tokens, config)
        launch(name, plan.grid, (desc, active, num_active, sorted_slot, top_k, src, rows_out, cols, lut_bits,
                                 h_out, y_out, plan.stages, act_map),
               plan.shared_bytes, block=staged_threads(cls), activation=mode_activation(mode, layer.activation),
               config=config)
    return projection


def staged_activation_map(mode: int, src: torch.Tensor, sorted_slot: torch.Tensor, top_k: int, tokens: int,
                          config: KernelConfig = DEFAULT_CONFIG):
    """The staged launch's tensor map over its activations by sorted position (the kernel takes
    them by TMA): boxes of a pass's `tokens` rows by one 64-column step. Down's h is in that order
    already; gate_up's x is gathered into it first (moe_gather_rows, [tokens * top_k, hidden]: 4 MB
    at Mixtral size and 256 tokens)."""
    from pagedweight_kernels.tensor_maps import row_box_map

    rows = src
    if mode == 0:
        num_slots, cols = sorted_slot.numel(), src.shape[1]
        rows = torch.empty(num_slots, cols, dtype=src.dtype, device=src.device)
        chunks = cols * src.element_size() // 16
        launch("moe_gather_rows", (math.ceil(num_slots * chunks / THREADS),),
               (src, sorted_slot, top_k, num_slots, chunks, rows), config=config)
    return row_box_map(rows, tokens, STAGED_STEP)
