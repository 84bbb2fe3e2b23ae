"""Wiring of one worker: paged model + memory pool + arena + page table + pager + engine.

`build_runtime` is the one place these parts are put together (the worker service and
`pagedweight bench engine` both call it):
1. load the paged model directory; build the model's dense part (embeddings, attention,
   norms, routers, shared experts) on the device;
2. open a `MemoryPool` of the budget and charge it the dense weights and a workspace
   reserve (activations of the largest step);
3. cut the rest into one `Arena`; put every expert block in the weight `PageTable` at its
   starting bits and load them (`PageMover.load_all`);
4. the experts operator reads the page table (`ArenaExperts`); the engine's KV blocks come
   from the same arena, so bytes freed by lowering bits become KV blocks;
5. a policy name from the planner library makes the weights move with the load (a
   `WeightPager` over a `BitPlanner`, here the in-process one, registered with the page
   table's block bytes, the artifact's sensitivity and its calibration routing; live
   routing reaches it as snapshots from a `RoutingFeed`); `static-B` pins every block at B bits;
6. with `prompt_residuals` on (opt-in) and the artifact's residual heads, each request's
   prefill routing is recorded (engine/prompt_routing.py) and every plan request carries the
   prompts in flight, their residual predicted by the heads in the page table's block order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from pagedweight.common.errors import UserError
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.memory.arena import DEFAULT_PAGE_BYTES, Arena
from pagedweight.memory.kv_cache import blocks_for, kv_block_bytes, kv_tile_bytes
from pagedweight.memory.pool import OTHER_WEIGHTS, WORKSPACE, MemoryPool
from pagedweight.format.model_config import ModelConfig
from pagedweight.model.materialize import materialize_dense
from pagedweight.model.transformer import MoECausalLM
from pagedweight.planner.sizing import format_sizing
from pagedweight.format.apl_format import BIT_WIDTHS, MIN_BITS
from pagedweight.weights.arena_experts import ArenaExperts, precompile_kernels
from pagedweight.weights.page_mover import PageMover
from pagedweight.weights.page_table import PageTable

log = logging.getLogger(__name__)

STATIC_PREFIX = "static-"  # "static-4": every block at 4 bits, never moved


@dataclass(frozen=True)
class RuntimeConfig:
    memory_budget: int  # bytes for everything on the device: weights, KV, workspace
    policy: str = "pagedweight"  # a planner policy (services/planner/policies.py) or static-B
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    page_bytes: int = DEFAULT_PAGE_BYTES
    min_kv_tokens_at_start: int = 64  # KV room the starting bits leave free
    # loss scales for the policy: None = the artifact's (quantize measures them), "raw" = none,
    # else a file from `pagedweight plan-scales`
    scales_file: str | None = None
    # feed the prompts in flight through the artifact's residual heads into every plan
    # (the planner's third signal). Opt-in: on held-out text, calibrated on the served domain
    # or on another, they did not lower KL beyond noise (docs/calibration.md, docs/planner.md)
    prompt_residuals: bool = False
    # lowering plans move fewer blocks further: each moved block costs this many medians of
    # one bit's damage (planner/fewer_moves.py); 0: the planner's one-bit greedy. 16 halved the
    # blocks lowered for the same load (CPU, docs/elasticity.md 2c) for 0.06-0.1 fewer mean
    # bits, and is what every H200 run since used
    move_cost: float = 16.0
    # compile every fused-kernel instance the layers can meet at start-up (seconds, once per
    # process), so none compiles inside a step when the pager changes a layer's bit classes
    precompile_kernels: bool = True
    # the fused kernel's decode launches independent of the layers' bits (the merged kernel
    # with the 8-bit LUT size), so the pager's bit changes never make a decode graph capture
    # again; None: on for a policy whose bits move, off for static-B (its class kernels stay)
    stable_decode_launches: bool | None = None
    # compaction for raises also while sequences run;
    # off: raises during a load take only free runs that already hold them, the rest wait for
    # a boundary with nothing running (weights/weight_pager.py, docs/elasticity.md 2h)
    compact_raises_while_running: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        if self.memory_budget <= 0:
            raise UserError(f"memory budget must be positive, got {self.memory_budget}")
        if self.move_cost < 0:
            raise UserError(f"move_cost must be >= 0, got {self.move_cost}")
        if self.static_bits is not None and self.static_bits not in BIT_WIDTHS:
            raise UserError(f"policy {self.policy!r}: static bits must be in {BIT_WIDTHS}")

    @property
    def static_bits(self) -> int | None:
        if not self.policy.startswith(STATIC_PREFIX):
            return None
        try:
            return int(self.policy[len(STATIC_PREFIX):])
        except ValueError:
            raise UserError(f"policy {self.policy!r}: expected static-B with B in {BIT_WIDTHS}") from None


@dataclass
class WorkerRuntime:
    engine: Engine
    pool: MemoryPool
    arena: Arena
    table: PageTable
    mover: PageMover
    pager: object | None  # WeightPager, None for a static policy
    routing_feed: object | None = None  # RoutingFeed into the policy (the worker forwards its windows)
    prompt_routing: object | None = None  # PromptRoutingRecorder: the prompts in flight (None: off)

    def warm_up(self) -> list[int]:
        """Meet every decode bucket once before serving (engine/graph_warmup.py: the
        attention kernel's per-split compile and each bucket's graph capture, 0.3-0.5 s
        steps on an H200 otherwise paid by the first load to reach a bucket), then drop the
        routing window those synthetic one-token requests filled, so the planner's routing
        mass starts from live traffic. A no-op where every step is eager (the CPU).
        Returns the buckets met."""
        from pagedweight.engine.graph_warmup import warm_decode_buckets

        buckets = warm_decode_buckets(self.engine)
        if buckets and self.routing_feed is not None:
            self.routing_feed.snapshot()  # the warm-up's window, discarded
        return buckets

    def close(self) -> None:
        self.mover.close()


def workspace_bytes(config: ModelConfig, engine: EngineConfig, dtype: torch.dtype) -> int:
    """Activations of the largest step: a few hidden-sized buffers and the expert
    intermediates per token, plus fp32 logits of every sampled sequence."""
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = engine.scheduler.max_num_batched_tokens
    per_token = 8 * config.hidden_size + 4 * config.num_experts_per_tok * config.expert_intermediate_size
    logits = engine.scheduler.max_num_seqs * config.vocab_size * 4
    return tokens * per_token * elem + logits


# The phases of a start and their rough shares of its time (common/startup.py reports them).
STARTUP_PHASES = {"reading the paged model": 30, "dense weights to the device": 10, "choosing the starting bits": 10,
                  "loading the expert pages": 30, "compiling kernels": 10, "building the engine": 2, "warming up": 8}


def build_runtime(paged_dir, config: RuntimeConfig, eos_token_ids=(), progress=None) -> WorkerRuntime:
    """eos_token_ids: EOS ids beyond the model's own (config.json and generation_config.json,
    which the engine always gets: a runtime built without a tokenizer still stops at EOS).
    progress(phase): told as each of STARTUP_PHASES begins (None: nothing told)."""
    from pagedweight.format.model_config import read_eos_token_ids
    from pagedweight.format.paged_model import load_paged_model

    progress = progress or (lambda phase: None)
    progress("reading the paged model")
    paged = load_paged_model(paged_dir, with_bf16=False)
    return build_runtime_from_paged(paged, config, (*read_eos_token_ids(paged_dir), *eos_token_ids), progress)


def build_runtime_from_paged(paged, config: RuntimeConfig, eos_token_ids=(), progress=None) -> WorkerRuntime:
    """The same wiring over a `PagedModel` already in memory (bench/real_shape.py builds one
    at a real model's size without writing tens of GB to disk); eos_token_ids: all of them."""
    progress = progress or (lambda phase: None)
    device = torch.device(config.device)
    progress("dense weights to the device")
    model = materialize_dense(paged, config.dtype, device)  # routed experts: over the arena below
    pool = MemoryPool(config.memory_budget)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    workspace = workspace_bytes(paged.config, config.engine, config.dtype)
    if dense + workspace >= config.memory_budget:
        raise UserError(
            f"memory budget {config.memory_budget} bytes does not hold the dense weights "
            f"({dense} bytes) and the workspace ({workspace} bytes)"
        )
    pool.allocate(OTHER_WEIGHTS, dense)
    pool.allocate(WORKSPACE, workspace)
    num_dense_params = sum(p.numel() for p in model.parameters())
    log.info("sizing of %s\n%s", paged.path or "the paged model",
             format_sizing(startup_sizing(paged, config, num_dense_params, dense, workspace)))
    arena = Arena.from_pool(pool, config.page_bytes, device)
    table = PageTable({bid: paged.block(bid) for bid in paged.block_ids}, arena)
    planner = feed = prompts = None
    progress("choosing the starting bits")
    if config.static_bits is None:
        planner, feed = _policy_planner(paged, config, table, model)
        prompts = _prompt_mix(paged, config, table, model)
    table.set_desired_bits(_starting_bits(config, paged.config, table, arena, planner))
    mover = PageMover(table)
    progress("loading the expert pages")
    mover.load_all()
    stable = config.static_bits is None if config.stable_decode_launches is None else config.stable_decode_launches
    for layer, moe in enumerate(model.moe_blocks):
        moe.experts = ArenaExperts(table, layer, paged.config.num_experts, activation=paged.config.expert_activation,
                                   stable_launches=stable)
    progress("compiling kernels")
    if config.precompile_kernels:
        start = time.perf_counter()
        compiled = precompile_kernels([moe.experts for moe in model.moe_blocks], config.dtype)
        if compiled:
            log.info("compiled %d fused-kernel instances in %.1f s", compiled, time.perf_counter() - start)
    progress("building the engine")
    recorder, residual_of = prompts or (None, None)
    pager = None
    if planner is not None:
        from pagedweight.weights.weight_pager import WeightPager

        tile = kv_tile_bytes(paged.config, config.engine.kv.block_size, config.dtype)  # the unit KV is placed in
        # KV lives in tiles that fit the holes lowering leaves: no compaction for KV room
        pager = WeightPager(mover, planner, kv_block_bytes=tile, routing=feed.snapshot, compact_for_kv=False,
                            compact_raises_while_running=config.compact_raises_while_running,
                            prompts=(lambda: recorder.mix(residual_of)) if recorder is not None else None)
    engine = Engine(model, config.engine, arena=arena, pager=pager, eos_token_ids=eos_token_ids,
                    max_kv_blocks=_max_kv_blocks(config, paged.config, table, arena), prompt_routing=recorder)
    if pager is not None:
        pager.latency = lambda: engine.inter_token_s  # the engine exists only now
    return WorkerRuntime(engine, pool, arena, table, mover, pager, feed, recorder)


def startup_sizing(paged, config: RuntimeConfig, num_dense_params: int, dense: int, workspace: int) -> dict:
    """The report `pagedweight info` prints (planner/sizing.py), with this worker's own dense
    and workspace bytes, dtype, page and KV block size; logged at start-up."""
    from pathlib import Path

    from pagedweight.format.paged_meta import META_FILE
    from pagedweight.planner.sizing import sizes_from_meta, sizing_report

    name = str(config.dtype).removeprefix("torch.")
    elem = torch.empty((), dtype=config.dtype).element_size()
    sizes = sizes_from_meta(paged.config, paged.meta, Path(paged.path or ".") / META_FILE, num_dense_params, name,
                            elem, workspace, config.page_bytes, config.engine.kv.block_size, dense_bytes=dense)
    return sizing_report(sizes, config.memory_budget)


def _max_kv_blocks(config: RuntimeConfig, model_config: ModelConfig, table: PageTable, arena: Arena) -> int:
    """KV blocks the arena holds once every expert block is at its lowest allowed bits."""
    floor_bits = config.static_bits or min(BIT_WIDTHS)
    weights = sum(table.charged_bytes(bid, floor_bits) for bid in table.entries)
    return (arena.num_pages * arena.page_bytes - weights) // _charged_kv_block(model_config, config, arena)


def _charged_kv_block(model_config: ModelConfig, config: RuntimeConfig, arena: Arena) -> int:
    """Arena bytes of one KV block: its per-layer tiles, each in whole pages."""
    tile = kv_tile_bytes(model_config, config.engine.kv.block_size, config.dtype)
    return model_config.num_layers * arena.charged_bytes(tile)


def _policy_planner(paged, config: RuntimeConfig, table: PageTable, model: MoECausalLM):
    """The planner library's policy, registered with this worker's blocks, and the feed of
    the traffic's routing (snapshots sent with each plan request)."""
    from pathlib import Path

    import numpy as np

    from pagedweight.format.paged_meta import META_FILE
    from pagedweight.planner.artifact import artifact_scales, choose_scales, table_from_meta
    from pagedweight.planner.in_process_planner import InProcessPlanner, page_table_registration
    from pagedweight.weights.routing_feed import RoutingFeed

    where = Path(paged.path or ".") / META_FILE
    t = table_from_meta(paged.meta, where)
    top_k = int(paged.meta["model_config"].get("num_experts_per_tok", 2))
    # default: the loss scales quantize stored in the artifact; "raw": none; else a file
    scales, _ = choose_scales(artifact_scales(paged.meta, where, "sensitivity"), config.scales_file, "sensitivity")
    row = {bid: i for i, bid in enumerate(t.block_ids)}
    sensitivity = np.stack([t.sensitivity[row[bid]] for bid in table.entries])  # page-table order
    planner = InProcessPlanner(config.policy, scales, move_cost=config.move_cost)
    planner.register(page_table_registration(table.charged_bytes_table(), t.num_layers, t.num_experts,
                                             top_k, sensitivity, t.calib_mass, t.calib_share))
    feed = RoutingFeed(t.num_layers, t.num_experts, model.device)
    feed.install(model)
    return planner, feed


def _prompt_mix(paged, config: RuntimeConfig, table: PageTable, model: MoECausalLM):
    """(recorder of each prompt's routing, the residual heads in page-table order), or None
    when off or the artifact has no heads (then plans see routing only)."""
    from pathlib import Path

    from pagedweight.engine.prompt_routing import PromptRoutingRecorder
    from pagedweight.planner.artifact import load_heads
    from pagedweight.planner.prompt_context import HeadsInBlockOrder

    heads = load_heads(Path(paged.path), paged.meta) if config.prompt_residuals and paged.path else None
    if heads is None:
        return None
    keys = [b["key"] for b in paged.meta["blocks"]]  # the heads' block order
    try:
        residual_of = HeadsInBlockOrder(heads, keys, [bid.key() for bid in table.entries],
                                        paged.config.num_layers * paged.config.num_experts)
    except ValueError as err:
        from pagedweight.common.errors import CheckpointError

        raise CheckpointError(f"{paged.path}: {err}") from None
    recorder = PromptRoutingRecorder(paged.config.num_layers, paged.config.num_experts, model.device)
    recorder.install(model)  # after the routing feed: both see every step
    return recorder, residual_of


def _starting_bits(config: RuntimeConfig, model_config: ModelConfig, table: PageTable, arena: Arena, planner):
    """# block_id -> bits: static-B, or the policy's plan for the arena less some KV room.

    The budget must hold every block at its floor (static-B, else MIN_BITS) plus the KV
    room: a policy cannot plan below its floor, so a smaller arena would be over-committed
    before the first step. That is the user's error, reported with the budget that fits."""
    capacity = arena.num_pages * arena.page_bytes
    floor_bits = config.static_bits or MIN_BITS
    floor = sum(table.charged_bytes(bid, floor_bits) for bid in table.entries)
    kv_block = _charged_kv_block(model_config, config, arena)
    # a policy starts with min_kv_tokens_at_start of KV room; fixed bits need one KV block
    kv_tokens = config.engine.kv.block_size if config.static_bits else config.min_kv_tokens_at_start
    kv_room = kv_block * blocks_for(kv_tokens, config.engine.kv.block_size)
    if floor + kv_room > capacity:
        need = arena.pool.reserved_bytes + floor + kv_room  # dense weights and workspace are charged
        raise UserError(
            f"policy {config.policy}: memory budget too small: need at least {need} bytes, got "
            f"{config.memory_budget} (every expert block at {floor_bits} bits takes {floor} bytes and "
            f"{kv_tokens} tokens of KV {kv_room}, besides the dense weights and workspace)")
    if config.static_bits is not None:
        return {bid: config.static_bits for bid in table.entries}
    kv_per_token = kv_block_bytes(model_config, 1, config.dtype)
    bits = planner.initial_bits(capacity - config.min_kv_tokens_at_start * kv_per_token)
    return {bid: int(b) for bid, b in zip(table.entries, bits)}  # registration order = page-table order
