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
//   warps 4-7 (the producer warpgroup): thread i owns weight row i of the CTA. Per step it waits
//     for a free buffer, copies the pass's activations for the step into it (cp.async, completion
//     tracked by the buffer's mbarrier), dequantises its row's 64 weights from plane words loaded
//     APL_STAGED_PREFETCH units (APL_STAGED_UNIT steps each) ahead in registers, stores them in the wgmma
//     layout and arrives. The row's tables live in registers (RowLut): 3-4 bits its LUT (RegLut:
//     PRMT lookups), 5-8 bits its cells' offsets and widths (CellLut: two lookups and one FMA).
// Each weight is dequantised once per pass of 8 * NT8 tokens; a hotter expert takes more passes
// (the step counter runs on across passes, so the ring's phases stay in step). Outputs are written
// by position, so reruns are bit-identical; blocks whose bits the class does not hold produce NaN.
//
// The same source runs on the CPU (apl_host.h, tests/kernels/staged_host.py): the functions below are
// APL_HD, with host branches for their PTX, and staged_cta is the kernel's body, so a whole launch
// runs with its threads as host threads, checked against torch (tests/kernels/test_staged_host_cpu.py).

#ifndef APL_STAGED_PREFETCH
#define APL_STAGED_PREFETCH 2  // units of plane words (APL_STAGED_UNIT steps each) a producer thread has in flight
#endif
// Steps a unit of plane words covers: 2 (16 bytes a plane and row, half a 32-byte sector, the other
// half a unit later) or 4 (the whole sector in one unit, twice the registers a unit: 3-4-bit rows
// with 16-byte plane loads in passes of up to 64 tokens only; the others spill at 4 and keep 2)
#ifndef APL_STAGED_UNIT
#define APL_STAGED_UNIT 2
#endif
// 1 (the default since 2026-12-05: 6-11% faster than 0 at the 4-bit layers timed; a second unit in
// registers bought nothing, as if the fence below drained it; docs/kernel.md):
// the 3-4-bit class's plane words come by cp.async into a ring of APL_STAGED_PREFETCH unit slots
// per producer thread in shared memory (past the CTA's ring buffers; staged_plan counts it) and are
// read back by LDS when used. Each step ends in fence.proxy.async, which compiles to MEMBAR.ALL.CTA:
// if that waits for the thread's loads in flight, the register prefetch (0) is drained every step,
// while cp.async copies complete by wait_group and the fence need not wait for them. (They also
// delay the step's full phase: cp.async.mbarrier.arrive counts every earlier copy of the thread.)
#ifndef APL_STAGED_PLANE_ASYNC
#define APL_STAGED_PLANE_ASYNC 1
#endif
// 1: the same for the 5-8-bit and merged classes (their plane ring sized for the launch's widest rows,
// past the LUT rows and ring buffers; staged_plane_ring_bytes). Nsight on Mixtral 256 tokens, 8 bits
// (2026-12-05): the producers' long-scoreboard waits on their plane words in registers
// were the largest stall after the consumers' barrier wait. 1 (the default since then; H100,
// docs/kernel.md): Mixtral 256 tokens 8 bits 1581.9 against 1751.8 us,
// Qwen1.5-MoE 256 tokens 668.6 against 742.9, mixed 1-3% faster; 3 units in the ring were slower.
#ifndef APL_STAGED_PLANE_ASYNC_LUT
#define APL_STAGED_PLANE_ASYNC_LUT 1
#endif
// 0: the producers skip their per-step fence.proxy.async (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S), and
// the consumers' fence after each full wait is the one proxy fence between the producers' stores and
// the wgmma that read them: about 3% faster at 8 bits, and not supported by the PTX ISA, whose
// proxy-preserved causality order has no case for a generic write read through the async proxy and
// whose proxy fences take effect within the executing thread. 1 (the default, and the only documented
// pattern, CUTLASS's and FlashAttention-3's): the writing thread fences, then synchronises. A variant
// to time only (docs/kernel.md, "A second producer warpgroup, and the producer fence settled").
#ifndef APL_STAGED_PRODUCER_FENCE
#define APL_STAGED_PRODUCER_FENCE 1
#endif
// 1 (2026-12-05): no copies for the token rows a pass holds past its expert's count
// (at Mixtral 256 tokens, passes of 96 for 46-82 tokens an expert: a third of the activation
// copies, which Nsight put at 46% of the kernel's shared-memory wavefronts; each 16-byte copy costs
// a wavefront even when it only writes zeros). 0: every row copied, zeros past the count.
#ifndef APL_STAGED_SKIP_PAD
#define APL_STAGED_SKIP_PAD 1
#endif
// 1 (2026-12-05; the 3-4-bit class, staged_tma): each step's activations come by one TMA copy (cp.async.bulk.tensor,
// issued by producer thread 0, completion counted on the buffer's full mbarrier in bytes) from a
// tensor map over rows by sorted position (down: h itself; gate_up: x gathered into that order by
// moe_gather_rows first), into B tiles in the 128-byte-swizzled K-major layout the consumers'
// descriptors then name. Nsight at Mixtral 256 tokens: the producers' 16-byte cp.async copies cost a
// whole L2 sector and a shared-memory wavefront per lane (32 a warp instruction, where their bytes
// need 16 and 4), 46% of the kernel's wavefronts. Measured on an H100 (bench/results/
// docs/kernel.md): 1.10-1.55x faster wherever the staged regime is taken (Mixtral 256
// tokens, 4 bits: 892.9 against 1223.4 us), bit for bit. 0: those copies, into the no-swizzle layout.
// 2 (the default since 2026-12-05): every class (the 5-8-bit and merged classes too,
// whose rings then start 1024-byte aligned; with their other knobs, H100, bench/results/
// docs/kernel.md: Mixtral 256 tokens 8 bits 2221.7 against 4084.4 us with the copies, where
// the alignment also left one CTA an SM with 4 ring buffers; at one CTA an SM either way, 0-11% faster).
#ifndef APL_STAGED_TMA
#define APL_STAGED_TMA 2
#endif
// Units of plane words a 5-8-bit producer thread has in flight in registers (8 planes' words a unit:
// 32 registers); 1 loads a unit only after the last one's steps, so a warpgroup waits for every unit's
// latency. At one producer warpgroup, 2 (the default then) was 4-8% faster than 1 at the 8-bit shapes
// timed, -3% to +2% at mixed ones (docs/kernel.md); 4 was 2-16% slower than 2
// (docs/kernel.md). With two producer warpgroups (below), each has its own units in
// flight (while one waits for a unit, the other can fill steps), and 1 (the default since 2026-12-05)
// was 4-8% faster than 2 at five of the six 8-bit and mixed shapes timed and level at
// the sixth (H100, docs/kernel.md: Mixtral 256 tokens 8 bits 1422.3 against
// 1538.3 us).
#ifndef APL_STAGED_PREFETCH_LUT
#define APL_STAGED_PREFETCH_LUT 1
#endif
#ifndef APL_STAGED_BLOCKS
#define APL_STAGED_BLOCKS 2    // CTAs per SM the register budget must allow (2: 128 registers a thread)
#endif
// The same for the 5-8-bit and merged classes, whose LUT rows (64 KB at 8 bits) leave one CTA an SM
// more ring buffers than two do (1: up to 255 registers a thread, no setmaxnreg split). 1 (the default):
// Mixtral 64 tokens 8 bits 1445.5 against 2297.3 us, Qwen1.5-MoE 256 tokens 736.7 against 853.9
// (H100, docs/kernel.md: 4 ring buffers where 2 CTAs had 2).
#ifndef APL_STAGED_LUT_BLOCKS
#define APL_STAGED_LUT_BLOCKS 1
#endif
// Producer warpgroups of the 5-8-bit and merged classes' CTAs (the 3-4-bit class keeps one: two CTAs an
// SM, setmaxnreg). At one CTA an SM a single producer warpgroup leaves one producer warp a scheduler,
// and Nsight at Mixtral 256 tokens, 8 bits (2026-12-05) found the SM latency-bound:
// 77% of cycles with no eligible warp. 2: 384 threads, the second producer warpgroup taking every
// other unit of steps (each step still filled by one warpgroup, so the barriers count 128 arrivals
// as before), every thread under the launch bound's 168 registers (no setmaxnreg split: the
// consumers' 2 x 64 accumulators of m64n128 fit it, as at two CTAs an SM). 2 (the default since
// 2026-12-05; with APL_STAGED_PREFETCH_LUT 1): Mixtral 256 tokens 8 bits 1420.4 against
// 1550.0 us at one warpgroup, 1.20x bf16 grouped_mm (H100, docs/kernel.md).
#ifndef APL_STAGED_LUT_PRODUCERS
#define APL_STAGED_LUT_PRODUCERS 2
#endif
#define ST_ROWS 128            // weight rows per CTA (two m64 wgmma per k16 slice)
#define ST_KS 64               // columns per step (4 k16 slices)
#define ST_MAX_STAGES 8
#define ST_A_BYTES (ST_ROWS * ST_KS * 2)
// Whether class CLS's launches take their activations by TMA: the 3-4-bit class (APL_STAGED_TMA 1) or
// every class (2). Its ring
// starts the dynamic shared memory, which a 128-byte-swizzled B tile needs on a 1024-byte boundary;
// the other classes keep 512 (an 8-bit LUT row's), so 8-bit LUT rows still leave 2 ring buffers at
// 2 CTAs an SM (the host's staged_align_pad follows both).
template <int CLS> APL_HD constexpr bool staged_tma() { return APL_STAGED_TMA == 2 || (APL_STAGED_TMA == 1 && CLS == 0); }
template <int CLS> APL_HD constexpr int staged_blocks() { return CLS == 0 ? APL_STAGED_BLOCKS : APL_STAGED_LUT_BLOCKS; }
template <int CLS> APL_HD constexpr int staged_producers() { return CLS == 0 ? 1 : APL_STAGED_LUT_PRODUCERS; }
// A CTA's threads: the consumer warpgroup, then the producer warpgroups.
template <int CLS> APL_HD constexpr int staged_threads() { return 128 * (1 + staged_producers<CLS>()); }
template <int CLS> APL_HD constexpr unsigned staged_align() { return staged_tma<CLS>() ? 1024u : 512u; }

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
// Row pt's 64 weights of one step into the step's A tile (at a_tile): words 2 * half and
// 2 * half + 1 of a unit's plane words (W a plane), dequantised from the row's register tables
// (RowLut) and stored in the wgmma layout.
template <int B, int W, bool BF16>
APL_HD void stage_weights(const RowLut<B, BF16>& lut, const u32 (&unit)[B][W], int half, u32 a_tile, int pt) {
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
// CPU test runs staged_cta's 256 threads as host threads, wgmma by the PTX ISA's definition).
#if APL_HAS_WGMMA || APL_HOST_CTA
// The arrive-on of the executing thread's earlier cp.async copies (the pending count is raised
// now and lowered when they land, so the phase cannot complete before them; on the host they
// have landed, and the arrive-on changes nothing).
APL_HD void cp_async_mbar_arrive(unsigned long long* bar) {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" :: "r"(shared_addr(bar)) : "memory");
#endif
}
template <bool HINT>
APL_HD uint4 ldg_plane_v4(const u32* p) {
#ifdef __CUDA_ARCH__
    uint4 v;
    if constexpr (HINT)
        asm volatile("ld.global.nc" APL_PLANE_L1 APL_PLANE_L2 ".v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else
        asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}
// The CTA's barrier (its `threads`), and the producer warpgroups' (named barrier 2).
APL_HD void cta_barrier(int threads) {
#ifdef __CUDA_ARCH__
    __syncthreads();
#else
    host_bar_sync(0, (unsigned)threads);
#endif
}
template <int NP>
APL_HD void producer_barrier() {
#ifdef __CUDA_ARCH__
    asm volatile("bar.sync 2, %0;" :: "n"(128 * NP) : "memory");
#else
    host_bar_sync(2, 128 * NP);
#endif
}

// acc += A (64 rows at da) x B (8 * N8 tokens at db), one k16 slice, both from shared memory.
// (the m64n128 fragment: apl_gemv.cu's APL_D48 and 16 more)
#define APL_D64 APL_D48 ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define APL_WGMMA_SS(SHAPE, TY, D, DA, DB, SCALE, ...)                                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." \
                 TY "." TY " {" D "}, " DA ", " DB ", p, 1, 1, 0, 0;\n}"                                      \
                 : __VA_ARGS__ : "l"(da), "l"(db), "r"(1) : "memory")
template <int N8, bool BF16>
APL_HD void wgmma_ss(float (&acc)[N8][4], unsigned long long da, unsigned long long db) {
#ifndef __CUDA_ARCH__
    host_wgmma_ss<N8, BF16>(acc, da, db);
#else
    if constexpr (N8 == 2 && BF16)
        APL_WGMMA_SS("m64n16k16", "bf16", APL_D8, "%8", "%9", "%10", APL_ACC4(0), APL_ACC4(1));
    else if constexpr (N8 == 2)
        APL_WGMMA_SS("m64n16k16", "f16", APL_D8, "%8", "%9", "%10", APL_ACC4(0), APL_ACC4(1));
    else if constexpr (N8 == 4 && BF16)
        APL_WGMMA_SS("m64n32k16", "bf16", APL_D16, "%16", "%17", "%18", APL_ACC4(0), APL_ACC4(1), APL_ACC4(2), APL_ACC4(3));
    else if constexpr (N8 == 4)
        APL_WGMMA_SS("m64n32k16", "f16", APL_D16, "%16", "%17", "%18", APL_ACC4(0), APL_ACC4(1), APL_ACC4(2), APL_ACC4(3));
    else if constexpr (N8 == 8 && BF16)
        APL_WGMMA_SS("m64n64k16", "bf16", APL_D32, "%32", "%33", "%34",
                     APL_ACC4(0), APL_ACC4(1), APL_ACC4(2), APL_ACC4(3), APL_ACC4(4), APL_ACC4(5), APL_ACC4(6), APL_ACC4(7));
    else if constexpr (N8 == 8)
        APL_WGMMA_SS("m64n64k16", "f16", APL_D32, "%32", "%33", "%34",
                     APL_ACC4(0), APL_ACC4(1), APL_ACC4(2), APL_ACC4(3), APL_ACC4(4), APL_ACC4(5), APL_ACC4(6), APL_ACC4(7));
    else if constexpr (N8 == 12 && BF16)
        APL_WGMMA_SS("m64n96k16", "bf16", APL_D48, "%48", "%49", "%50",
                     APL_ACC4(0), APL_ACC4(1), APL_ACC4(2), APL_ACC4(3), APL_ACC4(4), APL_ACC4(5), APL_ACC4(6), APL_ACC4(7),
                     APL_ACC4(8), APL_ACC4(9), APL_ACC4(10), APL_ACC4(11));
    else if constexpr (N8 == 12)
        APL_WGMMA_SS("m64n96k16", "f16", APL_D48, "%48", "%49", "%50",
                     APL_ACC4(0), APL_ACC4(1), APL_ACC4(2), APL_ACC4(3), APL_ACC4(4), APL_ACC4(5), APL_ACC4(6), APL_ACC4(7),
                     APL_ACC4(8), APL_ACC4(9), APL_ACC4(10), APL_ACC4(11));
    else if constexpr (N8 == 16 && BF16)
        APL_WGMMA_SS("m64n128k16", "bf16", APL_D64, "%64", "%65", "%66",
                     APL_ACC4(0), APL_ACC4(1), APL_ACC4(2), APL_ACC4(3), APL_ACC4(4), APL_ACC4(5), APL_ACC4(6), APL_ACC4(7),
                     APL_ACC4(8), APL_ACC4(9), APL_ACC4(10), APL_ACC4(11), APL_ACC4(12), APL_ACC4(13), APL_ACC4(14), APL_ACC4(15));
    else if constexpr (N8 == 16)
        APL_WGMMA_SS("m64n128k16", "f16", APL_D64, "%64", "%65", "%66",
                     APL_ACC4(0), APL_ACC4(1), APL_ACC4(2), APL_ACC4(3), APL_ACC4(4), APL_ACC4(5), APL_ACC4(6), APL_ACC4(7),
                     APL_ACC4(8), APL_ACC4(9), APL_ACC4(10), APL_ACC4(11), APL_ACC4(12), APL_ACC4(13), APL_ACC4(14), APL_ACC4(15));
#endif
}

// What both warpgroups know of the CTA's work.
struct StagedWork {
    int expert_start, n;      // the expert's first sorted position and its token count
    int r0, rows_out, cols;   // first output row (h column for gate_up), projection sizes
    int steps, stages;        // 64-column steps per pass, ring depth
    u32 ring;                 // shared address of buffer 0 (A tile, then B tile)
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

// cp_async16 where `issue` holds; on the host a lane that skips it still takes the warp
// instruction's ordinal (the harness's bank count groups lanes by ordinal).
// On the device a predicated copy, not a branch (a branch made the 128-token down instance spill 64
// bytes at nvcc 13.0).
APL_HD void cp_async16_if(bool issue, u32 dst, const void* src, u32 src_bytes) {
#ifdef __CUDA_ARCH__
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %3, 0;\n@p cp.async.cg.shared.global [%0], [%1], 16, %2;\n}"
                 :: "r"(dst), "l"(src), "r"(src_bytes), "r"((int)issue) : "memory");
#else
    if (issue) cp_async16(dst, src, src_bytes);
    else host_log_skipped(CP_ASYNC_16);
#endif
}

// The B operand's descriptor for a TMA-written tile (APL_STAGED_TMA): K-major with the 128-byte
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

// A producer warpgroup: its thread pt owns weight row pt of the CTA. PA: plane words by cp.async
// (APL_STAGED_PLANE_ASYNC, APL_STAGED_PLANE_ASYNC_LUT). NP producer warpgroups (staged_producers):
// warpgroup wg fills the steps of every NP-th unit (U steps) of the CTA's passes, from unit wg.
template <int B, int MODE, bool BF16, bool V4, int NT8, bool PA, bool TMA, int NP>
APL_HD void staged_produce(const BlockRef& blk, const StagedWork& w, const int* __restrict__ sorted_slot, int top_k,
                           const u16* __restrict__ x, const StagedTensorMap& act_map) {
    // P: units in flight; 5-8-bit rows APL_STAGED_PREFETCH_LUT (8 planes' words a unit; with 4-byte plane
    // loads one: those instances spill 448-912 bytes at 2, nvcc 13.0)
    constexpr int NT = 8 * NT8, P = B <= 4 ? APL_STAGED_PREFETCH : V4 ? APL_STAGED_PREFETCH_LUT : 1, MINE = NT8 / 2;  // MINE: B chunks a step
    const int wg = (threadIdx.x - 128) / 128, pt = (threadIdx.x - 128) % 128;
    const int rpc = MODE == 0 ? ST_ROWS / 2 : ST_ROWS;
    bool valid;
    int wrow = weight_row<MODE>(pt, w.r0, rpc, w.rows_out, &valid);
    if (!valid) wrow = 0;  // (loads stay in bounds; the epilogue writes nothing for the row)
    constexpr int U = B <= 4 && V4 && NT8 <= 8 ? APL_STAGED_UNIT : 2, W = 2 * U;  // steps and words (per plane) a unit
    static_assert(U == 2 || U == 4, "units of 2 or 4 steps");
    const int wpr = w.cols / 32, units = (w.steps + U - 1) / U;
    int first = 0, mine = 0;  // this pass's units of this warpgroup: j < mine -> unit first + NP j
    const u32* row_planes[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) row_planes[p] = blk.planes[p] + (long long)wrow * wpr;
    RowLut<B, BF16> rlut;
    rlut.load(blk.lut + (long long)wrow * lut_row_entries(B), true, BF16);
    // Unit u = steps Uu..Uu+U-1 = words Wu..Wu+W-1 of the row in every plane (clamped into the row:
    // columns past the end meet zero activations); the warpgroup's own unit j.
    auto load_unit = [&](u32 (&buf)[B][W], int j) {
        const int w0 = W * min(first + NP * j, units - 1);
#pragma unroll
        for (int p = 0; p < B; ++p) {
            if constexpr (V4) {
#pragma unroll
                for (int q = 0; q < W / 4; ++q) {  // (wpr is a multiple of 4: only a unit of 4 steps can pass the end)
                    const uint4 v = ldg_plane_v4<true>(row_planes[p] + (q == 0 ? w0 : min(w0 + 4 * q, wpr - 4)));
                    buf[p][4 * q] = v.x; buf[p][4 * q + 1] = v.y; buf[p][4 * q + 2] = v.z; buf[p][4 * q + 3] = v.w;
                }
            } else {
#pragma unroll
                for (int i = 0; i < W; ++i) buf[p][i] = ldg_plane_u32<true>(row_planes[p] + min(w0 + i, wpr - 1));
            }
        }
    };
    // PA: the warpgroup's unit j's words land in slot j % P of the thread's plane ring ([slot][plane]
    // [producer thread][W words]), one commit group a unit; past its last unit the group is empty, so no
    // copy is ever in flight to a slot that is being read or refilled.
    const u32 plane_ring = stage_a<NT8>(w, w.stages) + (u32)(threadIdx.x - 128) * (W * 4);
    auto plane_slot = [&](int d, int p) { return plane_ring + (u32)((d * B + p) * NP * ST_ROWS * W * 4); };
    auto issue_unit = [&](int d, int j) {
        if (j < mine) {
            const int w0 = W * (first + NP * j);
#pragma unroll
            for (int p = 0; p < B; ++p) {
                if constexpr (V4) {
#pragma unroll
                    for (int q = 0; q < W / 4; ++q)
                        cp_async16(plane_slot(d, p) + 16 * q, row_planes[p] + (q == 0 ? w0 : min(w0 + 4 * q, wpr - 4)), 16u);
                } else {
#pragma unroll
                    for (int i = 0; i < W; ++i) cp_async4(plane_slot(d, p) + 4 * i, row_planes[p] + min(w0 + i, wpr - 1));
                }
            }
        }
        cp_async_commit();
    };
    // This thread copies chunk c8 (columns 8 c8.. of the step) of tokens tok0 + 16 i. A chunk's banks
    // follow its token alone (tile_chunk: (tok & 7) * 16 bytes into a 128-byte line), so the 8 lanes
    // of each quarter-warp take 8 consecutive tokens: 4 wavefronts a warp's 16-byte copy, not the 8
    // of 8 chunks of 4 tokens (the harness's bank count, docs/kernel.md); each warp still reads 16
    // sectors of activations (8 tokens x 64 bytes).
    const int c8 = (pt >> 3) & 7, tok0 = (pt & 7) + 8 * (pt >> 6);
    for (int m0 = blockIdx.z * NT, pass = 0; m0 < w.n; m0 += gridDim.z * NT, ++pass) {
        const u32 pass_it = (u32)pass * (u32)w.steps;  // the ring's steps before this pass (consumers take each in order)
        // the units of all the CTA's passes in one sequence, dealt round the warpgroups: a warpgroup's next
        // step is then at most U (NP - 1) + 1 steps on from its last, also across a pass's end, and a
        // ring of as many buffers (staged_plan) keeps its parity waits one phase from the barrier's
        first = (wg + NP - (int)((long long)pass * units % NP)) % NP;
        mine = units > first ? (units - first + NP - 1) / NP : 0;
        const u16* src[MINE];
#pragma unroll
        for (int i = 0; i < (TMA ? 0 : MINE); ++i) {
            const int tok = tok0 + 16 * i;
            long long row = 0;
            if (m0 + tok < w.n) {
                const int s = w.expert_start + m0 + tok;
                row = MODE == 0 ? sorted_slot[s] / top_k : s;
            }
            src[i] = x + row * w.cols + c8 * 8;
        }
        u32 buf[PA ? 1 : P][B][W];
#pragma unroll
        for (int d = 0; d < P; ++d) {
            if constexpr (PA) issue_unit(d, d);
            else load_unit(buf[d], d);
        }
        for (int j0 = 0; j0 < mine; j0 += P) {
#pragma unroll
            for (int d = 0; d < P; ++d) {
                const int j = j0 + d, u = first + NP * j;
                if (j >= mine) break;
                if constexpr (PA) cp_async_wait<P - 1>();  // unit j's group has landed (the P - 1 after it need not)
                u32 words[B][W] = {};  // PA: two steps' words of every plane at a time, from the slot
#pragma unroll
                for (int half = 0; half < U; ++half) {  // (a unit's steps)
                    const int step = U * u + half;
                    if (step >= w.steps) break;
                    const u32 it = pass_it + (u32)step;
                    const int slot = (int)(it % (u32)w.stages);
                    const u32 use = it / (u32)w.stages;
                    if (use > 0) mbar_wait_phase(&w.empty[slot], use - 1);
                    const u32 a_tile = stage_a<NT8>(w, slot), b_tile = a_tile + ST_A_BYTES;
                    if constexpr (TMA) {
                        // Rows past the expert's count are the next expert's (or zeros past the
                        // tensor): wgmma keeps token columns apart and the epilogue skips them.
                        // Columns past the row's end come as zeros (they meet the clamped weights).
                        if (pt == 0) {
                            mbar_expect_tx(&w.full[slot], NT * ST_KS * 2);
                            tma_load_rows(b_tile, act_map, step * ST_KS, w.expert_start + m0, &w.full[slot]);
                        }
                    } else {
                        const int col = step * ST_KS + c8 * 8;
#pragma unroll
                        for (int i = 0; i < MINE; ++i) {
                            const int tok = tok0 + 16 * i;
                            const bool in = m0 + tok < w.n && col < w.cols;
                            // A pass's token rows past the expert's count are left as they are (any
                            // bits, NaN too): wgmma keeps token columns apart and the epilogue skips them.
                            // Columns past the row's end still need zeros (they meet the clamped weights).
                            cp_async16_if(!APL_STAGED_SKIP_PAD || m0 + tok < w.n, tile_chunk(b_tile, NT, tok, c8),
                                          src[i] + step * ST_KS, in ? 16u : 0u);
                        }
                        cp_async_mbar_arrive(&w.full[slot]);
                    }
                    if constexpr (PA) {
                        // one LDS.128 a plane for this step and the next: a warp's 32 x 16 contiguous
                        // bytes take 4 wavefronts, where an LDS.64 a step took 4 each (tests/kernels/staged_host.py, bank_counts)
                        if (half % 2 == 0) {
#pragma unroll
                            for (int p = 0; p < B; ++p) {
                                const uint4 v = lds_v4(plane_slot(d, p) + 8 * half);
                                words[p][2 * half] = v.x;
                                words[p][2 * half + 1] = v.y;
                                words[p][2 * half + 2] = v.z;
                                words[p][2 * half + 3] = v.w;
                            }
                        }
                        stage_weights<B, W, BF16>(rlut, words, half, a_tile, pt);
                    } else {
                        stage_weights<B, W, BF16>(rlut, buf[d], half, a_tile, pt);
                    }
                    if constexpr (APL_STAGED_PRODUCER_FENCE)
                        fence_proxy_async();  // the stores, before wgmma (the async proxy) reads them
                    mbar_arrive(&w.full[slot]);
                }
                if constexpr (PA) issue_unit(d, j + P);
                else load_unit(buf[d], j + P);
            }
        }
    }
}

// The consumer warpgroup: the pass's wgmma over the ring, then the epilogue.
template <int MODE, bool BF16, int NT8, bool TMA>
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
                fence_proxy_async();  // the producers' stores (and the activations' cp.async copies), before wgmma reads them
                const u32 a_tile = stage_a<NT8>(w, slot), b_tile = a_tile + ST_A_BYTES;
                wgmma_fence();
                fence_accumulators(acc0);
                fence_accumulators(acc1);
#pragma unroll
                for (int kk = 0; kk < ST_KS / 16; ++kk) {
                    const unsigned long long db =
                        TMA ? wgmma_desc_sw128(b_tile + kk * 32) : wgmma_desc(b_tile + kk * (NT * 32));
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

// The warpgroups' register budgets (setmaxnreg; 2 CTAs of 256 threads share 64K registers, so
// consumer + producer <= 256): the consumer holds 2 x 4 NT8 accumulators, the producer a row's
// LUT, plane words in flight and a word's codes and chunks.
#ifndef APL_STAGED_REGS
#define APL_STAGED_REGS 1  // 0: every thread at the launch bound's 128
#endif
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
    // Dynamic shared memory from a staged_align boundary (the host's staged_align_pad): at least an 8-bit
    // LUT row's size, so every row is aligned to its own (Codes' base | offset), and with TMA the ring's
    // B tiles to a swizzled tile's 1024 (LUT rooms and ring buffers are multiples of it).
    const u32 raw = shared_addr(smem_raw);
    constexpr bool TMA = staged_tma<CLS>();  // (activations by TMA: the 3-4-bit class)
    constexpr unsigned ALIGN = staged_align<CLS>();
    unsigned char* smem = smem_raw + (((raw + (ALIGN - 1u)) & ~(ALIGN - 1u)) - raw);
    w.ring = shared_addr(smem);
    if (threadIdx.x == 0) {
        for (int i = 0; i < stages; ++i) {
            mbar_init(&w.full[i], 128);   // the producers' arrivals (and their copies', tracked)
            mbar_init(&w.empty[i], 128);  // the consumers'
        }
    }
    cta_barrier(staged_threads<CLS>());
    if (threadIdx.x < 128) {
        if constexpr (APL_STAGED_REGS && staged_blocks<CLS>() == 2) set_warpgroup_registers<StagedRegs<NT8>::consumer>();
        staged_consume<MODE, BF16, NT8, TMA>(w, bad, sorted_slot, h_out, y_out);
        return;
    }
    if constexpr (APL_STAGED_REGS && staged_blocks<CLS>() == 2) set_warpgroup_registers<StagedRegs<NT8>::producer>();
    if (bad) return;
    constexpr int NP = staged_producers<CLS>();
    constexpr bool PA_LUT = APL_STAGED_PLANE_ASYNC && APL_STAGED_PLANE_ASYNC_LUT && CLS != 0;
    constexpr bool PA = (APL_STAGED_PLANE_ASYNC && CLS == 0) || PA_LUT;
    switch (blk.bits) {
        case 3: if constexpr (CLS != 1) staged_produce<3, MODE, BF16, V4, NT8, PA, TMA, NP>(blk, w, sorted_slot, top_k, x, act_map); break;
        case 4: if constexpr (CLS != 1) staged_produce<4, MODE, BF16, V4, NT8, PA, TMA, NP>(blk, w, sorted_slot, top_k, x, act_map); break;
        case 5: if constexpr (CLS != 0) staged_produce<5, MODE, BF16, V4, NT8, PA_LUT, TMA, NP>(blk, w, sorted_slot, top_k, x, act_map); break;
        case 6: if constexpr (CLS != 0) staged_produce<6, MODE, BF16, V4, NT8, PA_LUT, TMA, NP>(blk, w, sorted_slot, top_k, x, act_map); break;
        case 7: if constexpr (CLS != 0) staged_produce<7, MODE, BF16, V4, NT8, PA_LUT, TMA, NP>(blk, w, sorted_slot, top_k, x, act_map); break;
        default: if constexpr (CLS != 0) staged_produce<8, MODE, BF16, V4, NT8, PA_LUT, TMA, NP>(blk, w, sorted_slot, top_k, x, act_map); break;
    }
}

// Kernel classes as apl_gemv's: CLS 0 3-4 bits, 1 5-8 bits, 2 any (the merged class). V4: every
// plane 16-byte aligned with a word count per row divisible by 4 (16-byte plane loads).
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
