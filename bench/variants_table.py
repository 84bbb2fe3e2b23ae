"""An `apl_gemv_variants` result as a table to read at a glance: one line per shape, the variants'
times (us) side by side, a mixed layer's time over its byte-weighted time in brackets where the run
weighed it. The device scripts print it last, so a call's reply carries it.

    python3 -m bench.variants_table bench/results/apl_gemv_long_rule_c697377.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def table(rows: list[dict]) -> list[str]:
    """The lines: a header of the variants in run order, then one line per (model, tokens, bits)."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    shapes: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        shapes.setdefault((r["model"][:3], r["tokens"], r["bits"]), {})[r["variant"]] = r
    lines = [" ".join(["shape", *variants])]
    for (model, tokens, bits), by in shapes.items():
        cells = [f'{by[v]["us"]:.1f}' + (f'({by[v]["over_byte_weighted"]:.3f})' if "over_byte_weighted" in by[v] else "")
                 if v in by else "-" for v in variants]
        lines.append(" ".join([f"{model}{tokens}/{bits}", *cells]))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="an apl_gemv_variants JSON (its `results` rows)")
    args = parser.parse_args(argv)
    try:
        lines = table(json.loads(args.result.read_text())["results"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"variants_table: cannot read {args.result}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
