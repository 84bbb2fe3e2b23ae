"""Numbers on the command line: finite and in range, or argparse's one error line (exit 2).

`build_parser` swaps every plain `type=float` for `finite_float`, so NaN and infinities are
refused by every flag; flags with a meaningful range use `seconds`/`positive_seconds`.
"""

from __future__ import annotations

import argparse
import math


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _ranged(low: float, high: float, low_open: bool):
    def parse(text: str) -> float:
        value = finite_float(text)
        if (value <= low if low_open else value < low) or value > high:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound} and <= {high:g} seconds, got {text!r}")
        return value
    parse.__name__ = "seconds"
    return parse


MAX_SECONDS = 30 * 24 * 3600.0  # longer than any timeout or TTL means a typo
seconds = _ranged(0.0, MAX_SECONDS, low_open=False)  # >= 0
positive_seconds = _ranged(0.0, MAX_SECONDS, low_open=True)  # > 0


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def finite_floats_everywhere(parser: argparse.ArgumentParser) -> None:
    """Every `type=float` in the parser and its sub-parsers becomes finite_float."""
    for action in parser._actions:  # argparse has no public walk over its actions
        if action.type is float:
            action.type = finite_float
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                finite_floats_everywhere(sub)

