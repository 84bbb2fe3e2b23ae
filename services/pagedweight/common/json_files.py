"""Reading JSON files that come from users or model directories, as untrusted input.

`json.loads` alone turns several bad files into tracebacks or into values we then trust:
non-UTF-8 bytes (UnicodeDecodeError), deep nesting (RecursionError), integers of more
than 4300 digits (ValueError), `NaN`/`Infinity` literals (accepted as floats), and a
top-level array or number where an object belongs. `read_json_object` turns each into
one `UserError` (or the subclass the caller names) that says which file is at fault.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedweight.common.errors import UserError

MAX_JSON_BYTES = 256 << 20  # far above any config, manifest or bits file we write


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def parse_json_object(text: str, where: str, error: type[UserError] = UserError) -> dict:
    """`text` -> dict, or `error` naming `where`."""
    try:
        raw = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise error(f"{where}: not valid JSON ({err})") from None
    except RecursionError:
        raise error(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as err:  # a NaN/Infinity literal, or an integer too long to convert
        raise error(f"{where}: not valid JSON ({str(err)[:120]})") from None
    if not isinstance(raw, dict):
        raise error(f"{where}: expected a JSON object, got {type(raw).__name__}")
    return raw


def read_json_object(path: str | Path, what: str, error: type[UserError] = UserError) -> dict:
    """Read `path` (a `what`, e.g. 'bits file') as a JSON object, or raise `error`."""
    path = Path(path)
    try:
        if not path.is_file():
            raise error(f"{path}: {what} does not exist")
        if path.stat().st_size > MAX_JSON_BYTES:
            raise error(f"{path}: {what} is larger than {MAX_JSON_BYTES} bytes")
        data = path.read_bytes()
    except OSError as err:
        raise error(f"{path}: cannot read the {what} ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}: {what} is not UTF-8 ({err.reason} at byte {err.start})") from None
    return parse_json_object(text, str(path), error)
