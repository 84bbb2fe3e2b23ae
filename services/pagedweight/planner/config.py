"""Every coefficient of the planner, in one checked dataclass with documented defaults.

The damage model (services/planner/damage.py), the routing moving average
(routing_stats.py) and the online hysteresis (planner.py) all read this one config, so an
experiment changes one object and the evidence benchmark can record it whole.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedweight.format.blocks import MAX_BITS, MIN_BITS


@dataclass(frozen=True)
class PlannerConfig:
    # --- damage model: D_i(b) = m_e * S_i(b) * exp(residual_weight * r_i(b)) ---------
    # m_e = clip(relative_mass_e ** routing_exponent, min_multiplier, max_multiplier),
    # relative_mass_e = expert e's routing mass / the mean mass of its layer (1 = average).
    routing_exponent: float = 1.0  # 1: damage proportional to how much output the expert makes
    min_multiplier: float = 0.05  # a never-routed expert still costs something: it may wake up
    max_multiplier: float = 20.0  # one very hot expert must not swallow the whole budget
    # Hot experts get a soft bit floor: relative mass >= threshold -> at least `bits`.
    # Pairs (threshold, bits), any order; the highest floor that applies wins. Soft: when
    # the budget cannot be met above the floors, the planner goes below them and reports it.
    hot_floors: tuple[tuple[float, int], ...] = ((2.5, 4), (5.0, 5))
    # Prompt residual r_i(b) = predicted log(S_i^prompt(b) / S_i(b)); clipped to
    # +-residual_clip so a wild regression output cannot dominate the offline table.
    residual_weight: float = 1.0
    residual_clip: float = 2.0
    # --- routing statistics -------------------------------------------------------------
    # Moving average over tokens: a step of n tokens gets weight 1 - 2^(-n / half_life).
    routing_half_life_tokens: float = 2048.0
    # --- online hysteresis (planner.py) ---------------------------------------------------
    dead_band_fraction: float = 0.01  # spare bytes below this share of the budget stay unspent
    # A rebalance (raise some blocks, lower others, same budget) must cut predicted damage
    # by at least this fraction, and moves at most rebalance_fraction of the budget per plan.
    rebalance_min_gain: float = 0.02
    rebalance_fraction: float = 0.05
    min_bits: int = MIN_BITS
    max_bits: int = MAX_BITS

    def __post_init__(self):
        _check(MIN_BITS <= self.min_bits <= self.max_bits <= MAX_BITS,
               f"min_bits/max_bits must satisfy {MIN_BITS} <= min <= max <= {MAX_BITS}")
        _check(self.routing_exponent >= 0, "routing_exponent must be >= 0")
        _check(0 < self.min_multiplier <= 1 <= self.max_multiplier,
               "need 0 < min_multiplier <= 1 <= max_multiplier")
        for threshold, bits in self.hot_floors:
            _check(threshold > 0 and self.min_bits <= bits <= self.max_bits,
                   f"hot_floors entry ({threshold}, {bits}): threshold > 0, bits in range")
        _check(self.residual_clip >= 0, "residual_clip must be >= 0")
        _check(self.routing_half_life_tokens > 0, "routing_half_life_tokens must be > 0")
        _check(0 <= self.dead_band_fraction < 1, "dead_band_fraction must be in [0, 1)")
        _check(0 <= self.rebalance_min_gain < 1, "rebalance_min_gain must be in [0, 1)")
        _check(0 <= self.rebalance_fraction <= 1, "rebalance_fraction must be in [0, 1]")

    def to_dict(self) -> dict:
        return asdict(self)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"PlannerConfig: {message}")
