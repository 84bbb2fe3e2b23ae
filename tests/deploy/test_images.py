"""The Dockerfiles: hadolint clean, and the properties the issue asks of every image
(no Docker engine runs here, so the images are checked as files, not built)."""

from __future__ import annotations

import re
import tomllib

import pytest

from deploy_helpers import ROOT, run, tool

pytestmark = pytest.mark.deploy

DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))
ROLES = {"Dockerfile.worker", "Dockerfile.worker-cpu", "Dockerfile.planner", "Dockerfile.gateway"}


def test_one_image_per_role():
    assert {p.name for p in DOCKERFILES} == ROLES


def test_hadolint_clean():
    # hadolint exits non-zero on any finding at warning level or above
    result = run(tool("hadolint"), "--failure-threshold", "info", *DOCKERFILES, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_basics(dockerfile):
    text = dockerfile.read_text()
    for base in re.findall(r"^FROM\s+(\S+)", text, re.M):
        name, _, tag = base.partition(":")
        # pinned: an exact version tag (digits and dots), never latest or a bare major
        assert re.match(r"\d+\.\d+\.\d+", tag), f"{dockerfile.name}: base {base} is not pinned to a full version"
    final = text[text.rindex("\nFROM "):]  # the runtime stage
    assert re.search(r"^USER\s+10001\s*$", final, re.M), f"{dockerfile.name}: runtime stage must run as non-root"
    assert re.search(r"^HEALTHCHECK .*\n?.*CMD", final, re.M), f"{dockerfile.name}: no HEALTHCHECK"
    assert "COPY --from=build /opt/venv" in final, f"{dockerfile.name}: build tools must stay in the build stage"


@pytest.mark.parametrize("role", ["planner", "gateway"])
def test_torch_free_images(role):
    text = (ROOT / "docker" / f"Dockerfile.{role}").read_text()
    lines = [line.strip() for line in (ROOT / "docker" / "requirements" / f"{role}.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines and not [line for line in lines if line.startswith("torch")]
    assert re.search(r"pip install --no-deps \.", text), "the project must be installed without its torch dependency"
    for line in lines:
        assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][\w.]*", line), f"{role}: unpinned {line!r}"


def test_torch_free_requirements_cover_the_project_dependencies():
    """Every non-torch dependency of pyproject.toml that a torch-free role imports is pinned in
    its requirements file, so `pip install --no-deps .` leaves nothing missing."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ]", d)[0].lower() for d in deps}
    for role, needed in {"planner": {"numpy", "safetensors"}, "gateway": {"tokenizers", "jinja2"}}.items():
        pinned = {line.split("==")[0].lower() for line in (ROOT / "docker" / "requirements" / f"{role}.txt").read_text().splitlines()
                  if "==" in line and not line.startswith("#")}
        assert needed <= names, f"pyproject no longer lists {needed - names}: update this test"
        assert needed <= pinned, f"{role}: {needed - pinned} missing from docker/requirements/{role}.txt"


def test_healthcheck_script_usage():
    result = run("python3", ROOT / "docker" / "healthcheck.py", check=False)
    assert result.returncode == 2 and "healthcheck.py http://" in result.stderr
    # nothing listens on port 9 (discard): the check reports unhealthy, it does not crash
    result = run("python3", ROOT / "docker" / "healthcheck.py", "http://127.0.0.1:9/health", check=False)
    assert result.returncode == 1, result.stderr


@pytest.fixture(scope="module")
def torch_free_venvs(tmp_path_factory) -> dict:
    """role -> the python of a fresh venv holding what the role's image installs: its
    requirements file and the project with --no-deps (no Docker engine here, so the image's
    pip steps run as they would inside it)."""
    venvs = {}
    for role in ("planner", "gateway"):
        venv = tmp_path_factory.mktemp(f"{role}-image") / "venv"
        run("python3", "-m", "venv", venv)
        pip = venv / "bin" / "pip"
        run(pip, "install", "--quiet", "--requirement", ROOT / "docker" / "requirements" / f"{role}.txt")
        run(pip, "install", "--quiet", "--no-deps", ROOT)
        venvs[role] = venv / "bin" / "python"
    return venvs


@pytest.mark.parametrize("role, module", [("planner", "pagedweight.planner_service.server"),
                                          ("gateway", "pagedweight.gateway.serving")])
def test_torch_free_image_runs_its_command_without_torch(torch_free_venvs, role, module):
    """The image's entry point (docker/torch_free_main.py) starts the role's command in an
    environment that has only what the image installs: no torch."""
    python = torch_free_venvs[role]
    assert run(python, "-c", "import torch", check=False).returncode != 0  # really torch-free
    run(python, "-c", f"import {module}")
    entry = ROOT / "docker" / "torch_free_main.py"
    assert run(python, entry, role, "--help").stdout.count("--port") >= 1
    # a bad flag value is one error line and exit 2, as from the `pagedweight` command
    extra = ["--workers", "127.0.0.1:1", "--model", str(ROOT / "models" / "micro-mixtral")] if role == "gateway" else []
    bad = run(python, entry, role, "--port", "70000", *extra, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "error:" in bad.stderr, bad.stderr


def test_torch_free_images_use_the_torch_free_entry_point():
    for role in ("planner", "gateway"):
        text = (ROOT / "docker" / f"Dockerfile.{role}").read_text()
        assert 'ENTRYPOINT ["python", "/app/torch_free_main.py"]' in text
        assert "docker/torch_free_main.py" in text
