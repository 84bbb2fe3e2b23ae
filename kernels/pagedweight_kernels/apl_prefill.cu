// The prefill regime of the fused MoE (apl_moe.cu's launches 2 and 3 above apl_gemv.cu's tiles
// regime where the staged regime does not run: GPUs other than Hopper, and `regime="prefill"`).
// Compiled after apl_gemv.cu (its row tables: RowLut, dequant_chunks). Each CTA dequantises a
// 64-row x 128-column weight tile into shared memory from its rows' register tables (every width
// from registers: no table in shared memory) and runs bf16/fp16 mma.sync (m16n8k16, fp32 accum)
// over a tile of MT tokens.

#define PF_ROWS 64            // weight rows per CTA
#define PF_KS 128             // columns per K step (4 plane words per row)
#define PF_SP (PF_KS + 8)     // padded shared row stride (u16): conflict-free fragment loads
#define PF_CS (PF_ROWS + 4)   // fp32 epilogue row stride

// MODE 0: the 64 weight rows are 32 gate rows and their 32 up rows (h columns r0..r0+31).
// The CTA's work at B bits (bad_bits: a block the launch cannot read, whose rows come out NaN).
template <int MT, int MODE, bool BF16, int B>
__device__ __forceinline__ void prefill_cta(
    const BlockRef& blk, bool bad_bits, const int* __restrict__ active, const int* __restrict__ sorted_slot, int top_k,
    const u16* __restrict__ x, int rows_out, int cols, u16* __restrict__ h_out, float* __restrict__ y_out,
    unsigned char* smem) {
    constexpr int MTILES = MT / 16, WARPS_N = 8 / MTILES, NRANGE = PF_ROWS / WARPS_N, NN8 = NRANGE / 8;
    constexpr int XV = MT * (PF_KS / 8) / 256;  // uint4 of x per thread per K step
    const int a = blockIdx.y;
    const int start = active[3 * a + 1], n = active[3 * a + 2];
    const int rpc = MODE == 0 ? PF_ROWS / 2 : PF_ROWS;
    const int r0 = blockIdx.x * rpc;
    const int words_per_row = cols / 32;
    u16* ws = reinterpret_cast<u16*>(smem);          // [64][PF_SP]
    u16* xs = ws + PF_ROWS * PF_SP;                   // [MT][PF_SP]
    float* cs = reinterpret_cast<float*>(ws);         // epilogue [MT][PF_CS], reuses ws/xs

    // This thread dequantises plane word dq_word of weight row dq_row in every K step.
    const int dq_row = threadIdx.x >> 2, dq_word = threadIdx.x & 3;
    bool dq_valid;
    const int dq_wrow = weight_row<MODE>(dq_row, r0, rpc, rows_out, &dq_valid);
    dq_valid = dq_valid && !bad_bits;
    RowLut<B, BF16> lut;  // the row's tables, held for every K step
    lut.load(blk.lut + (long long)dq_wrow * lut_row_entries(B), dq_valid, BF16);
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
                pw[p] = (ok && p < B) ? __ldg(blk.planes[p] + (long long)dq_wrow * words_per_row + word) : 0u;
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
            __syncthreads();  // the previous step's mma done with ws and xs
            u16* dst = ws + dq_row * PF_SP + dq_word * 32;
            if (dq_valid && k0 / 32 + dq_word < words_per_row) {
                uint4 chunk[4];
                dequant_chunks<B, BF16>(lut, pw, chunk);
#pragma unroll
                for (int q = 0; q < 4; ++q) *reinterpret_cast<uint4*>(dst + q * 8) = chunk[q];
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

// Grid (row tiles of 64 weight rows, active experts, m-tile groups), 256 threads (8 warps).
// lut_log2: the launch's widest bits; a block above them (or outside 3..8) gives NaN rows.
template <int MT, int MODE, bool BF16>
__global__ void __launch_bounds__(256, 1) apl_prefill(
    const long long* __restrict__ desc, const int* __restrict__ active,
    const int* __restrict__ num_active, const int* __restrict__ sorted_slot, int top_k,
    const u16* __restrict__ x, int rows_out, int cols, int lut_log2,
    u16* __restrict__ h_out, float* __restrict__ y_out) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int a = blockIdx.y;
    if (a >= *num_active) return;
    const int e = active[3 * a], n = active[3 * a + 2];
    if ((int)blockIdx.z * MT >= n) return;
    unsigned char* smem = aligned_smem(smem_raw);
    const BlockRef blk = load_block(desc, e);
    const bool bad_bits = blk.bits < 3 || blk.bits > lut_log2;
    switch (bad_bits ? 3 : blk.bits) {
        case 3: prefill_cta<MT, MODE, BF16, 3>(blk, bad_bits, active, sorted_slot, top_k, x, rows_out, cols, h_out, y_out, smem); break;
        case 4: prefill_cta<MT, MODE, BF16, 4>(blk, bad_bits, active, sorted_slot, top_k, x, rows_out, cols, h_out, y_out, smem); break;
        case 5: prefill_cta<MT, MODE, BF16, 5>(blk, bad_bits, active, sorted_slot, top_k, x, rows_out, cols, h_out, y_out, smem); break;
        case 6: prefill_cta<MT, MODE, BF16, 6>(blk, bad_bits, active, sorted_slot, top_k, x, rows_out, cols, h_out, y_out, smem); break;
        case 7: prefill_cta<MT, MODE, BF16, 7>(blk, bad_bits, active, sorted_slot, top_k, x, rows_out, cols, h_out, y_out, smem); break;
        default: prefill_cta<MT, MODE, BF16, 8>(blk, bad_bits, active, sorted_slot, top_k, x, rows_out, cols, h_out, y_out, smem); break;
    }
}
