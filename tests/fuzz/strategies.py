"""Hostile values and JSON mutations for the fuzz tests."""

from __future__ import annotations

import copy
import json

from hypothesis import strategies as st

# Numbers and strings that have broken parsers before: zero, negatives, the edges of int64
# and float64, NaN and infinities, non-ASCII digits, lone surrogates, paths that escape.
EDGE_TEXT = ["0", "-1", "1", "2", "3", "4", "8", "9", "nan", "inf", "-inf", "1e-300", "1e309", "", " ",
             "0x10", "\uff11", "\u0663", "1.5", "-0", "1e3", str(2**63), str(2**64), "9" * 50,
             "\udcff", "caf\udcc3", "../../etc/passwd", "/dev/zero", "/dev/null", "20TiB", "90%", "-5%",
             "0.5", "static-4", "static-0", "static-x", "meta", "cuda", "cpu:1", "cuda:-1", "foo"]
EDGE_JSON = [0, -1, 1, 3, 8, 10**7, 2**31, 2**63, -(2**63), 10**30, 1e-300, 1e308, -0.0, 0.5, True, False, None,
             "", "4", "L0.E0.down", "L00.E0.down", [], {}, [1, 2], {"a": 1}]

json_leaves = st.one_of(st.sampled_from(EDGE_JSON), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                        st.text(max_size=12))
json_values = st.recursive(json_leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=6)


@st.composite
def mutated_json(draw, base: dict, max_edits: int = 3) -> dict:
    """`base` with 1..max_edits edits, each at a random path: replace, delete or add."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, max_edits))):
        node = doc
        while True:
            children = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not children:
                break
            key = draw(st.sampled_from(children))
            child = node[key]
            if isinstance(child, (dict, list)) and child and draw(st.booleans()):
                node = child
                continue
            op = draw(st.sampled_from(["replace", "delete", "add"]))
            if op == "replace":
                node[key] = draw(json_values)
            elif op == "delete":
                del node[key]
            elif isinstance(node, dict):
                node[draw(st.text(max_size=10))] = draw(json_values)
            else:
                node.append(draw(json_values))
            break
    return doc


@st.composite
def json_file_bytes(draw, doc_strategy) -> bytes:
    """A JSON document, sometimes damaged at the byte level (truncated, not UTF-8, not an object)."""
    doc = draw(doc_strategy)
    data = json.dumps(doc).encode("utf-8", "surrogatepass")
    damage = draw(st.sampled_from(["none"] * 6 + ["truncate", "bad-byte", "array", "deep"]))
    if damage == "truncate":
        return data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    if damage == "bad-byte":
        at = draw(st.integers(0, len(data)))
        return data[:at] + b"\xff\xfe" + data[at:]
    if damage == "array":
        return b"[" + data + b"]"
    if damage == "deep":
        return b"[" * 100_000 + b"]" * 100_000
    return data
