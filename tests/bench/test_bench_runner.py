"""The benchmark runner (`python -m bench`), driven as a user drives it: every recipe names a
benchmark module that exists and flags that module defines, and a dry run prints the command
with the artifacts folder filled in and the extra arguments last. (tests import nothing from
bench/: the runner runs in a child process.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bench(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout


def recipes() -> dict[str, str]:
    """name -> module, from the recipe table's source (no import of bench/)."""
    text = (REPO / "bench" / "__main__.py").read_text()
    return dict(re.findall(r'Recipe\("([a-z0-9-]+)", "([a-z_]+)"', text))


def source_with_helpers(module: str) -> str:
    """A bench module's source and that of the bench modules it imports (where shared flags live)."""
    source = (REPO / "bench" / f"{module}.py").read_text()
    helpers = re.findall(r"^from bench(?:\.(\w+))? import (\w+)", source, re.M)
    names = {sub or name for sub, name in helpers}
    return source + "".join((REPO / "bench" / f"{n}.py").read_text() for n in sorted(names))


def test_every_recipe_is_listed_and_names_a_module_with_its_flags():
    table = recipes()
    listed = [line.split()[0] for line in bench("list").splitlines()]
    assert sorted(listed) == sorted(table) and len(table) >= 10
    for name, module in table.items():
        source = source_with_helpers(module)
        assert 'if __name__ == "__main__"' in source, module
        for flag in re.findall(r"--[a-z][a-z-]*", bench("run", name, "--dry-run", "--artifacts", "/a")):
            assert f'"{flag}"' in source, (name, flag)


def test_dry_run_fills_in_artifacts_and_appends_extra_arguments():
    out = bench("run", "serve-load", "--dry-run", "--artifacts", "/tmp/paged", "--", "--request-rate", "4")
    assert out.split()[1:] == ["-m", "bench.serve_load", "--model", "/tmp/paged/micro-mixtral", "--request-rate", "4"]


def test_an_unknown_recipe_is_refused():
    result = subprocess.run([sys.executable, "-m", "bench", "run", "no-such-recipe"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_the_docs_tables_are_what_the_results_give():
    """`python -m bench tables --check`: a result file changed without `python -m bench tables`,
    or a table edited by hand, fails here."""
    result = subprocess.run([sys.executable, "-m", "bench", "tables", "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
