"""The artifact's `planner_scales` section as the planner reads it (torch-free)."""

from __future__ import annotations

import json

import pytest

from pagedweight.common.errors import CheckpointError, UserError
from pagedweight.format.apl_format import MODULES
from pagedweight.format.paged_model import META_FILE, write_meta
from pagedweight.planner.artifact import choose_scales, load_planner_inputs
from tests.planner.test_artifact_and_cli import LAYERS, synthetic_meta


def write(tmp_path, planner_scales):
    meta = synthetic_meta()
    meta["sensitivity_gn"] = meta["sensitivity"]
    if planner_scales is not None:
        meta["planner_scales"] = planner_scales
    write_meta(tmp_path, meta)
    return tmp_path


def groups(value):
    return {f"L{l}.{m}": value for l in range(LAYERS) for m in MODULES}


def test_scales_of_the_requested_table_are_read(tmp_path):
    path = write(tmp_path, {"sensitivity": {"scales": groups(2.0), "kl_at_3_bits": groups(0.1), "num_tokens": 9},
                            "sensitivity_gn": {"scales": groups(3.0), "sensitivity": "sensitivity_gn"}})
    inputs = load_planner_inputs(path)
    assert inputs.scales.scales == groups(2.0) and inputs.scales.num_tokens == 9
    assert load_planner_inputs(path, sensitivity="sensitivity_gn").scales.scales == groups(3.0)
    assert choose_scales(inputs.scales, None, "sensitivity") == (inputs.scales, "artifact")
    assert choose_scales(inputs.scales, "raw", "sensitivity") == (None, "raw")


def test_an_artifact_without_scales_plans_with_raw_s_and_says_so(tmp_path):
    inputs = load_planner_inputs(write(tmp_path, None))
    assert inputs.scales is None
    assert choose_scales(inputs.scales, None, "sensitivity") == (None, "raw (the artifact has no scales)")


@pytest.mark.parametrize("section, error", [
    ([1, 2], CheckpointError),
    ({"sensitivity": {"kl_at_3_bits": {}}}, CheckpointError),
    ({"sensitivity": {"scales": {"L0.down": "x"}}}, CheckpointError),
    ({"sensitivity": {"scales": {"L0.down": -1.0}}}, UserError),
])
def test_a_malformed_section_is_one_clear_error(tmp_path, section, error):
    with pytest.raises(error, match="planner_scales"):
        load_planner_inputs(write(tmp_path, section))
