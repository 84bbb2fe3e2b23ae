"""Running a parsed sub-command: the one place that turns a UserError into an error line.

Torch-free, so the torch-free images' entry point (docker/torch_free_main.py) handles
errors exactly as the `pagedweight` command does.
"""

from __future__ import annotations

import argparse
import sys

from pagedweight.cli.numbers import finite_floats_everywhere
from pagedweight.common.errors import UserError


def run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse argv and call the sub-command's handler; a UserError is one `error:` line on
    stderr and exit code 2, like argparse's own usage errors."""
    finite_floats_everywhere(parser)  # NaN and infinities are refused by every flag
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
