"""The collector's pauses: timed by generation, and gone from objects frozen at start-up."""

import gc

from pagedweight.common.gc_pauses import GCPauses, freeze_startup_heap, unfreeze


class Node:
    def __init__(self):
        self.other = None


def cycles(n: int) -> list:
    out = []
    for _ in range(n):
        a, b = Node(), Node()
        a.other, b.other = b, a
        out.append(a)
    return out


def test_full_collections_are_timed_and_walk_only_unfrozen_objects():
    pauses = GCPauses().install()
    try:
        heap = cycles(200_000)  # a start-up heap: live objects a full pass must walk
        n, s = pauses.num_full, pauses.full_seconds
        gc.collect()
        cold = pauses.full_seconds - s
        assert pauses.num_full == n + 1 and cold > 0
        assert freeze_startup_heap() >= 400_000
        n, s = pauses.num_full, pauses.full_seconds
        gc.collect()
        frozen = pauses.full_seconds - s
        assert pauses.num_full == n + 1
        assert frozen < cold / 5  # the frozen heap is not walked again
        assert len(heap) == 200_000
    finally:
        unfreeze()
        pauses.remove()
    assert gc.get_freeze_count() == 0
