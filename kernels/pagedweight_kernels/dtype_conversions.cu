// The 16-bit float conversions every kernel module of this package uses, prepended by the
// Python launchers (apl_moe.py, decode_ops.py) to the module's own source: NVRTC through
// cupy compiles one string, no headers. cvt instructions round to nearest even, as torch's
// casts do, so a kernel's stores equal the torch chain it replaces.

typedef unsigned short u16;
typedef unsigned int u32;

__device__ __forceinline__ float half_to_float(u16 v) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f;
}
__device__ __forceinline__ u16 float_to_half(float f) {
    u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
}
__device__ __forceinline__ float bf16_to_float(u16 v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ u16 float_to_bf16(float f) {
    u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
}
