// Host stand-ins for the PTX of the APL_HD helpers (dtype_conversions.cu), so that the staged
// regime can run on a machine without a GPU: its producer's dequantisation, and whole CTAs of
// apl_staged (staged_cta) with their 256 threads as host threads. Included only by the CPU test's
// harness (tests/kernels/staged_host_harness.cu), before the kernel sources, and only in nvcc's
// host pass; the kernels as the launcher builds them (NVRTC, device code only) never read it.
//
// Each stand-in follows the PTX ISA's definition of its instruction, including the cases the
// kernels are meant never to hit (PRMT's sign-replicate selectors, NaN conversions), so a code
// path that hits them gives a different answer here too. What the emulation does not model:
// timing and the memory model's weaker orders (every shared-memory hand-over goes through a
// mutex), so a missing fence is invisible here; a missing arrive or a wrong phase is a deadlock,
// which the waits report and abort on.
#pragma once
#ifndef __CUDA_ARCH__

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

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
// apl_host_shared_limit: the bytes the launch gave the CTA (the harness sets it per launch), so
// that a kernel reaching past what its host planned for fails here as it would on the device.
constexpr unsigned APL_HOST_SHARED_BYTES = 228u * 1024u;
inline unsigned char apl_host_shared[APL_HOST_SHARED_BYTES];
inline unsigned apl_host_shared_limit = APL_HOST_SHARED_BYTES;

inline void host_shared_check(unsigned addr, unsigned size) {
    if (addr % size != 0 || addr + size > apl_host_shared_limit) {
        std::fprintf(stderr, "host shared memory: %u-byte access at %u is misaligned or past the CTA's %u bytes\n",
                     size, addr, apl_host_shared_limit);
        std::abort();
    }
}
// Bank accounting (the harness's APL_HOST_BANKS): with apl_host_log_banks set, each thread logs its
// shared-memory instructions in order: the LSU's (LDS, STS, cp.async), not wgmma's operand reads.
// In the convergent code that issues them, the accesses of a warp's lanes with the same ordinal are
// one warp instruction, whose bank conflicts the harness counts.
enum HostAccessKind : unsigned char { LDS_128, STS_128, CP_ASYNC_4, CP_ASYNC_16, LDS_32, STS_32, HOST_ACCESS_KINDS };
struct HostAccess { unsigned addr; HostAccessKind kind; };
inline bool apl_host_log_banks = false;
inline thread_local std::vector<HostAccess> apl_host_accesses;
inline void host_log(unsigned addr, HostAccessKind kind) {
    if (apl_host_log_banks) apl_host_accesses.push_back(HostAccess{addr, kind});
}

inline uint4 host_lds_v4(unsigned addr) {  // (nvcc includes the CUDA vector types first)
    host_shared_check(addr, 16);
    host_log(addr, LDS_128);
    uint4 v;
    std::memcpy(&v, apl_host_shared + addr, 16);
    return v;
}
inline void host_sts_v4(unsigned addr, const uint4& v) {
    host_shared_check(addr, 16);
    host_log(addr, STS_128);
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    std::memcpy(apl_host_shared + addr, w, 16);
}

inline unsigned host_lds_u32(unsigned addr) {
    host_shared_check(addr, 4);
    host_log(addr, LDS_32);
    unsigned v;
    std::memcpy(&v, apl_host_shared + addr, 4);
    return v;
}
inline void host_sts_u32(unsigned addr, unsigned v) {
    host_shared_check(addr, 4);
    host_log(addr, STS_32);
    std::memcpy(apl_host_shared + addr, &v, 4);
}

// cvt.rn.f16.f32: round to nearest even, overflow to infinity, subnormals kept.
inline unsigned short host_float_to_half(float f) {
    unsigned x;
    std::memcpy(&x, &f, 4);
    const unsigned short sign = (unsigned short)((x >> 16) & 0x8000u);
    const unsigned ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00u;  // NaN
    if (ax >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: infinity
    if (ax >= 0x38800000u) {  // normal half
        const unsigned r = ax - 0x38000000u;  // rebias the exponent (127 -> 15)
        const unsigned h = (r >> 13) + (((r >> 12) & 1u) & (((r & 0xFFFu) != 0) | ((r >> 13) & 1u)));
        return sign | (unsigned short)h;
    }
    if (ax < 0x33000000u) return sign;  // below half the smallest subnormal: zero
    const unsigned e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u;
    const unsigned shift = 126u - e;  // 14..24: the subnormal's mantissa bits
    const unsigned h = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return sign | (unsigned short)(h + (rest > half || (rest == half && (h & 1u))));
}
// fma.rn.f16 / fma.rn.bf16: a * b + c rounded once. The product of two 16-bit floats is exact in
// double and so, for the values a table holds, is the sum; the double is then rounded once to the
// 16-bit format at its own binade (subnormals included), ties to even.
inline double host_act_to_double(bool bf16, unsigned short v) {
    if (!bf16) return (double)host_half_to_float(v);
    const unsigned bits = (unsigned)v << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return (double)f;
}
inline unsigned short host_double_to_act(bool bf16, double x) {
    const int precision = bf16 ? 8 : 11, min_exponent = bf16 ? -125 : -13;  // frexp's exponent of the smallest normal
    int exponent;
    std::frexp(x, &exponent);
    const int ulp = std::max(exponent, min_exponent) - precision;
    const double rounded = std::ldexp(std::nearbyint(std::ldexp(x, -ulp)), ulp);  // (the default mode: ties to even)
    return bf16 ? host_float_to_bf16((float)rounded) : host_float_to_half((float)rounded);  // exact: representable
}
inline unsigned short host_act_fma(bool bf16, unsigned short a, unsigned short b, unsigned short c) {
    return host_double_to_act(bf16, host_act_to_double(bf16, a) * host_act_to_double(bf16, b) + host_act_to_double(bf16, c));
}

inline float host_quiet_nan() {
    const unsigned bits = 0x7fc00000u;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// ---------------------------------------------------------------- the CTA emulation
// APL_HOST_CTA: apl_staged.cu compiles staged_cta for the host. The thread's coordinates are
// thread-local, set by the harness before a host thread runs its part of the CTA.
#define APL_HOST_CTA 1
inline thread_local uint3 apl_host_thread_idx, apl_host_block_idx;
inline uint3 apl_host_grid_dim;
#define threadIdx apl_host_thread_idx
#define blockIdx apl_host_block_idx
#define gridDim apl_host_grid_dim

inline unsigned host_shared_addr(const void* p) {
    const unsigned char* b = static_cast<const unsigned char*>(p);
    if (b < apl_host_shared || b >= apl_host_shared + APL_HOST_SHARED_BYTES) {
        std::fprintf(stderr, "host shared memory: a generic address outside the CTA's shared memory\n");
        std::abort();
    }
    return (unsigned)(b - apl_host_shared);
}

// cp.async (size bytes, src_bytes of them read, the rest zero-filled): lands when issued.
inline void host_cp_async(unsigned dst, const void* src, unsigned size, unsigned src_bytes) {
    host_shared_check(dst, size);
    if (src_bytes > size || reinterpret_cast<unsigned long long>(src) % size) {
        std::fprintf(stderr, "cp.async: %u source bytes for a %u-byte copy, or a misaligned source\n", src_bytes, size);
        std::abort();
    }
    host_log(dst, size == 16 ? CP_ASYNC_16 : CP_ASYNC_4);
    std::memset(apl_host_shared + dst, 0, size);
    if (src_bytes) std::memcpy(apl_host_shared + dst, src, src_bytes);
}

// mbarriers and named barriers, under one mutex. A wait that outlasts APL_HOST_DEADLOCK_S seconds
// (default 60) is a deadlock: it says which barrier and aborts.
inline std::mutex apl_host_mutex;
inline std::condition_variable apl_host_cv;
// tx: the bytes of asynchronous copies the current phase still waits for (expect_tx raises it, a
// copy's complete_tx lowers it); a phase completes when its arrivals are in and tx is zero.
struct HostMbar { unsigned count = 0, pending = 0, phase = 0; long long tx = 0; };
struct HostBar { unsigned arrived = 0, generation = 0; };
inline std::map<unsigned, HostMbar> apl_host_mbars;
inline std::map<unsigned, HostBar> apl_host_bars;

inline std::chrono::seconds host_deadlock_after() {
    const char* s = std::getenv("APL_HOST_DEADLOCK_S");
    return std::chrono::seconds(s ? std::atoi(s) : 60);
}
[[noreturn]] inline void host_deadlock(const char* what, unsigned which, unsigned arg) {
    std::fprintf(stderr, "deadlock: thread %u of CTA (%u, %u, %u) waited %lld s on %s %u (%u)\n", apl_host_thread_idx.x,
                 apl_host_block_idx.x, apl_host_block_idx.y, apl_host_block_idx.z,
                 (long long)host_deadlock_after().count(), what, which, arg);
    std::fflush(stderr);
    std::_Exit(3);
}
inline HostMbar& host_mbar(unsigned addr) {
    auto it = apl_host_mbars.find(addr);
    if (it == apl_host_mbars.end()) {
        std::fprintf(stderr, "mbarrier at %u used before mbarrier.init\n", addr);
        std::abort();
    }
    return it->second;
}
inline void host_mbar_init(unsigned addr, unsigned count) {
    host_shared_check(addr, 8);
    std::lock_guard<std::mutex> lock(apl_host_mutex);
    apl_host_mbars[addr] = HostMbar{count, count, 0};
}
// (under apl_host_mutex) the phase completes once its arrivals are in and no copy bytes are owed;
// the next one expects count arrivals again.
inline void host_mbar_try_complete(HostMbar& b) {
    if (b.pending == 0 && b.tx == 0) {
        ++b.phase;
        b.pending = b.count;
        apl_host_cv.notify_all();
    }
}
inline void host_mbar_arrive(unsigned addr) {
    std::lock_guard<std::mutex> lock(apl_host_mutex);
    HostMbar& b = host_mbar(addr);
    if (b.pending == 0) {
        std::fprintf(stderr, "mbarrier at %u: an arrival beyond its count in one phase\n", addr);
        std::abort();
    }
    --b.pending;
    host_mbar_try_complete(b);
}
// mbarrier.expect_tx: the current phase also waits for `bytes` of copies.
inline void host_mbar_expect_tx(unsigned addr, unsigned bytes) {
    std::lock_guard<std::mutex> lock(apl_host_mutex);
    host_mbar(addr).tx += bytes;
}
// complete_tx from an asynchronous copy that has landed.
inline void host_mbar_complete_tx(unsigned addr, unsigned bytes) {
    std::lock_guard<std::mutex> lock(apl_host_mutex);
    HostMbar& b = host_mbar(addr);
    b.tx -= bytes;
    host_mbar_try_complete(b);
}
// The 128-byte swizzle (TMA's CU_TENSOR_MAP_SWIZZLE_128B, wgmma's layout type 1): the 16-byte chunk
// bits 4-6 of a shared address XORed with its 128-byte row bits 7-9, so the 8 rows of a 1024-byte
// atom hold their chunks in 8 different orders.
inline unsigned host_swizzle128(unsigned addr) { return addr ^ (((addr >> 7) & 7u) << 4); }

// cp.async.bulk.tensor.2d (tile mode) from the host's stand-in for a tensor map: word 0 the
// tensor's address, 1 its columns, 2 its rows, 3 the box's rows, 4 the box's columns (2-byte
// elements, rows packed); the box from (col, row) lands at dst with the 128-byte swizzle, elements
// outside the tensor as zeros, and its bytes complete on the mbarrier at bar. Lands when issued.
inline void host_tma_load_rows(unsigned dst, const unsigned long long* map, int col, int row, unsigned bar) {
    const unsigned short* base = reinterpret_cast<const unsigned short*>(map[0]);
    const long long cols = (long long)map[1], rows = (long long)map[2];
    const int box_rows = (int)map[3], box_cols = (int)map[4];
    if (dst % 1024u || box_cols * 2 != 128 || box_rows <= 0 || box_rows > 256 || col % 8) {
        std::fprintf(stderr, "tma: a box of %d x %d at shared %u (col %d): needs 128-byte rows, a 1024-byte aligned"
                     " destination and 16-byte aligned columns\n", box_rows, box_cols, dst, col);
        std::abort();
    }
    host_shared_check(dst, 16);
    host_shared_check(dst + (unsigned)box_rows * 128u - 16u, 16);
    for (int r = 0; r < box_rows; ++r)
        for (int c = 0; c < box_cols; ++c) {
            const long long gr = (long long)row + r, gc = (long long)col + c;
            const unsigned short v = gr < rows && gc < cols ? base[gr * cols + gc] : (unsigned short)0;
            std::memcpy(apl_host_shared + host_swizzle128(dst + (unsigned)r * 128u + (unsigned)c * 2u), &v, 2);
        }
    host_mbar_complete_tx(bar, (unsigned)(box_rows * box_cols * 2));
}

// mbarrier.try_wait.parity in a loop: returns once the phase of this parity has completed, i.e.
// the current phase's parity differs from it.
inline void host_mbar_wait(unsigned addr, unsigned parity) {
    std::unique_lock<std::mutex> lock(apl_host_mutex);
    HostMbar& b = host_mbar(addr);
    if (!apl_host_cv.wait_for(lock, host_deadlock_after(), [&] { return (b.phase & 1u) != (parity & 1u); }))
        host_deadlock("the mbarrier at", addr, parity);
}
// A wait for phase `phase` of the mbarrier at addr (apl_staged.cu's mbar_wait_phase) is sound only while
// the barrier has completed that phase's predecessors and at most the phase itself.
inline void host_mbar_check_phase(unsigned addr, unsigned phase) {
    std::unique_lock<std::mutex> lock(apl_host_mutex);
    const unsigned done = host_mbar(addr).phase;
    if (done < phase || done > phase + 1) {
        std::fprintf(stderr, "a parity wait for phase %u of the mbarrier at %u, which has completed %u phases\n", phase,
                     addr, done);
        std::abort();
    }
}
// bar.sync id, count (and __syncthreads: id 0, every thread).
inline void host_bar_sync(unsigned id, unsigned count) {
    std::unique_lock<std::mutex> lock(apl_host_mutex);
    HostBar& b = apl_host_bars[id];
    const unsigned generation = b.generation;
    if (++b.arrived == count) {
        b.arrived = 0;
        ++b.generation;
        apl_host_cv.notify_all();
    } else if (!apl_host_cv.wait_for(lock, host_deadlock_after(), [&] { return b.generation != generation; })) {
        host_deadlock("named barrier", id, count);
    }
}

// wgmma.mma_async m64nNk16 with A and B from shared memory (f32 accumulators, scale-d 1, neither
// operand transposed: both K-major), by the PTX ISA: a matrix descriptor holds the start address
// (bits 0-13), the leading byte offset (16-29: between core matrices adjacent in K) and the stride
// byte offset (32-45: between 8-row groups), each in 16-byte units, and the layout type (62-63);
// type 0 (no swizzle): a core matrix is 8 rows of 16 contiguous bytes, LBO apart in K; type 1 (the
// 128-byte swizzle): a row's K runs on in one 128-byte row, rows 128 bytes apart within 8-row groups
// SBO apart, and host_swizzle128 applies to the address formed (the LBO unused). Base offset 0 only. The executing
// thread's accumulators are its fragment of D: warp w of the warpgroup, lane (g, t) = (lane / 4,
// lane % 4) holds acc[j][i] = D(16 w + g + 8 (i / 2), 8 j + 2 t + i % 2).
template <bool BF16>
inline float host_operand(unsigned long long desc, int row, int k) {
    const unsigned layout = (unsigned)(desc >> 62);
    if ((desc >> 49) & 7u || layout > 1) {
        std::fprintf(stderr, "wgmma: only no-swizzle and 128-byte-swizzle descriptors with base offset 0 are emulated\n");
        std::abort();
    }
    const unsigned start = (unsigned)(desc & 0x3FFFu) << 4, lbo = (unsigned)((desc >> 16) & 0x3FFFu) << 4,
                   sbo = (unsigned)((desc >> 32) & 0x3FFFu) << 4;
    const unsigned addr = layout == 1
        ? host_swizzle128(start + (unsigned)(row / 8) * sbo + (unsigned)(row % 8) * 128 + (unsigned)k * 2)
        : start + (unsigned)(row / 8) * sbo + (unsigned)(k / 8) * lbo + (unsigned)(row % 8) * 16 + (unsigned)(k % 8) * 2;
    host_shared_check(addr, 2);  // (the tensor cores' read: not an LSU access, not logged)
    unsigned short v;
    std::memcpy(&v, apl_host_shared + addr, 2);
    if (BF16) {
        const unsigned bits = (unsigned)v << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
    }
    return host_half_to_float(v);
}
// wgmma is asynchronous: it reads its operands and writes the accumulators at some time before the
// wait_group that covers its commit group. The emulation runs each one at that wait (so a buffer
// handed back or overwritten before its wgmma was waited for gives wrong sums here too, and
// accumulators read before the wait are stale), in issue order, per thread.
inline thread_local std::vector<std::function<void()>> apl_host_wgmma_open;           // issued, not committed
inline thread_local std::deque<std::vector<std::function<void()>>> apl_host_wgmma_groups;  // committed, oldest first
template <int N8, bool BF16>
inline void host_wgmma_ss(float (&acc)[N8][4], unsigned long long da, unsigned long long db) {
    const int tid = (int)(apl_host_thread_idx.x % 128u);
    apl_host_wgmma_open.push_back([&acc, da, db, tid] {
        const int warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
        for (int j = 0; j < N8; ++j)
            for (int i = 0; i < 4; ++i) {
                const int row = 16 * warp + g + 8 * (i / 2), col = 8 * j + 2 * t + i % 2;
                float sum = 0.f;
                for (int k = 0; k < 16; ++k) sum += host_operand<BF16>(da, row, k) * host_operand<BF16>(db, col, k);
                acc[j][i] += sum;
            }
    });
}
inline void host_wgmma_commit() {
    apl_host_wgmma_groups.push_back(std::move(apl_host_wgmma_open));
    apl_host_wgmma_open.clear();
}
// wgmma.wait_group n: every committed group but the n most recent has completed.
inline void host_wgmma_wait(unsigned n) {
    while (apl_host_wgmma_groups.size() > n) {
        for (auto& op : apl_host_wgmma_groups.front()) op();
        apl_host_wgmma_groups.pop_front();
    }
}
// After a thread's part of the CTA: a wgmma issued and never waited for is a bug in the kernel.
inline bool host_wgmma_all_waited() { return apl_host_wgmma_open.empty() && apl_host_wgmma_groups.empty(); }

#endif  // __CUDA_ARCH__
