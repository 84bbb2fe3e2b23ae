"""Running a parsed sub-command: the one place that turns a UserError into an error line.

Torch-free, so the torch-free images' entry point (docker/torch_free_main.py) handles
errors exactly as the `pagedweight` command does.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys

from pagedweight.cli.numbers import finite_floats_everywhere
from pagedweight.common.errors import UserError

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one `prog: error: message` line and exit code 2 (the
    usage itself is what --help prints): a bad flag reads like every other bad input.
    Sub-command parsers inherit the class through add_subparsers."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse argv and call the sub-command's handler; a UserError is one `error:` line on
    stderr and exit code 2, like a usage error of a OneLineParser."""
    finite_floats_everywhere(parser)  # NaN and infinities are refused by every flag
    args = parser.parse_args(argv)
    try:
        return args.handler(args) or 0
    except UserError as err:
        print(f"pagedweight {args.command}: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except Exception as err:
        # a full disk or quota, or a file past a size limit, is the machine's state, not a bug:
        # one line (outputs are written atomically, so nothing whole was replaced by a part)
        code = out_of_space(err)
        if code is None:
            raise
        where = f" {err.filename}" if isinstance(err, OSError) and err.filename else ""
        print(f"pagedweight {args.command}: error: cannot write{one_line(where)}: {os.strerror(code)}",
              file=sys.stderr)
        return 2


def out_of_space(err: BaseException) -> int | None:
    """The errno when `err` is a write that found no room: an OSError, or a native
    library's error that carries it as "(os error N)" (safetensors' Rust writer does)."""
    if isinstance(err, OSError):
        return err.errno if err.errno in OUT_OF_SPACE else None
    match = re.search(r"\(os error (\d+)\)", str(err))
    return int(match.group(1)) if match and int(match.group(1)) in OUT_OF_SPACE else None


def one_line(message: str) -> str:
    """Messages quote what the user gave: escape newlines, other separators and controls
    (and undecodable bytes) so the error stays one printable line."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)
