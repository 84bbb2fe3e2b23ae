"""bench/apl_gemv_variants' variants name only knobs the host has: a misspelt define would be
compiled in silently (NVRTC ignores an unused -D) and a misspelt host knob never set, so a
device call would time the base twice under two names."""

import pytest

pytest.importorskip("torch")

from bench.apl_gemv_variants import BASE, HOST_KNOBS, LAYER_SWITCHES, VARIANTS  # noqa: E402


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_changes_known_knobs(name):
    defines, host = VARIANTS[name]
    assert set(defines) <= set(BASE), set(defines) - set(BASE)
    assert set(host) <= set(HOST_KNOBS) | set(LAYER_SWITCHES), set(host) - set(HOST_KNOBS) - set(LAYER_SWITCHES)
