"""Entry point of the torch-free images (planner, gateway): `pagedweight ROLE ARGS...`.

`pagedweight.cli.main` imports every sub-command module for its help and for a command it
does not know, and several of those import torch (bench, eval, generate), which these images
do not have. This entry point builds the parser from the one sub-command the image runs and
hands it to the same runner the `pagedweight` command uses (a UserError is one `error:`
line, exit code 2).
"""

from __future__ import annotations

import importlib
import sys

ROLES = {"planner": "pagedweight.cli.planner_cmd", "gateway": "pagedweight.cli.gateway_cmd"}


def main(argv: list[str]) -> int:
    from pagedweight.cli.dispatch import OneLineParser, run

    if not argv or argv[0] not in ROLES:
        print(f"usage: pagedweight {{{','.join(ROLES)}}} ... (this image runs only these)", file=sys.stderr)
        return 2
    parser = OneLineParser(prog="pagedweight")
    subparsers = parser.add_subparsers(dest="command", required=True)
    importlib.import_module(ROLES[argv[0]]).register(subparsers)
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
