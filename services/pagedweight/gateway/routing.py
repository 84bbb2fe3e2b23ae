"""Which worker serves a request: plain functions of the ready workers and their loads.

- A session sticks to the worker it used last while that worker is ready; otherwise it
  goes where the consistent-hash ring over the ready workers puts it (so every gateway
  replica sends it to the same place, and a worker leaving moves only its sessions).
- Without a session: the least-loaded ready worker, load being the requests it holds or
  queues (from its last stats) plus those sent since, KV usage breaking ties.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pagedweight.gateway.hashring import HashRing


@dataclass(frozen=True)
class WorkerLoad:
    num_requests: int  # running + waiting at the last stats poll, plus those sent since
    kv_cache_usage: float  # 0..1


def least_loaded(loads: dict[str, WorkerLoad]) -> str | None:
    """address -> load; the address with the fewest requests (then least KV usage)."""
    if not loads:
        return None
    return min(loads, key=lambda a: (loads[a].num_requests, loads[a].kv_cache_usage, a))


def pick_worker(loads: dict[str, WorkerLoad], session_id: str | None, affinity: str | None) -> str | None:
    """loads: the ready workers only. None when no worker is ready."""
    if session_id is None:
        return least_loaded(loads)
    if affinity in loads:
        return affinity
    return _ring(tuple(sorted(loads))).get(session_id)


@lru_cache(maxsize=16)
def _ring(nodes: tuple[str, ...]) -> HashRing:
    """Rings of the recent sets of ready workers (the set changes rarely)."""
    return HashRing(list(nodes))
