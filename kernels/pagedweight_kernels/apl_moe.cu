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
//   [0] bits (3..8)   [1] address of LUT_bits (fp16 [rows, 2^bits])
//   [2 + p] address of plane p (uint8 [rows, cols/8], read as uint32 words), p < bits.
// So every plane of every block may live anywhere in the memory pool.
//
// No headers: half/bf16 conversions and mma are inline PTX, so NVRTC needs no include path.

// u16, u32 and the 16-bit float conversions: dtype_conversions.cu (prepended by apl_moe.py)
#define DESC_WIDTH 10
#define MAX_EXPERTS 1024

// ---------------------------------------------------------------- conversions
template <bool BF16> __device__ __forceinline__ float act_to_float(u16 v) {
    return BF16 ? bf16_to_float(v) : half_to_float(v);
}
template <bool BF16> APL_HD u16 float_to_act(float f) {
    return BF16 ? float_to_bf16(f) : float_to_half(f);
}
// A LUT entry (fp16) as the activation dtype sees it: the reference path rounds the
// dequantised weights to x's dtype before the matmul, and so do we.
template <bool BF16> APL_HD u16 lut_to_act(u16 v) {
    return BF16 ? float_to_bf16(half_to_float(v)) : v;
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
// Sub-interval j's centre of a cell split in 2^s (fp16 bits); (2j + 1) / 2^(s+1) is exact.
APL_HD u16 lut_cell_entry(LutCell cell, int s, int j) {
    return float_to_half(add_rn(cell.lo, mul_rn(cell.width, (float)(2 * j + 1) / (float)(2 << s))));
}
// Work units of one row's table fill at `bits`: one entry each up to 4 bits, one cell of LUT_4
// (2^(bits-4) entries) each above, so a cell's bounds are computed once.
APL_HD int lut_fill_units(int bits) { return bits <= 4 ? 1 << bits : 16; }
// Unit u of row `row`'s table at `bits`: put(entry, fp16 bits) for each of its entries, zeros
// for a row that is not `valid` (nothing is read for it). `lut`: the block's stored LUT.
template <typename Put>
APL_HD void lut_fill_unit(const u16* __restrict__ lut, int bits, long long row, int u, bool valid, Put put) {
    if (bits <= 4) {
        put(u, valid ? lut[row * lut_row_entries(bits) + u] : (u16)0);
        return;
    }
    const int s = bits - 4;
    if (!valid) {
        for (int j = 0; j < (1 << s); ++j) put((u << s) | j, (u16)0);
        return;
    }
    const LutCell cell = lut_cell(lut + row * 17, u);
    for (int j = 0; j < (1 << s); ++j) put((u << s) | j, lut_cell_entry(cell, s, j));
}

// ---------------------------------------------------------------- bit-planes -> codes
// Widths from 4 up: the code transposes' shifts on the FMA pipe. Measured (docs/kernel.md, "Fewer
// integer-pipe instructions"): up to 2.6% faster at 4, 8 and mixed bits on the decode shapes and up
// to 4% on the tiles regime, 0.4-1.9% slower at 3 bits, hence a threshold per width.
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

// The 32 codes of one plane word (32 columns), rebuilt from pw[p] = word of plane p
// (column i in bit i) by a bit-matrix transpose done in every nibble or byte lane at once:
//   B <= 4: o[c] nibble n = code of column 4n+c (4 words, 4x4 transposes: ~0.6 ops/weight)
//   B >= 5: o[k] byte L = code << (8-B) of column 8L+k (8 words, 8x8 transposes)
// offset<E>(j) = code of column j times 2^E: a byte offset into a LUT of 2^E-byte entries,
// whose row base is aligned so that base | offset == base + offset (one LOP3 per weight).
template <int B>
struct Codes {
    static constexpr bool NIB = B <= 4;
    u32 o[NIB ? 4 : 8];

    APL_HD explicit Codes(const u32 (&pw)[8]) {
        constexpr bool F = FmaShifts<B>::on;
        if constexpr (NIB) {
#pragma unroll
            for (int j = 0; j < 4; ++j) o[j] = (B - 1 - j >= 0) ? pw[B - 1 - j] : 0u;
            delta_swap<F, 2, 0x33333333u>(o[0], o[2]); delta_swap<F, 2, 0x33333333u>(o[1], o[3]);
            delta_swap<F, 1, 0x55555555u>(o[0], o[1]); delta_swap<F, 1, 0x55555555u>(o[2], o[3]);
        } else {
#pragma unroll
            for (int q = 0; q < 8; ++q) o[q] = (7 - q < B) ? pw[7 - q] : 0u;
#pragma unroll
            for (int q = 0; q < 4; ++q) delta_swap<F, 4, 0x0F0F0F0Fu>(o[q], o[q + 4]);
            delta_swap<F, 2, 0x33333333u>(o[0], o[2]); delta_swap<F, 2, 0x33333333u>(o[1], o[3]);
            delta_swap<F, 2, 0x33333333u>(o[4], o[6]); delta_swap<F, 2, 0x33333333u>(o[5], o[7]);
            delta_swap<F, 1, 0x55555555u>(o[0], o[1]); delta_swap<F, 1, 0x55555555u>(o[2], o[3]);
            delta_swap<F, 1, 0x55555555u>(o[4], o[5]); delta_swap<F, 1, 0x55555555u>(o[6], o[7]);
        }
    }

    template <int E>
    APL_HD u32 offset(int j) const {
        const u32 v = NIB ? o[j & 3] : o[j & 7];
        const int shift = NIB ? 4 * (j >> 2) - E : 8 * (j >> 3) + 8 - B - E;
        const u32 mask = ((1u << B) - 1u) << E;
        if (shift > 0) return (v >> shift) & mask;
        return (v << -shift) & mask;
    }
};

APL_HD u16 lds_u16(u32 addr) {
#ifdef __CUDA_ARCH__
    u16 v; asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr)); return v;
#else
    return host_lds_u16(addr);
#endif
}
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
// Dynamic shared memory, its start rounded up to 1 KB so LUT rows are aligned (see Codes).
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

// The staged regime's gate_up with TMA activations (APL_STAGED_TMA): out[pos] = x[sorted_slot[pos] /
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

// ---------------------------------------------------------------- 2/3. prefill regime
#define PF_ROWS 64            // weight rows per CTA
#define PF_KS 128             // columns per K step (4 plane words per row)
#define PF_SP (PF_KS + 8)     // padded shared row stride (u16): conflict-free fragment loads
#define PF_CS (PF_ROWS + 4)   // fp32 epilogue row stride

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

// Dequantise one plane word (32 columns of one row) into 32 act values at dst (16B aligned).
// lut_base: shared address of the row's LUT (u16 act values), aligned (see Codes).
template <int B>
__device__ __forceinline__ void dequant_word(const u32 (&pw)[8], u32 lut_base, u16* dst) {
    const Codes<B> codes(pw);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        u32 v[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int j = q * 8 + 2 * m;
            v[m] = (u32)lds_u16(lut_base | codes.template offset<1>(j)) |
                   ((u32)lds_u16(lut_base | codes.template offset<1>(j + 1)) << 16);
        }
        *reinterpret_cast<uint4*>(dst + q * 8) = make_uint4(v[0], v[1], v[2], v[3]);
    }
}

// Grid (row tiles of 64 weight rows, active experts, m-tile groups), 256 threads (8 warps).
// MODE 0: the 64 weight rows are 32 gate rows and their 32 up rows (h columns r0..r0+31).
template <int MT, int MODE, bool BF16>
__global__ void __launch_bounds__(256, 1) apl_prefill(
    const long long* __restrict__ desc, const int* __restrict__ active,
    const int* __restrict__ num_active, const int* __restrict__ sorted_slot, int top_k,
    const u16* __restrict__ x, int rows_out, int cols, int lut_log2,
    u16* __restrict__ h_out, float* __restrict__ y_out) {
    constexpr int MTILES = MT / 16, WARPS_N = 8 / MTILES, NRANGE = PF_ROWS / WARPS_N, NN8 = NRANGE / 8;
    constexpr int XV = MT * (PF_KS / 8) / 256;  // uint4 of x per thread per K step
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int a = blockIdx.y;
    if (a >= *num_active) return;
    const int e = active[3 * a], start = active[3 * a + 1], n = active[3 * a + 2];
    if ((int)blockIdx.z * MT >= n) return;
    unsigned char* smem = aligned_smem(smem_raw);
    const BlockRef blk = load_block(desc, e);
    const int rpc = MODE == 0 ? PF_ROWS / 2 : PF_ROWS;
    const int r0 = blockIdx.x * rpc;
    const int lut_stride = 1 << lut_log2;
    const bool bad_bits = blk.bits < 3 || blk.bits > lut_log2;
    const int words_per_row = cols / 32;
    u16* lut_s = reinterpret_cast<u16*>(smem);      // [64][lut_stride] act values
    u16* ws = lut_s + PF_ROWS * lut_stride;          // [64][PF_SP]
    u16* xs = ws + PF_ROWS * PF_SP;                   // [MT][PF_SP]
    float* cs = reinterpret_cast<float*>(ws);         // epilogue [MT][PF_CS], reuses ws/xs

    if (!bad_bits) {
        const int units = lut_fill_units(blk.bits);
        for (int idx = threadIdx.x; idx < PF_ROWS * units; idx += blockDim.x) {
            const int lw = idx / units;
            bool valid;
            const int row = weight_row<MODE>(lw, r0, rpc, rows_out, &valid);
            lut_fill_unit(blk.lut, blk.bits, row, idx % units, valid, [&](int ent, u16 v) {
                lut_s[lw * lut_stride + ent] = valid ? lut_to_act<BF16>(v) : (u16)0;
            });
        }
    }
    // This thread dequantises plane word dq_word of weight row dq_row in every K step.
    const int dq_row = threadIdx.x >> 2, dq_word = threadIdx.x & 3;
    bool dq_valid;
    const int dq_wrow = weight_row<MODE>(dq_row, r0, rpc, rows_out, &dq_valid);
    dq_valid = dq_valid && !bad_bits;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int wm = warp % MTILES, wn = warp / MTILES;

    for (int m0 = blockIdx.z * MT; m0 < n; m0 += gridDim.z * MT) {
        float acc[NN8][4];
#pragma unroll
        for (int j = 0; j < NN8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        u32 pw[8];
        uint4 xr[XV];
        auto load_step = [&](int k0) {
            const int word = k0 / 32 + dq_word;
            const bool ok = dq_valid && word < words_per_row;
#pragma unroll
            for (int p = 0; p < 8; ++p)
                pw[p] = (ok && p < blk.bits) ? __ldg(blk.planes[p] + (long long)dq_wrow * words_per_row + word) : 0u;
#pragma unroll
            for (int v = 0; v < XV; ++v) {
                const int idx = threadIdx.x + v * 256, m = idx / (PF_KS / 8), c = k0 + (idx % (PF_KS / 8)) * 8;
                xr[v] = make_uint4(0, 0, 0, 0);
                if (m0 + m < n && c < cols) {
                    const int s = start + m0 + m;
                    const long long row = MODE == 0 ? sorted_slot[s] / top_k : s;
                    xr[v] = *reinterpret_cast<const uint4*>(x + row * cols + c);
                }
            }
        };
        load_step(0);
        for (int k0 = 0; k0 < cols; k0 += PF_KS) {
            __syncthreads();  // LUT written / previous step's mma done with ws and xs
            u16* dst = ws + dq_row * PF_SP + dq_word * 32;
            if (dq_valid && k0 / 32 + dq_word < words_per_row) {
                const u32 lut_row = shared_addr(lut_s + dq_row * lut_stride);
                switch (blk.bits) {
                    case 3: dequant_word<3>(pw, lut_row, dst); break;
                    case 4: dequant_word<4>(pw, lut_row, dst); break;
                    case 5: dequant_word<5>(pw, lut_row, dst); break;
                    case 6: dequant_word<6>(pw, lut_row, dst); break;
                    case 7: dequant_word<7>(pw, lut_row, dst); break;
                    default: dequant_word<8>(pw, lut_row, dst); break;
                }
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) *reinterpret_cast<uint4*>(dst + q * 8) = make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int v = 0; v < XV; ++v) {
                const int idx = threadIdx.x + v * 256, m = idx / (PF_KS / 8), c8 = idx % (PF_KS / 8);
                *reinterpret_cast<uint4*>(xs + m * PF_SP + c8 * 8) = xr[v];
            }
            __syncthreads();
            if (k0 + PF_KS < cols) load_step(k0 + PF_KS);  // in flight during the mma below
#pragma unroll
            for (int kk = 0; kk < PF_KS; kk += 16) {
                const u16* ap = xs + (wm * 16 + g) * PF_SP + kk + 2 * t4;
                const u32 a0 = *reinterpret_cast<const u32*>(ap);
                const u32 a1 = *reinterpret_cast<const u32*>(ap + 8 * PF_SP);
                const u32 a2 = *reinterpret_cast<const u32*>(ap + 8);
                const u32 a3 = *reinterpret_cast<const u32*>(ap + 8 * PF_SP + 8);
#pragma unroll
                for (int j = 0; j < NN8; ++j) {
                    const u16* bp = ws + (wn * NRANGE + j * 8 + g) * PF_SP + kk + 2 * t4;
                    mma16816<BF16>(acc[j], a0, a1, a2, a3, *reinterpret_cast<const u32*>(bp),
                                   *reinterpret_cast<const u32*>(bp + 8));
                }
            }
        }
        __syncthreads();  // all mma done before cs overwrites ws/xs
#pragma unroll
        for (int j = 0; j < NN8; ++j) {
            const int col = wn * NRANGE + j * 8 + 2 * t4, row = wm * 16 + g;
            cs[row * PF_CS + col] = acc[j][0];
            cs[row * PF_CS + col + 1] = acc[j][1];
            cs[(row + 8) * PF_CS + col] = acc[j][2];
            cs[(row + 8) * PF_CS + col + 1] = acc[j][3];
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < MT * rpc; idx += blockDim.x) {
            const int m = idx / rpc, c = idx % rpc;
            if (m0 + m >= n || r0 + c >= rows_out) continue;
            const int s = start + m0 + m;
            float v = cs[m * PF_CS + c];
            if (bad_bits) v = __int_as_float(0x7fc00000);
            if (MODE == 0) {
                const float u = cs[m * PF_CS + rpc + c];
                h_out[(long long)s * rows_out + r0 + c] = float_to_act<BF16>(gate_act(v) * u);
            } else {
                y_out[(long long)sorted_slot[s] * rows_out + r0 + c] = v;
            }
        }
    }
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
