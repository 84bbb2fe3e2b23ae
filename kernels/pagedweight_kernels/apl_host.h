// Host stand-ins for the PTX of the APL_HD helpers (dtype_conversions.cu), so that the staged
// producer's dequantisation can run on a machine without a GPU. Included only by the CPU test's
// harness (tests/kernels/staged_host/harness.cu), before the kernel sources; the kernels as the
// launcher builds them (NVRTC, device code only) never read this file.
//
// Each stand-in follows the PTX ISA's definition of its instruction, including the cases the
// kernels are meant never to hit (PRMT's sign-replicate selectors, NaN conversions), so a code
// path that hits them gives a different answer here too.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

// prmt.b32 d, a, b, c (default mode): bytes 0-3 of a and 4-7 of b; result byte i is the byte
// that selector nibble i's low 3 bits name, or, with the nibble's bit 3 set, that byte's sign
// (its msb) replicated over 8 bits.
inline unsigned host_prmt(unsigned a, unsigned b, unsigned sel) {
    const unsigned long long bytes = (unsigned long long)a | ((unsigned long long)b << 32);
    unsigned d = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned nib = (sel >> (4 * i)) & 0xFu;
        unsigned v = (unsigned)(bytes >> (8 * (nib & 7u))) & 0xFFu;
        if (nib & 8u) v = (v & 0x80u) ? 0xFFu : 0u;
        d |= v << (8 * i);
    }
    return d;
}

// lop3.b32 d, a, b, c, lut: bit i of d = bit (4 a_i + 2 b_i + c_i) of lut (a = 0xF0, b = 0xCC,
// c = 0xAA in the ISA's notation).
inline unsigned host_lop3(unsigned a, unsigned b, unsigned c, unsigned lut) {
    unsigned d = 0;
    for (int i = 0; i < 32; ++i) {
        const unsigned idx = (((a >> i) & 1u) << 2) | (((b >> i) & 1u) << 1) | ((c >> i) & 1u);
        d |= ((lut >> idx) & 1u) << i;
    }
    return d;
}

// mul.hi.u32 (and __umulhi): the high 32 bits of the 64-bit product.
inline unsigned host_mul_hi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}

// cvt.f32.f16: exact (subnormals included).
inline float host_half_to_float(unsigned short h) {
    const unsigned sign = (unsigned)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    unsigned bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (man << 13);  // inf, NaN (payload kept)
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        unsigned m = man;
        do { m <<= 1; ++e; } while (!(m & 0x400u));
        bits = sign | ((unsigned)(112 - e) << 23) | ((m & 0x3FFu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// cvt.rn.bf16.f32: round to nearest even; a NaN becomes the canonical 0x7FFF.
inline unsigned short host_float_to_bf16(float f) {
    unsigned bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu)) return 0x7FFFu;
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (unsigned short)(bits >> 16);
}

// Shared memory: one CTA's worth of bytes, addressed as the device's shared window is (a u32
// offset). An access outside it, or misaligned, is a bug in the code under test: abort loudly.
constexpr unsigned APL_HOST_SHARED_BYTES = 228u * 1024u;
inline unsigned char apl_host_shared[APL_HOST_SHARED_BYTES];

inline void host_shared_check(unsigned addr, unsigned size) {
    if (addr % size != 0 || addr + size > APL_HOST_SHARED_BYTES) {
        std::fprintf(stderr, "host shared memory: %u-byte access at %u is misaligned or out of range\n", size, addr);
        std::abort();
    }
}
inline unsigned short host_lds_u16(unsigned addr) {
    host_shared_check(addr, 2);
    unsigned short v;
    std::memcpy(&v, apl_host_shared + addr, 2);
    return v;
}
inline void host_sts_v4(unsigned addr, const uint4& v) {  // (nvcc includes the CUDA vector types first)
    host_shared_check(addr, 16);
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    std::memcpy(apl_host_shared + addr, w, 16);
}
