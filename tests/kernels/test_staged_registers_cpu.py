"""The staged regime's register budget (StagedRegs in apl_staged.cu: setmaxnreg splits 2 CTAs'
registers between the consumer and producer warpgroups): every instance staged_projection can
launch must fit without spilling (the 96-token 4-byte-load instances spilled, and staged_plan
does not pick them: test_apl_moe_cpu), with the default knobs and with the plane words by
cp.async. Compiled by nvcc as bench/sass_mix does (bf16; fp16 differs in conversions only), no
GPU; skipped without nvcc."""

import shutil

import pytest

from bench.sass_mix import build_instance, resource_usage
from pagedweight_kernels import apl_moe as op
from pagedweight_kernels.apl_moe import staged_instances
from pagedweight_kernels.plan import staged_blocks, staged_threads


def _kernel_class(instance: str) -> int:
    """The kernel class of an apl_staged instance name (its first template argument)."""
    return int(instance.split("<")[1].split(",")[0])


# (Among them the 128-token passes, staged_wide_nt8 16: the consumers' 2 x 64 accumulators of m64n128
# beside the producers' plane ring. Gate_up's act(gate) * up epilogue spilled 12 bytes at nvcc 13.0
# until the padding rows' copies became one predicated cp.async, cp_async16_if.)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("instance", staged_instances("true"))
def test_every_staged_instance_fits_without_spilling(instance, tmp_path):
    _, resources = build_instance(instance, {}, tmp_path)
    registers, spilled = resource_usage(resources)
    cls = _kernel_class(instance)  # (the 5-8-bit classes: one CTA an SM)
    assert registers <= min(255, 65536 // (staged_threads(cls) * staged_blocks(cls))), resources  # (the launch bounds)
    assert spilled == 0, resources


# APL_STAGED_PLANE_ASYNC (the 3-4-bit class's plane words by cp.async, the default; 0: in registers) changes
# that class's producer only. Not the 128-token passes: with plane words in registers they spill (112 and
# 244 bytes at nvcc 13.0), and they were timed with the plane ring only.
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("instance", [name for name in staged_instances("true")
                                      if name.startswith("apl_staged<0,") and not name.endswith(", 16>")])
def test_staged_instances_fit_with_plane_words_in_registers(instance, tmp_path):
    _, resources = build_instance(instance, {"APL_STAGED_PLANE_ASYNC": 0}, tmp_path)
    registers, spilled = resource_usage(resources)
    assert registers <= 128, resources
    assert spilled == 0, resources


# APL_STAGED_LUT_PRODUCERS flipped (1 <-> 2): the 5-8-bit and merged classes with the other count of
# producer warpgroups (384 threads: every thread under 168 registers) must fit without spilling too.
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("instance", [name for name in staged_instances("true")
                                      if not name.startswith("apl_staged<0,") and ", true, " in name])
def test_lut_class_instances_fit_with_the_other_producer_count(instance, tmp_path):
    producers = 3 - op.DEFAULT_CONFIG.staged_lut_producers
    config = op.DEFAULT_CONFIG.with_knobs(APL_STAGED_LUT_PRODUCERS=producers)
    _, resources = build_instance(instance, {"APL_STAGED_LUT_PRODUCERS": producers}, tmp_path)
    registers, spilled = resource_usage(resources)
    cls = _kernel_class(instance)
    assert registers <= 65536 // (staged_threads(cls, config) * staged_blocks(cls, config)), resources
    assert spilled == 0, resources
