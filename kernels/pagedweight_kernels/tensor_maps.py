"""Tensor maps for TMA copies (cp.async.bulk.tensor, sm_90+), encoded by the driver's
cuTensorMapEncodeTiled through ctypes (cupy and torch expose no encoder). A map is a kernel
parameter of 128 bytes (`const __grid_constant__`), so launches that take one go through the
driver (programmatic_launch.launch_driver).

The enums below mirror cuda.h (CUDA 12.0+)."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from pagedweight_kernels.programmatic_launch import cuda_driver, driver_error_name

CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1   # CUtensorMapDataType: 2-byte elements, copied as bits
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_SWIZZLE_128B = 3       # CUtensorMapSwizzle
CU_TENSOR_MAP_L2_PROMOTION_L2_128B = 2
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # elements outside the tensor arrive as zeros
SWIZZLE_128B_ROW_BYTES = 128  # a 128-byte-swizzled box's inner extent, at most


class TensorMap(ctypes.Structure):
    """A CUtensorMap: 128 opaque bytes (64-byte aligned where the driver writes it)."""
    _fields_ = [("word", ctypes.c_uint64 * 16)]


class TensorMapError(ValueError):
    pass


def row_box_map(tensor: torch.Tensor, box_rows: int, box_cols: int) -> TensorMap:
    """The map of a contiguous 2-D tensor of 2-byte elements whose boxes are `box_rows` rows of
    `box_cols` columns (box_cols * 2 = 128 bytes), landing in shared memory with the 128-byte
    swizzle; reads past the tensor's edges give zeros."""
    if tensor.dim() != 2 or tensor.element_size() != 2 or not tensor.is_contiguous() or not tensor.is_cuda:
        raise TensorMapError(f"need a contiguous 2-D CUDA tensor of 2-byte elements, got {tuple(tensor.shape)} "
                             f"{tensor.dtype} on {tensor.device}")
    rows, cols = tensor.shape
    if box_cols * 2 != SWIZZLE_128B_ROW_BYTES or not 1 <= box_rows <= 256:
        raise TensorMapError(f"a box of {box_rows} x {box_cols}: the 128-byte swizzle takes 128-byte rows, up to 256")
    if rows < 1 or (cols * 2) % 16 or tensor.data_ptr() % 16:
        raise TensorMapError(f"rows of {cols * 2} bytes at {tensor.data_ptr():#x}: need 16-byte aligned rows")
    # The driver writes the map 64-byte aligned: encode into an aligned spot of a larger buffer.
    raw = (ctypes.c_uint8 * (ctypes.sizeof(TensorMap) + 64))()
    at = (ctypes.addressof(raw) + 63) // 64 * 64
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(cols * 2)  # bytes between rows (the innermost stride is implied)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    element_strides = (ctypes.c_uint32 * 2)(1, 1)
    encode = _encoder()
    result = encode(ctypes.c_void_p(at), CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, ctypes.c_void_p(tensor.data_ptr()), dims,
                    strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                    CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if result:
        raise TensorMapError(f"cuTensorMapEncodeTiled failed: {driver_error_name(result)} ({result})")
    return TensorMap.from_buffer_copy(ctypes.string_at(at, ctypes.sizeof(TensorMap)))


@lru_cache(maxsize=1)
def _encoder():
    driver = cuda_driver()
    encode = driver.cuTensorMapEncodeTiled
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    encode.restype = ctypes.c_int
    return encode
