"""Kernel GPU test runs: the fused kernel's instances compiled in threads before many tests.

Tests run one at a time, so each first use of a kernel instance compiled it alone (NVRTC,
seconds each): on the H200, compiles took most of a 330 s run of test_apl_moe_gpu.py. When
a run selects at least PRECOMPILE_MIN_TESTS GPU tests of this folder, every instance `apl_moe`
can launch (both dtypes, both activations) is compiled first, in parallel threads
(`precompile`; NVRTC runs outside the GIL). PAGEDWEIGHT_TEST_PRECOMPILE=1 or 0 forces it on or off.
"""

import os

import pytest
import torch

PRECOMPILE_MIN_TESTS = 20


def _wanted(session) -> bool:
    forced = os.environ.get("PAGEDWEIGHT_TEST_PRECOMPILE")
    if forced is not None:
        return forced == "1"
    here = os.path.dirname(__file__)
    selected = [item for item in session.items
                if item.get_closest_marker("gpu") and str(item.fspath).startswith(here)]
    return len(selected) >= PRECOMPILE_MIN_TESTS


@pytest.fixture(scope="session", autouse=True)
def kernel_instances_compiled(request):
    from pagedweight_kernels.apl_moe import kernel_available, precompile

    if not kernel_available() or not _wanted(request.session):
        return
    workers = os.cpu_count() or 1
    for dtype in (torch.bfloat16, torch.float16):
        for activation in ("silu", "gelu_tanh"):
            precompile(dtype, activation, max_workers=workers)


@pytest.fixture
def tiles_regime():
    """The configuration for the GPU tests of the tiles regime's own launches: 3-4-bit layers at 256
    or more assignments would take the staged regime by default (plan.staged_layer), which
    test_apl_staged_gpu covers."""
    import dataclasses

    from pagedweight_kernels.config import DEFAULT_CONFIG

    return dataclasses.replace(DEFAULT_CONFIG, staged_classes=frozenset())

