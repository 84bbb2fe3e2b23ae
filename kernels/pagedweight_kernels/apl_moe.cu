// Fused mixed-precision MoE over APL bit-planes (docs/apl_format.md, docs/kernel.md).
//
// The prefill regime (above apl_gemv.cu's tiles regime: more than 128 tokens per expert or
// 4096 assignments) and the helpers apl_gemv.cu and apl_staged.cu use (compiled after this file).
// One MoE layer = four launches on one stream, no host synchronisation:
//   1. moe_align     one CTA: group the T*k (token, slot) assignments by expert; list the
//                    active experts (expert id, first sorted position, token count).
//   2. gate_up       every active expert's gate_up block at its own bit-width; the
//                    epilogue applies act(gate) * up (gate_act: SiLU or GELU-tanh) and writes h [T*k, I] in sorted order.
//   3. down          every active expert's down block; writes y [splits, T*k, H] in fp32,
//                    indexed by the original slot t*k+j.
//   4. moe_combine   out[t] = sum_j w[t,j] * sum_split y[split, t*k+j]: a fixed-order,
//                    deterministic reduction (no float atomics).
// Steps 2 and 3 here are apl_prefill: each CTA dequantises a 64-row x 128-column weight tile
// into shared memory and runs bf16/fp16 mma.sync (m16n8k16, fp32 accum). apl_staged.cu's
// regime takes the same four launches with its own projection kernel.
//
// Block descriptor (int64 [DESC_WIDTH] per block, one row per expert and module):
//   [0] bits (3..8)   [1] address of the stored LUT (fp16 [rows, lut_row_entries(bits)])
//   [2 + p] address of plane p (uint8 [rows, cols/8], read as uint32 words), p < bits.
// So every plane of every block may live anywhere in the memory pool.
//
// No headers: half/bf16 conversions and mma are inline PTX, so NVRTC needs no include path.

// u16, u32 and the 16-bit float conversions: dtype_conversions.cu (prepended by cuda_packages.py)
#define DESC_WIDTH 10
#define MAX_EXPERTS 1024

// ---------------------------------------------------------------- conversions
template <bool BF16> APL_HD u16 float_to_act(float f) {
    return BF16 ? float_to_bf16(f) : float_to_half(f);
}

// The experts' gate activation, chosen at compile time (the launcher compiles one module per
// activation): APL_ACT 0 = SiLU, 1 = GELU's tanh approximation (Gemma-4), as torch's
// F.gelu(approximate="tanh") computes it.
#ifndef APL_ACT
#define APL_ACT 0
#endif
APL_HD float gate_act(float g) {
#if APL_ACT == 1
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + tanhf(k * (g + 0.044715f * g * g * g)));
#elif defined(__CUDA_ARCH__)
    return g / (1.f + __expf(-g));
#else
    return g / (1.f + expf(-g));  // (the host's exp for the device's fast one: the CPU test compares with a tolerance)
#endif
}

// ---------------------------------------------------------------- descriptors
struct BlockRef {
    int bits;
    const u16* lut;
    const u32* planes[8];
};

APL_HD BlockRef load_block(const long long* __restrict__ desc, int e) {
    const long long* d = desc + (long long)e * DESC_WIDTH;
    BlockRef b;
    b.bits = (int)d[0];
    b.lut = (const u16*)d[1];
#pragma unroll
    for (int p = 0; p < 8; ++p) b.planes[p] = (const u32*)d[2 + p];
    return b;
}

// ---------------------------------------------------------------- LUT entries (APL format 2)
// A block stores LUT_3 (8 fp16 a row) and LUT_4 (17 a row: 16 centroids, then the outer cells'
// extent); from 5 bits up a code's value is derived from LUT_4 (apl_format.expand_lut, the one
// definition): code p << s | j (s = bits - 4) is the centre of sub-interval j of the 2^s equal
// parts of cell p, whose bounds are the midpoints to p's neighbours (the outer cells reach the
// extent beyond their centroid). Each step is one fp32 rounding in the reference's order (no
// contraction into FMA), so values are bit-identical.
APL_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
APL_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
// Entries a row of the stored LUT holds at `bits` (its row stride): LUT_3's 8, LUT_4's 17.
APL_HD int lut_row_entries(int bits) { return bits <= 3 ? 8 : 17; }
// Cell p of a row's LUT_4 (l4: the row's 17 entries): its low bound and width.
struct LutCell { float lo, width; };
APL_HD LutCell lut_cell(const u16* __restrict__ l4, int p) {
    const float c = half_to_float(l4[p]), extent = half_to_float(l4[16]);
    const float lo = p > 0 ? mul_rn(add_rn(half_to_float(l4[p - 1]), c), 0.5f) : add_rn(c, -extent);
    const float hi = p < 15 ? mul_rn(add_rn(c, half_to_float(l4[p + 1])), 0.5f) : add_rn(c, extent);
    return {lo, add_rn(hi, -lo)};
}
// Cell p's affine form at s = bits - 4 refinement bits (apl_format.cell_affine), act values:
// code p << s | j is offset + width * (1 + j / 2^s), the centre of sub-interval j. 1 + j / 2^s is
// 1.0 with j in the top of its mantissa, so no table holds the 2^bits values: the register path
// (CellLut) ORs the refinement bits into 1.0 and runs one packed FMA per two weights.
struct CellAffine { u16 offset, width; };
template <bool BF16>
APL_HD CellAffine cell_affine(LutCell cell, int s) {
    const float offset = add_rn(cell.lo, mul_rn(cell.width, -(1.f - 1.f / (float)(2 << s))));
    return {float_to_act<BF16>(offset), float_to_act<BF16>(cell.width)};
}
// 1.0 in the act dtype, and where its mantissa's top bit is.
template <bool BF16> struct ActOne { static constexpr u32 bits = BF16 ? 0x3F80u : 0x3C00u, top = BF16 ? 6 : 9; };
// a * b + c on two act values in each u32, rounded once (the register path's one instruction per two weights).
template <bool BF16>
APL_HD u32 act_fma2(u32 a, u32 b, u32 c) {
#ifdef __CUDA_ARCH__
    u32 r;
    if constexpr (BF16) asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    else asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
#else
    return (u32)host_act_fma(BF16, (u16)a, (u16)b, (u16)c) |
           ((u32)host_act_fma(BF16, (u16)(a >> 16), (u16)(b >> 16), (u16)(c >> 16)) << 16);
#endif
}
// ---------------------------------------------------------------- bit-planes -> codes
// Widths from 4 up: the code transposes' shifts on the FMA pipe, which relieves the integer pipe
// that binds the step loops (docs/kernel.md, "What bounds it"); at 3 bits it is slower, hence a
// threshold per width.
template <int B>
struct FmaShifts { static constexpr bool on = B >= 4; };

// a >> S; with FMA, as a multiply-high by 2^(32-S), which the FMA pipe runs, so the integer
// (ALU) pipe that binds Mixtral-size decode issues one op less.
template <bool FMA, int S>
APL_HD u32 shr_pipe(u32 a) {
    if constexpr (FMA) {
#ifdef __CUDA_ARCH__
        u32 r;
        asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "n"(1u << (32 - S)));
        return r;
#else
        return host_mul_hi(a, 1u << (32 - S));
#endif
    } else {
        return a >> S;
    }
}
// (x & M) | (b & ~M) in one LOP3 (nvcc splits it into two when written in C).
template <u32 M>
APL_HD u32 bit_merge(u32 b, u32 x) {
#ifdef __CUDA_ARCH__
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xD8;" : "=r"(r) : "r"(b), "r"(x), "n"(M));
    return r;
#else
    return host_lop3(b, x, M, 0xD8);
#endif
}
// Swap the bits of b under mask M with the bits of a under M << S. With FMA, as two bitfield
// merges (one LOP3 each) of shifted copies (IMAD.SHL / IMAD.HI): 2 ALU ops instead of 5.
template <bool FMA, int S, u32 M>
APL_HD void delta_swap(u32& a, u32& b) {
    if constexpr (FMA) {
        const u32 a0 = a, b0 = b;
        b = bit_merge<M>(b0, shr_pipe<true, S>(a0));
        a = bit_merge<(M << S)>(a0, b0 << S);
    } else {
        const u32 t = ((a >> S) ^ b) & M;
        b ^= t;
        a ^= t << S;
    }
}

// The 32 codes of one plane word (32 columns) at B <= 4 bits, rebuilt from pw[p] = word of plane
// p (column i in bit i) by a bit-matrix transpose done in every nibble lane at once: o[c] nibble n
// = code of column 4n+c (4 words, 4x4 transposes: ~0.6 ops/weight). 5-8 bits take it for their
// top four planes (CellCodes, apl_gemv.cu).
template <int B>
struct Codes {
    static_assert(B <= 4, "5-8-bit codes are a 4-bit cell and refinement bits (CellCodes)");
    u32 o[4];

    APL_HD explicit Codes(const u32 (&pw)[8]) {
        constexpr bool F = FmaShifts<B>::on;
#pragma unroll
        for (int j = 0; j < 4; ++j) o[j] = (B - 1 - j >= 0) ? pw[B - 1 - j] : 0u;
        delta_swap<F, 2, 0x33333333u>(o[0], o[2]); delta_swap<F, 2, 0x33333333u>(o[1], o[3]);
        delta_swap<F, 1, 0x55555555u>(o[0], o[1]); delta_swap<F, 1, 0x55555555u>(o[2], o[3]);
    }
};

APL_HD uint4 lds_v4(u32 addr) {
#ifdef __CUDA_ARCH__
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
#else
    return host_lds_v4(addr);
#endif
}
APL_HD u32 shared_addr(const void* p) {
#ifdef __CUDA_ARCH__
    return (u32)__cvta_generic_to_shared(p);
#else
    return host_shared_addr(p);
#endif
}
// Dynamic shared memory, its start rounded up to 1 KB.
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
    const u32 a = shared_addr(raw);
    return raw + (((a + 1023u) & ~1023u) - a);
}

// ---------------------------------------------------------------- 1. align
// One CTA. sorted_slot[pos] = assignment index t*k+j, grouped by expert; active[3a..3a+2] =
// (expert, first position, count) for the a-th expert with tokens; *num_active = how many.
// Ids outside [0, num_experts) are dropped (their outputs count as zero in moe_combine).
extern "C" __global__ void moe_align(const long long* __restrict__ topk_ids, int num_assign,
                                     int num_experts, int* __restrict__ sorted_slot,
                                     int* __restrict__ active, int* __restrict__ num_active) {
    __shared__ int count[MAX_EXPERTS], offset[MAX_EXPERTS], cursor[MAX_EXPERTS];
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) { count[e] = 0; cursor[e] = 0; }
    __syncthreads();
    for (int a = threadIdx.x; a < num_assign; a += blockDim.x) {
        long long e = topk_ids[a];
        if (e >= 0 && e < num_experts) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int pos = 0, na = 0;
        for (int e = 0; e < num_experts; ++e) {
            offset[e] = pos;
            if (count[e]) {
                active[3 * na] = e; active[3 * na + 1] = pos; active[3 * na + 2] = count[e];
                ++na; pos += count[e];
            }
        }
        *num_active = na;
    }
    __syncthreads();
    // Order within an expert is arbitrary: every position's result is computed on its own
    // and written back by slot, so the output does not depend on it.
    for (int a = threadIdx.x; a < num_assign; a += blockDim.x) {
        long long e = topk_ids[a];
        if (e >= 0 && e < num_experts) sorted_slot[offset[e] + atomicAdd(&cursor[e], 1)] = a;
    }
}

// The staged regime's gate_up, whose activations come by TMA: out[pos] = x[sorted_slot[pos] /
// top_k], rows of `chunks` 16-byte chunks, so that each expert's tokens are consecutive rows a
// tensor map can box. One thread a chunk.
extern "C" __global__ void moe_gather_rows(const uint4* __restrict__ x, const int* __restrict__ sorted_slot,
                                           int top_k, int num_slots, int chunks, uint4* __restrict__ out) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)num_slots * chunks) return;
    const long long pos = idx / chunks, c = idx % chunks;
    out[idx] = x[(long long)(sorted_slot[pos] / top_k) * chunks + c];
}

// ---------------------------------------------------------------- 2/3. weight rows of a CTA
// MODE 0 (gate_up): the CTA owns output rows [r0, r0+rpc) of h, i.e. gate rows r0.. and
// up rows I+r0..; local weight row lw < rpc is a gate row, lw >= rpc an up row.
// MODE 1 (down): local weight row lw is row r0+lw.
template <int MODE>
APL_HD int weight_row(int lw, int r0, int rpc, int rows_out, bool* valid) {
    if (MODE == 0) {
        const int r = lw < rpc ? lw : lw - rpc;
        *valid = r0 + r < rows_out;
        return (lw < rpc ? 0 : rows_out) + r0 + r;
    }
    *valid = r0 + lw < rows_out;
    return r0 + lw;
}

// ---------------------------------------------------------------- tensor-core mma
template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if (BF16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------- 4. combine
// out[t, h] = sum_j w[t, j] * sum_s y[s, t*k+j, h], in a fixed order (deterministic).
template <bool BF16>
__global__ void moe_combine(const float* __restrict__ y, int num_splits, int num_slots,
                            const long long* __restrict__ topk_ids, const float* __restrict__ topk_w,
                            int num_experts, int num_tokens, int top_k, int hidden, u16* __restrict__ out) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)num_tokens * hidden) return;
    const int t = (int)(idx / hidden), h = (int)(idx % hidden);
    float sum = 0.f;
    for (int j = 0; j < top_k; ++j) {
        const int slot = t * top_k + j;
        const long long e = topk_ids[slot];
        if (e < 0 || e >= num_experts) continue;
        float v = 0.f;
        for (int s = 0; s < num_splits; ++s) v += y[((long long)s * num_slots + slot) * hidden + h];
        sum += topk_w[slot] * v;
    }
    out[idx] = float_to_act<BF16>(sum);
}
