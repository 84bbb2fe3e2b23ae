"""Entry point of the `pagedweight` command.

Each sub-command module exposes `register(subparsers)`, which adds its parser and sets
`handler`. A command line that names a sub-command imports that one module alone, so the
planner, the gateway and `serve`, whose modules need no torch, start without importing it
(~1.6 s of CPU a process); help, --version and an unknown command build every parser. A
`UserError` becomes one `error: ...` line on stderr and exit code 2, like argparse's own
usage errors; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata

from pagedweight.cli.dispatch import OneLineParser, run

# sub-command -> the module in pagedweight.cli that registers it, in the order help lists them
COMMANDS = {"generate": "generate_cmd", "eval": "eval_cmd", "quantize": "quantize_cmd", "plan": "plan_cmd",
            "plan-scales": "plan_cmd", "bench": "bench_cmd", "info": "info_cmd"}
COMMANDS |= {"worker": "worker_cmd", "planner": "planner_cmd", "serve": "serve_cmd", "gateway": "gateway_cmd"}  # the services


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every sub-command, or of `command`'s module alone where it names one."""
    parser = OneLineParser(prog="pagedweight", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pagedweight {metadata.version('pagedweight')}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = [COMMANDS[command]] if command in COMMANDS else dict.fromkeys(COMMANDS.values())
    for module in modules:
        importlib.import_module(f"pagedweight.cli.{module}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = build_parser(args[0] if args else None)
    if not args:  # no command: say which there are
        parser.print_help(sys.stderr)
        return 2
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
