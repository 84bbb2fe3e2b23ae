"""The staged regime's knobs on the CPU, no GPU: every knob the GPU tests also flip
(test_apl_staged_gpu.py) leaves whole launches bit for bit equal to the launcher's defaults,
each built as a host harness with nvcc (tests/kernels/staged_host.py; see
test_staged_host_cpu.py for what the emulation runs). A file of its own so the suite's
processes take the two halves of the harness builds in parallel. Skipped without nvcc."""

import shutil

import pytest

from pagedweight_kernels import apl_moe as op
from tests.kernels.staged_host import LAUNCHES, launch_case, planned, run_launch

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


# The knobs the GPU tests run bit for bit (test_apl_staged_gpu.py), here on whole launches: the
# producers' schedule and lookups change, the sums the consumers form must not, to the bit. Units of 4
# steps run the merged class with one producer warpgroup: with two, its 3-4-bit rows' units would want
# 5 ring buffers beside 8-bit LUT rows (staged_min_stages), and the plan refuses the launch.
UNITS_OF_4 = {"APL_STAGED_UNIT": 4, "APL_STAGED_LUT_PRODUCERS": 1}
KNOBS = {"prefetch_1": {"APL_STAGED_PREFETCH": 1}, "prefetch_3": {"APL_STAGED_PREFETCH": 3},
         "units_of_4": UNITS_OF_4,
         "register_prefetch": {"APL_STAGED_PLANE_ASYNC": 0},
         "register_prefetch_units_of_4_prefetch_3": {"APL_STAGED_PLANE_ASYNC": 0, **UNITS_OF_4, "APL_STAGED_PREFETCH": 3},
         "plane_async_units_of_4_prefetch_3": {"APL_STAGED_PLANE_ASYNC": 1, **UNITS_OF_4, "APL_STAGED_PREFETCH": 3},
         "plane_async_prefetch_1": {"APL_STAGED_PLANE_ASYNC": 1, "APL_STAGED_PREFETCH": 1},
         "producer_fence_off": {"APL_STAGED_PRODUCER_FENCE": 0},
         "padding_rows_zeroed": {"APL_STAGED_SKIP_PAD": 0, "APL_STAGED_TMA": 0},  # (the copies' knob)
         "cp_async_activations": {"APL_STAGED_TMA": 0}}


@pytest.mark.parametrize("knob", list(KNOBS))
@pytest.mark.parametrize("name", ["gate_up_3_4_bits_16_token_passes", "down_3_4_bits_4_byte_loads_ragged_step",
                                  "down_merged_class"])
def test_staged_knobs_leave_the_launch_bit_for_bit(cta_harness, default_outputs, tmp_path, name, knob):
    case, instance = launch_case(name, seed=5)
    default = default_outputs(name, case)
    # the host plans with the kernel's knobs (the plane ring's bytes)
    _, plan, lut_bits = planned(case, op.DEFAULT_CONFIG.with_knobs(**KNOBS[knob]))
    run = run_launch(cta_harness(instance, KNOBS[knob]), tmp_path, case, plan, lut_bits)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "out.bin").read_bytes() == default


@pytest.mark.parametrize("name", [n for n in LAUNCHES if n not in ("gate_up_3_4_bits_16_token_passes",
                                                                 "down_3_4_bits_4_byte_loads_ragged_step",
                                                                 "down_merged_class")])
def test_either_activation_path_leaves_the_other_launches_bit_for_bit(cta_harness, default_outputs, tmp_path, name):
    # APL_STAGED_TMA flipped: the 3-4-bit class's B tiles by one tensor-map box a step (128-byte
    # swizzled, read by swizzled descriptors) or by the producers' cp.async copies (the knob test above
    # covers three launches; these are the 96-token case, a pass's box reaching past the tensor's last
    # row, and a 5-8-bit one; 0 against 2, every class)
    case, instance = launch_case(name, seed=5)
    default = default_outputs(name, case)
    flipped = {"APL_STAGED_TMA": 0 if op.DEFAULT_CONFIG.staged_tma else 2}
    _, plan, lut_bits = planned(case, op.DEFAULT_CONFIG.with_knobs(**flipped))  # (planned with its pad)
    run = run_launch(cta_harness(instance, flipped), tmp_path, case, plan, lut_bits)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "out.bin").read_bytes() == default


# The 5-8-bit producers' knobs: units of plane words in registers, activations by TMA for every class,
# and the second producer warpgroup. Against the defaults (1 unit a producer thread, TMA for every
# class, one CTA an SM, two producer warpgroups): each flipped, and earlier defaults all at once.
LUT_KNOBS = {"prefetch_2": {"APL_STAGED_PREFETCH_LUT": 2},
             "copies": {"APL_STAGED_TMA": 1},
             "plane_words_in_registers": {"APL_STAGED_PLANE_ASYNC_LUT": 0},
             "plane_ring_prefetch_3": {"APL_STAGED_PREFETCH_LUT": 3},
             "earlier_defaults": {"APL_STAGED_PREFETCH_LUT": 1, "APL_STAGED_TMA": 1,
                                  "APL_STAGED_LUT_BLOCKS": 2, "APL_STAGED_PLANE_ASYNC_LUT": 0,
                                  "APL_STAGED_LUT_PRODUCERS": 1},
             # one producer warpgroup (earlier defaults), and two with plane words in registers and
             # the activations' copies
             "one_producer_warpgroup": {"APL_STAGED_LUT_PRODUCERS": 1, "APL_STAGED_PREFETCH_LUT": 2},
             "two_producer_warpgroups_earlier": {"APL_STAGED_LUT_PRODUCERS": 2,
                                                 "APL_STAGED_TMA": 1, "APL_STAGED_PLANE_ASYNC_LUT": 0}}


# (each pair builds a harness: the layout and the earlier defaults on both launches, the rest on the merged one)
@pytest.mark.parametrize("name, knob", [(name, knob) for knob in LUT_KNOBS
                                        for name in ("gate_up_5_8_bits_two_pass_groups", "down_merged_class")
                                        if name == "down_merged_class" or knob in ("earlier_defaults",
                                                                                   "two_producer_warpgroups_earlier")])
def test_lut_row_knobs_leave_the_launch_bit_for_bit(cta_harness, default_outputs, tmp_path, name, knob):
    case, instance = launch_case(name, seed=5)
    default = default_outputs(name, case)
    flipped = {define: 1 - op.DEFAULT_CONFIG.knobs()[define] if value == "flip" else value
               for define, value in LUT_KNOBS[knob].items()}  # (lanes: the other layout than the default's)
    _, plan, lut_bits = planned(case, op.DEFAULT_CONFIG.with_knobs(**flipped))  # (TMA's alignment pad)
    run = run_launch(cta_harness(instance, flipped), tmp_path, case, plan, lut_bits)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "out.bin").read_bytes() == default


@pytest.fixture(scope="module")
def default_outputs(cta_harness, tmp_path_factory):
    """name -> the launch's output bytes with the launcher's knobs, run once per module."""
    done = {}

    def get(name: str, case: dict) -> bytes:
        if name not in done:
            work = tmp_path_factory.mktemp("default")
            _, plan, lut_bits = planned(case)
            run = run_launch(cta_harness(LAUNCHES[name][-1]), work, case, plan, lut_bits)
            assert run.returncode == 0, run.stderr[-2000:]
            done[name] = (work / "out.bin").read_bytes()
        return done[name]
    return get
