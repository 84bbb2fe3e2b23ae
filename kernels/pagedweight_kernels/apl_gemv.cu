// The decode and tiles regimes: the MoE layer in two launches, weights turned into
// tensor-core fragments in registers (docs/kernel.md, "Regimes").
//
// Compiled after apl_moe.cu (the launcher concatenates the two sources; it uses that file's
// conversions, BlockRef, Codes and mma16816).
//
//   apl_gemv<CLS, 0>  gate_up: every CTA finds its expert from topk_ids itself (no moe_align
//                     launch), multiplies a 64-row tile of the block by up to 8 tokens per pass
//                     over one column split, writes fp32 partials; the last split of a tile to
//                     finish sums the splits in a fixed order and writes h = act(gate) * up.
//   apl_gemv<CLS, 1>  down: the same over h; the last CTA to finish a row tile (over every
//                     expert and split) forms out[t] = sum_j w[t,j] * sum_split y, in a fixed
//                     order (no moe_combine launch, no float atomics: bit-identical reruns).
//
// Per-width classes (CLS): a layer of one class takes that class's kernel, a layer holding
// both takes the merged one (CLS 2); a CTA of a one-class kernel whose block is of the other
// class exits at once:
//   CLS 0, 3-4 bits: the row's LUT lives in registers as two byte tables (low and high byte
//          of the 8 or 16 act-dtype entries); four codes in the nibbles of a PRMT selector
//          give four low bytes in one PRMT and four high bytes in another (at 4 bits, one
//          more of each for entries 8..15 and a LOP3 select by the top bit), and two PRMTs
//          interleave them into the two bf16x2/fp16x2 registers of an mma A fragment.
//   CLS 1, 5-8 bits: every value is affine in its 4-bit cell (APL format 2): the cell code
//          gives the cell's offset and width, the refinement bits become 1 + q/16 in the act
//          dtype, and one packed FMA gives two weights. The cells come from a 16 KB
//          shared-memory table, one conflict-free LDS a weight (CellTab). The plane words in
//          flight take ~170 registers, so these kernels run 3 CTAs an SM
//          (APL_GEMV_CELL_BLOCKS, tiles_blocks).
//   CLS 2, every width in one launch (both paths compiled into one kernel): the host picks it
//          for layers holding both classes (faster than a launch per class).
//
// The tiles regime (NT8 > 1, more tokens per expert: prefill and large decode batches) is the
// same kernel with passes of up to 8 * NT8 tokens: each weight's A fragments are built once
// per pass and feed one mma per 8-token tile (tiles_warp), the activations are staged a step
// (256 columns) at a time (the next step by cp.async during this one's mma), so a split may
// span the whole row and the fp32 partials stay small.
//
// Warp = 16 weight rows; thread (g = lane/4, t = lane%4) holds rows g and g+8 and, per
// 256-column step, plane words 2t and 2t+1 of both. A plane word's 32 codes come out of the
// nibble transpose (Codes<B>) as 8 selectors of 4 columns {16h+c+4i}; each selector is one
// k16 slice of m16n8k16 (this thread's 4 k slots), the 8 columns of the mma B operand are
// tokens, and the activations are staged in shared memory in the same permuted column order.

#define GV_THREADS 128
#define GV_ROWS 64             // weight rows per CTA (4 warps x 16)
#define GV_STEP_WORDS 8        // plane words per row per warp step (256 columns)
#define GV_TOKENS 8            // tokens per pass: the mma's N
#ifndef APL_GEMV_MIN_BLOCKS
#define APL_GEMV_MIN_BLOCKS 4
#endif
// Decode CTAs per SM the register budget must allow for the kernels holding 5-8-bit blocks (CLS 1
// and the merged 2): up to 8 planes' words in flight take ~170 registers, which 4 CTAs (128
// each) would spill.
#ifndef APL_GEMV_CELL_BLOCKS
#define APL_GEMV_CELL_BLOCKS 3
#endif
// 1: each decode step asks L2 for the plane sectors two steps ahead (off: slower, docs/kernel.md).
#ifndef APL_GEMV_L2_PREFETCH
#define APL_GEMV_L2_PREFETCH 0
#endif
// CTAs per SM the register budget must allow in the tiles regime (NT8 > 1), per instance: 3
// (<= 168 registers) where the body fits them unspilled (nvcc 13.0, sm_90a), else 2. Fitting at 3:
// the 3-4-bit kernel up to NT8 8; the 5-8-bit one up to 8 with 8-byte plane loads (V2), 2 with
// 4-byte ones; the merged body at NT8 2 with 8-byte loads only. NT8 12 (96-token passes, the
// 3-4-bit class only: the host's TILES_WIDE_NT8) holds 48 accumulators a thread: 2.
APL_HD constexpr int tiles_blocks(int cls, int nt8, bool v2) {
    const int widest_at_3 = cls == 0 ? 8 : cls == 1 ? (v2 ? 8 : 2) : (v2 ? 2 : 0);
    return nt8 <= widest_at_3 ? 3 : 2;
}
// The plane words' loads (load_step) of the instances of at least APL_PLANE_HINT_MIN_NT8 and of
// the decode instances compiled for long splits (LONG) carry L2::256B: a row's first load in each
// 256 bytes has L2 fetch them all, so the warp's next steps hit L2. On short splits the 256 bytes
// overshoot the split and cost time, and a run-time test of the split's length in the loop costs
// more than it saves, so the host picks a LONG instance (plan.long_split: splits of 64+ words over
// rows of 128+, from 2 tokens).
#ifndef APL_PLANE_HINT_MIN_NT8
#define APL_PLANE_HINT_MIN_NT8 8  // the instances the hint applies to: NT8 >= this (1: decode too)
#endif
#ifndef APL_TILES_GROUP
#define APL_TILES_GROUP 4  // tiles regime: 8-token tiles whose mma chains interleave (activations in registers)
#endif

APL_HD u32 prmt(u32 a, u32 b, u32 sel) {
#ifdef __CUDA_ARCH__
    u32 d; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel)); return d;
#else
    return host_prmt(a, b, sel);
#endif
}
// A read-only global load (__ldg) the host can run.
template <class T>
APL_HD T ldg_ro(const T* p) {
#ifdef __CUDA_ARCH__
    return __ldg(p);
#else
    return *p;
#endif
}
// Plane words through the non-coherent path; HINT: with the L2::256B qualifier (the same bytes
// either way; only where the caches keep them).
template <bool HINT>
APL_HD u32 ldg_plane_u32(const u32* p) {
#ifdef __CUDA_ARCH__
    u32 v;
    if constexpr (HINT) asm volatile("ld.global.nc.L2::256B.u32 %0, [%1];" : "=r"(v) : "l"(p));
    else asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
#else
    return *p;
#endif
}
template <bool HINT>
__device__ __forceinline__ uint2 ldg_plane_u64(const u32* p) {
    uint2 v;
    if constexpr (HINT)
        asm volatile("ld.global.nc.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    else
        asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ int atom_add_acq_rel_gpu(int* p, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
// Programmatic dependent launch (sm_90+; no-ops for a grid launched without the attribute).
// wait: this thread waits until the grid it depends on has finished and its writes are visible;
// launch_dependents: the grid launched after this one with the attribute may start once every
// CTA of this grid has executed it (or exited), on the SM slots this grid's CTAs free.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" :: "l"(p)); }
APL_HD void cp_async4(u32 dst, const u32* src) {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(src) : "memory");
#else
    host_cp_async(dst, src, 4, 4);
#endif
}
APL_HD void cp_async_commit() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// 16 bytes, L2 only; src_bytes 0 fills the destination with zeros (no read).
APL_HD void cp_async16(u32 dst, const void* src, u32 src_bytes) {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
#else
    host_cp_async(dst, src, 16, src_bytes);
#endif
}
// (On the host a cp.async copy lands when issued: commit and wait have nothing to do.)
template <int N>
APL_HD void cp_async_wait() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}

// The columns of selector s (0..7) of a plane word, in the order of the 4 k slots a thread
// owns: (2t, 2t+1) then (2t+8, 2t+9). Codes<B> puts column 4n+c in nibble n of o[c].
__device__ __forceinline__ int sel_col(int s, int i) { return 16 * (s >> 2) + (s & 3) + 4 * i; }

// Selector s = 4h + r of a word as the mma's two k pairs: lo = the act values of columns
// sel_col(s, 0..1), hi = sel_col(s, 2..3), from pr = the word's column pairs 8h..8h+7 (pair m
// = columns 2m, 2m+1; column 16h + r + 4i is the low half of pair 8h + r/2 + 2i for even r).
__device__ __forceinline__ void selector_pairs(const u32* pr, int r, u32& lo, u32& hi) {
    const u32 sel = (r & 1) ? 0x7632u : 0x5410u;
    lo = prmt(pr[r >> 1], pr[2 + (r >> 1)], sel);
    hi = prmt(pr[4 + (r >> 1)], pr[6 + (r >> 1)], sel);
}

// The tiles regime's staging: one word's 32 activations v (4 16-byte chunks in column order,
// i.e. column pairs (2m, 2m+1), m = 0..15) into the layout the mma slices read (see apl_gemv's
// stage_split): chunk q holds selectors 2q and 2q+1 (lo, hi of each), stored at
// q ^ ((wl >> 1) & 3) of the word.
__device__ __forceinline__ void stage_word(const uint4 (&v)[4], u16* word, int wl) {
    const u32* pr = &v[0].x;
    uint4* dst = reinterpret_cast<uint4*>(word);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        uint4 d;
        selector_pairs(pr + 8 * (q >> 1), 2 * (q & 1), d.x, d.y);
        selector_pairs(pr + 8 * (q >> 1), 2 * (q & 1) + 1, d.z, d.w);
        dst[q ^ ((wl >> 1) & 3)] = d;
    }
}

// Register LUT of one row for 3-4 bits: lo[j] / hi[j] = low / high bytes of entries 4j..4j+3.
template <int B>
struct RegLut {
    using CodesT = Codes<B>;
    u32 lo[B == 4 ? 4 : 2], hi[B == 4 ? 4 : 2];

    u32 raw[(1 << B) / 2];  // entries 2j, 2j+1 as loaded (fp16), between fetch and build

    // The row's entries are loaded by fetch and turned into the byte tables by build, so the
    // loads stay in flight while the CTA stages its activations (at decode run_passes calls build
    // after the first stage: one dependent global round trip less per CTA).
    APL_HD void fetch(const u16* row_lut, bool valid) {
        constexpr int N = 1 << B;
#pragma unroll
        for (int j = 0; j < N / 2; ++j) {  // LUTs need only 2-byte alignment
            const u32 a = valid ? ldg_ro(row_lut + 2 * j) : (u16)0, b = valid ? ldg_ro(row_lut + 2 * j + 1) : (u16)0;
            raw[j] = a | (b << 16);
        }
    }
    APL_HD void build(bool bf16) {
        constexpr int N = 1 << B;
        u32 e[N / 2];  // entries 2j, 2j+1 as act values
#pragma unroll
        for (int j = 0; j < N / 2; ++j) {
            u32 a = raw[j] & 0xffffu, b = raw[j] >> 16;
            if (bf16) {
                a = float_to_bf16(half_to_float((u16)a));
                b = float_to_bf16(half_to_float((u16)b));
            }
            e[j] = a | (b << 16);
        }
        tables(e);
    }
    // The byte tables from the entries as act values (e[j]: entries 2j, 2j + 1).
    APL_HD void tables(const u32 (&e)[(1 << B) / 2]) {
        constexpr int N = 1 << B;
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
            // entries 8j..8j+7 = e[4j..4j+3]; low bytes are byte 0 and 2 of each pair
            lo[2 * j] = prmt(e[4 * j], e[4 * j + 1], 0x6420);
            hi[2 * j] = prmt(e[4 * j], e[4 * j + 1], 0x7531);
            lo[2 * j + 1] = prmt(e[4 * j + 2], e[4 * j + 3], 0x6420);
            hi[2 * j + 1] = prmt(e[4 * j + 2], e[4 * j + 3], 0x7531);
        }
    }
    APL_HD void load(const u16* row_lut, bool valid, bool bf16) {
        fetch(row_lut, valid);
        build(bf16);
    }

    // Four weights (the codes in nibbles 4h..4h+3 of the Codes<B> word o) as two act x2
    // registers; o3 = o & 0x77777777 (the selector without the top code bit), precomputed.
    // S01 / S23: the PRMTs that pair the looked-up low and high bytes (byte i of each belongs to
    // nibble 4h + i); by default nibbles (0, 1) and (2, 3), apl_staged.cu's pairs (0, 2) and (1, 3).
    template <int HALF, u32 S01 = 0x5140u, u32 S23 = 0x7362u>
    APL_HD void lookup(u32 o, u32 o3, u32& w01, u32& w23) const {
        u32 lob, hib;
        if constexpr (B == 3) {
            const u32 s = HALF ? shr_pipe<FmaShifts<B>::on, 16>(o) : o;  // PRMT reads the selector's low 16 bits only
            lob = prmt(lo[0], lo[1], s);
            hib = prmt(hi[0], hi[1], s);
        } else {
            // The top code bit (nibble bit 3) would switch PRMT to sign-replicate mode: the
            // lookups use o3, and a sign-mode PRMT turns the top bits into a byte mask
            // (o << 4 has nibble 2i's bit 3 at byte i's msb, o nibble 2i+1's).
            const u32 s3 = HALF ? shr_pipe<FmaShifts<B>::on, 16>(o3) : o3;
            const u32 l0 = prmt(lo[0], lo[1], s3), l1 = prmt(lo[2], lo[3], s3);
            const u32 h0 = prmt(hi[0], hi[1], s3), h1 = prmt(hi[2], hi[3], s3);
            const u32 m = prmt(o << 4, o, HALF ? 0xFBEAu : 0xD9C8u);
            lob = (l0 & ~m) | (l1 & m);
            hib = (h0 & ~m) | (h1 & m);
        }
        w01 = prmt(lob, hib, S01);
        w23 = prmt(lob, hib, S23);
    }

    // Selectors s and s+4 of a plane word (the two halves of nibble word c = s & 3).
    APL_HD void select2(const Codes<B>& c, int s, u32 (&w)[4]) const {
        const u32 o = c.o[s & 3], o3 = B == 4 ? o & 0x77777777u : o;
        lookup<0>(o, o3, w[0], w[1]);
        lookup<1>(o, o3, w[2], w[3]);
    }
};

// 32-bit shared-memory accesses by shared-window address (the decode regime's cell table).
APL_HD u32 lds_u32(u32 addr) {
#ifdef __CUDA_ARCH__
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
#else
    return host_lds_u32(addr);
#endif
}
APL_HD void sts_u32(u32 addr, u32 v) {
#ifdef __CUDA_ARCH__
    asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
#else
    host_sts_u32(addr, v);
#endif
}
// (x & M) | c in one LOP3; c a register (nvcc writes two instructions for the C form when c is a
// constant too, as LOP3 takes one immediate).
template <u32 M>
APL_HD u32 mask_or(u32 x, u32 c) {
#ifdef __CUDA_ARCH__
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "n"(M), "r"(c));
    return r;
#else
    return host_lop3(x, M, c, 0xEA);
#endif
}

// The codes of one plane word at 5-8 bits, for the register path (CellLut): the top four planes
// as Codes<4> gives a 4-bit code (cell: o[c] nibble n = cell of column 4n + c), the low B - 4
// planes in the same nibble layout (q[c] nibble n = column 4n + c's refinement bits j << (8 - B),
// absent planes zero): two 4x4 transposes instead of one 8x8.
template <int B>
struct CellCodes {
    Codes<4> cell;
    u32 q[4];

    APL_HD explicit CellCodes(const u32 (&pw)[8]) : cell(pw) {
        constexpr bool F = B == 8;  // (with absent planes the plain shifts fold away)
#pragma unroll
        for (int j = 0; j < 4; ++j) q[j] = (7 - j < B) ? pw[7 - j] : 0u;
        delta_swap<F, 2, 0x33333333u>(q[0], q[2]); delta_swap<F, 2, 0x33333333u>(q[1], q[3]);
        delta_swap<F, 1, 0x55555555u>(q[0], q[1]); delta_swap<F, 1, 0x55555555u>(q[2], q[3]);
    }
};

// The refinement fractions 1 + q / 16 of two weights as act x2: q in nibbles A (low half) and
// B (high half) of qw, ORed into the top of 1.0's mantissa (ActOne). A nibble reaches its place
// through a shifted copy of qw whose byte k holds it at the right bit, and one PRMT takes each
// half's two bytes from its copy; a word's pairs share the copies (the same shifts, CSE'd), so a
// pair costs a PRMT and a LOP3.
template <int S>
APL_HD u32 shift_by(u32 v) { if constexpr (S >= 0) return v << S; else return v >> -S; }
template <bool BF16, int N>
struct NibbleCopy {
    static constexpr int P = ActOne<BF16>::top - 3;  // the mantissa's top nibble starts here in a half
    // the copy's byte k (and k + 1, where the nibble crosses into it) holds it at bit P of a half
    static constexpr int k = (P + 3 < 8) ? N / 2 : (N / 2 < 2 ? N / 2 : 2);
    static constexpr int shift = P + 8 * k - 4 * N;
};
template <bool BF16, int A, int B>
APL_HD u32 fraction_pair(u32 qw) {
    using CA = NibbleCopy<BF16, A>;
    using CB = NibbleCopy<BF16, B>;
    constexpr u32 sel = (u32)CA::k | (u32)(CA::k + 1) << 4 | (u32)(4 + CB::k) << 8 | (u32)(5 + CB::k) << 12;
    const u32 t = prmt(shift_by<CA::shift>(qw), shift_by<CB::shift>(qw), sel & 0x7777u);
    constexpr u32 mask = 0xFu << CA::P | 0xFu << (16 + CA::P);
    return mask_or<mask>(t, ActOne<BF16>::bits * 0x10001u);
}

// A 5-8-bit row's stored LUT_4 (16 centroids and the extent, fp16), loaded by fetch and read
// back by build (CellLut, CellTab), so the loads stay in flight while the CTA stages its
// activations.
struct Lut4Row {
    u32 raw[9];  // entries 2j, 2j + 1, then the extent

    APL_HD void fetch(const u16* row_lut, bool valid) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 a = valid ? ldg_ro(row_lut + 2 * j) : (u16)0, b = valid ? ldg_ro(row_lut + 2 * j + 1) : (u16)0;
            raw[j] = a | (b << 16);
        }
        raw[8] = valid ? ldg_ro(row_lut + 16) : (u16)0;
    }
    APL_HD void entries(u16 (&l4)[17]) const {
#pragma unroll
        for (int j = 0; j < 8; ++j) { l4[2 * j] = (u16)raw[j]; l4[2 * j + 1] = (u16)(raw[j] >> 16); }
        l4[16] = (u16)raw[8];
    }
};

// Register tables of one row for 5-8 bits (APL format 2: every value is affine in its 4-bit cell,
// cell_affine): the 16 cells' offsets and widths as two RegLut<4> byte tables, looked up by the
// cell code as the 4-bit path looks up its entries; the refinement bits become 1 + q / 16 in the
// act dtype (fraction_pair) and one packed FMA gives two weights. No table in shared memory, no
// fill and no barrier before the first step, and the same values as apl_format.expand_lut.
template <int B, bool BF16>
struct CellLut : Lut4Row {
    using CodesT = CellCodes<B>;
    RegLut<4> offset, width;

    APL_HD void build(bool) {
        u16 l4[17];
        entries(l4);
        u32 off[8], wid[8];
#pragma unroll
        for (int p = 0; p < 16; p += 2) {
            const CellAffine c0 = cell_affine<BF16>(lut_cell(l4, p), B - 4), c1 = cell_affine<BF16>(lut_cell(l4, p + 1), B - 4);
            off[p / 2] = (u32)c0.offset | ((u32)c1.offset << 16);
            wid[p / 2] = (u32)c0.width | ((u32)c1.width << 16);
        }
        offset.tables(off);
        width.tables(wid);
    }
    APL_HD void load(const u16* row_lut, bool valid, bool) { fetch(row_lut, valid); build(BF16); }

    // Selectors s and s+4 of a plane word, as RegLut<B>::select2: w[i] = columns of nibbles
    // (2i, 2i + 1) of the cell word.
    APL_HD void select2(const CellCodes<B>& c, int s, u32 (&w)[4]) const {
        u32 o[4], d[4];
        offset.select2(c.cell, s, o);
        width.select2(c.cell, s, d);
        const u32 q = c.q[s & 3];
        w[0] = act_fma2<BF16>(d[0], fraction_pair<BF16, 0, 1>(q), o[0]);
        w[1] = act_fma2<BF16>(d[1], fraction_pair<BF16, 2, 3>(q), o[1]);
        w[2] = act_fma2<BF16>(d[2], fraction_pair<BF16, 4, 5>(q), o[2]);
        w[3] = act_fma2<BF16>(d[3], fraction_pair<BF16, 6, 7>(q), o[3]);
    }
};

// The decode regime's 5-8-bit row tables: the row's 16 cells (offset | width << 16, act values,
// cell_affine) as 32-bit words in shared memory, in a column this thread alone reads and writes:
// column = a 2 KB-aligned base + (warp << 12 | lane << 2) for row a, + 2 KB for row b; cell c at
// column | c << 7. Every lane's words sit in bank `lane`, so each lookup is one conflict-free LDS
// whatever the codes, and no barrier is needed between the fill (build) and the first lookup.
// A weight costs its cell code's shift (a multiply, the FMA pipe), one LOP3 for the address and
// the LDS, then per two weights two PRMTs pair the offsets and widths, fraction_pair makes the
// refinement fractions and one packed FMA the two values: where CellLut spends two 4-bit
// register-table lookups (six PRMTs and a LOP3 per four weights a table) per weight.
// Same values as CellLut and apl_format.expand_lut, bit for bit.
constexpr u32 CELL_TAB_ROW_BYTES = 2048, CELL_TAB_BYTES = 4 * 2 * CELL_TAB_ROW_BYTES, CELL_TAB_ALIGN = 2048;
template <int B, bool BF16>
struct CellTab : Lut4Row {
    using CodesT = CellCodes<B>;
    u32 col;  // this thread's column for its row

    APL_HD explicit CellTab(u32 column) : col(column) {}
    APL_HD void build(bool) {
        u16 l4[17];
        entries(l4);
#pragma unroll
        for (int p = 0; p < 16; ++p) {
            const CellAffine c = cell_affine<BF16>(lut_cell(l4, p), B - 4);
            sts_u32(col | (u32)p << 7, (u32)c.offset | ((u32)c.width << 16));
        }
    }
    APL_HD void load(const u16* row_lut, bool valid, bool) { fetch(row_lut, valid); build(BF16); }

    // Nibble N of the cell word o at bits 7..10 (the cell's offset in the column), by a multiply.
    template <int N>
    APL_HD u32 cell_bits(u32 o) const {
        constexpr int S = 4 * N - 7;
        if constexpr (S < 0) return o * (1u << -S);
        else return shr_pipe<true, S>(o);
    }
    template <int N>
    APL_HD u32 cell(u32 o) const { return lds_u32(mask_or<0xFu << 7>(cell_bits<N>(o), col)); }
    // Selectors s and s+4 of a plane word, as CellLut::select2.
    APL_HD void select2(const CellCodes<B>& c, int s, u32 (&w)[4]) const {
        const u32 o = c.cell.o[s & 3], q = c.q[s & 3];
        const u32 v0 = cell<0>(o), v1 = cell<1>(o), v2 = cell<2>(o), v3 = cell<3>(o);
        const u32 v4 = cell<4>(o), v5 = cell<5>(o), v6 = cell<6>(o), v7 = cell<7>(o);
        w[0] = act_fma2<BF16>(prmt(v0, v1, 0x7632u), fraction_pair<BF16, 0, 1>(q), prmt(v0, v1, 0x5410u));
        w[1] = act_fma2<BF16>(prmt(v2, v3, 0x7632u), fraction_pair<BF16, 2, 3>(q), prmt(v2, v3, 0x5410u));
        w[2] = act_fma2<BF16>(prmt(v4, v5, 0x7632u), fraction_pair<BF16, 4, 5>(q), prmt(v4, v5, 0x5410u));
        w[3] = act_fma2<BF16>(prmt(v6, v7, 0x7632u), fraction_pair<BF16, 6, 7>(q), prmt(v6, v7, 0x5410u));
    }
};

// A width as a type, for generic lambdas (NVRTC has no std::integral_constant).
template <int B> struct Width { static constexpr int value = B; };

// A row's register tables at B bits: RegLut's entries up to 4 bits, CellLut's cells above.
template <int B, bool BF16, bool CELL = (B >= 5)> struct RowLutOf { using type = RegLut<B>; };
template <int B, bool BF16> struct RowLutOf<B, BF16, true> { using type = CellLut<B, BF16>; };
template <int B, bool BF16> using RowLut = typename RowLutOf<B, BF16>::type;

// The byte transpose of four code words: w[j]'s byte c = o[c]'s byte j.
APL_HD void transpose_nibble_bytes(const u32 (&o)[4], u32 (&w)[4]) {
    const u32 t0 = prmt(o[0], o[1], 0x5140u), t1 = prmt(o[0], o[1], 0x7362u);
    const u32 t2 = prmt(o[2], o[3], 0x5140u), t3 = prmt(o[2], o[3], 0x7362u);
    w[0] = prmt(t0, t2, 0x5410u); w[1] = prmt(t0, t2, 0x7632u); w[2] = prmt(t1, t3, 0x5410u); w[3] = prmt(t1, t3, 0x7632u);
}
// One plane word (32 columns) of a 3-4-bit row as 4 chunks of 8 consecutive columns (act x2
// pairs (8j, 8j+1), ..., (8j+6, 8j+7)). Codes<B> puts column 4n + c in nibble n of o[c]; a 4x4
// byte transpose makes W[j] (byte c = o[c]'s byte j), whose nibbles are columns 8j + (0, 4, 1,
// 5, 2, 6, 3, 7), so each lookup half's bytes pair as (0, 2) and (1, 3): 8 PRMTs a word more
// than the tiles regime's selector order, which the activations' copies cannot follow.
template <int B, bool BF16>
APL_HD void dequant_chunks(const RegLut<B>& lut, const u32 (&pw)[8], uint4 (&chunk)[4]) {
    const Codes<B> c(pw);
    u32 w[4];
    transpose_nibble_bytes(c.o, w);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 o = w[j], o3 = B == 4 ? o & 0x77777777u : o;
        u32 p01, p45, p23, p67;
        lut.template lookup<0, 0x6240u, 0x7351u>(o, o3, p01, p45);
        lut.template lookup<1, 0x6240u, 0x7351u>(o, o3, p23, p67);
        chunk[j] = make_uint4(p01, p23, p45, p67);
    }
}
// The same for 5-8 bits from the row's cell tables (CellLut): the cell codes and the refinement
// bits take the same byte transpose, so nibbles pair as (0, 2) and (1, 3) there too.
template <int B, bool BF16>
APL_HD void dequant_chunks(const CellLut<B, BF16>& lut, const u32 (&pw)[8], uint4 (&chunk)[4]) {
    const CellCodes<B> c(pw);
    u32 wc[4], wq[4];
    transpose_nibble_bytes(c.cell.o, wc);
    transpose_nibble_bytes(c.q, wq);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 o = wc[j], o3 = o & 0x77777777u, q = wq[j];
        u32 o01, o45, o23, o67, d01, d45, d23, d67;
        lut.offset.template lookup<0, 0x6240u, 0x7351u>(o, o3, o01, o45);
        lut.offset.template lookup<1, 0x6240u, 0x7351u>(o, o3, o23, o67);
        lut.width.template lookup<0, 0x6240u, 0x7351u>(o, o3, d01, d45);
        lut.width.template lookup<1, 0x6240u, 0x7351u>(o, o3, d23, d67);
        chunk[j] = make_uint4(act_fma2<BF16>(d01, fraction_pair<BF16, 0, 2>(q), o01),
                              act_fma2<BF16>(d23, fraction_pair<BF16, 4, 6>(q), o23),
                              act_fma2<BF16>(d45, fraction_pair<BF16, 1, 3>(q), o45),
                              act_fma2<BF16>(d67, fraction_pair<BF16, 5, 7>(q), o67));
    }
}
// The same from the row's column of a shared-memory cell table (CellTab, the staged producers'):
// one LDS a weight for its cell, the pairs (0, 2), (4, 6), (1, 3), (5, 7) of the transposed nibbles.
template <int B, bool BF16>
APL_HD void dequant_chunks(const CellTab<B, BF16>& lut, const u32 (&pw)[8], uint4 (&chunk)[4]) {
    const CellCodes<B> c(pw);
    u32 wc[4], wq[4];
    transpose_nibble_bytes(c.cell.o, wc);
    transpose_nibble_bytes(c.q, wq);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 o = wc[j], q = wq[j];
        const u32 v0 = lut.template cell<0>(o), v1 = lut.template cell<1>(o), v2 = lut.template cell<2>(o);
        const u32 v3 = lut.template cell<3>(o), v4 = lut.template cell<4>(o), v5 = lut.template cell<5>(o);
        const u32 v6 = lut.template cell<6>(o), v7 = lut.template cell<7>(o);
        chunk[j] = make_uint4(act_fma2<BF16>(prmt(v0, v2, 0x7632u), fraction_pair<BF16, 0, 2>(q), prmt(v0, v2, 0x5410u)),
                              act_fma2<BF16>(prmt(v4, v6, 0x7632u), fraction_pair<BF16, 4, 6>(q), prmt(v4, v6, 0x5410u)),
                              act_fma2<BF16>(prmt(v1, v3, 0x7632u), fraction_pair<BF16, 1, 3>(q), prmt(v1, v3, 0x5410u)),
                              act_fma2<BF16>(prmt(v5, v7, 0x7632u), fraction_pair<BF16, 5, 7>(q), prmt(v5, v7, 0x5410u)));
    }
}

// ---------------------------------------------------------------- routing inside the CTA
// The a-th expert with tokens (ascending id) and its slots (ascending), as moe_align would
// list them; every CTA derives the same answer from topk_ids, so no launch is needed.
struct Route { int expert, count, num_active; };

// Phase 1, the experts with tokens as a bitmask in present[32]. The first round of ids is
// loaded before the barrier that zeroes the mask, so the two round trips overlap.
// BATCH (the tiles regime): rounds of 8 ids a thread, loaded together (in one-id rounds the
// atomics keep each load behind the previous round's atomic: a round trip per 128 ids).
template <bool BATCH>
__device__ __forceinline__ void route_mask(const long long* __restrict__ ids, int num_assign, int num_experts,
                                           u32* present) {
    const int tid = threadIdx.x;
    constexpr int U = BATCH ? 8 : 1;
    long long e[U];
#pragma unroll
    for (int u = 0; u < U; ++u) e[u] = tid + u * GV_THREADS < num_assign ? ids[tid + u * GV_THREADS] : -1;
    if (tid < 32) present[tid] = 0u;
    __syncthreads();
    if constexpr (BATCH) {
        for (int i0 = tid;; i0 += U * GV_THREADS) {
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (e[u] >= 0 && e[u] < num_experts) atomicOr(&present[e[u] >> 5], 1u << (e[u] & 31));
            if (i0 + U * GV_THREADS >= num_assign) break;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = i0 + (U + u) * GV_THREADS;
                e[u] = i < num_assign ? ids[i] : -1;
            }
        }
    } else {
        if (e[0] >= 0 && e[0] < num_experts) atomicOr(&present[e[0] >> 5], 1u << (e[0] & 31));
        for (int i = tid + GV_THREADS; i < num_assign; i += GV_THREADS) {
            const long long e1 = ids[i];
            if (e1 >= 0 && e1 < num_experts) atomicOr(&present[e1 >> 5], 1u << (e1 & 31));
        }
    }
    __syncthreads();
}

// HEAVY order (the merged kernel's, apl_gemv): the sort key of a block of these bits, widest first; bits
// outside 3..8 (a block whose CTAs only write NaN) first of all.
__device__ __forceinline__ int heavy_key(long long bits) { return bits < 3 || bits > 8 ? 0 : 9 - (int)bits; }

// The bits of expert e's block (0 past the layer): warp 0 loads those of experts lane and lane + 32
// before the mask is built (route_cta), so at Mixtral and Qwen1.5-MoE sizes the pick waits on no load.
__device__ __forceinline__ long long block_bits(const long long* __restrict__ desc, int e, int num_experts) {
    return e < num_experts ? desc[(long long)e * DESC_WIDTH] : 0;
}

// Warp 0 of route_pick under HEAVY: scratch[0] = the a-th expert with tokens in the order (key,
// ascending id), scratch[1] = how many have tokens. A launch whose blocks differ in width (the
// merged kernel) then starts its longest CTAs first and ends on short ones, instead of a tail of
// the widest expert's CTAs when that expert has the largest id. bits01: block_bits of experts
// lane and lane + 32.
__device__ __forceinline__ void pick_heavy_first(int a, const u32* present, const long long* __restrict__ desc,
                                                 int num_experts, const long long (&bits01)[2], int* scratch) {
    const int lane = threadIdx.x & 31;
    auto key_at = [&](int j0) {  // -1: no tokens (or past the layer)
        const int e = j0 + lane;
        if (e >= num_experts || !((present[e >> 5] >> (e & 31)) & 1u)) return -1;
        return heavy_key(j0 == 0 ? bits01[0] : j0 == 32 ? bits01[1] : block_bits(desc, e, num_experts));
    };
    int count[7];
#pragma unroll
    for (int q = 0; q < 7; ++q) count[q] = 0;
    for (int j0 = 0; j0 < num_experts; j0 += 32) {
        const int key = key_at(j0);
#pragma unroll
        for (int q = 0; q < 7; ++q) count[q] += __popc(__ballot_sync(0xffffffffu, key == q));
    }
    int total = 0, target = -1, rank = 0;
#pragma unroll
    for (int q = 0; q < 7; ++q) {
        if (target < 0 && a < total + count[q]) { target = q; rank = a - total; }
        total += count[q];
    }
    if (lane == 0) scratch[1] = total;
    if (target < 0) return;  // (warp-uniform) a >= total: this CTA has no expert
    for (int j0 = 0, seen = 0; j0 < num_experts && seen <= rank; j0 += 32) {
        const bool hit = key_at(j0) == target;  // (past 64 experts: the loads above, now in L1)
        const u32 ballot = __ballot_sync(0xffffffffu, hit);
        if (hit && seen + __popc(ballot & ((1u << lane) - 1u)) == rank) scratch[0] = j0 + lane;
        seen += __popc(ballot);
    }
}

// Phase 2 (after route_mask): the a-th expert with tokens and its slots.
template <bool BATCH, bool HEAVY = false>
__device__ __forceinline__ Route route_pick(const long long* __restrict__ ids, int num_assign, int a, int* slots,
                                            const u32* present, int* scratch, const long long* __restrict__ desc = nullptr,
                                            int num_experts = 0, const long long (&bits01)[2] = {0, 0},
                                            bool heavy = HEAVY) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (HEAVY && heavy && warp == 0) {
        pick_heavy_first(a, present, desc, num_experts, bits01, scratch);
    } else if (warp == 0) {
        const u32 v = present[lane];
        int incl = __popc(v);
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int n = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += n;
        }
        const int excl = incl - __popc(v);
        if (a >= excl && a < incl) {
            u32 bits = v;
            for (int k = a - excl; k > 0; --k) bits &= bits - 1;  // drop the lower set bits
            scratch[0] = 32 * lane + __ffs(bits) - 1;
        }
        if (lane == 31) scratch[1] = incl;
    }
    __syncthreads();
    Route r;
    r.num_active = scratch[1];
    r.expert = a < r.num_active ? scratch[0] : -1;
    r.count = 0;
    if (r.expert < 0) return r;
    if constexpr (BATCH) {
        // Thread tid owns the ids [tid * R, tid * R + R), R = ceil(num_assign / 128) <= 32 (the host
        // keeps num_assign <= GEMV_MAX_ASSIGN = 4096): its hits as a bitmask from loads issued 8 at
        // a time, then one block-wide scan of the hit counts places its slots, in ascending order:
        // the same list as the rounds below, which take a round trip and two barriers per 128 ids.
        const int R = (num_assign + GV_THREADS - 1) / GV_THREADS, i0 = tid * R;
        u32 hits = 0u;
        for (int q0 = 0; q0 < R; q0 += 8) {
            long long e[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) e[u] = q0 + u < R && i0 + q0 + u < num_assign ? ids[i0 + q0 + u] : -1;
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (e[u] == r.expert) hits |= 1u << (q0 + u);  // (r.expert >= 0: never an id past R)
        }
        const int own = __popc(hits);
        int incl = own;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int n = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += n;
        }
        if (lane == 31) scratch[2 + warp] = incl;  // (scratch[0..1] are only read past the barrier above)
        __syncthreads();
        int before = incl - own;
        for (int w = 0; w < warp; ++w) before += scratch[2 + w];
        for (u32 b = hits; b != 0u; b &= b - 1u) slots[before++] = i0 + __ffs(b) - 1;
        r.count = scratch[2] + scratch[3] + scratch[4] + scratch[5];
        __syncthreads();
        return r;
    }
    int base = 0;
    for (int i0 = 0; i0 < num_assign; i0 += GV_THREADS) {
        const int i = i0 + tid;
        const bool hit = i < num_assign && ids[i] == r.expert;
        const u32 ballot = __ballot_sync(0xffffffffu, hit);
        __syncthreads();  // previous round done with scratch
        if (lane == 0) scratch[2 + warp] = __popc(ballot);
        __syncthreads();
        int before = base;
        for (int w = 0; w < warp; ++w) before += scratch[2 + w];
        if (hit) slots[before + __popc(ballot & ((1u << lane) - 1u))] = i;
        base += scratch[2] + scratch[3] + scratch[4] + scratch[5];
    }
    __syncthreads();
    r.count = base;
    return r;
}

template <bool BATCH, bool HEAVY = false>
__device__ __forceinline__ Route route_cta(const long long* __restrict__ ids, int num_assign, int num_experts,
                                           int a, int* slots, u32* present, int* scratch,
                                           const long long* __restrict__ desc = nullptr, bool heavy = HEAVY) {
    long long bits01[2] = {0, 0};
    if (HEAVY && heavy && threadIdx.x < 32) {
        bits01[0] = block_bits(desc, threadIdx.x, num_experts);
        bits01[1] = block_bits(desc, threadIdx.x + 32, num_experts);
    }
    route_mask<BATCH>(ids, num_assign, num_experts, present);
    return route_pick<BATCH, HEAVY>(ids, num_assign, a, slots, present, scratch, desc, num_experts, bits01, heavy);
}

// ---------------------------------------------------------------- one warp step
// Plane words of one step into buf [row a/b][word 0/1][plane]. Words past the split are
// clamped to its last word (valid memory, any codes): their staged activations are zero.
// V2: the layer's planes are 8-byte aligned with an even number of words per row, so a
// thread's two words come in one 8-byte load (a quad reads 32 contiguous bytes per row).
// HINT: the instance's NT8 is at least APL_PLANE_HINT_MIN_NT8, or it is a decode instance the host
// launches for long splits only (LONG, plan.long_split: 64+ words, so the 256 bytes an
// L2::256B load fetches per row and plane are all the split's own) (load_hint).
template <int NT8, bool LONG = false>
__host__ __device__ constexpr bool load_hint() { return NT8 >= APL_PLANE_HINT_MIN_NT8 || LONG; }
template <int B, bool V2, bool HINT = false>
__device__ __forceinline__ void load_step(const BlockRef& blk, u32 w0a, u32 w0b, int kw, int step,
                                          u32 (&buf)[2][2][8]) {
    const int t = threadIdx.x & 3;
    if constexpr (V2) {
        const u32 w = (u32)min(step * GV_STEP_WORDS + 2 * t, kw - 2);
#pragma unroll
        for (int p = 0; p < 8; ++p) {
            if (p < B) {
                const uint2 a = ldg_plane_u64<HINT>(blk.planes[p] + (w0a + w)), b = ldg_plane_u64<HINT>(blk.planes[p] + (w0b + w));
                buf[0][0][p] = a.x; buf[0][1][p] = a.y; buf[1][0][p] = b.x; buf[1][1][p] = b.y;
            }
        }
    } else {
#pragma unroll
        for (int wi = 0; wi < 2; ++wi) {
            const u32 w = (u32)min(step * GV_STEP_WORDS + 2 * t + wi, kw - 1);
#pragma unroll
            for (int p = 0; p < 8; ++p) {
                if (p < B) {
                    buf[0][wi][p] = ldg_plane_u32<HINT>(blk.planes[p] + (w0a + w));
                    buf[1][wi][p] = ldg_plane_u32<HINT>(blk.planes[p] + (w0b + w));
                }
            }
        }
    }
}

// One plane word of rows a and b (pa, pb: its B plane words) times the staged activations of
// token row x_row: word w of the split.
template <int B, bool BF16, class Lut>
__device__ __forceinline__ void compute_word(const Lut& la, const Lut& lb, const u16* xs, int tstride, int x_row,
                                             const u32 (&pa)[8], const u32 (&pb)[8], int w, float (&acc)[4]) {
    uint4 xb[4];
    // Lanes of tokens past this pass read the zero row staged after the last token.
    const uint4* xw = reinterpret_cast<const uint4*>(xs + x_row * tstride + w * 32);
#pragma unroll
    for (int q = 0; q < 4; ++q) xb[q] = xw[q ^ ((w >> 1) & 3)];
    const typename Lut::CodesT ca(pa), cb(pb);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        u32 wa[4], wb[4];  // selectors s and s+4 of rows a and b
        la.select2(ca, s, wa);
        lb.select2(cb, s, wb);
        const uint4 v = xb[s >> 1], u = xb[2 + (s >> 1)];
        mma16816<BF16>(acc, wa[0], wb[0], wa[1], wb[1], (s & 1) ? v.z : v.x, (s & 1) ? v.w : v.y);
        mma16816<BF16>(acc, wa[2], wb[2], wa[3], wb[3], (s & 1) ? u.z : u.x, (s & 1) ? u.w : u.y);
    }
}

// One step of plane words (buf) times the staged activations of token row x_row, into acc.
template <int B, bool BF16, class Lut>
__device__ __forceinline__ void compute_step(const Lut& la, const Lut& lb, const u16* xs, int tstride, int x_row,
                                             const u32 (&buf)[2][2][8], int step, float (&acc)[4]) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int wi = 0; wi < 2; ++wi)
        compute_word<B, BF16>(la, lb, xs, tstride, x_row, buf[0][wi], buf[1][wi], step * GV_STEP_WORDS + 2 * t + wi, acc);
}

// COMPACT (gemv_warp): the same words in the same order, with the two words of a step in a rolled
// loop (word 1 picked by SEL, not by unrolling), so the step's code exists once.
template <int B, bool BF16, class Lut>
__device__ __forceinline__ void compute_step_rolled(const Lut& la, const Lut& lb, const u16* xs, int tstride,
                                                    int x_row, const u32 (&buf)[2][2][8], int step, float (&acc)[4]) {
    const int t = threadIdx.x & 3;
#pragma unroll 1
    for (int wi = 0; wi < 2; ++wi) {
        u32 pa[8], pb[8];
#pragma unroll
        for (int p = 0; p < 8; ++p) {
            pa[p] = wi ? buf[0][1][p] : buf[0][0][p];
            pb[p] = wi ? buf[1][1][p] : buf[1][0][p];
        }
        compute_word<B, BF16>(la, lb, xs, tstride, x_row, pa, pb, step * GV_STEP_WORDS + 2 * t + wi, acc);
    }
}

// ---------------------------------------------------------------- the mainloop of one warp
// acc = the C fragment: (row g, tokens 2t, 2t+1), (row g+8, tokens 2t, 2t+1).
// xs: staged activations [token][word][4 chunks of 16 B]; chunk q of word w is stored at
// q ^ ((w >> 1) & 3), so the 4 threads of a quad read different banks. Plane words are
// loaded one step ahead in registers (2 rows x 2 words x B planes); b0 arrives holding step 0.
template <int B, bool BF16, bool V2, bool COMPACT, bool LONG, class Lut>
__device__ __forceinline__ void gemv_warp(const BlockRef& blk, u32 w0a, u32 w0b, const Lut& la, const Lut& lb,
                                          int kw, const u16* xs, int tstride, int x_row, u32 (&b0)[2][2][8],
                                          float (&acc)[4]) {
    const int t = threadIdx.x & 3;
    const int steps = (kw + GV_STEP_WORDS - 1) / GV_STEP_WORDS;
    auto compute = [&](const u32 (&buf)[2][2][8], int step) {
        compute_step<B, BF16>(la, lb, xs, tstride, x_row, buf, step, acc);
    };
    // The 32-byte sectors of a step: 16 rows x B planes; lane (g, t) asks for row g / g+8,
    // planes t, t+4 (t < 2B). Only the L2 is asked: the registers hold one step ahead.
    auto prefetch = [&](int step) {
        if (!APL_GEMV_L2_PREFETCH || step >= steps) return;
        const u32 w = (u32)(step * GV_STEP_WORDS);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int combo = t + 4 * c, p = combo >> 1;
            if (combo < 2 * B) {
#pragma unroll
                for (int q = 0; q < 8; ++q)  // planes[] indexed by constants only
                    if (q == p) prefetch_l2(blk.planes[q] + ((combo & 1) ? w0b : w0a) + w);
            }
        }
    };
    u32 b1[2][2][8];  // ping-pong: one step in flight while the other is used
    prefetch(1);
    if constexpr (COMPACT) {
        // One copy of the step's code: step + 1 loads into b1 during step's compute, then moves
        // to b0 (register moves where the ping-pong would have unrolled a second copy).
#pragma unroll 1
        for (int step = 0; step < steps; ++step) {
            if (step + 1 < steps) load_step<B, V2, load_hint<1, LONG>()>(blk, w0a, w0b, kw, step + 1, b1);
            prefetch(step + 2);
            compute_step_rolled<B, BF16>(la, lb, xs, tstride, x_row, b0, step, acc);
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int wi = 0; wi < 2; ++wi)
#pragma unroll
                    for (int p = 0; p < 8; ++p)
                        if (p < B) b0[r][wi][p] = b1[r][wi][p];
        }
        return;
    }
    for (int step = 0; step < steps; step += 2) {
        if (step + 1 < steps) load_step<B, V2, load_hint<1, LONG>()>(blk, w0a, w0b, kw, step + 1, b1);
        prefetch(step + 2);
        compute(b0, step);
        if (step + 1 >= steps) break;
        if (step + 2 < steps) load_step<B, V2, load_hint<1, LONG>()>(blk, w0a, w0b, kw, step + 2, b0);
        prefetch(step + 3);
        compute(b1, step + 1);
    }
}

// ---------------------------------------------------------------- wgmma (sm_90a), the tiles regime
// On sm_90a (APL_HAS_WGMMA) a pass's 8 * NT8 tokens are the N of one warpgroup wgmma.m64nNk16
// per k16 slice, A (the CTA's 64 weight rows) from the registers the dequantisation fills,
// exactly the mma.sync A fragments (warp w: rows 16w..16w+15), B (the staged activations) read
// by the tensor cores from shared memory, so one instruction replaces NT8 mma.sync and their
// activation loads. D: warp w's
// rows, 8-token chunk j in acc[j], the mma.sync C layout. Other GPUs run mma.sync (tiles_warp).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define APL_HAS_WGMMA 1
#else
#define APL_HAS_WGMMA 0
#endif
// (Host branches: apl_host.h's CTA emulation runs a wgmma at the wait_group that covers it, and a
// cp.async copy lands when it is issued, so the fences have nothing to order there.)
APL_HD void wgmma_fence() {
#ifdef __CUDA_ARCH__
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
APL_HD void wgmma_commit() {
#ifdef __CUDA_ARCH__
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#else
    host_wgmma_commit();
#endif
}
template <int N>
APL_HD void wgmma_wait() {
#ifdef __CUDA_ARCH__
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
#else
    host_wgmma_wait(N);
#endif
}
// The compiler sees a wgmma's registers as written when the asm statement issues, but the
// tensor cores write the accumulators (and read A) until the wait_group: these empty volatile
// statements pin every access to them to its side of the fence or wait (CUTLASS's
// warpgroup_fence_operand), whatever the compiler's scheduling (nvcc 13.0 happens to emit
// the same SASS without them).
template <int N8>
APL_HD void fence_accumulators(float (&acc)[N8][4]) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(acc[j][i]) :: "memory");
#endif
}
__device__ __forceinline__ void fence_registers(u32 (&r)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
}
// Shared memory written by ordinary stores and read next by wgmma (the async proxy).
APL_HD void fence_proxy_async() {
#ifdef __CUDA_ARCH__
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// The B operand's descriptor, no swizzle, K-major: 8-token x 16-byte core matrices of 128
// contiguous bytes, the slice's second 8 k at +128 bytes (leading byte offset), the next 8
// tokens at +256 (stride byte offset). Addresses and offsets in 16-byte units.
APL_HD unsigned long long wgmma_desc(u32 smem_addr) {
    return (unsigned long long)((smem_addr & 0x3FFFFu) >> 4) | ((unsigned long long)(128 >> 4) << 16) |
           ((unsigned long long)(256 >> 4) << 32);
}

// acc += A (rows of this warp: a0 = (g, k 2t..), a1 = (g+8, k 2t..), a2 = (g, k 2t+8..), a3 =
// (g+8, k 2t+8..)) x B (the slice at desc), N = 8 * N8 tokens. One asm text per shape and
// dtype (PTX names both in the opcode): APL_WGMMA_RS(shape, type, D operands, A, desc, scale-d,
// the accumulators' constraints).
#define APL_ACC4(j) "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
#define APL_ACC8 APL_ACC4(0), APL_ACC4(1)
#define APL_ACC16 APL_ACC8, APL_ACC4(2), APL_ACC4(3)
#define APL_ACC32 APL_ACC16, APL_ACC4(4), APL_ACC4(5), APL_ACC4(6), APL_ACC4(7)
#define APL_ACC48 APL_ACC32, APL_ACC4(8), APL_ACC4(9), APL_ACC4(10), APL_ACC4(11)
#define APL_WGMMA_RS(SHAPE, TY, D, A, DESC, SCALE, ...)                                                      \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." \
                 TY "." TY " {" D "}, {" A "}, " DESC ", p, 1, 1, 0;\n}"                                       \
                 : __VA_ARGS__ : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1) : "memory")
// The shape's bf16 or f16 form, by the template's BF16.
#define APL_WGMMA_RS_ACT(SHAPE, ...) \
    if constexpr (BF16) APL_WGMMA_RS(SHAPE, "bf16", __VA_ARGS__); else APL_WGMMA_RS(SHAPE, "f16", __VA_ARGS__)
#define APL_D8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define APL_D16 APL_D8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define APL_D32 APL_D16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define APL_D48 APL_D32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
template <int N8, bool BF16>
__device__ __forceinline__ void wgmma_rs(float (&acc)[N8][4], u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long desc) {
#if APL_HAS_WGMMA
    if constexpr (N8 == 2) { APL_WGMMA_RS_ACT("m64n16k16", APL_D8, "%8, %9, %10, %11", "%12", "%13", APL_ACC8); }
    else if constexpr (N8 == 4) { APL_WGMMA_RS_ACT("m64n32k16", APL_D16, "%16, %17, %18, %19", "%20", "%21", APL_ACC16); }
    else if constexpr (N8 == 8) { APL_WGMMA_RS_ACT("m64n64k16", APL_D32, "%32, %33, %34, %35", "%36", "%37", APL_ACC32); }
    else if constexpr (N8 == 12) { APL_WGMMA_RS_ACT("m64n96k16", APL_D48, "%48, %49, %50, %51", "%52", "%53", APL_ACC48); }
#endif
}

// ---------------------------------------------------------------- the tiles regime (NT8 > 1)
// Many tokens per expert (prefill, large decode batches): a pass holds up to 8 * NT8 tokens,
// so each weight is dequantised once per pass (once per layer call for an expert with at most
// 8 * NT8 tokens) and its A fragments feed NT8 mma, one per 8-token tile. The activations are
// staged one warp step (256 columns) at a time, so the staging buffer does not bound the
// split (a split of the whole row keeps the fp32 partials small). stage_chunk(step) stages
// step `step` of every token of the pass (it holds the barriers); plane words are loaded one
// step ahead in registers as in gemv_warp, so their loads overlap the staging. stage_chunk
// returns the staged step's buffer.
template <int B, int NT8, bool BF16, bool V2, class Lut, class StageChunk>
__device__ __forceinline__ void tiles_warp(const BlockRef& blk, u32 w0a, u32 w0b, const Lut& la, const Lut& lb,
                                           int kw, const u16* xs, int tstride, int np, u32 (&b0)[2][2][8],
                                           float (&acc)[NT8][4], StageChunk stage_chunk) {
    const int steps = (kw + GV_STEP_WORDS - 1) / GV_STEP_WORDS;
#if APL_HAS_WGMMA
    // One wgmma per k16 slice (stage_async's layout: slice 8 wi + s holds selector s of words
    // 2t + wi, t = 0..3, of every pass token). A stage is one selector pair's 8 A registers and
    // its two wgmma; one stage stays in flight while the next is dequantised. The step ends with
    // every wgmma done, so the next staging may overwrite the slices.
    auto compute = [&](const u32 (&buf)[2][2][8], const u16* xsb) {
        const unsigned long long desc0 = wgmma_desc(shared_addr(xsb));
        fence_accumulators(acc);
#pragma unroll
        for (int wi = 0; wi < 2; ++wi) {
            const typename Lut::CodesT ca(buf[0][wi]), cb(buf[1][wi]);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                u32 wa[4], wb[4];  // selectors s and s + 4 of rows a and b
                la.select2(ca, s, wa);
                lb.select2(cb, s, wb);
                fence_registers(wa);  // A is complete before the fence
                fence_registers(wb);
                wgmma_fence();
                wgmma_rs<NT8, BF16>(acc, wa[0], wb[0], wa[1], wb[1], desc0 + (unsigned long long)((8 * wi + s) * NT8 * 16));
                wgmma_rs<NT8, BF16>(acc, wa[2], wb[2], wa[3], wb[3], desc0 + (unsigned long long)((8 * wi + s + 4) * NT8 * 16));
                wgmma_commit();
                wgmma_wait<1>();
            }
        }
        wgmma_wait<0>();
        fence_accumulators(acc);
    };
#else
    // 5-8 bits hold twice the plane words in flight: groups of 2 there, for the register budget.
    constexpr int TG_MAX = B >= 5 && APL_TILES_GROUP > 2 ? 2 : APL_TILES_GROUP;
    constexpr int TG = NT8 < TG_MAX ? NT8 : TG_MAX;
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    auto compute = [&](const u32 (&buf)[2][2][8], const u16* xsb) {
#pragma unroll
        for (int wi = 0; wi < 2; ++wi) {
            const int wl = 2 * t + wi;  // word within the staged step
            const typename Lut::CodesT ca(buf[0][wi]), cb(buf[1][wi]);
            u32 wa[4][4], wb[4][4];  // selectors s and s+4 of rows a and b, s = 0..3
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                la.select2(ca, s, wa[s]);
                lb.select2(cb, s, wb[s]);
            }
            // Tiles in groups of TG: the group's activations are loaded first, so its TG
            // accumulation chains interleave (one chain alone waits on each mma's latency).
#pragma unroll
            for (int j0 = 0; j0 < NT8; j0 += TG) {
                if (8 * j0 >= np) break;  // CTA-uniform: groups past the pass's tokens
                uint4 xb[TG][4];
#pragma unroll
                for (int jj = 0; jj < TG; ++jj) {
                    // Tokens past the pass read the zero row staged after the last token.
                    const uint4* xw = reinterpret_cast<const uint4*>(xsb + min(8 * (j0 + jj) + g, np) * tstride + wl * 32);
#pragma unroll
                    for (int q = 0; q < 4; ++q) xb[jj][q] = xw[q ^ ((wl >> 1) & 3)];
                }
#pragma unroll
                for (int s = 0; s < 4; ++s)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int jj = 0; jj < TG; ++jj) {
                            const uint4 v = xb[jj][2 * h + (s >> 1)];
                            mma16816<BF16>(acc[j0 + jj], wa[s][2 * h], wb[s][2 * h], wa[s][2 * h + 1], wb[s][2 * h + 1],
                                           (s & 1) ? v.z : v.x, (s & 1) ? v.w : v.y);
                        }
            }
        }
    };
#endif
    u32 b1[2][2][8];
    for (int step = 0; step < steps; step += 2) {
        if (step + 1 < steps) load_step<B, V2, load_hint<NT8>()>(blk, w0a, w0b, kw, step + 1, b1);
        compute(b0, stage_chunk(step));
        if (step + 1 >= steps) break;
        if (step + 2 < steps) load_step<B, V2, load_hint<NT8>()>(blk, w0a, w0b, kw, step + 2, b0);
        compute(b1, stage_chunk(step + 1));
    }
}

// Every pass of up to stage_tokens tokens over this CTA's split. The first step's plane
// sectors are asked of L2 before the LUT (prologue) and the activations (stage) are read, so
// those loads overlap (L2, not registers: the 128-register budget has no room for them).
// NT8 > 1: the tiles regime (tiles_warp); stage then stages one step: stage(p0, np, step).
template <int B, bool BF16, bool V2, int NT8, bool COMPACT,
          bool LONG, class Lut, class Prologue, class Stage, class Emit>
__device__ __forceinline__ void run_passes(const BlockRef& blk, u32 w0a, u32 w0b, Lut& la, Lut& lb, int kw,
                                           const u16* xs, int tstride, int count, int stage_tokens,
                                           Prologue prologue, Stage stage, Emit emit) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // lane t: (row, plane) pairs t, t+4, ... of the first step
        const int combo = t + 4 * c, p = combo >> 1;
#pragma unroll
        for (int q = 0; q < 8; ++q)  // planes[] indexed by constants only
            if (q == p && combo < 2 * B) prefetch_l2(blk.planes[q] + ((combo & 1) ? w0b : w0a));
    }
    prologue(la, lb);  // register LUTs: the entries' loads are issued here, built below
    if constexpr (NT8 > 1) {
        la.build(BF16);
        lb.build(BF16);
        for (int p0 = 0; p0 < count; p0 += stage_tokens) {
            const int np = min(stage_tokens, count - p0);
            float acc[NT8][4];
#pragma unroll
            for (int j = 0; j < NT8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
            u32 b0[2][2][8];
            load_step<B, V2, load_hint<NT8>()>(blk, w0a, w0b, kw, 0, b0);
            tiles_warp<B, NT8, BF16, V2>(blk, w0a, w0b, la, lb, kw, xs, tstride, np, b0, acc,
                                         [&](int step) { return stage(p0, np, step); });
#pragma unroll
            for (int j = 0; j < NT8; ++j)
                if (8 * j < np) emit(p0 + 8 * j, min(8, np - 8 * j), acc[j]);
        }
    } else {
        for (int p0 = 0; p0 < count; p0 += stage_tokens) {
            const int np = min(stage_tokens, count - p0);
            stage(p0, np, -1);
            if (p0 == 0) { la.build(BF16); lb.build(BF16); }  // the LUT loads overlapped the staging
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
            u32 b0[2][2][8];
            load_step<B, V2, load_hint<1, LONG>()>(blk, w0a, w0b, kw, 0, b0);
            gemv_warp<B, BF16, V2, COMPACT, LONG>(blk, w0a, w0b, la, lb, kw, xs, tstride, min(g, np), b0, acc);
            emit(p0, np, acc);
        }
    }
}

// ---------------------------------------------------------------- staging the activations
// The tiles regime: one step (8 words) of a pass's tokens at a time. Raw rows [token][word][4
// chunks of 16 B] (chunk q at q ^ ((w >> 1) & 3)) after the LUT rows, then each pass token's row
// offset in x (the host adds 512 + 8 * NT8 * (512 + 4) bytes). Step s + 1 is copied in by
// cp.async while step s's mma run; at its turn it is reordered into xs (shared to shared). A
// thread copies chunk q = tid % 4 of word wl = tid / 4 % 8 of tokens tid / 32, + 4, + 8, ...
// WG (wgmma, on sm_90a; other GPUs run mma.sync): raw rows padded to 528 bytes, so the wgmma
// staging's 8 tokens per 8 threads read different banks.
template <int MODE, int NT8>
struct TilesStager {
    static constexpr bool WG = NT8 > 1 && APL_HAS_WGMMA;
    static constexpr int RAW_ROW = WG ? 264 : 256;  // u16 per token of raw
    static constexpr int CP_TOKENS = GV_THREADS / 32;  // tokens a round of copies
    const u16* __restrict__ x;
    const int* slots;
    u16* xs;
    u16* raw_s;
    int* rowoff_s;
    int top_k, cols, c0w, kw, steps;
    int cp_wl, cp_q, cp_t0;  // this thread's word, chunk and first token of the copies
    u32 cp_dst;

    __device__ __forceinline__ TilesStager(const u16* __restrict__ x_, const int* slots_, u16* xs_, u16* raw_s_,
                                           int stage_tokens, int top_k_, int cols_, int c0w_, int kw_)
        : x(x_), slots(slots_), xs(xs_), raw_s(raw_s_), rowoff_s(reinterpret_cast<int*>(raw_s_ + stage_tokens * RAW_ROW)),
          top_k(top_k_), cols(cols_), c0w(c0w_), kw(kw_), steps((kw_ + GV_STEP_WORDS - 1) / GV_STEP_WORDS),
          cp_wl((threadIdx.x >> 2) & 7), cp_q(threadIdx.x & 3), cp_t0(threadIdx.x >> 5),
          cp_dst(shared_addr(raw_s_ + cp_wl * 32 + (cp_q ^ ((cp_wl >> 1) & 3)) * 8)) {}

    // The copies of step `step` of the pass's np tokens, one commit group.
    __device__ __forceinline__ void issue(int np, int step) const {
        const int w = step * GV_STEP_WORDS + cp_wl;
        const bool ok = w < kw;  // words past the split: zeros
        const u16* src = x + (ok ? (c0w + w) * 32 + cp_q * 8 : 0);
        // The row offsets of 4 tokens are read before their 4 copies issue (each copy's "memory"
        // clobber would keep the next token's shared read behind it: a shared round trip per token).
        for (int i0 = cp_t0; i0 < np; i0 += 4 * CP_TOKENS) {
            int off[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) off[u] = ok && i0 + u * CP_TOKENS < np ? rowoff_s[i0 + u * CP_TOKENS] : 0;
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (i0 + u * CP_TOKENS < np) cp_async16(cp_dst + (i0 + u * CP_TOKENS) * (2 * RAW_ROW), src + off[u], ok ? 16u : 0u);
        }
        cp_async_commit();
    }
    // Step `step` of tokens p0..p0+np-1 into xs (tiles_warp's stage_chunk), the next one's copies issued.
    __device__ __forceinline__ void stage(int p0, int np, int step) const {
        const int tid = threadIdx.x;
        const int tstride = GV_STEP_WORDS * 32 + 32;
        if (step == 0) {  // a pass's first step (raw and rowoff_s are free: see below)
            if constexpr (MODE == 1) grid_dependency_wait();  // down: h is the grid before's output
            for (int i = tid; i < np; i += GV_THREADS) {
                const int slot = slots[p0 + i];
                rowoff_s[i] = (MODE == 0 ? slot / top_k : slot) * cols;  // < 2^31: checked by the host
            }
            __syncthreads();
            issue(np, 0);
        }
        cp_async_wait<0>();
        __syncthreads();  // raw holds this step for every thread; the previous mma are done with xs
        if constexpr (WG) {
            // The wgmma B layout: slice 8 wi + s (s = 0..7) of token n is 16 k values, k 2t, 2t+1
            // = columns sel_col(s, 0..1) of word 2t + wi (t = 0..3) and k 2t+8, 2t+9 = sel_col(s,
            // 2..3): [slice][token / 8][k half][token % 8][16 bytes]. An item (n, wi, h) reads
            // the column pairs 8h..8h+7 of its 4 words (raw chunks 2h, 2h+1) and writes the 4
            // slices of selectors 4h..4h+3. Tokens past the pass are not written: their columns
            // of the product are never read.
            for (int idx = tid; idx < ((np + 7) & ~7) * 4; idx += GV_THREADS) {
                const int n = (idx & 7) | ((idx >> 5) << 3);
                const int wi = (idx >> 3) & 1, h = (idx >> 4) & 1;
                if (n >= np) continue;
                u32 lo[4][4], hi[4][4];  // [selector 4h + r][t]
#pragma unroll
                for (int tw = 0; tw < 4; ++tw) {
                    const u16* src = raw_s + n * RAW_ROW + (2 * tw + wi) * 32;  // chunk q at q ^ tw
                    const uint4 c0 = *reinterpret_cast<const uint4*>(src + ((2 * h) ^ tw) * 8);
                    const uint4 c1 = *reinterpret_cast<const uint4*>(src + ((2 * h + 1) ^ tw) * 8);
                    const u32 pr[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
                    for (int r = 0; r < 4; ++r) selector_pairs(pr, r, lo[r][tw], hi[r][tw]);
                }
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    uint4* dst = reinterpret_cast<uint4*>(xs + (8 * wi + 4 * h + r) * NT8 * 128 + (n >> 3) * 128 + (n & 7) * 8);
                    dst[0] = make_uint4(lo[r][0], lo[r][1], lo[r][2], lo[r][3]);
                    dst[8] = make_uint4(hi[r][0], hi[r][1], hi[r][2], hi[r][3]);  // the second 8 k, +128 bytes
                }
            }
            fence_proxy_async();  // the tensor cores read these stores next
        } else {  // (braced: with `else for`, nvcc 13.0 dropped the barrier below from the WG instances)
            for (int idx = tid; idx < (np + 1) * GV_STEP_WORDS; idx += GV_THREADS) {
                const int i = idx / GV_STEP_WORDS, wl = idx % GV_STEP_WORDS;
                uint4 v[4];
#pragma unroll
                for (int q = 0; q < 4; ++q)  // row np: the zero row
                    v[q] = i < np ? *reinterpret_cast<const uint4*>(raw_s + i * RAW_ROW + wl * 32 + (q ^ ((wl >> 1) & 3)) * 8)
                                  : make_uint4(0u, 0u, 0u, 0u);
                stage_word(v, xs + i * tstride + wl * 32, wl);
            }
        }
        __syncthreads();  // xs ready; every thread is done reading raw
        if (step + 1 < steps) issue(np, step + 1);
    }
};

// ---------------------------------------------------------------- the reductions
// The last CTA to finish its work item's contributions (gemv_cta) sums the splits' fp32 partials.
// The reductions' partials come from L2. BATCH: a round holds U items of a
// thread and the partials of up to SU splits (gate_up) or PU (expert, split) pairs (down) of
// each, all loaded before any is summed: one L2 round trip per round, not one per split of
// every item. The sums run in the same order either way: the same bits.
// gate_up: h[slot] = act(gate) * up over this row tile's rows, for the CTA's expert's `count` slots.
template <bool BF16, bool BATCH>
__device__ __forceinline__ void reduce_gate_up(const float* __restrict__ part, const int* slots, int count, int num_assign,
                                               int rows_w, int rows_out, int r0, int rpc, int splits,
                                               u16* __restrict__ h_out) {
    const int tid = threadIdx.x;
    constexpr int U = 4, SU = 4;
    if constexpr (BATCH) {
        const int n_items = count * rpc;
        const long long split_stride = (long long)num_assign * rows_w;
        for (int idx0 = tid; idx0 < n_items; idx0 += U * GV_THREADS) {
            float gs[U], us[U];
            const float* p[U];
            bool ok[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int idx = idx0 + u * GV_THREADS, c = idx % rpc;
                ok[u] = idx < n_items && r0 + c < rows_out;
                p[u] = part + (long long)(ok[u] ? slots[idx / rpc] : 0) * rows_w + r0 + c;
                gs[u] = 0.f;
                us[u] = 0.f;
            }
            for (int s0 = 0; s0 < splits; s0 += SU) {
                float g[SU][U], v[SU][U];
#pragma unroll
                for (int s = 0; s < SU; ++s)
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const bool in = ok[u] && s0 + s < splits;
                        g[s][u] = in ? __ldcg(p[u] + (s0 + s) * split_stride) : 0.f;
                        v[s][u] = in ? __ldcg(p[u] + (s0 + s) * split_stride + rows_out) : 0.f;
                    }
#pragma unroll
                for (int s = 0; s < SU; ++s)
#pragma unroll
                    for (int u = 0; u < U; ++u)
                        if (s0 + s < splits) {
                            gs[u] += g[s][u];
                            us[u] += v[s][u];
                        }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int idx = idx0 + u * GV_THREADS;
                if (ok[u])
                    h_out[(long long)slots[idx / rpc] * rows_out + r0 + idx % rpc] = float_to_act<BF16>(gate_act(gs[u]) * us[u]);
            }
        }
    } else {
        for (int idx = tid; idx < count * rpc; idx += GV_THREADS) {
            const int i = idx / rpc, c = idx % rpc;
            if (r0 + c >= rows_out) continue;
            const int slot = slots[i];
            float gs = 0.f, us = 0.f;
            for (int s = 0; s < splits; ++s) {
                const float* p = part + ((long long)s * num_assign + slot) * rows_w;
                gs += __ldcg(p + r0 + c);
                us += __ldcg(p + rows_out + r0 + c);
            }
            h_out[(long long)slot * rows_out + r0 + c] = float_to_act<BF16>(gate_act(gs) * us);
        }
    }
}

// down: out[t] = sum_j w[t, j] * sum_split y over this row tile's rows, every token, in a fixed order.
template <bool BF16, bool BATCH>
__device__ __forceinline__ void reduce_down(const float* __restrict__ part, const long long* __restrict__ topk_ids,
                                            const void* __restrict__ topk_w, int w_kind, int num_tokens, int top_k,
                                            int num_experts, int num_assign, int rows_w, int rows_out, int r0, int rpc,
                                            int splits, u16* __restrict__ out) {
    const int tid = threadIdx.x;
    constexpr int U = 4, PU = 4;
    auto weight_of = [&](int slot) {
        return w_kind == 0 ? reinterpret_cast<const float*>(topk_w)[slot]
             : w_kind == 1 ? bf16_to_float(reinterpret_cast<const u16*>(topk_w)[slot])
                           : half_to_float(reinterpret_cast<const u16*>(topk_w)[slot]);
    };
    if constexpr (BATCH) {
        // Pair q = (expert j, split s) in the order below (j outer): the partials of a slot with
        // an invalid expert id are loaded too (the buffer holds every slot) and dropped unread.
        const int n_items = num_tokens * rpc, pairs = top_k * splits;
        for (int idx0 = tid; idx0 < n_items; idx0 += U * GV_THREADS) {
            int tk[U], c[U];
            bool ok[U];
            float sum[U], v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int idx = idx0 + u * GV_THREADS;
                tk[u] = idx / rpc;
                c[u] = idx % rpc;
                ok[u] = idx < n_items && r0 + c[u] < rows_out;
                sum[u] = 0.f;
                v[u] = 0.f;
            }
            for (int q0 = 0; q0 < pairs; q0 += PU) {
                long long e[PU][U];
                float y[PU][U], wt[PU][U];
#pragma unroll
                for (int q = 0; q < PU; ++q) {
                    const int j = (q0 + q) / splits, s = q0 + q - j * splits;
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const bool in = ok[u] && q0 + q < pairs;
                        const int slot = tk[u] * top_k + j;
                        e[q][u] = in ? topk_ids[slot] : -1;
                        y[q][u] = in ? __ldcg(part + ((long long)s * num_assign + slot) * rows_w + r0 + c[u]) : 0.f;
                        wt[q][u] = in ? weight_of(slot) : 0.f;
                    }
                }
#pragma unroll
                for (int q = 0; q < PU; ++q) {
                    if (q0 + q >= pairs) break;
                    const int j = (q0 + q) / splits, s = q0 + q - j * splits;
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        v[u] += y[q][u];
                        if (s == splits - 1) {  // expert j's partials summed
                            if (e[q][u] >= 0 && e[q][u] < num_experts) sum[u] += wt[q][u] * v[u];
                            v[u] = 0.f;
                        }
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (ok[u]) out[(long long)tk[u] * rows_out + r0 + c[u]] = float_to_act<BF16>(sum[u]);
        }
    } else {
        for (int idx = tid; idx < num_tokens * rpc; idx += GV_THREADS) {
            const int tk = idx / rpc, c = idx % rpc;
            if (r0 + c >= rows_out) continue;
            float sum = 0.f;
            for (int j = 0; j < top_k; ++j) {
                const int slot = tk * top_k + j;
                const long long e = topk_ids[slot];
                if (e < 0 || e >= num_experts) continue;
                float v = 0.f;
                for (int s = 0; s < splits; ++s) v += __ldcg(part + ((long long)s * num_assign + slot) * rows_w + r0 + c);
                sum += weight_of(slot) * v;
            }
            out[(long long)tk * rows_out + r0 + c] = float_to_act<BF16>(sum);
        }
    }
}

// ---------------------------------------------------------------- the kernel
// Grid (row tiles, max active experts, column splits), 128 threads.
// MODE 0: rows_out = I, weight rows 2I (gate rows then up rows); the CTA's 64 weight rows
//         are gate rows r0..r0+31 and up rows I+r0..; x = tokens [T, cols]; h_out [T*k, I]
//         by slot.
// MODE 1: rows_out = H = weight rows; x = h [T*k, cols] by slot; out [T, H].
// part: fp32 [splits][num_assign][weight rows]; counters: int32, zero before, zero after.
// w_kind: topk weights' dtype, 0 fp32, 1 bf16, 2 fp16. zero_fill (MODE 1, the first class
// launched): write zeros where no token has a valid expert id.
// NT8: 8-token tiles per pass. 1: decode (a pass's activations staged for the whole split);
// > 1: the tiles regime (stage_tokens <= 8 * NT8 per pass, activations staged a step at a time).
// One CTA's work item (row tile bx, bx < gx; the by-th active expert; column split z of
// `splits`), the body of the kernel below.
template <int CLS, int MODE, bool BF16, bool V2, int NT8, bool HEAVY = false,
          bool LONG = false>
__device__ __forceinline__ void gemv_cta(
    const long long* __restrict__ desc, const long long* __restrict__ topk_ids, int num_assign, int top_k,
    int num_experts, const u16* __restrict__ x, int rows_out, int cols, int split_words, int lut_entries,
    int stage_tokens, float* __restrict__ part, int* __restrict__ counters, u16* __restrict__ h_out,
    const void* __restrict__ topk_w, int w_kind, int num_tokens, u16* __restrict__ out, int zero_fill,
    int bx, int by, int z, int splits, int gx, u32* present, int* scratch, int& last_flag) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int rows_w = MODE == 0 ? 2 * rows_out : rows_out;
    const int rpc = MODE == 0 ? GV_ROWS / 2 : GV_ROWS;
    const int r0 = bx * rpc;
    const int words_per_row = cols / 32;
    const int c0w = z * split_words;
    const int kw = min(split_words, words_per_row - c0w);
    // dynamic shared: slots int [num_assign] | xs u16 [stage_tokens + 1][tstride] | the kernels holding
    // 5-8-bit blocks: the cell table (CellTab) | the tiles regime's raw rows (TilesStager)
    int* slots = reinterpret_cast<int*>(smem_raw);
    // +64 B: consecutive tokens alternate bank halves. The tiles regime stages one step.
    const int tstride = (NT8 == 1 ? split_words : GV_STEP_WORDS) * 32 + 32;
    u16* xs = reinterpret_cast<u16*>(smem_raw + ((num_assign * 4 + 15) & ~15));
    // The 512-byte boundary past xs (then 64 rows of lut_entries u16, which the host passes as 0)
    const u32 lut_off = ((num_assign * 4 + 15) & ~15) + (stage_tokens + 1) * tstride * 2;
    const u32 lut_at = shared_addr(smem_raw) + lut_off;
    u16* lut_s = reinterpret_cast<u16*>(smem_raw + lut_off + (((lut_at + 511u) & ~511u) - lut_at));

    // BATCH: routing and the reductions read their inputs in batches, loads in flight together, in
    // the tiles regime only: at decode (<= 128 ids, the epilogue's few items) it is slower.
    constexpr bool BATCH = NT8 > 1;
    // Programmatic dependent launch, with the host's launch attribute: gate_up waits for the grid before
    // it (the router's output) before it reads anything; down reads only what existed before
    // gate_up started (routing, descriptors, LUTs, planes) until await_h, before its first read of
    // h and its first global write, so its prologue runs while gate_up's last CTAs finish. Both let
    // their dependents launch at once: those take only the SM slots this grid's CTAs leave, once
    // every one of them has started.
    if constexpr (MODE == 0) grid_dependency_wait();
    launch_dependents();
    // HEAVY from 2 tokens: at 1 token it gains nothing (docs/kernel.md).
    const Route route = route_cta<BATCH, HEAVY>(topk_ids, num_assign, num_experts, by, slots, present, scratch, desc,
                                                num_tokens >= 2);
    auto await_h = [&]() {
        if constexpr (MODE == 1) grid_dependency_wait();
    };
    if (MODE == 1 && zero_fill && route.num_active == 0 && by == 0 && z == 0) {
        await_h();
        for (int idx = tid; idx < num_tokens * rpc; idx += GV_THREADS)  // no valid expert id at all
            if (r0 + idx % rpc < rows_out) out[(long long)(idx / rpc) * rows_out + r0 + idx % rpc] = 0;
    }
    if (route.expert < 0) return;
    const BlockRef blk = load_block(desc, route.expert);
    const int cls = blk.bits >= 5 && blk.bits <= 8 ? 1 : 0;  // bad bits: class 0 writes NaN
    if (CLS != 2 && cls != CLS) return;  // another launch's class
    const bool bad_bits = blk.bits < 3 || blk.bits > 8 || (CLS != 2 && cls != CLS);

    auto weight_row_of = [&](int lw, bool* valid) {
        if (MODE == 0) {
            const int r = lw < 32 ? lw : lw - 32;
            *valid = r0 + r < rows_out;
            return (lw < 32 ? 0 : rows_out) + r0 + r;
        }
        *valid = r0 + lw < rows_out;
        return r0 + lw;
    };
    bool va, vb;
    const int lwa = 16 * warp + g, lwb = lwa + 8;
    const int rowa = weight_row_of(lwa, &va), rowb = weight_row_of(lwb, &vb);
    const bool in_a = va, in_b = vb;  // rows inside the block
    va = va && !bad_bits;
    vb = vb && !bad_bits;
    // First plane word of this split in rows a and b; rows past the block read the last
    // row instead (valid memory; their results are never written).
    const u32 w0a = (u32)((in_a ? rowa : rows_w - 1) * words_per_row + c0w);
    const u32 w0b = (u32)((in_b ? rowb : rows_w - 1) * words_per_row + c0w);
    const int kwp = (kw + GV_STEP_WORDS - 1) / GV_STEP_WORDS * GV_STEP_WORDS;
    // Activations of tokens p0..p0+np-1 (and a zero row after them) for this split:
    // xs[i][w] holds, for selector s of word w, the act values of columns sel_col(s, 0..3).
    // Word w of the split for assignment `slot` (its token's row of x, or its own row of h):
    // 32 act values as 4 16-byte loads (x is checked 16-byte aligned; a word is 64 bytes).
    auto load_word = [&](int slot, int w, uint4 (&raw)[4]) {
        const long long xrow = MODE == 0 ? slot / top_k : slot;
        const uint4* src = reinterpret_cast<const uint4*>(x + xrow * cols + (long long)(c0w + w) * 32);
#pragma unroll
        for (int q = 0; q < 4; ++q)  // h, written by a grid that ran while this one started: L2, not L1/nc
            raw[q] = MODE == 1 ? __ldcg(src + q) : __ldg(src + q);
    };
    auto stage_split = [&](int p0, int np) {
        if (p0 == 0) await_h();
        __syncthreads();  // LUT written; the previous pass is done with xs
        // A (token, word) item: the word's 32 values (load_word, 16-byte loads), reordered into
        // the mma slices' layout by stage_word.
        for (int idx = tid; idx < (np + 1) * kwp; idx += GV_THREADS) {
            const int i = idx / kwp, w = idx % kwp;
            uint4 raw[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) raw[q] = make_uint4(0u, 0u, 0u, 0u);
            if (w < kw && i < np) load_word(slots[p0 + i], w, raw);
            stage_word(raw, xs + i * tstride + w * 32, w);  // (its swizzle reads w mod 8 only)
        }
        __syncthreads();
    };
    // (The stager is built here, after routing: computing its shared addresses before routing
    // changes the tiles instances' SASS, nvcc 13.0.)
    // The kernels holding 5-8-bit blocks keep their cell table (CellTab) from the first 2 KB boundary
    // past the staged activations, the tiles regime's raw rows after it.
    const u32 tab_base = (lut_at + CELL_TAB_ALIGN - 1) & ~(CELL_TAB_ALIGN - 1);
    u16* const raw_s = CLS == 0 ? lut_s + GV_ROWS * lut_entries
                                : reinterpret_cast<u16*>(smem_raw + lut_off + (tab_base - lut_at) + CELL_TAB_BYTES);
    const TilesStager<MODE, NT8> tiles(x, slots, xs, raw_s, stage_tokens, top_k, cols, c0w, kw);
    auto stage = [&](int p0, int np, int step) -> const u16* {
        if constexpr (NT8 == 1) stage_split(p0, np);
        else tiles.stage(p0, np, step);
        return xs;
    };
    // Partials: tokens 2t, 2t+1 of this pass, rows a and b (NaN for a block of bad bits).
    auto emit = [&](int p0, int np, const float (&acc)[4]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int tok = 2 * t + (j & 1);
            if (tok < np && (j < 2 ? in_a : in_b)) {
                const float v = bad_bits ? __int_as_float(0x7fc00000) : acc[j];
                part[((long long)z * num_assign + slots[p0 + tok]) * rows_w + (j < 2 ? rowa : rowb)] = v;
            }
        }
    };
    // The row tables' entries are loaded here; at decode they are built after the first staging
    // (run_passes), so their loads overlap it.
    // COMPACT: the decode ping-pong of the kernels holding 5-8-bit blocks keeps one copy of the step's
    // code, its two words in a rolled loop (less SASS to fetch cold); the 3-4-bit kernel is faster
    // unrolled.
    constexpr bool COMPACT = CLS != 0;
    auto reg_lut = [&](auto& la, auto& lb) {
        la.fetch(blk.lut + (long long)rowa * lut_row_entries(blk.bits), va);
        lb.fetch(blk.lut + (long long)rowb * lut_row_entries(blk.bits), vb);
    };
    if (bad_bits) {
        await_h();
        for (int p0 = 0; p0 < route.count; p0 += GV_TOKENS) {  // emit writes up to 8 tokens
            const float nan4[4] = {0.f, 0.f, 0.f, 0.f};
            emit(p0, min(GV_TOKENS, route.count - p0), nan4);
        }
    } else if (CLS == 0 || (CLS == 2 && cls == 0)) {
        if (blk.bits == 4) {
            RegLut<4> la, lb;
            run_passes<4, BF16, V2, NT8, COMPACT, LONG>(blk, w0a, w0b, la, lb, kw, xs, tstride, route.count, stage_tokens,
                                          reg_lut, stage, emit);
        } else {
            RegLut<3> la, lb;
            run_passes<3, BF16, V2, NT8, COMPACT, LONG>(blk, w0a, w0b, la, lb, kw, xs, tstride, route.count, stage_tokens,
                                          reg_lut, stage, emit);
        }
    } else {
        // 5-8 bits: the cells from shared memory (CellTab), one conflict-free LDS a weight, in decode
        // and the tiles regime alike.
        const u32 tab_col = tab_base + ((u32)warp << 12 | (u32)lane << 2);
        auto cells = [&](auto width) {
            constexpr int B = decltype(width)::value;
            CellTab<B, BF16> la(tab_col), lb(tab_col + CELL_TAB_ROW_BYTES);
            run_passes<B, BF16, V2, NT8, COMPACT, LONG>(blk, w0a, w0b, la, lb, kw, xs, tstride, route.count, stage_tokens,
                                                        reg_lut, stage, emit);
        };
        switch (blk.bits) {
            case 5: cells(Width<5>{}); break;
            case 6: cells(Width<6>{}); break;
            case 7: cells(Width<7>{}); break;
            default: cells(Width<8>{}); break;
        }
    }

    // The last CTA to finish this tile's splits (MODE 0) or this row tile over every expert
    // and split (MODE 1) reduces the partials, in a fixed order.
    const int expected = MODE == 0 ? splits : route.num_active * splits;
    int* counter = counters + (MODE == 0 ? by * gx + bx : bx);
    if (expected > 1) {
        // CUTLASS's semaphore pattern: one thread's acq_rel atomic after a barrier, no per-thread
        // fences.
        // The barrier orders every thread's partials before thread 0's release (fence
        // cumulativity); its acquire orders the reduction's reads after every contributor's
        // partials, and the second barrier hands that to the CTA.
        __syncthreads();
        if (tid == 0) {
            const int done = atom_add_acq_rel_gpu(counter, 1) + 1;
            last_flag = done == expected;
            if (done == expected) atomicExch(counter, 0);  // every contributor has arrived
        }
        __syncthreads();
        if (!last_flag) return;
    } else {
        __syncthreads();
    }
    if constexpr (MODE == 0)
        reduce_gate_up<BF16, BATCH>(part, slots, route.count, num_assign, rows_w, rows_out, r0, rpc, splits, h_out);
    else
        reduce_down<BF16, BATCH>(part, topk_ids, topk_w, w_kind, num_tokens, top_k, num_experts, num_assign, rows_w,
                                 rows_out, r0, rpc, splits, out);
}

// One launch per projection: grid (row tiles, max active experts, column splits), 128 threads.
// LONG (decode only): the instance for column splits of at least GEMV_LONG_SPLIT_WORDS, whose
// plane loads carry L2::256B (load_hint); the host picks it from the plan, so a
// launch's instance never depends on the layer's bits.
template <int CLS, int MODE, bool BF16, bool V2, int NT8, bool LONG = false>
__global__ void __launch_bounds__(GV_THREADS, NT8 == 1 ? (CLS == 0 ? APL_GEMV_MIN_BLOCKS : APL_GEMV_CELL_BLOCKS) : tiles_blocks(CLS, NT8, V2)) apl_gemv(
    const long long* __restrict__ desc, const long long* __restrict__ topk_ids, int num_assign, int top_k,
    int num_experts, const u16* __restrict__ x, int rows_out, int cols, int split_words, int lut_entries,
    int stage_tokens, float* __restrict__ part, int* __restrict__ counters, u16* __restrict__ h_out,
    const void* __restrict__ topk_w, int w_kind, int num_tokens, u16* __restrict__ out, int zero_fill) {
    static_assert(!LONG || NT8 == 1, "LONG instances are decode instances (the tiles' hint is APL_PLANE_HINT_MIN_NT8's)");
    __shared__ u32 present[32];
    __shared__ int scratch[8];
    __shared__ int last_flag;
    // HEAVY: the merged kernel (CLS 2), whose blocks differ in width, takes its active experts widest
    // first (route_pick), in decode and the tiles regime alike, so a launch ends on short CTAs.
    constexpr bool HEAVY = CLS == 2;
    gemv_cta<CLS, MODE, BF16, V2, NT8, HEAVY, LONG>(desc, topk_ids, num_assign, top_k, num_experts, x, rows_out,
                                                    cols, split_words, lut_entries, stage_tokens, part, counters,
                                                    h_out, topk_w, w_kind, num_tokens, out, zero_fill, blockIdx.x,
                                                    blockIdx.y, blockIdx.z, gridDim.z, gridDim.x, present, scratch,
                                                    last_flag);
}
