"""The planner runs without torch: a planner service image carries numpy, not torch."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pagedweight.planner


def planner_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(pagedweight.planner.__path__, "pagedweight.planner."))


def test_every_planner_module_imports_without_torch():
    modules = planner_modules()
    assert "pagedweight.planner.messages" in modules and len(modules) >= 10
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print(','.join(loaded))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing the planner loaded torch: {out.stdout.strip()[:200]}"
