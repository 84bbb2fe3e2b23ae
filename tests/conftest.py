"""Shared fixtures: where the bundled and shared models and the text corpus live."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = REPO_ROOT / "models" / "micro-mixtral"
SHARED_DIR = Path(os.environ.get("PAGEDWEIGHT_SHARED", REPO_ROOT.parent / "shared"))
SHARED_MODELS = SHARED_DIR / "models"
CORPUS_DIR = SHARED_DIR / "data" / "corpus"
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
    """micro-mixtral as a paged model directory, quantised quickly (for runtime tests)."""
    from services.offline.quantize import quantize_model
    from tests.quant.conftest import CALIB_TEXT, quick_config

    folder = tmp_path_factory.mktemp("paged_calib")
    files = []
    for name, text in CALIB_TEXT.items():
        (folder / f"{name}.calib.txt").write_text(text)
        files.append(folder / f"{name}.calib.txt")
    return quantize_model(BUNDLED_MODEL, tmp_path_factory.mktemp("paged_micro") / "micro", files, quick_config())
