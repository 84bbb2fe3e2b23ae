"""The staged regime's register budget (StagedRegs in apl_staged.cu: setmaxnreg splits 2 CTAs'
registers between the consumer and producer warpgroups): every instance staged_projection can
launch must fit without spilling (the 96-token 4-byte-load instances spilled, and staged_plan
does not pick them: test_apl_moe_cpu). Compiled by nvcc as bench/sass_mix does (bf16; fp16
differs in conversions only), no GPU; skipped without nvcc."""

import shutil

import pytest

from bench.sass_mix import build_instance
from pagedweight_kernels.compile import staged_instances
from pagedweight_kernels.plan import staged_blocks, staged_threads
from tests.kernels.ptxas import resource_usage


def _kernel_class(instance: str) -> int:
    """The kernel class of an apl_staged instance name (its first template argument)."""
    return int(instance.split("<")[1].split(",")[0])


# (Among them the 128-token passes, staged_wide_nt8 16: the consumers' 2 x 64 accumulators of m64n128
# beside the producers' plane ring.)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("instance", staged_instances("true"))
def test_every_staged_instance_fits_without_spilling(instance, tmp_path):
    _, resources = build_instance(instance, {}, tmp_path)
    registers, spilled = resource_usage(resources)
    cls = _kernel_class(instance)  # (the 5-8-bit classes: one CTA an SM)
    assert registers <= min(255, 65536 // (staged_threads(cls) * staged_blocks(cls))), resources  # (the launch bounds)
    assert spilled == 0, resources
