// Fused mixed-precision MoE over APL bit-planes (docs/apl_format.md, docs/kernel.md).
//
// One MoE layer = four launches on one stream, no host synchronisation:
//   1. moe_align     one CTA: group the T*k (token, slot) assignments by expert; list the
//                    active experts (expert id, first sorted position, token count).
//   2. gate_up       every active expert's gate_up block at its own bit-width; the
//                    epilogue applies SiLU(gate) * up and writes h [T*k, I] in sorted order.
//   3. down          every active expert's down block; writes y [splits, T*k, H] in fp32,
//                    indexed by the original slot t*k+j.
//   4. moe_combine   out[t] = sum_j w[t,j] * sum_split y[split, t*k+j]: a fixed-order,
//                    deterministic reduction (no float atomics).
// Steps 2 and 3 come in two regimes, chosen per launch by the host from tokens per expert:
//   apl_decode   few tokens per expert, memory-bound GEMV: LPR lanes share one weight row,
//                each plane word is read once, LUTs and activations sit in shared memory,
//                grid = (row tiles, active experts, column splits) so small experts still
//                fill the GPU.
//   apl_prefill  many tokens per expert: each CTA dequantises a 64-row x 128-column weight
//                tile into shared memory and runs bf16/fp16 mma.sync (m16n8k16, fp32 accum).
//
// Block descriptor (int64 [DESC_WIDTH] per block, one row per expert and module):
//   [0] bits (3..8)   [1] address of LUT_bits (fp16 [rows, 2^bits])
//   [2 + p] address of plane p (uint8 [rows, cols/8], read as uint32 words), p < bits.
// So every plane of every block may live anywhere in the memory pool.
//
// No headers: half/bf16 conversions and mma are inline PTX, so NVRTC needs no include path.

typedef unsigned short u16;
typedef unsigned int u32;
#define DESC_WIDTH 10
#define MAX_EXPERTS 1024

// ---------------------------------------------------------------- conversions
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
template <bool BF16> __device__ __forceinline__ float act_to_float(u16 v) {
    return BF16 ? bf16_to_float(v) : half_to_float(v);
}
template <bool BF16> __device__ __forceinline__ u16 float_to_act(float f) {
    return BF16 ? float_to_bf16(f) : float_to_half(f);
}
// A LUT entry (fp16) as the activation dtype sees it: the reference path rounds the
// dequantised weights to x's dtype before the matmul, and so do we.
template <bool BF16> __device__ __forceinline__ u16 lut_to_act(u16 v) {
    return BF16 ? float_to_bf16(half_to_float(v)) : v;
}

// ---------------------------------------------------------------- descriptors
struct BlockRef {
    int bits;
    const u16* lut;
    const u32* planes[8];
};

__device__ __forceinline__ BlockRef load_block(const long long* __restrict__ desc, int e) {
    const long long* d = desc + (long long)e * DESC_WIDTH;
    BlockRef b;
    b.bits = (int)d[0];
    b.lut = (const u16*)d[1];
#pragma unroll
    for (int p = 0; p < 8; ++p) b.planes[p] = (const u32*)d[2 + p];
    return b;
}

// ---------------------------------------------------------------- bit-planes -> codes
#define DELTA_SWAP(a, b, s, m) { u32 t_ = (((a) >> (s)) ^ (b)) & (m); (b) ^= t_; (a) ^= t_ << (s); }

// pw[p] = word of plane p (column i in bit i). Returns o[k] whose byte lane L holds the
// 8-bit code of column 8L+k, low (8-B) bits zero: an 8x8 bit transpose in every byte lane.
template <int B>
__device__ __forceinline__ void planes_to_codes(const u32 (&pw)[8], u32 (&o)[8]) {
#pragma unroll
    for (int q = 0; q < 8; ++q) o[q] = (7 - q < B) ? pw[7 - q] : 0u;
#pragma unroll
    for (int q = 0; q < 4; ++q) DELTA_SWAP(o[q], o[q + 4], 4, 0x0F0F0F0Fu);
    DELTA_SWAP(o[0], o[2], 2, 0x33333333u); DELTA_SWAP(o[1], o[3], 2, 0x33333333u);
    DELTA_SWAP(o[4], o[6], 2, 0x33333333u); DELTA_SWAP(o[5], o[7], 2, 0x33333333u);
    DELTA_SWAP(o[0], o[1], 1, 0x55555555u); DELTA_SWAP(o[2], o[3], 1, 0x55555555u);
    DELTA_SWAP(o[4], o[5], 1, 0x55555555u); DELTA_SWAP(o[6], o[7], 1, 0x55555555u);
}

// b-bit code of column i (0..31) of the word transposed into o.
template <int B>
__device__ __forceinline__ u32 code_of(const u32 (&o)[8], int i) {
    return (o[i & 7] >> (8 * (i >> 3) + 8 - B)) & ((1u << B) - 1u);
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

// ---------------------------------------------------------------- 2/3. decode regime
// One weight row (columns [c0, c0 + 32*KW)) against NT tokens; this lane takes words
// lane, lane+LPR, ... Plane words are loaded one word ahead to keep loads in flight.
template <int B, int NT, int LPR>
__device__ __forceinline__ void dot_row(const BlockRef& blk, long long word0, int KW, int lane,
                                        const float* __restrict__ lut_row,
                                        const float* __restrict__ xs, int xstride,
                                        float (&acc)[NT]) {
    u32 cur[8], nxt[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) cur[p] = (p < B && lane < KW) ? __ldg(blk.planes[p] + word0 + lane) : 0u;
    for (int w = lane; w < KW; w += LPR) {
        const int wn = w + LPR;
#pragma unroll
        for (int p = 0; p < 8; ++p) nxt[p] = (p < B && wn < KW) ? __ldg(blk.planes[p] + word0 + wn) : 0u;
        u32 o[8];
        planes_to_codes<B>(cur, o);
        const float* xw = xs + w * NT;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const float wv = lut_row[code_of<B>(o, i)];
            const float* xp = xw + i * xstride;
            if constexpr (NT == 4) {
                const float4 v = *reinterpret_cast<const float4*>(xp);
                acc[0] += wv * v.x; acc[1] += wv * v.y; acc[2] += wv * v.z; acc[3] += wv * v.w;
            } else if constexpr (NT == 2) {
                const float2 v = *reinterpret_cast<const float2*>(xp);
                acc[0] += wv * v.x; acc[1] += wv * v.y;
            } else {
                acc[0] += wv * xp[0];
            }
        }
#pragma unroll
        for (int p = 0; p < 8; ++p) cur[p] = nxt[p];
    }
}

// MODE 0 (gate_up): the CTA owns output rows [r0, r0+rpc) of h, i.e. gate rows r0.. and
// up rows I+r0..; local weight row lw < rpc is a gate row, lw >= rpc an up row.
// MODE 1 (down): local weight row lw is row r0+lw.
template <int MODE>
__device__ __forceinline__ int weight_row(int lw, int r0, int rpc, int rows_out, bool* valid) {
    if (MODE == 0) {
        const int r = lw < rpc ? lw : lw - rpc;
        *valid = r0 + r < rows_out;
        return (lw < rpc ? 0 : rows_out) + r0 + r;
    }
    *valid = r0 + lw < rows_out;
    return r0 + lw;
}

// Grid (row tiles, active experts, column splits), 256 threads. rows_out: I (MODE 0) or H.
// x: MODE 0 the tokens [T, cols] (row = slot / top_k); MODE 1 h [T*k, cols] by sorted position.
// lut_log2: log2 of the shared LUT row stride (the layer's largest bit-width).
template <int NT, int LPR, int MODE, bool BF16>
__global__ void __launch_bounds__(256) apl_decode(
    const long long* __restrict__ desc, const int* __restrict__ active,
    const int* __restrict__ num_active, const int* __restrict__ sorted_slot, int top_k,
    const u16* __restrict__ x, int rows_out, int cols, int split_cols, int rpc, int lut_log2,
    u16* __restrict__ h_out, float* __restrict__ y_out, int num_slots) {
    extern __shared__ float smem[];
    const int a = blockIdx.y;
    if (a >= *num_active) return;
    const int e = active[3 * a], start = active[3 * a + 1], n = active[3 * a + 2];
    const BlockRef blk = load_block(desc, e);
    const int r0 = blockIdx.x * rpc;
    const int nr = min(rpc, rows_out - r0);
    const int rows_w = MODE == 0 ? 2 * rpc : rpc;  // weight rows in this CTA
    const int c0 = blockIdx.z * split_cols;
    const int KW = min(split_cols, cols - c0) / 32, words_per_row = cols / 32;
    const int xstride = KW * NT + NT;  // floats per column-in-word i; +NT pads banks
    const int lut_stride = 1 << lut_log2;
    const bool bad_bits = blk.bits < 3 || blk.bits > lut_log2;
    float* lut_s = smem;                          // [rows_w][lut_stride] fp32
    float* xs = lut_s + rows_w * lut_stride;      // [32][KW][NT] (+pad): xs[i][w][t] = x[t][32w+i]
    float* res = xs + 32 * xstride;               // [rows_w][NT]

    if (!bad_bits) {
        const int nent = 1 << blk.bits;
        for (int idx = threadIdx.x; idx < rows_w * nent; idx += blockDim.x) {
            const int lw = idx >> blk.bits, ent = idx & (nent - 1);
            bool valid;
            const int row = weight_row<MODE>(lw, r0, rpc, rows_out, &valid);
            lut_s[lw * lut_stride + ent] =
                valid ? act_to_float<BF16>(lut_to_act<BF16>(blk.lut[(long long)row * nent + ent])) : 0.f;
        }
    }
    const int group = threadIdx.x / LPR, lane = threadIdx.x % LPR, num_groups = blockDim.x / LPR;
    for (int t0 = 0; t0 < n; t0 += NT) {
        __syncthreads();  // LUT written / previous chunk done with xs and res
        for (int idx = threadIdx.x; idx < KW * 32 * NT; idx += blockDim.x) {
            const int t = idx % NT, c = idx / NT;
            float v = 0.f;
            if (t0 + t < n) {
                const int s = start + t0 + t;
                const long long row = MODE == 0 ? sorted_slot[s] / top_k : s;
                v = act_to_float<BF16>(x[row * cols + c0 + c]);
            }
            xs[(c & 31) * xstride + (c >> 5) * NT + t] = v;
        }
        __syncthreads();
        for (int base = 0; base < rows_w; base += num_groups) {
            const int lw = base + group;
            bool valid = false;
            const int row = lw < rows_w ? weight_row<MODE>(lw, r0, rpc, rows_out, &valid) : 0;
            float acc[NT];
#pragma unroll
            for (int t = 0; t < NT; ++t) acc[t] = 0.f;
            if (valid && !bad_bits) {
                const long long word0 = (long long)row * words_per_row + c0 / 32;
                const float* lut_row = lut_s + lw * lut_stride;
                switch (blk.bits) {
                    case 3: dot_row<3, NT, LPR>(blk, word0, KW, lane, lut_row, xs, xstride, acc); break;
                    case 4: dot_row<4, NT, LPR>(blk, word0, KW, lane, lut_row, xs, xstride, acc); break;
                    case 5: dot_row<5, NT, LPR>(blk, word0, KW, lane, lut_row, xs, xstride, acc); break;
                    case 6: dot_row<6, NT, LPR>(blk, word0, KW, lane, lut_row, xs, xstride, acc); break;
                    case 7: dot_row<7, NT, LPR>(blk, word0, KW, lane, lut_row, xs, xstride, acc); break;
                    default: dot_row<8, NT, LPR>(blk, word0, KW, lane, lut_row, xs, xstride, acc); break;
                }
            }
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int off = LPR / 2; off > 0; off >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], off);
            if (lane == 0 && lw < rows_w)
#pragma unroll
                for (int t = 0; t < NT; ++t) res[lw * NT + t] = bad_bits ? __int_as_float(0x7fc00000) : acc[t];
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < nr * NT; idx += blockDim.x) {
            const int lr = idx / NT, t = idx % NT;
            if (t0 + t >= n) continue;
            const int s = start + t0 + t;
            if (MODE == 0) {
                const float g = res[lr * NT + t], u = res[(rpc + lr) * NT + t];
                h_out[(long long)s * rows_out + r0 + lr] = float_to_act<BF16>(g / (1.f + __expf(-g)) * u);
            } else {
                y_out[((long long)blockIdx.z * num_slots + sorted_slot[s]) * rows_out + r0 + lr] = res[lr * NT + t];
            }
        }
    }
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
template <int B>
__device__ __forceinline__ void dequant_word(const u32 (&pw)[8], const u16* __restrict__ lut_row, u16* dst) {
    u32 o[8];
    planes_to_codes<B>(pw, o);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        u32 v[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int i = q * 8 + 2 * m;
            v[m] = (u32)lut_row[code_of<B>(o, i)] | ((u32)lut_row[code_of<B>(o, i + 1)] << 16);
        }
        *reinterpret_cast<uint4*>(dst + q * 8) = make_uint4(v[0], v[1], v[2], v[3]);
    }
}

// Grid (row tiles of 64 weight rows, active experts, m-tile groups), 256 threads (8 warps).
// MODE 0: the 64 weight rows are 32 gate rows and their 32 up rows (h columns r0..r0+31).
template <int MT, int MODE, bool BF16>
__global__ void __launch_bounds__(256) apl_prefill(
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
    const BlockRef blk = load_block(desc, e);
    const int rpc = MODE == 0 ? PF_ROWS / 2 : PF_ROWS;
    const int r0 = blockIdx.x * rpc;
    const int lut_stride = 1 << lut_log2;
    const bool bad_bits = blk.bits < 3 || blk.bits > lut_log2;
    const int words_per_row = cols / 32;
    u16* lut_s = reinterpret_cast<u16*>(smem_raw);  // [64][lut_stride] act values
    u16* ws = lut_s + PF_ROWS * lut_stride;          // [64][PF_SP]
    u16* xs = ws + PF_ROWS * PF_SP;                   // [MT][PF_SP]
    float* cs = reinterpret_cast<float*>(ws);         // epilogue [MT][PF_CS], reuses ws/xs

    if (!bad_bits) {
        const int nent = 1 << blk.bits;
        for (int idx = threadIdx.x; idx < PF_ROWS * nent; idx += blockDim.x) {
            const int lw = idx >> blk.bits, ent = idx & (nent - 1);
            bool valid;
            const int row = weight_row<MODE>(lw, r0, rpc, rows_out, &valid);
            lut_s[lw * lut_stride + ent] = valid ? lut_to_act<BF16>(blk.lut[(long long)row * nent + ent]) : (u16)0;
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
                const u16* lut_row = lut_s + dq_row * lut_stride;
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
                h_out[(long long)s * rows_out + r0 + c] = float_to_act<BF16>(v / (1.f + __expf(-v)) * u);
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
