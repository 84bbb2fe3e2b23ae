"""The kernels' configuration: one typed, frozen KernelConfig, passed to planning and compilation.

Every value here is what a default or a per-shape entry uses; what other values gave is in
docs/kernel.md's "What we tried" table. `config_for(hidden,
intermediate)` is the per-shape table: a layer shape without an entry takes DEFAULT_CONFIG. An
experiment changes a value with `dataclasses.replace` and passes the result explicitly; nothing is
read from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

# The .cu's APL_ACT per expert activation (moe_reference.ACTIVATIONS): one compiled module each.
ACT_CODES = {"silu": 0, "gelu_tanh": 1}
# Shared memory an SM offers (H100/H200: 228 KB); each CTA reserves 1 KB of it.
SM_SHARED = 228 * 1024


@dataclass(frozen=True)
class KernelConfig:
    """Launch planning: regimes, grids, pass widths and the staged regime's ring."""

    # Decode launches split to about this many CTAs: one wave on a 132-SM H100/H200 at 4 CTAs per
    # SM (longer CTAs, fewer prologues; 2 and 4 waves are no better).
    gemv_target_ctas: int = 528
    # The same for launches of the kernels holding 5-8-bit blocks, 3 CTAs an SM (apl_gemv.cu's
    # APL_GEMV_CELL_BLOCKS: their register tables need the registers of the fourth).
    gemv_cell_target_ctas: int = 396
    # Layers of 3-4-bit blocks whose passes want more than 8 tiles and at most this many take
    # passes of 96 tokens (48 accumulators a thread, 2 CTAs per SM), so an expert a little over
    # the mean is dequantised once, not twice. 0: off (the NT8 12 instances are not compiled).
    tiles_wide_nt8: int = 12
    # The staged regime (apl_staged.cu, sm_90a) for the calls the tiles and prefill regimes
    # would take: layers whose bit classes are all in staged_classes, 3-4-bit layers from
    # staged_min_assignments (token, expert) assignments, layers with 5-8-bit blocks from
    # staged_lut_min_per_expert an expert (below them the tiles regime is faster).
    # staged_every_layer: every layer's tiles and prefill calls (an experiment's switch).
    staged_classes: frozenset = frozenset({0, 1})
    staged_every_layer: bool = False
    staged_min_assignments: int = 256
    staged_lut_min_per_expert: int = 16
    # Passes of 8 * NT8 tokens in the staged regime where more than tiles_wide_nt8 (3-4 bits) or
    # 8 (5-8 bits) tiles are wanted and the planes are read as 16-byte vectors (0: off): each
    # weight is dequantised once for more tokens.
    staged_wide_nt8: int = 16
    staged_lut_wide_nt8: int = 16
    staged_stages: int = 4  # ring buffers wanted (fewer where shared memory is short)
    # Dynamic shared memory a staged CTA may take for 2 CTAs per SM (1 KB reserved per CTA, the
    # kernel's 128 bytes of static mbarriers), and for 1.
    staged_cta_shared: tuple = (SM_SHARED // 2 - 1024 - 128, 227 * 1024 - 128)

    def defines(self, activation: str = "silu") -> tuple:
        """The compile key of a module: the activation's APL_ACT (every other value is the
        sources' own)."""
        return (("APL_ACT", ACT_CODES[activation]),)


DEFAULT_CONFIG = KernelConfig()
# Per layer shape (hidden, intermediate): the configuration its launches take. Empty: every
# measured shape runs the defaults.
SHAPE_CONFIGS: dict[tuple[int, int], KernelConfig] = {}


def config_for(hidden: int, intermediate: int) -> KernelConfig:
    """The configuration for a layer of this shape: its SHAPE_CONFIGS entry, else the defaults."""
    return SHAPE_CONFIGS.get((hidden, intermediate), DEFAULT_CONFIG)
