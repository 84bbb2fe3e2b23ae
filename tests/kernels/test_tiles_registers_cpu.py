"""The tiles regime's register rule (tiles_blocks in apl_gemv.cu): the instances it compiles for 3
CTAs per SM are capped at the 168 registers that leaves, the rest at 2 CTAs' 255; every one must fit
without spilling (a spill would cost every tiles call silently). Compiled by nvcc as bench/sass_mix
does (no GPU); skipped where nvcc is absent."""

import shutil

import pytest

from bench.sass_mix import build_instance
from pagedweight_kernels.compile import GEMV_SOURCE
from tests.kernels.ptxas import resource_usage

THREE_CTA_REGISTERS = 65536 // (3 * 128) // 8 * 8  # 168: the register file over 3 CTAs of 128 threads
TWO_CTA_REGISTERS = 255  # (the most a thread can hold)
# the rule as this test reads it: the widest NT8 each kernel class runs at 3 CTAs, by plane loads
RULE = "const int widest_at_3 = cls == 0 ? 8 : cls == 1 ? (v2 ? 8 : 2) : (v2 ? 2 : 0);"


def test_the_rule_is_the_one_this_test_checks():
    assert RULE in GEMV_SOURCE.read_text(), "tiles_blocks changed: update the instances below"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("cls, mode, bf16, v2, nt8, ctas", [  # each branch of the rule once (nvcc: ~20 s each)
    (0, 0, "true", "true", 8, 3), (1, 1, "true", "true", 8, 3), (1, 0, "false", "false", 2, 3),
    (1, 0, "true", "false", 8, 2), (2, 0, "true", "true", 2, 3), (2, 1, "true", "true", 4, 2),
    (2, 0, "true", "false", 2, 2)])
def test_tiles_instances_fit_their_ctas_without_spilling(cls, mode, bf16, v2, nt8, ctas, tmp_path):
    _, resources = build_instance(f"apl_gemv<{cls}, {mode}, {bf16}, {v2}, {nt8}>", {}, tmp_path)
    registers, spilled = resource_usage(resources)
    assert registers <= (THREE_CTA_REGISTERS if ctas == 3 else TWO_CTA_REGISTERS), resources
    assert spilled == 0, resources


def test_resource_usage_reads_the_instance_not_the_next_entry():
    lines = ("16 bytes stack frame, 16 bytes spill stores, 28 bytes spill loads\n"
             "ptxas info    : Used 168 registers, used 1 barriers, 176 bytes smem\n"
             "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
             "ptxas info    : Used 18 registers, used 1 barriers, 12288 bytes smem")
    assert resource_usage(lines) == (168, 44)
    with pytest.raises(ValueError):
        resource_usage("no resources here")
