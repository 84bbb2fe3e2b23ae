"""Entry point of the `pagedweight` command.

Each sub-command module exposes `register(subparsers)`, which adds its parser and sets
`handler`. A `UserError` becomes one `error: ...` line on stderr and exit code 2, like
argparse's own usage errors; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from pagedweight.cli import bench_cmd, eval_cmd, generate_cmd, info_cmd, plan_cmd, plan_scales_cmd, quantize_cmd
from pagedweight.cli import planner_cmd, serve_cmd, worker_cmd
from pagedweight.common.errors import UserError

COMMANDS = (generate_cmd, eval_cmd, quantize_cmd, plan_cmd, plan_scales_cmd, bench_cmd, info_cmd)
COMMANDS += (worker_cmd, planner_cmd, serve_cmd)  # the services


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedweight", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args) or 0
    except UserError as err:
        print(f"pagedweight {args.command}: error: {one_line(str(err))}", file=sys.stderr)
        return 2


def one_line(message: str) -> str:
    """Messages quote what the user gave: escape newlines, other separators and controls
    (and undecodable bytes) so the error stays one printable line."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)


if __name__ == "__main__":
    sys.exit(main())
