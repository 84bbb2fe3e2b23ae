"""The kernel modules compile under NVRTC, as the device compiles them (cupy's RawModule), without a
GPU: libnvrtc from the `nvidia-cuda-nvrtc` wheel (the test extra), through ctypes. The device's
first call should not be the first compile of a module: a host-only construct leaking into device
code (the APL_HD helpers' host branches) would otherwise cost a device call to find.

The fused module (apl_moe.cu, apl_gemv.cu, apl_staged.cu) for sm_90a with the launcher's defines,
with instances of every staged class and projection and of apl_gemv's classes instantiated; for
sm_80 (no wgmma) the apl_gemv instances; and the decode-ops module. Skipped where the wheel is
absent."""

import ctypes
import glob
import importlib.util
import os

import pytest

from bench.sass_mix import GEMV_PARAMS, STAGED_PARAMS, kernel_defines, module_text
from pagedweight_kernels import decode_ops
from pagedweight_kernels.cuda_packages import module_source


def _libnvrtc() -> str | None:
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []) or []:
        found = sorted(glob.glob(os.path.join(root, "cu*", "lib", "libnvrtc.so*")))
        if found:
            return found[0]
    return None


LIBNVRTC = _libnvrtc()
pytestmark = pytest.mark.skipif(LIBNVRTC is None, reason="needs the nvidia-cuda-nvrtc wheel")


def nvrtc_compile(source: str, options: list[str]) -> tuple[int, str]:
    """(NVRTC's result code, its log) for one program."""
    lib = ctypes.CDLL(LIBNVRTC)
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"module.cu", 0, None, None) == 0
    try:
        opts = [o.encode() for o in options]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        return rc, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


STAGED = [f"apl_staged<{cls}, {mode}, true, {v4}, {nt8}>" for cls, mode, v4, nt8 in
          ((0, 0, "true", 12), (0, 0, "true", 16), (0, 1, "false", 4), (1, 0, "true", 8), (1, 1, "false", 2), (2, 0, "false", 8), (2, 1, "true", 4))]
GEMV = [f"apl_gemv<{cls}, {mode}, true, true, {nt8}>" for cls, mode, nt8 in ((0, 0, 1), (1, 1, 1), (2, 0, 8), (0, 1, 8))]


PREFILL = [f"apl_prefill<{mt}, {mode}, {bf16}>" for mt, mode, bf16 in ((16, 0, "true"), (128, 1, "false"))]
PREFILL_PARAMS = ("const long long* __restrict__, const int* __restrict__, const int* __restrict__, const int* __restrict__, "
                  "int, const u16* __restrict__, int, int, int, u16* __restrict__, float* __restrict__")


def instantiate(names: list[str]) -> str:
    params = {"apl_staged": STAGED_PARAMS, "apl_gemv": GEMV_PARAMS, "apl_prefill": PREFILL_PARAMS}
    return "".join(f"\ntemplate __global__ void {n}({params[n[:n.index('<')]]});" for n in names) + "\n"


@pytest.mark.slow
def test_the_fused_module_compiles_for_sm90a():
    defines = kernel_defines({})
    rc, log = nvrtc_compile(module_text(staged=True) + instantiate(STAGED + GEMV + PREFILL),
                            ["-std=c++17", "--gpu-architecture=sm_90a", *(f"-D{k}={v}" for k, v in defines.items())])
    assert rc == 0, log[-3000:]


@pytest.mark.slow
def test_the_fused_module_compiles_without_wgmma():
    # sm_80: the decode and tiles instances on mma.sync (the staged kernel is sm_90a only)
    rc, log = nvrtc_compile(module_text(staged=True) + instantiate(GEMV),
                            ["-std=c++17", "--gpu-architecture=sm_80",
                             *(f"-D{k}={v}" for k, v in kernel_defines({}).items())])
    assert rc == 0, log[-3000:]


def test_the_decode_ops_module_compiles():
    rc, log = nvrtc_compile(module_source(decode_ops.SOURCE, decode_ops.GEMV_SOURCE),
                            ["-std=c++17", "--gpu-architecture=sm_90a"])
    assert rc == 0, log[-3000:]


def test_a_module_that_does_not_compile_fails_here():
    # the check can fail: a host-only call in device code, as an APL_HD helper's host branch would be
    rc, log = nvrtc_compile(module_text(staged=True) + "\n__global__ void bad(float* y) { y[0] = host_quiet_nan(); }\n",
                            ["-std=c++17", "--gpu-architecture=sm_90a"])
    assert rc != 0 and "host_quiet_nan" in log
