"""What every fuzz test requires of the `pagedweight` command, whatever its input.

Exactly two outcomes are allowed:
- a clean error: exit code 2, and stderr's last line is the one `error:` line (argparse
  may print its usage above it); nothing on stdout;
- a correct result: exit code 0, and every JSON line printed is valid JSON with no NaN
  or Infinity in it.
Never a traceback (any other exception fails the test with it), never a hang (an alarm
stops an example after `TIME_LIMIT_S`), and no file outside `--out` changes.

Modes: `ci` (a few examples per test, the same ones every run, the default) keeps `make
test` fast and reproducible; `long` runs 300 random ones per test:
`PAGEDWEIGHT_FUZZ=long .venv/bin/python -m pytest -q tests/fuzz`. (An env var, not
`--hypothesis-profile`: pytest loads that profile before this module registers it.)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
from pathlib import Path

from hypothesis import HealthCheck, event, settings

from pagedweight.cli.main import main

TIME_LIMIT_S = 120

settings.register_profile("fuzz-ci", max_examples=10, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("fuzz-long", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def fuzz_settings(ci_examples: int = 10) -> settings:
    """Per-test settings: PAGEDWEIGHT_FUZZ=long picks the long mode."""
    if os.environ.get("PAGEDWEIGHT_FUZZ") == "long":
        return settings(settings.get_profile("fuzz-long"))
    return settings(settings.get_profile("fuzz-ci"), max_examples=ci_examples)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"the command ran past {TIME_LIMIT_S} s")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) in-process with stdout/stderr captured and a time limit."""
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_LIMIT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse usage errors
                code = exit_.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, out.getvalue(), err.getvalue()


def _no_constant(name):
    raise AssertionError(f"non-finite number {name} printed as a result")


def assert_clean_outcome(code: int, out: str, err: str) -> None:
    event(f"exit {code}")  # --hypothesis-show-statistics: how often each outcome was reached
    assert "Traceback" not in err, err
    if code == 0:
        for line in out.splitlines():
            if line.startswith("{"):
                json.loads(line, parse_constant=_no_constant)
        return
    assert code == 2, f"exit code {code}: {err}"
    assert out == "", out
    lines = err.strip().splitlines()
    assert lines and ": error: " in lines[-1], err
    assert sum(": error: " in line for line in lines) == 1, err


def tree_digest(*roots: Path, skip: Path | None = None) -> dict[str, str]:
    """path -> sha256 of every file under roots (except under `skip`): what must not change."""
    digest = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if skip is not None and (path == skip or skip in path.parents):
                continue
            if path.is_file() and not path.is_symlink():
                digest[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest
