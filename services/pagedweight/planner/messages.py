"""The messages between a worker's weight pager and a bit planner: plain, torch-free data.

Both sides import this one module: the pager (weights/weight_pager.py) through the
`BitPlanner` protocol (weights/bit_planner.py), the planner in-process now and behind
gRPC later. Nothing here holds a reference into the other side's state: routing
statistics and KV pressure travel as snapshots, and a plan travels back as the blocks
that change. Arrays are numpy (a wire format copies them as flat lists).

The exchange:
1. `PlannerRegistration` once, when the worker starts: its block table (the bytes each
   block costs in the worker's arena at 3..8 bits, so the planner's byte counts are the
   arena's, LUTs and page rounding included), the offline sensitivity table and the
   calibration routing prior.
2. `PlanRequest` at a step boundary where the KV cache is short of bytes or has bytes
   to spare: the routing seen since the previous request, the KV pressure, the bits the
   worker is heading for, and the prompts in flight (`PromptMix`: their routing and the
   residual heads' prediction for them; None when none is in flight or the worker has no
   heads).
3. `PlanResponse`, possibly at a later boundary: the new bits of the blocks that change,
   with the bytes they free or take and the predicted damage. The worker applies it
   when it arrives; a response to an older request is still valid as a direction (a
   free only lowers, a spend only raises).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedweight.format.blocks import BIT_WIDTHS, BlockId

NUM_WIDTHS = len(BIT_WIDTHS)
FREE, SPEND = "free", "spend"


@dataclass(frozen=True)
class PlannerRegistration:
    """A worker's block table. Row i of every per-block array is block `block_keys[i]`."""

    block_keys: tuple[str, ...]  # BlockId.key() of each block, in the worker's order
    nbytes: np.ndarray  # int64 [N, 6]: arena bytes of block i at 3..8 bits
    sensitivity: np.ndarray  # float64 [N, 6]: offline S_i(b) (the artifact's table)
    num_layers: int
    num_experts: int  # routed experts per layer
    top_k: int  # experts per token
    calib_mass: np.ndarray | None = None  # float64 [L, E]: calibration gate weight per token
    calib_share: np.ndarray | None = None  # float64 [L, E]: calibration selections per token

    def __post_init__(self):
        n = len(self.block_keys)
        if np.shape(self.nbytes) != (n, NUM_WIDTHS) or np.shape(self.sensitivity) != (n, NUM_WIDTHS):
            raise ValueError(f"registration: nbytes and sensitivity must be [{n}, {NUM_WIDTHS}], got "
                             f"{np.shape(self.nbytes)} and {np.shape(self.sensitivity)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"registration: top_k {self.top_k} for {self.num_experts} experts")

    def block_ids(self) -> list[BlockId]:
        return [BlockId.parse(k) for k in self.block_keys]


@dataclass(frozen=True)
class RoutingSnapshot:
    """The router's choices since the previous snapshot, per MoE layer."""

    counts: np.ndarray  # float64 [L, E]: top-k selections of each expert
    mass: np.ndarray  # float64 [L, E]: sum of each expert's gate weights
    num_tokens: np.ndarray  # int64 [L]: tokens routed

    def is_empty(self) -> bool:
        return not np.any(self.num_tokens)


@dataclass(frozen=True)
class KVPressure:
    """What the KV cache wants from the weights: bytes needed, or bytes free to give."""

    bytes_needed: int = 0  # > 0: free at least this many arena bytes (on top of pending lowerings)
    bytes_free: int = 0  # spare arena bytes the weights may take (used when bytes_needed == 0)

    def __post_init__(self):
        if self.bytes_needed < 0 or self.bytes_free < 0:
            raise ValueError(f"KV pressure must be >= 0, got {self.bytes_needed} needed, {self.bytes_free} free")

    @property
    def direction(self) -> str:
        return FREE if self.bytes_needed > 0 else SPEND


@dataclass(frozen=True)
class PromptMix:
    """The prompts in flight when a request is made: the planner's third signal.

    Each prompt's routing (per layer, the fraction of its prefill's top-k selections each
    expert got) is weighted by the tokens its request still has to run, so a request near
    its end counts little and a finished one not at all. The residual heads are affine in
    these features, so `residual` (the heads on the weighted mean) is also the weighted
    mean of each prompt's own predicted residual."""

    routing: np.ndarray  # float64 [L, E]: weighted mean routing fractions (each row sums to 1)
    residual: np.ndarray | None  # float64 [N]: predicted log(S_prompt / S), registration order
    num_prompts: int  # prompts in the mix
    num_tokens: int  # the weights' sum: tokens the prompts' requests still run

    def __post_init__(self):
        if self.num_prompts < 1 or self.num_tokens < 1:
            raise ValueError(f"a prompt mix needs >= 1 prompt and token, got {self.num_prompts} and {self.num_tokens}")
        if np.ndim(self.routing) != 2 or not np.all(np.isfinite(self.routing)) or np.any(self.routing < 0):
            raise ValueError("prompt mix routing must be a finite, non-negative [L, E] array")
        if self.residual is not None and (np.ndim(self.residual) != 1 or not np.all(np.isfinite(self.residual))):
            raise ValueError("prompt mix residual must be a finite [N] array")


@dataclass(frozen=True)
class PlanRequest:
    request_id: int
    pressure: KVPressure
    bits: np.ndarray  # int64 [N]: the bits the worker is heading for (committed, or pending moves' targets)
    routing: RoutingSnapshot | None = None  # routing since the previous request (None: none recorded)
    # the prompts in flight now (None: none, or no residual heads): every request carries the
    # current mix, so prompts that left drop out of the planner's context with the next one
    prompts: PromptMix | None = None
    inter_token_s: float = 0.0  # the worker's recent mean inter-token latency (0: not measured)


@dataclass(frozen=True)
class PlanResponse:
    request_id: int  # the request this answers
    plan_id: int  # the planner's running plan number
    block_indices: np.ndarray  # int64 [M]: rows of the registration whose bits change
    bits: np.ndarray  # int64 [M]: their new bits
    bytes_delta: int  # arena bytes the changes take (> 0) or free (< 0)
    damage: float  # predicted damage of the whole plan after the changes

    def changes(self) -> dict[int, int]:
        """block index -> new bits."""
        return {int(i): int(b) for i, b in zip(self.block_indices, self.bits)}
