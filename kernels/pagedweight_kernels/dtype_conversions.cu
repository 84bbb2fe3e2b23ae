// The 16-bit float conversions every kernel module of this package uses, prepended by the
// Python launchers (apl_moe.py, decode_ops.py) to the module's own source: NVRTC through
// cupy compiles one string, no headers. cvt instructions round to nearest even, as torch's
// casts do, so a kernel's stores equal the torch chain it replaces.

typedef unsigned short u16;
typedef unsigned int u32;

// APL_HD: a helper the host can run too. The staged producer's dequantisation and everything it
// calls are compiled for the host by the CPU test (tests/kernels/staged_host.py): each such helper
// keeps its PTX for the device and, where it has PTX, a host branch calling the stand-in of the
// same name in apl_host.h, which only that harness includes. NVRTC and the device pass of nvcc
// define __CUDA_ARCH__ and never see the host branches.
#define APL_HD __host__ __device__ __forceinline__

APL_HD float half_to_float(u16 v) {
#ifdef __CUDA_ARCH__
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f;
#else
    return host_half_to_float(v);
#endif
}
APL_HD u16 float_to_half(float f) {
#ifdef __CUDA_ARCH__
    u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
#else
    return host_float_to_half(f);
#endif
}
__device__ __forceinline__ float bf16_to_float(u16 v) { return __uint_as_float(((u32)v) << 16); }
// The quiet NaN the kernels write for blocks they cannot read.
APL_HD float quiet_nan() {
#ifdef __CUDA_ARCH__
    return __int_as_float(0x7fc00000);
#else
    return host_quiet_nan();
#endif
}
APL_HD u16 float_to_bf16(float f) {
#ifdef __CUDA_ARCH__
    u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
#else
    return host_float_to_bf16(f);
#endif
}
