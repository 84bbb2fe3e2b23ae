"""Worker choice: consistent hashing for sessions, least load without one."""

from __future__ import annotations

import collections

from pagedweight.gateway.hashring import VIRTUAL_NODES, HashRing
from pagedweight.gateway.routing import WorkerLoad, least_loaded, pick_worker

WORKERS = [f"10.0.0.{i}:50051" for i in range(1, 5)]
KEYS = [f"session-{i}" for i in range(4000)]


def test_ring_is_deterministic_and_independent_of_worker_order():
    a, b = HashRing(WORKERS), HashRing(list(reversed(WORKERS)))
    assert [a.get(k) for k in KEYS] == [b.get(k) for k in KEYS]
    assert len(a._points) == VIRTUAL_NODES * len(WORKERS)


def test_ring_spreads_keys_over_every_worker():
    ring = HashRing(WORKERS)
    counts = collections.Counter(ring.get(k) for k in KEYS)
    assert set(counts) == set(WORKERS)
    share = len(KEYS) / len(WORKERS)
    assert all(0.7 * share < c < 1.3 * share for c in counts.values()), counts


def test_removing_a_worker_moves_only_its_sessions():
    before = HashRing(WORKERS)
    after = HashRing(WORKERS[:-1])
    for key in KEYS:
        if before.get(key) != WORKERS[-1]:
            assert after.get(key) == before.get(key)
        else:
            assert after.get(key) in WORKERS[:-1]


def test_empty_ring_has_no_owner():
    assert HashRing([]).get("x") is None


def test_least_loaded_counts_requests_then_kv_usage():
    loads = {"a": WorkerLoad(3, 0.1), "b": WorkerLoad(1, 0.9), "c": WorkerLoad(1, 0.2)}
    assert least_loaded(loads) == "c"
    assert least_loaded({}) is None


def test_session_keeps_its_worker_while_ready_else_rehashes():
    loads = {w: WorkerLoad(0, 0.0) for w in WORKERS}
    assert pick_worker(loads, "s1", affinity=WORKERS[2]) == WORKERS[2]
    gone = {w: l for w, l in loads.items() if w != WORKERS[2]}
    assert pick_worker(gone, "s1", affinity=WORKERS[2]) == HashRing(list(gone)).get("s1")
    # without a session, load decides even if a ring would say otherwise
    busy = dict(loads, **{w: WorkerLoad(5, 0.0) for w in WORKERS[1:]})
    assert pick_worker(busy, None, None) == WORKERS[0]
    assert pick_worker({}, "s1", None) is None
