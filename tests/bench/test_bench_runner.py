"""The benchmark runner (`python -m bench`), driven as a user drives it: every recipe names a
benchmark module that exists and flags that module defines, and a dry run prints the command
with the artifacts folder filled in and the extra arguments last. And what a bench module may
be (CONTRIBUTING.md), read from the sources: a recipe's, a helper one imports, or the runner's,
named in the layers contract, functions under 80 lines. (tests import nothing from bench/: the
runner runs in a child process.)"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
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


def bench_imports(module: str) -> set[str]:
    """The bench modules a module imports (at any depth of its code)."""
    tree = ast.parse((REPO / "bench" / f"{module}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "bench":
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench."):
            names.add(node.module.split(".")[1])
    return names


def test_every_bench_module_is_a_recipe_s_a_helper_or_the_runner_s_and_fits_a_screen():
    modules = {p.stem for p in (REPO / "bench").glob("*.py")}
    used = set(recipes().values()) | {"__init__", "__main__", "tables"}
    todo = list(used)
    while todo:
        for name in bench_imports(todo.pop()) - used:
            used.add(name)
            todo.append(name)
    assert modules == used & modules, f"no recipe, doc table or benchmark uses {sorted(modules - used)}"
    for path in (REPO / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 80, f"{path.name}: {node.name} is longer than 80 lines"


def test_every_bench_module_is_in_the_layers_of_the_contract():
    """A module the layers contract does not name is not checked by it."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["name"].startswith("bench: the runner"))
    named = {m.strip().removeprefix("bench.") for layer in layers for m in re.split(r"[|:]", layer)}
    assert {p.stem for p in (REPO / "bench").glob("*.py")} - {"__init__"} <= named


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
