"""One byte budget for everything the worker keeps on its device.

`MemoryPool` is the accounting half of the memory design (docs/memory_pool.md): every
byte the worker holds is charged to exactly one *kind* (expert weights at each
bit-width, other weights, the workspace reserve, KV blocks holding tokens, KV blocks
kept free, plane copies in transit), and the sum of all kinds never exceeds the budget,
at any instant: `allocate` raises `BudgetExceeded` instead of clamping. The physical
half is `services/pagedweight/memory/arena.py`: one device tensor whose page allocator charges
this pool for every page it hands out, so the accounting is the real memory.

`peak_in_use_bytes` follows the issue's definition of pool use: resident weights, KV
blocks holding tokens, workspace and in-transit copies; KV blocks the cache holds but
has not filled (`kv_free`) are reserved, not in use.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from pagedweight.common.errors import UserError
from pagedweight.format.blocks import BIT_WIDTHS

# The kinds. Expert weights are charged per committed bit-width: `expert_kind(bits)`.
OTHER_WEIGHTS = "other_weights"  # embeddings, attention, norms, routers, shared experts
WORKSPACE = "workspace"  # activations and scratch: a fixed reserve set at start-up
KV_USED = "kv_used"  # KV blocks holding tokens
KV_FREE = "kv_free"  # KV blocks the cache keeps allocated but empty
TRANSIT = "transit"  # planes/LUTs being copied in, not yet committed
EXPERT_PREFIX = "expert@"
KV_KINDS = (KV_USED, KV_FREE)


def expert_kind(bits: int) -> str:
    """The kind of expert-weight bytes of blocks committed at `bits`: 'expert@4'."""
    if bits not in BIT_WIDTHS:
        raise ValueError(f"expert bit-width must be in {BIT_WIDTHS}, got {bits}")
    return f"{EXPERT_PREFIX}{bits}"


ALL_KINDS = (OTHER_WEIGHTS, WORKSPACE, KV_USED, KV_FREE, TRANSIT) + tuple(expert_kind(b) for b in BIT_WIDTHS)


class BudgetExceeded(RuntimeError):
    """An allocation would take the pool over its budget (a bug in the caller's checks)."""


class MemoryBudgetError(UserError):
    """A `--memory-budget` value that cannot be parsed or does not fit the device."""


@dataclass(frozen=True)
class PoolSnapshot:
    """Bytes by kind at one instant (what the metrics endpoint exports)."""

    budget_bytes: int
    expert_bytes_by_bits: dict[int, int]  # bits -> bytes of expert blocks committed at bits
    other_weight_bytes: int
    workspace_bytes: int
    kv_used_bytes: int
    kv_free_bytes: int
    transit_bytes: int
    reserved_bytes: int  # sum of every kind: what the budget bounds
    in_use_bytes: int  # reserved minus kv_free
    peak_in_use_bytes: int  # the most in_use_bytes ever seen
    peak_reserved_bytes: int  # the most reserved_bytes ever seen

    @property
    def expert_bytes(self) -> int:
        return sum(self.expert_bytes_by_bits.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.reserved_bytes

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "expert_bytes_by_bits"}
        out["expert_bytes_by_bits"] = {str(b): n for b, n in self.expert_bytes_by_bits.items()}
        out["expert_bytes"] = self.expert_bytes
        out["free_bytes"] = self.free_bytes
        return out


@dataclass
class MemoryPool:
    """Byte accounting by kind against one budget; thread-safe (the page mover's thread
    and the engine both charge it)."""

    budget_bytes: int
    _bytes: dict[str, int] = field(default_factory=lambda: {k: 0 for k in ALL_KINDS})  # kind -> bytes
    _peak_in_use: int = 0
    _peak_reserved: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        if self.budget_bytes <= 0:
            raise MemoryBudgetError(f"memory budget must be positive, got {self.budget_bytes} bytes")

    @property
    def reserved_bytes(self) -> int:
        return sum(self._bytes.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.reserved_bytes

    def bytes_of(self, kind: str) -> int:
        return self._bytes[_checked(kind)]

    def can_allocate(self, kind: str, num_bytes: int) -> bool:
        _checked(kind)
        return 0 <= num_bytes <= self.free_bytes

    def allocate(self, kind: str, num_bytes: int) -> None:
        """Charge `num_bytes` to `kind`; raises BudgetExceeded rather than going over."""
        with self._lock:
            _checked(kind)
            if num_bytes < 0:
                raise ValueError(f"cannot allocate {num_bytes} bytes")
            if num_bytes > self.free_bytes:
                raise BudgetExceeded(
                    f"allocating {num_bytes} bytes of {kind} would exceed the budget of "
                    f"{self.budget_bytes} bytes ({self.reserved_bytes} reserved)"
                )
            self._bytes[kind] += num_bytes
            self._update_peaks()

    def free(self, kind: str, num_bytes: int) -> None:
        with self._lock:
            _checked(kind)
            if not 0 <= num_bytes <= self._bytes[kind]:
                raise ValueError(f"freeing {num_bytes} bytes of {kind}, which holds {self._bytes[kind]}")
            self._bytes[kind] -= num_bytes

    def move(self, src_kind: str, dst_kind: str, num_bytes: int) -> None:
        """Re-label bytes (a commit turns transit into expert@b; a KV block fills up).
        The total does not change, so it cannot exceed the budget."""
        with self._lock:
            _checked(src_kind), _checked(dst_kind)
            if not 0 <= num_bytes <= self._bytes[src_kind]:
                raise ValueError(f"moving {num_bytes} bytes out of {src_kind}, which holds {self._bytes[src_kind]}")
            self._bytes[src_kind] -= num_bytes
            self._bytes[dst_kind] += num_bytes
            self._update_peaks()

    def snapshot(self) -> PoolSnapshot:
        with self._lock:
            b = dict(self._bytes)
            reserved = sum(b.values())
            return PoolSnapshot(
                budget_bytes=self.budget_bytes,
                expert_bytes_by_bits={bits: b[expert_kind(bits)] for bits in BIT_WIDTHS},
                other_weight_bytes=b[OTHER_WEIGHTS],
                workspace_bytes=b[WORKSPACE],
                kv_used_bytes=b[KV_USED],
                kv_free_bytes=b[KV_FREE],
                transit_bytes=b[TRANSIT],
                reserved_bytes=reserved,
                in_use_bytes=reserved - b[KV_FREE],
                peak_in_use_bytes=self._peak_in_use,
                peak_reserved_bytes=self._peak_reserved,
            )

    def _update_peaks(self) -> None:
        reserved = sum(self._bytes.values())
        self._peak_reserved = max(self._peak_reserved, reserved)
        self._peak_in_use = max(self._peak_in_use, reserved - self._bytes[KV_FREE])


def _checked(kind: str) -> str:
    if kind not in ALL_KINDS:
        raise ValueError(f"unknown memory kind {kind!r} (one of {', '.join(ALL_KINDS)})")
    return kind


_SUFFIXES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
             "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
             "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_memory_budget(text: str, device_total_bytes: int | None = None) -> int:
    """`--memory-budget` -> bytes.

    Accepts a byte count ('123456789', '8GiB', '512M'; binary multiples) or a fraction
    of the device's memory ('0.9', '90%'), which needs `device_total_bytes`
    (`device_memory_bytes()`). Raises MemoryBudgetError with the value at fault.
    """
    raw = str(text).strip().lower()
    fraction = _parse_fraction(raw)
    if fraction is not None:
        if device_total_bytes is None:
            raise MemoryBudgetError(f"--memory-budget {text!r} is a fraction, but the device's memory size is unknown")
        if not 0 < fraction <= 1:
            raise MemoryBudgetError(f"--memory-budget {text!r}: a fraction must be in (0, 1]")
        return int(fraction * device_total_bytes)
    match = re.fullmatch(r"([0-9]{1,30})\s*([a-z]*)", raw)  # ASCII digits; int() of 5000 digits raises
    if not match or match.group(2) not in _SUFFIXES:
        raise MemoryBudgetError(f"--memory-budget {text!r}: expected bytes (e.g. 8GiB, 512M, 1000000) or a fraction (0.9, 90%)")
    num_bytes = int(match.group(1)) * _SUFFIXES[match.group(2)]
    if num_bytes <= 0:
        raise MemoryBudgetError(f"--memory-budget {text!r} must be positive")
    if device_total_bytes is not None and num_bytes > device_total_bytes:
        raise MemoryBudgetError(f"--memory-budget {text!r} exceeds the device's {device_total_bytes} bytes")
    return num_bytes


def _parse_fraction(raw: str) -> float | None:
    if raw.endswith("%"):
        try:
            return float(raw[:-1]) / 100
        except ValueError:
            raise MemoryBudgetError(f"--memory-budget {raw!r}: not a percentage") from None
    if "." in raw:
        try:
            return float(raw)
        except ValueError:
            return None
    return None


def device_memory_bytes(device) -> int | None:
    """Total memory of a CUDA device, or the machine's physical memory for the CPU (a
    budget beyond it would be allocated until the machine dies), None if unknown."""
    import os

    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
