"""Entry point of the `pagedweight` command.

Each sub-command module exposes `register(subparsers)`, which adds its parser and sets
`handler`. A `UserError` becomes one `error: ...` line on stderr and exit code 2, like
argparse's own usage errors; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from pagedweight.cli import bench_cmd, eval_cmd, generate_cmd, info_cmd, plan_cmd, quantize_cmd
from pagedweight.cli import gateway_cmd, planner_cmd, serve_cmd, worker_cmd
from pagedweight.cli.dispatch import OneLineParser, run

COMMANDS = (generate_cmd, eval_cmd, quantize_cmd, plan_cmd, bench_cmd, info_cmd)
COMMANDS += (worker_cmd, planner_cmd, serve_cmd, gateway_cmd)  # the services


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pagedweight", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pagedweight {metadata.version('pagedweight')}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # no command: say which there are
        parser.print_help(sys.stderr)
        return 2
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
