"""Where the shared models and text corpus live: one locator for the CLI, tests and bench/.

The checkout sits beside a `shared/` folder (`<repo>/../shared`: models/, data/corpus/) on
the development and CI machines; `PAGEDWEIGHT_SHARED` points elsewhere (an installed wheel
has no checkout around it, so it needs the variable).
"""

from __future__ import annotations

import os
from pathlib import Path

# services/pagedweight/common/paths.py -> the checkout's root
REPO_ROOT = Path(__file__).resolve().parents[3]
BUNDLED_MODEL = REPO_ROOT / "models" / "micro-mixtral"


def shared_dir() -> Path:
    return Path(os.environ.get("PAGEDWEIGHT_SHARED", REPO_ROOT.parent / "shared"))


def shared_models_dir() -> Path:
    return shared_dir() / "models"


def corpus_dir() -> Path:
    return shared_dir() / "data" / "corpus"
