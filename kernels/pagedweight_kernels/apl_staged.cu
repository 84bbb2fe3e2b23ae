// The staged regime (sm_90a only, compiled after
// apl_moe.cu and apl_gemv.cu and using their helpers): a producer warpgroup dequantises plane
// tiles into a ring of shared-memory buffers while a consumer warpgroup runs wgmma with both
// operands in shared memory.
//
// One projection for every active expert, launched like apl_prefill (the four-launch path:
// moe_align, gate_up, down, moe_combine) and with its arguments plus the ring's depth:
// grid (row tiles of ST_ROWS weight rows, active experts, token-pass groups), staged_threads threads.
//   warps 0-3 (the consumer warpgroup): per 64-column step, wait for the step's buffer, 4 k16
//     slices x 2 wgmma.m64nNk16 (weight rows 0-63 and 64-127, N = the pass's 8 * NT8 tokens), then
//     hand the previous step's buffer back; after a pass, the epilogue from the accumulators
//     (act(gate) * up into h for gate_up, whose rows 0-63 are gate rows and 64-127 the same up
//     rows; fp32 rows of y for down).
//   warps 4-7 (the producer warpgroup; 4-11 for the 5-8-bit and merged classes, two of them): thread
//     i of a warpgroup owns weight row i of the CTA. Per step it waits for a free buffer (thread 0
//     then has TMA copy the pass's activations for the step into it, counted on the buffer's mbarrier
//     in bytes), dequantises its row's 64 weights from plane words copied ahead by cp.async into its
//     slots of a plane ring in shared memory, stores them in the wgmma layout, fences and arrives.
//     A 3-4-bit row's LUT lives in registers (RegLut: PRMT lookups); a 5-8-bit row's 16 cells in
//     the thread's column of its warpgroup's shared-memory cell table (CellTab: one conflict-free
//     LDS a weight, then one FMA per two).
// Each weight is dequantised once per pass of 8 * NT8 tokens; a hotter expert takes more passes
// (the step counter runs on across passes, so the ring's phases stay in step). Outputs are written
// by position, so reruns are bit-identical; blocks whose bits the class does not hold produce NaN.
//
// The same source runs on the CPU (tests/kernels/apl_host.h, staged_host.py): the functions below are
// APL_HD, with host branches for their PTX, and staged_cta is the kernel's body, so a whole launch
// runs with its threads as host threads, checked against torch (tests/kernels/test_staged_host_cpu.py).

#define ST_ROWS 128            // weight rows per CTA (two m64 wgmma per k16 slice)
#define ST_KS 64               // columns per step (4 k16 slices)
#define ST_MAX_STAGES 8
#define ST_A_BYTES (ST_ROWS * ST_KS * 2)
// CTAs an SM a class's instances are compiled for. The 3-4-bit class: 2 (128 registers a thread,
// split between the warpgroups by setmaxnreg). The 5-8-bit and merged classes: 1 (up to 255
// registers a thread, no split), which leaves a CTA more ring buffers than two CTAs have.
template <int CLS> APL_HD constexpr int staged_blocks() { return CLS == 0 ? 2 : 1; }
// Producer warpgroups a CTA: the 3-4-bit class 1 (two CTAs an SM, setmaxnreg). The others 2, each
// taking every other unit of steps (each step still filled by one warpgroup, so the barriers count
// 128 arrivals), every thread under the launch bound's 168 registers: at one CTA an SM a single
// producer warpgroup leaves the SM short of eligible warps (docs/kernel.md, "What bounds it").
template <int CLS> APL_HD constexpr int staged_producers() { return CLS == 0 ? 1 : 2; }
// A CTA's threads: the consumer warpgroup, then the producer warpgroups.
template <int CLS> APL_HD constexpr int staged_threads() { return 128 * (1 + staged_producers<CLS>()); }
// The dynamic shared memory starts on this boundary (the host's staged_align_pad): the ring comes
// first, and a 128-byte-swizzled B tile, as TMA writes it, needs 1024 bytes.
#define ST_ALIGN 1024u
// The 5-8-bit and merged classes' cell tables come first instead, from a 2 KB boundary (CellTab's):
// one a producer warpgroup (a column of 16 cells for each of its 128 rows), so no thread reads a
// word another writes; the ring follows on a 1024-byte boundary. The host's staged_cell_tables.
#define ST_CELL_BYTES (ST_ROWS * 16 * 4)

// The activations' tensor map, a kernel parameter (__grid_constant__, so that its address is the
// parameter's own, as cp.async.bulk.tensor needs): on the device a CUtensorMap's 128 bytes, encoded
// by the host (tensor_maps.py); the host's CTA emulation keeps its own fields in the same bytes
// (apl_host.h, host_tma_load_rows).
struct __align__(64) StagedTensorMap { unsigned long long word[16]; };

// The producer's dequantisation and the operand layout, for the device and for the host (APL_HD:
// tests/kernels/staged_host.py runs them on the CPU, and its test reads the tiles back by the PTX ISA's layout).

// 16-byte chunk c (columns 8c..8c+7) of row r of a [rows x 64] operand tile in the no-swizzle
// K-major layout wgmma_desc describes: k16 slice c / 2 holds rows / 8 pairs of 128-byte core
// matrices (8 rows x 8 columns), the pair's second matrix the slice's columns 8-15. A warp's 8
// consecutive rows store 128 contiguous bytes: no bank conflicts.
APL_HD u32 tile_chunk(u32 base, int rows, int r, int c) {
    return base + (u32)((c >> 1) * (rows * 32) + (r >> 3) * 256 + (c & 1) * 128 + (r & 7) * 16);
}
APL_HD void st_shared_v4(u32 addr, const uint4& v) {
#ifdef __CUDA_ARCH__
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
    host_sts_v4(addr, v);
#endif
}
// A producer thread's row tables at B bits: RegLut's entries up to 4 bits, above them the row's
// column of its warpgroup's cell table (`column`).
template <int B, bool BF16>
APL_HD auto staged_row_lut(u32 column) {
    if constexpr (B <= 4) return RegLut<B>{};
    else return CellTab<B, BF16>(column);
}
// Row pt's 64 weights of one step into the step's A tile (at a_tile): words 2 * half and
// 2 * half + 1 of a unit's plane words (W a plane), dequantised from the row's tables
// (staged_row_lut) and stored in the wgmma layout.
template <int B, int W, bool BF16, class Lut>
APL_HD void stage_weights(const Lut& lut, const u32 (&unit)[B][W], int half, u32 a_tile, int pt) {
#pragma unroll
    for (int wi = 0; wi < 2; ++wi) {
        u32 pw[8];
#pragma unroll
        for (int p = 0; p < 8; ++p) pw[p] = p < B ? unit[p < B ? p : 0][2 * half + wi] : 0u;
        uint4 chunk[4];
        dequant_chunks<B, BF16>(lut, pw, chunk);
#pragma unroll
        for (int j = 0; j < 4; ++j) st_shared_v4(tile_chunk(a_tile, ST_ROWS, pt, 4 * wi + j), chunk[j]);
    }
}

// The kernel itself: for sm_90a, and for the host's CTA emulation (apl_host.h's APL_HOST_CTA: the
// CPU test runs staged_cta's threads as host threads, wgmma by the PTX ISA's definition).
#if APL_HAS_WGMMA || APL_HOST_CTA
// The CTA's barrier (its `threads`).
APL_HD void cta_barrier(int threads) {
#ifdef __CUDA_ARCH__
    __syncthreads();
#else
    host_bar_sync(0, (unsigned)threads);
#endif
}

// mbarriers (try_wait.parity): the hand-overs between the producer and consumer warpgroups.
// arrive releases and a completed wait acquires at CTA scope, so shared memory written before an
// arrive is visible to the threads whose wait that arrive completed.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ void mbar_init(unsigned long long* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(shared_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}" :: "r"(shared_addr(bar)) : "memory");
}
// Waits until the phase of this parity has completed (parity 0: the barrier's first phase).
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, u32 parity) {
    asm volatile("{\n.reg .pred done;\nMBAR_WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra MBAR_WAIT_%=;\n}" :: "r"(shared_addr(bar)), "r"(parity) : "memory");
}
#else  // the host's CTA emulation (tests/kernels/apl_host.h)
__host__ __forceinline__ void mbar_init(unsigned long long* bar, u32 count) { host_mbar_init(shared_addr(bar), count); }
__host__ __forceinline__ void mbar_arrive(unsigned long long* bar) { host_mbar_arrive(shared_addr(bar)); }
__host__ __forceinline__ void mbar_wait(unsigned long long* bar, u32 parity) { host_mbar_wait(shared_addr(bar), parity); }
#endif

// acc += A (64 rows at da) x B (8 * N8 tokens at db), one k16 slice, both from shared memory.
// (the m64n128 fragment: apl_gemv.cu's APL_D48 and APL_ACC48 and 16 more)
#define APL_D64 APL_D48 ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define APL_ACC64 APL_ACC48, APL_ACC4(12), APL_ACC4(13), APL_ACC4(14), APL_ACC4(15)
#define APL_WGMMA_SS(SHAPE, TY, D, DA, DB, SCALE, ...)                                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." \
                 TY "." TY " {" D "}, " DA ", " DB ", p, 1, 1, 0, 0;\n}"                                      \
                 : __VA_ARGS__ : "l"(da), "l"(db), "r"(1) : "memory")
#define APL_WGMMA_SS_ACT(SHAPE, ...) \
    if constexpr (BF16) APL_WGMMA_SS(SHAPE, "bf16", __VA_ARGS__); else APL_WGMMA_SS(SHAPE, "f16", __VA_ARGS__)
template <int N8, bool BF16>
APL_HD void wgmma_ss(float (&acc)[N8][4], unsigned long long da, unsigned long long db) {
#ifndef __CUDA_ARCH__
    host_wgmma_ss<N8, BF16>(acc, da, db);
#else
    if constexpr (N8 == 2) { APL_WGMMA_SS_ACT("m64n16k16", APL_D8, "%8", "%9", "%10", APL_ACC8); }
    else if constexpr (N8 == 4) { APL_WGMMA_SS_ACT("m64n32k16", APL_D16, "%16", "%17", "%18", APL_ACC16); }
    else if constexpr (N8 == 8) { APL_WGMMA_SS_ACT("m64n64k16", APL_D32, "%32", "%33", "%34", APL_ACC32); }
    else if constexpr (N8 == 12) { APL_WGMMA_SS_ACT("m64n96k16", APL_D48, "%48", "%49", "%50", APL_ACC48); }
    else if constexpr (N8 == 16) { APL_WGMMA_SS_ACT("m64n128k16", APL_D64, "%64", "%65", "%66", APL_ACC64); }
#endif
}

// What both warpgroups know of the CTA's work.
struct StagedWork {
    int expert_start, n;      // the expert's first sorted position and its token count
    int r0, rows_out, cols;   // first output row (h column for gate_up), projection sizes
    int steps, stages;        // 64-column steps per pass, ring depth
    u32 ring;                 // shared address of buffer 0 (A tile, then B tile)
    u32 cells;                // shared address of the first producer warpgroup's cell table (5-8 bits)
    unsigned long long* full;
    unsigned long long* empty;
};

template <int NT8>
APL_HD u32 stage_a(const StagedWork& w, int slot) {
    return w.ring + (u32)slot * (ST_A_BYTES + NT8 * 8 * ST_KS * 2);
}

// Waits for phase `phase` (counted from the barrier's init) of an mbarrier to complete, by its parity. A
// parity wait cannot tell phase k from k +- 2: issued before phase k - 1 completed it returns at once, issued
// after k + 1 completed it waits a lap. The host's CTA emulation checks that neither is the case.
APL_HD void mbar_wait_phase(unsigned long long* bar, u32 phase) {
#ifndef __CUDA_ARCH__
    host_mbar_check_phase(shared_addr(bar), phase);
#endif
    mbar_wait(bar, phase & 1u);
}

// The B operand's descriptor for a TMA-written tile: K-major with the 128-byte
// swizzle, a token's 64 columns in one 128-byte row, 8-token groups 1024 bytes apart (stride byte
// offset; the leading one is unused in this mode), the k16 slice chosen by the start address (+32
// bytes a slice: the swizzle applies to the address the tensor cores form, as TMA applied it).
APL_HD unsigned long long wgmma_desc_sw128(u32 smem_addr) {
    return (unsigned long long)((smem_addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}
// The full barrier also waits for `bytes` more of asynchronous copies in this phase.
APL_HD void mbar_expect_tx(unsigned long long* bar, u32 bytes) {
#ifdef __CUDA_ARCH__
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" :: "r"(shared_addr(bar)), "r"(bytes) : "memory");
#else
    host_mbar_expect_tx(shared_addr(bar), bytes);
#endif
}
// One box of the map (its 8 * NT8 rows from `row`, 64 columns from `col`; zeros past the tensor's
// edges) into shared memory at dst, swizzled; its bytes complete on bar.
APL_HD void tma_load_rows(u32 dst, const StagedTensorMap& map, int col, int row, unsigned long long* bar) {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(col), "r"(row), "r"(shared_addr(bar))
                 : "memory");
#else
    host_tma_load_rows(dst, map.word, col, row, shared_addr(bar));
#endif
}

// A producer warpgroup: its thread pt owns weight row pt of the CTA. NP producer warpgroups
// (staged_producers): warpgroup wg fills the steps of every NP-th unit (2 steps) of the CTA's passes,
// from unit wg.
// The plane words come by cp.async into the thread's slots of a plane ring in shared memory (past the
// ring buffers; staged_plan counts it) and are read back by LDS when used. Each step ends in
// fence.proxy.async, which compiles to MEMBAR.ALL.CTA and so would drain plane-word loads in flight
// to registers every step; cp.async copies complete by wait_group and the fence need not wait for them.
// Each step's activations come by one TMA copy from a tensor map over rows by sorted position (down:
// h itself; gate_up: x gathered into that order by moe_gather_rows first), into B tiles in the
// 128-byte-swizzled K-major layout the consumers' descriptors name (16-byte cp.async copies by the
// producers would each cost a whole L2 sector and a shared-memory wavefront a lane).
template <int B, int MODE, bool BF16, bool V4, int NT8, int NP>
APL_HD void staged_produce(const BlockRef& blk, const StagedWork& w, const StagedTensorMap& act_map) {
    // P: units in flight, each in a slot of the thread's plane ring: 3-4-bit rows 2; 5-8-bit rows 1 (8
    // planes' words a unit; a second unit would leave room for 3 ring buffers, not 4).
    constexpr int NT = 8 * NT8, P = B <= 4 ? 2 : 1;
    const int wg = (threadIdx.x - 128) / 128, pt = (threadIdx.x - 128) % 128;
    const int rpc = MODE == 0 ? ST_ROWS / 2 : ST_ROWS;
    bool valid;
    int wrow = weight_row<MODE>(pt, w.r0, rpc, w.rows_out, &valid);
    if (!valid) wrow = 0;  // (loads stay in bounds; the epilogue writes nothing for the row)
    // A unit: 2 steps, 4 words of every plane (16 bytes a plane and row: half a 32-byte sector, the
    // other half a unit later).
    constexpr int U = 2, W = 2 * U;
    const int wpr = w.cols / 32, units = (w.steps + U - 1) / U;
    int first = 0, mine = 0;  // this pass's units of this warpgroup: j < mine -> unit first + NP j
    const u32* row_planes[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) row_planes[p] = blk.planes[p] + (long long)wrow * wpr;
    // (a 5-8-bit row's column: its warpgroup's table, warp pt / 32's 2 KB, lane pt % 32's bank)
    auto rlut = staged_row_lut<B, BF16>(w.cells + (u32)wg * ST_CELL_BYTES + ((u32)(pt >> 5) << 11 | (u32)(pt & 31) << 2));
    rlut.load(blk.lut + (long long)wrow * lut_row_entries(B), true, BF16);
    // Unit u = steps Uu..Uu+U-1 = words Wu..Wu+W-1 of the row in every plane (4-byte copies clamped
    // into the row: columns past the end meet zero activations). The warpgroup's unit j's words land
    // in slot j % P of the thread's plane ring ([slot][plane][producer thread][W words]), one commit
    // group a unit; past its last unit the group is empty, so no copy is ever in flight to a slot
    // that is being read or refilled.
    const u32 plane_ring = stage_a<NT8>(w, w.stages) + (u32)(threadIdx.x - 128) * (W * 4);
    auto plane_slot = [&](int d, int p) { return plane_ring + (u32)((d * B + p) * NP * ST_ROWS * W * 4); };
    auto issue_unit = [&](int d, int j) {
        if (j < mine) {
            const int w0 = W * (first + NP * j);
#pragma unroll
            for (int p = 0; p < B; ++p) {
                if constexpr (V4) {
                    cp_async16(plane_slot(d, p), row_planes[p] + w0, 16u);
                } else {
#pragma unroll
                    for (int i = 0; i < W; ++i) cp_async4(plane_slot(d, p) + 4 * i, row_planes[p] + min(w0 + i, wpr - 1));
                }
            }
        }
        cp_async_commit();
    };
    for (int m0 = blockIdx.z * NT, pass = 0; m0 < w.n; m0 += gridDim.z * NT, ++pass) {
        const u32 pass_it = (u32)pass * (u32)w.steps;  // the ring's steps before this pass (consumers take each in order)
        // the units of all the CTA's passes in one sequence, dealt round the warpgroups: a warpgroup's next
        // step is then at most U (NP - 1) + 1 steps on from its last, also across a pass's end, and a
        // ring of as many buffers (staged_plan) keeps its parity waits one phase from the barrier's
        first = (wg + NP - (int)((long long)pass * units % NP)) % NP;
        mine = units > first ? (units - first + NP - 1) / NP : 0;
#pragma unroll
        for (int d = 0; d < P; ++d) issue_unit(d, d);
        for (int j0 = 0; j0 < mine; j0 += P) {
#pragma unroll
            for (int d = 0; d < P; ++d) {
                const int j = j0 + d, u = first + NP * j;
                if (j >= mine) break;
                cp_async_wait<P - 1>();  // unit j's group has landed (the P - 1 after it need not)
                u32 words[B][W] = {};  // the unit's words of every plane, from the slot
#pragma unroll
                for (int half = 0; half < U; ++half) {  // (a unit's steps)
                    const int step = U * u + half;
                    if (step >= w.steps) break;
                    const u32 it = pass_it + (u32)step;
                    const int slot = (int)(it % (u32)w.stages);
                    const u32 use = it / (u32)w.stages;
                    if (use > 0) mbar_wait_phase(&w.empty[slot], use - 1);
                    const u32 a_tile = stage_a<NT8>(w, slot), b_tile = a_tile + ST_A_BYTES;
                    // Rows past the expert's count are the next expert's (or zeros past the tensor):
                    // wgmma keeps token columns apart and the epilogue skips them. Columns past the
                    // row's end come as zeros (they meet the clamped weights).
                    if (pt == 0) {
                        mbar_expect_tx(&w.full[slot], NT * ST_KS * 2);
                        tma_load_rows(b_tile, act_map, step * ST_KS, w.expert_start + m0, &w.full[slot]);
                    }
                    // one LDS.128 a plane for the unit's two steps: a warp's 32 x 16 contiguous bytes
                    // take 4 wavefronts, an LDS.64 a step would take 4 each (tests/kernels/staged_host.py, bank_counts)
                    if (half == 0) {
#pragma unroll
                        for (int p = 0; p < B; ++p) {
                            const uint4 v = lds_v4(plane_slot(d, p));
                            words[p][0] = v.x;
                            words[p][1] = v.y;
                            words[p][2] = v.z;
                            words[p][3] = v.w;
                        }
                    }
                    stage_weights<B, W, BF16>(rlut, words, half, a_tile, pt);
                    // the stores, before wgmma (the async proxy) reads them: the writing thread fences,
                    // then arrives (the PTX ISA's proxy fences take effect within the executing thread)
                    fence_proxy_async();
                    mbar_arrive(&w.full[slot]);
                }
                issue_unit(d, j + P);
            }
        }
    }
}

// The consumer warpgroup: the pass's wgmma over the ring, then the epilogue.
template <int MODE, bool BF16, int NT8>
APL_HD void staged_consume(const StagedWork& w, bool bad, const int* __restrict__ sorted_slot, u16* __restrict__ h_out,
                           float* __restrict__ y_out) {
    constexpr int NT = 8 * NT8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    u32 it = 0;
    for (int m0 = blockIdx.z * NT; m0 < w.n; m0 += gridDim.z * NT) {
        float acc0[NT8][4], acc1[NT8][4];
#pragma unroll
        for (int j = 0; j < NT8; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc0[j][i] = acc1[j][i] = 0.f;
        if (!bad) {
            int prev = -1;
            for (int step = 0; step < w.steps; ++step, ++it) {
                const int slot = (int)(it % (u32)w.stages);
                mbar_wait_phase(&w.full[slot], it / (u32)w.stages);
                fence_proxy_async();  // the producers' stores, before wgmma reads them
                const u32 a_tile = stage_a<NT8>(w, slot), b_tile = a_tile + ST_A_BYTES;
                wgmma_fence();
                fence_accumulators(acc0);
                fence_accumulators(acc1);
#pragma unroll
                for (int kk = 0; kk < ST_KS / 16; ++kk) {
                    const unsigned long long db = wgmma_desc_sw128(b_tile + kk * 32);
                    wgmma_ss<NT8, BF16>(acc0, wgmma_desc(a_tile + kk * (ST_ROWS * 32)), db);
                    wgmma_ss<NT8, BF16>(acc1, wgmma_desc(a_tile + kk * (ST_ROWS * 32) + 2048), db);
                }
                wgmma_commit();
                fence_accumulators(acc0);
                fence_accumulators(acc1);
                wgmma_wait<1>();  // the previous step's wgmma are done with its buffer
                if (prev >= 0) mbar_arrive(&w.empty[prev]);
                prev = slot;
            }
            wgmma_wait<0>();
            fence_accumulators(acc0);
            fence_accumulators(acc1);
            if (prev >= 0) mbar_arrive(&w.empty[prev]);
        }
        const float nan = quiet_nan();
#pragma unroll
        for (int j = 0; j < NT8; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int tok = 8 * j + 2 * t4 + (i & 1), row = 16 * warp + g + 8 * (i >> 1);
                if (m0 + tok >= w.n) continue;
                const int s = w.expert_start + m0 + tok;
                if (MODE == 0) {
                    if (w.r0 + row >= w.rows_out) continue;
                    const float v = bad ? nan : gate_act(acc0[j][i]) * acc1[j][i];
                    h_out[(long long)s * w.rows_out + w.r0 + row] = float_to_act<BF16>(v);
                } else {
                    const long long base = (long long)sorted_slot[s] * w.rows_out + w.r0;
                    if (w.r0 + row < w.rows_out) y_out[base + row] = bad ? nan : acc0[j][i];
                    if (w.r0 + 64 + row < w.rows_out) y_out[base + 64 + row] = bad ? nan : acc1[j][i];
                }
            }
        }
    }
}

// The 3-4-bit class's warpgroups' register budgets (setmaxnreg; 2 CTAs of 256 threads share 64K
// registers, so consumer + producer <= 256): the consumer holds 2 x 4 NT8 accumulators, the producer a row's
// LUT, plane words in flight and a word's codes and chunks.
template <int NT8> struct StagedRegs {
    static constexpr int consumer = NT8 == 16 ? 168 : NT8 == 12 ? 136 : NT8 == 8 ? 96 : 80;
    static constexpr int producer = 256 - consumer;
};
// This warpgroup's registers to N from the launch bound's 128 (up or down; a no-op at 128).
template <int N> APL_HD void set_warpgroup_registers() {
#ifdef __CUDA_ARCH__
    if constexpr (N > 128) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N));
    else if constexpr (N < 128) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N));
#endif
}

// The CTA's work: the kernel's body (bars: 2 * ST_MAX_STAGES mbarriers, smem_raw: the dynamic
// shared memory), a function of its own so that the host's CTA emulation can run it.
template <int CLS, int MODE, bool BF16, bool V4, int NT8>
APL_HD void staged_cta(const long long* __restrict__ desc, const int* __restrict__ active, const int* __restrict__ num_active,
                       const int* __restrict__ sorted_slot, int top_k, const u16* __restrict__ x, int rows_out, int cols,
                       int lut_log2, u16* __restrict__ h_out, float* __restrict__ y_out, int stages,
                       const StagedTensorMap& act_map, unsigned long long* bars, unsigned char* smem_raw) {
    static_assert(NT8 == 2 || NT8 == 4 || NT8 == 8 || NT8 == 12 || NT8 == 16, "passes of 16, 32, 64, 96 or 128 tokens");
    const int a = blockIdx.y;
    if (a >= *num_active) return;
    const int e = active[3 * a];
    StagedWork w;
    w.expert_start = active[3 * a + 1];
    w.n = active[3 * a + 2];
    if ((int)blockIdx.z * 8 * NT8 >= w.n) return;
    const BlockRef blk = load_block(desc, e);
    const int lo = CLS == 1 ? 5 : 3, hi = CLS == 0 ? 4 : 8;
    const bool bad = blk.bits < lo || blk.bits > hi || (blk.bits >= 5 && blk.bits > lut_log2);
    w.r0 = blockIdx.x * (MODE == 0 ? ST_ROWS / 2 : ST_ROWS);
    w.rows_out = rows_out;
    w.cols = cols;
    w.steps = (cols + ST_KS - 1) / ST_KS;
    w.stages = stages;
    w.full = bars;
    w.empty = bars + ST_MAX_STAGES;
    // Dynamic shared memory from an ST_ALIGN boundary (the host's staged_align_pad), the cell tables'
    // 2 KB for the classes holding 5-8-bit rows, whose tables come first: the ring's B tiles on a
    // swizzled tile's 1024 (ring buffers and tables are multiples of it).
    constexpr u32 ALIGN = CLS == 0 ? ST_ALIGN : CELL_TAB_ALIGN;
    const u32 base = (shared_addr(smem_raw) + (ALIGN - 1u)) & ~(ALIGN - 1u);
    w.cells = base;
    w.ring = base + (CLS == 0 ? 0u : (u32)staged_producers<CLS>() * ST_CELL_BYTES);
    if (threadIdx.x == 0) {
        for (int i = 0; i < stages; ++i) {
            mbar_init(&w.full[i], 128);   // the producers' arrivals (and the TMA copy's bytes)
            mbar_init(&w.empty[i], 128);  // the consumers'
        }
    }
    cta_barrier(staged_threads<CLS>());
    if (threadIdx.x < 128) {
        if constexpr (staged_blocks<CLS>() == 2) set_warpgroup_registers<StagedRegs<NT8>::consumer>();
        staged_consume<MODE, BF16, NT8>(w, bad, sorted_slot, h_out, y_out);
        return;
    }
    if constexpr (staged_blocks<CLS>() == 2) set_warpgroup_registers<StagedRegs<NT8>::producer>();
    if (bad) return;
    constexpr int NP = staged_producers<CLS>();
    switch (blk.bits) {
        case 3: if constexpr (CLS != 1) staged_produce<3, MODE, BF16, V4, NT8, NP>(blk, w, act_map); break;
        case 4: if constexpr (CLS != 1) staged_produce<4, MODE, BF16, V4, NT8, NP>(blk, w, act_map); break;
        case 5: if constexpr (CLS != 0) staged_produce<5, MODE, BF16, V4, NT8, NP>(blk, w, act_map); break;
        case 6: if constexpr (CLS != 0) staged_produce<6, MODE, BF16, V4, NT8, NP>(blk, w, act_map); break;
        case 7: if constexpr (CLS != 0) staged_produce<7, MODE, BF16, V4, NT8, NP>(blk, w, act_map); break;
        default: if constexpr (CLS != 0) staged_produce<8, MODE, BF16, V4, NT8, NP>(blk, w, act_map); break;
    }
}

// Kernel classes as apl_gemv's: CLS 0 3-4 bits, 1 5-8 bits, 2 any (the merged class). V4: every
// plane 16-byte aligned with a word count per row divisible by 4 (16-byte plane copies). The
// arguments are apl_prefill's and the tensor map's: the activations come through act_map, so x and
// top_k go unread.
template <int CLS, int MODE, bool BF16, bool V4, int NT8>
__global__ void __launch_bounds__(staged_threads<CLS>(), staged_blocks<CLS>()) apl_staged(
    const long long* __restrict__ desc, const int* __restrict__ active, const int* __restrict__ num_active,
    const int* __restrict__ sorted_slot, int top_k, const u16* __restrict__ x, int rows_out, int cols, int lut_log2,
    u16* __restrict__ h_out, float* __restrict__ y_out, int stages, const __grid_constant__ StagedTensorMap act_map) {
    __shared__ __align__(8) unsigned long long bars[2 * ST_MAX_STAGES];
    extern __shared__ __align__(16) unsigned char smem_raw[];
    staged_cta<CLS, MODE, BF16, V4, NT8>(desc, active, num_active, sorted_slot, top_k, x, rows_out, cols, lut_log2,
                                         h_out, y_out, stages, act_map, bars, smem_raw);
}
#endif
