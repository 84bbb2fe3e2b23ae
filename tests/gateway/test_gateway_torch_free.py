"""The gateway runs without torch: its image and its start-up must not need the worker."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT

PROBE = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import pagedweight.gateway.api_server
import pagedweight.cli.gateway_cmd
from pagedweight.gateway.text import TextCodec
codec = TextCodec(sys.argv[1])
ids = codec.encode("Hello")
assert codec.decode(ids) == "Hello"
heavy = sorted(m for m, module in sys.modules.items() if module is not None and (
    m.split(".")[0] in ("torch", "numpy", "safetensors")
    or m.startswith(("pagedweight.model", "pagedweight.engine", "pagedweight.worker"))))
print("HEAVY", heavy)
"""


def test_gateway_imports_and_tokenises_without_torch(bundled_model_dir):
    result = subprocess.run([sys.executable, "-c", PROBE, str(bundled_model_dir)], capture_output=True,
                            text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout
