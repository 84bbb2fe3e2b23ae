"""The ctypes mirror of cuda.h's launch structures (programmatic_launch) and the packing of
kernel arguments, without a GPU: a wrong size or offset would hand the driver garbage."""

import ctypes

import numpy as np
import pytest
import torch

import pagedweight_kernels.launch as op
from pagedweight_kernels.cuda_packages import pack_arguments
from pagedweight_kernels.programmatic_launch import (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                                                     LaunchAttribute, LaunchAttributeValue, LaunchConfig,
                                                     function_handle, kernel_parameters, launch_config)


def test_structures_have_the_layout_of_cuda_h():
    # CUlaunchAttributeValue: a 64-byte union; CUlaunchAttribute: id, pad to 8, value;
    # CUlaunchConfig: 7 unsigned ints, then the stream, the attribute pointer and their count.
    assert ctypes.sizeof(LaunchAttributeValue) == 64 and ctypes.alignment(LaunchAttributeValue) == 8
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert LaunchConfig.shared_bytes.offset == 24
    assert (LaunchConfig.stream.offset, LaunchConfig.attrs.offset, LaunchConfig.num_attrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(LaunchConfig) == 56
    assert CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6


def test_launch_config_pads_the_grid_and_counts_the_attributes():
    attrs = (LaunchAttribute * 1)()
    config = launch_config((44, 4), 128, 49152, 0, attrs)
    assert (config.grid_x, config.grid_y, config.grid_z) == (44, 4, 1)
    assert (config.block_x, config.block_y, config.block_z) == (128, 1, 1)
    assert config.shared_bytes == 49152 and config.num_attrs == 1 and config.stream is None
    assert launch_config((7,), 256, 0, 0x1234, attrs).stream == 0x1234


def test_kernel_parameters_point_at_each_value_in_its_own_type():
    packed = pack_arguments([None, 3, -5, 0.5, np.uint64(2 ** 40 + 7)])
    values, pointers = kernel_parameters(packed)
    assert [type(v) for v in values] == [ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64]
    read = [ctypes.cast(pointers[i], ctypes.POINTER(type(values[i]))).contents.value for i in range(len(values))]
    assert read == [0, 3, -5, 0.5, 2 ** 40 + 7]
    with pytest.raises(TypeError):
        kernel_parameters([np.float64(1.0)])


def test_function_handle_needs_a_loaded_function():
    class Loaded:
        class function:  # noqa: N801 (the shape of cuda_packages.ArchKernel)
            ptr = 0xABC

    assert function_handle(Loaded()) == 0xABC
    with pytest.raises(TypeError):
        function_handle(object())


@pytest.mark.parametrize("capability, down", [((8, 0), False), ((9, 0), True), ((10, 0), True)])
def test_only_down_overlaps_and_only_where_the_waits_exist(monkeypatch, capability, down):
    # griddepcontrol (the kernels' waits) exists from compute capability 9.0; gate_up never overlaps
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    assert op.programmatic_projections() == (False, down)


def test_the_programmatic_attribute_allows_overlap():
    from pagedweight_kernels.programmatic_launch import _programmatic_attributes

    attrs = _programmatic_attributes()
    assert len(attrs) == 1 and attrs[0].id == CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attrs[0].value.as_u32 == 1
