"""Shared fixtures: where the bundled and shared models and the text corpus live, and how
the suite runs in parallel (`make test` runs `pytest -n 2`, pytest-xdist).

Parallel workers share nothing by accident: every test writes under its own `tmp_path`,
services listen on ports from each worker's own range (tests/service_procs.py `free_port`), and Redis keys
carry a per-test or per-run prefix. What they share on purpose is the expensive read-only
fixtures, built once per run by whichever worker comes first (`build_once`).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Callable

import pytest

from pagedweight.common.paths import BUNDLED_MODEL, REPO_ROOT, corpus_dir, shared_dir, shared_models_dir

SHARED_DIR = shared_dir()
SHARED_MODELS = shared_models_dir()
CORPUS_DIR = corpus_dir()
DOMAINS = ("kjv", "pydoc", "pycode", "cheader")


def shared_model_dirs() -> list[Path]:
    """Every model in ../shared/models (CI has them), else the bundled one."""
    if SHARED_MODELS.is_dir():
        return sorted(p for p in SHARED_MODELS.iterdir() if (p / "config.json").is_file())
    return [BUNDLED_MODEL]


def domain_prompts(num_chars: int = 160) -> dict[str, str]:
    """A prompt from each text domain's validation file (falls back to fixed text)."""
    if not CORPUS_DIR.is_dir():
        return {"text": "In the beginning God created the heaven and the earth."}
    return {d: (CORPUS_DIR / f"{d}.valid.txt").read_text()[:num_chars] for d in DOMAINS}


# Test files that build CUDA code with nvcc on the host (a harness or a register check per
# kernel instance, minutes of CPU in all): `slow`, so `make test-quick` leaves them to `make test`.
NVCC_BUILDS = ("test_staged_host_cpu.py", "test_staged_registers_cpu.py", "test_tiles_registers_cpu.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in NVCC_BUILDS:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    """Each xdist worker gets its share of the cores for torch's intra-op threads (here and in
    the services it starts), instead of every worker spreading over all of them."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("MKL_NUM_THREADS", str(threads))


def build_once(tmp_path_factory, name: str, build: Callable[[Path], Path]) -> Path:
    """`build(folder)`'s result, built once per test run: under xdist the workers share one
    folder, the first to take the lock builds and the others wait for it. The result is
    read-only to every test."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder = root / f"shared-{name}"
    done = root / f"shared-{name}.path"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            done.write_text(str(build(folder)))
    return Path(done.read_text())


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module of tiny models: handing their work to a second
    thread costs more than it saves (5-10x the CPU time on a busy machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    return BUNDLED_MODEL


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    if not CORPUS_DIR.is_dir():
        pytest.skip("../shared/data/corpus is not present")
    return CORPUS_DIR


@pytest.fixture(scope="session")
def paged_micro_dir(tmp_path_factory) -> Path:
    """micro-mixtral as a paged model directory, built fast for runtime tests: nested
    uniform APL codes (services/pagedweight/weights/synthetic.py) instead of the calibrated
    quantiser, the uniform grid's expected squared error as sensitivity, uniform routing."""
    return build_once(tmp_path_factory, "paged_micro", build_paged_micro)


def build_paged_micro(folder: Path) -> Path:
    import torch

    from pagedweight.model import load_model
    from pagedweight.format.apl_format import BIT_WIDTHS, MODULES, BlockId
    from pagedweight.format.paged_model import LayerPlanes, save_paged_model
    from pagedweight.weights.synthetic import nested_uniform_block

    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    config = model.config
    L, E = config.num_layers, config.num_experts
    apl, bf16, sensitivity = {}, {}, {}
    for layer, moe in enumerate(model.moe_blocks):
        for module in MODULES:
            weights = getattr(moe.experts, module).detach()
            blocks = [nested_uniform_block(weights[e]) for e in range(E)]
            luts = {b: torch.stack([blk.luts[b] for blk in blocks]) for b in blocks[0].luts}
            apl[(layer, module)] = LayerPlanes(torch.stack([blk.planes for blk in blocks]), luts)
            bf16[(layer, module)] = weights
            row_range = weights.amax(-1) - weights.amin(-1)  # [E, rows]
            for e in range(E):
                cols = weights.shape[-1]  # a b-bit bucket of width w has error w^2 / 12 per weight
                sensitivity[BlockId(layer, e, module).key()] = {
                    str(b): float(((row_range[e] / 2**b) ** 2 / 12 * cols).sum()) for b in BIT_WIDTHS
                }
    routing = {"num_tokens": 1, "token_counts": [[1] * E] * L, "routing_mass": [[1.0] * E] * L}
    dense = {k: v for k, v in model.state_dict().items() if ".experts." not in k}
    return save_paged_model(folder / "micro", BUNDLED_MODEL, config, dense, apl, bf16,
                            {"routing": routing, "sensitivity": sensitivity})
