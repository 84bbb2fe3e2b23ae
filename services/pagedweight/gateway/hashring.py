"""Consistent hashing of session ids onto workers (ketama style, 160 points per worker).

The production stack routes sessions this way: when a worker joins or leaves, only the
sessions on its arcs move. Points are md5 digests, so every gateway replica builds the
same ring from the same worker list.
"""

from __future__ import annotations

import bisect
import hashlib

VIRTUAL_NODES = 160


def _point(text: str) -> int:
    return int.from_bytes(hashlib.md5(text.encode()).digest()[:8], "big")


class HashRing:
    def __init__(self, nodes: list[str], virtual_nodes: int = VIRTUAL_NODES):
        self.nodes = tuple(sorted(set(nodes)))
        ring = sorted((_point(f"{node}-{i}"), node) for node in self.nodes for i in range(virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [n for _, n in ring]

    def get(self, key: str) -> str | None:
        """The node owning key: the first point clockwise from the key's hash."""
        if not self._points:
            return None
        i = bisect.bisect(self._points, _point(key)) % len(self._points)
        return self._owners[i]
