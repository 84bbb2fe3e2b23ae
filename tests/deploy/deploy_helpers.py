"""Helpers of the deploy tests: the real tools installed by `make tools`
(deploy/tools/install.sh, into .tools/bin) and the chart rendered by a real Helm."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools" / "bin"
CHART = ROOT / "helm" / "pagedweight"
VALUE_SETS = {  # name -> values files given to helm (the default values alone: none)
    "default": [],
    "no-gpu": [CHART / "ci" / "no-gpu-values.yaml"],
    "multi-worker": [CHART / "ci" / "multi-worker-values.yaml"],
    "external-redis": [CHART / "ci" / "external-redis-values.yaml"],
}


def tool(name: str) -> str:
    path = TOOLS / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make tools` (deploy/tools/install.sh) first")
    return str(path)


def run(*cmd, cwd=ROOT, check=True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=300, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def helm_template(*values_files, set_values=(), check=True) -> subprocess.CompletedProcess:
    args = [tool("helm"), "template", "rel", CHART, "--namespace", "serving"]
    for f in values_files:
        args += ["-f", f]
    for s in set_values:
        args += ["--set", s]
    return run(*args, check=check)


def manifests(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]
