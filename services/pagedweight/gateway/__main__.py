"""`python -m pagedweight.gateway ...`: the gateway without the rest of the CLI (no torch)."""

import argparse
import sys

from pagedweight.cli.gateway_cmd import HELP, add_arguments, run_gateway
from pagedweight.cli.numbers import finite_floats_everywhere
from pagedweight.common.errors import UserError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagedweight gateway", description=HELP)
    add_arguments(parser)
    finite_floats_everywhere(parser)
    args = parser.parse_args(argv)
    try:
        return run_gateway(args)
    except UserError as err:
        print(f"pagedweight gateway: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
