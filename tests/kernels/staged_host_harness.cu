// The staged regime on the CPU (tests/kernels/staged_host.py builds and runs this for tests/kernels/test_staged_host_cpu.py).
//
// Compiled by nvcc with the kernel module's text exactly as the launcher builds it (module.cu,
// written by the test) and the launcher's defines; the host pass runs the APL_HD helpers with
// apl_host.h's stand-ins for their PTX. Per 64-column step, every producer row stages its weights
// into one A tile by stage_weights, as staged_produce does on the device; the tile's bytes go to
// the output, and the test reads them back by the wgmma operand layout of the PTX ISA.
//
//   harness tiles IN OUT    IN: int32 bits, rows (= ST_ROWS), cols, bf16, lut_log2; then the
//                           stored fp16 LUT [rows][8 | 17]; then u32 plane words [bits][rows][cols / 32].
//                           OUT: the A tile's bytes after each step, [steps][ST_ROWS * ST_KS] u16.
//                           lut_log2: the LUT room of a 5-8-bit row (its own bits, or a merged
//                           launch's 8). Plane words in units of 2 steps, as the producers take them.
//   harness convert IN OUT  the emulation's fp16/bf16 conversions of fp32 values (see convert).
//   harness luts IN OUT     every code's value as the kernels' row tables derive it (see luts).
//   harness cells IN OUT    the same at 5-8 bits through the decode regime's cell table (CellTab).
//   harness cta INSTANCE IN OUT
//                           one projection's launch of apl_staged<INSTANCE> (e.g. `0,0,true,true,2`),
//                           one of those this binary is compiled with (harness_instances.h, written
//                           by the builder: HOST_INSTANCES(X) calls X(CLS, MODE, BF16, V4, NT8) for
//                           each; one build serves many, as the module and the other modes are most
//                           of its compile time): every
//                           CTA of the grid in turn, its threads as host threads running
//                           staged_cta. IN: int32 experts, rows_out, cols, top_k, lut_log2, stages,
//                           grid x, y, z, shared bytes, assignments, x rows, active experts; per
//                           expert int32 bits, the stored fp16 LUT [rows][8 | 17], plane bytes [bits][rows]
//                           [cols / 8] (rows: 2 rows_out for gate_up, rows_out for down); int32
//                           active [3 x active experts]; int32 sorted_slot [assignments]; act x [x
//                           rows][cols]. OUT: h (act [assignments][rows_out], by sorted position)
//                           for gate_up, y (fp32 [assignments][rows_out], by slot) for down, every
//                           element first filled with all-ones bits (so one no CTA wrote shows).
//                           With APL_HOST_BANKS=<file>: the launch's shared-memory bank conflicts
//                           per instruction kind, as JSON (count_banks).
// Exit 2 with one line on stderr for an input it cannot take; a deadlock exits 3 (apl_host.h), a
// wgmma never waited for 4.

#include "apl_host.h"
#include "module.cu"
#include "harness_instances.h"

#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#ifndef __CUDA_ARCH__  // (nvcc's device pass sees the module only: apl_host.h is host-only)
namespace {

int fail(const char* what) {
    std::fprintf(stderr, "harness: %s\n", what);
    return 2;
}

struct Input {
    int bits, rows, cols, bf16, lut_log2;
    std::vector<u16> lut;     // the stored LUT [rows][8 | 17] fp16
    std::vector<u32> planes;  // [bits][rows][cols / 32]
};

bool read_input(const char* path, Input& in) {
    FILE* f = std::fopen(path, "rb");
    if (!f) return false;
    int head[5];
    bool ok = std::fread(head, sizeof head, 1, f) == 1;
    if (ok) {
        in.bits = head[0]; in.rows = head[1]; in.cols = head[2];
        in.bf16 = head[3]; in.lut_log2 = head[4];
        ok = in.bits >= 3 && in.bits <= 8 && in.rows == ST_ROWS && in.cols > 0 && in.cols % ST_KS == 0 &&
             in.cols <= 1 << 16 && (in.bits <= 4 || (in.lut_log2 >= in.bits && in.lut_log2 <= 8));
    }
    if (ok) {
        in.lut.resize((size_t)in.rows * lut_row_entries(in.bits));
        in.planes.resize((size_t)in.bits * in.rows * (in.cols / 32));
        ok = std::fread(in.lut.data(), 2, in.lut.size(), f) == in.lut.size() &&
             std::fread(in.planes.data(), 4, in.planes.size(), f) == in.planes.size();
    }
    std::fclose(f);
    return ok;
}

// Where the harness's CTA keeps its 5-8-bit LUT rows and its one A tile (the device: LUT rows
// from a 512-byte boundary, the ring after them).
constexpr u32 LUT_AT = 0, TILE_AT = 128u * 1024u;

// The steps of one width: every row's register tables as apl_staged's producers load them, then
// per step every row's unit of plane words and stage_weights.
template <int B, bool BF16>
void stage_all(const Input& in, std::vector<u16>& out) {
    constexpr int U = 2, W = 2 * U;  // (staged_produce's unit)
    const int wpr = in.cols / 32, steps = in.cols / ST_KS;
    std::vector<RowLut<B, BF16>> rluts(ST_ROWS);
    for (int pt = 0; pt < ST_ROWS; ++pt) rluts[pt].load(in.lut.data() + (size_t)pt * lut_row_entries(B), true, BF16);
    for (int step = 0; step < steps; ++step) {
        const int u = step / U, half = step % U;
        for (int pt = 0; pt < ST_ROWS; ++pt) {
            u32 unit[B][W];
            for (int p = 0; p < B; ++p)
                for (int i = 0; i < W; ++i)
                    unit[p][i] = in.planes[((size_t)p * ST_ROWS + pt) * wpr + std::min(W * u + i, wpr - 1)];
            stage_weights<B, W, BF16>(rluts[pt], unit, half, TILE_AT, pt);
        }
        const u16* tile = reinterpret_cast<const u16*>(apl_host_shared + TILE_AT);
        out.insert(out.end(), tile, tile + ST_ROWS * ST_KS);
    }
}

template <int B>
void stage_width(const Input& in, std::vector<u16>& out) {
    if (in.bf16) stage_all<B, true>(in, out);
    else stage_all<B, false>(in, out);
}

int tiles(const char* in_path, const char* out_path) {
    Input in;
    if (!read_input(in_path, in)) return fail("unreadable or unsupported input");
    std::memset(apl_host_shared, 0xA5, APL_HOST_SHARED_BYTES);  // (bytes no store reaches stay visible)
    std::vector<u16> out;
    switch (in.bits) {
        case 3: stage_width<3>(in, out); break;
        case 4: stage_width<4>(in, out); break;
        case 5: stage_width<5>(in, out); break;
        case 6: stage_width<6>(in, out); break;
        case 7: stage_width<7>(in, out); break;
        default: stage_width<8>(in, out); break;
    }
    FILE* f = std::fopen(out_path, "wb");
    if (!f) return fail("cannot write the output");
    const bool ok = std::fwrite(out.data(), 2, out.size(), f) == out.size();
    return std::fclose(f) == 0 && ok ? 0 : fail("cannot write the output");
}

// Bank conflicts of a launch's shared-memory instructions (APL_HOST_BANKS=<file>): per kind, the warp
// instructions, the wavefronts the 32 banks of 4 bytes take for them (the most distinct words one bank
// is asked for, and at least one per 128 distinct bytes), and the fewest their bytes allow.
struct BankStats { long long instructions = 0, wavefronts = 0, ideal = 0; };
constexpr const char* KIND_NAMES[HOST_ACCESS_KINDS] = {"LDS.128", "STS.128", "LDGSTS.4", "LDGSTS.16", "LDS.32", "STS.32"};
constexpr unsigned KIND_BYTES[HOST_ACCESS_KINDS] = {16, 16, 4, 16, 4, 4};

void count_banks(const std::vector<std::vector<HostAccess>>& logs, BankStats (&stats)[HOST_ACCESS_KINDS]) {
    for (int warp = 0; warp < (int)logs.size() / 32; ++warp) {
        size_t longest = 0;
        for (int lane = 0; lane < 32; ++lane) longest = std::max(longest, logs[32 * warp + lane].size());
        for (size_t k = 0; k < longest; ++k)
            for (int kind = 0; kind < HOST_ACCESS_KINDS; ++kind) {  // (lanes of one ordinal share a kind where convergent)
                std::vector<unsigned> words;
                int lanes = 0;
                for (int lane = 0; lane < 32; ++lane) {
                    const auto& log = logs[32 * warp + lane];
                    if (k >= log.size() || log[k].kind != kind) continue;
                    ++lanes;
                    for (unsigned b = 0; b < std::max(1u, KIND_BYTES[kind] / 4); ++b) words.push_back(log[k].addr / 4 + b);
                }
                if (!lanes) continue;
                std::sort(words.begin(), words.end());
                words.erase(std::unique(words.begin(), words.end()), words.end());
                int per_bank[32] = {};
                int most = 0;
                for (unsigned w : words) most = std::max(most, ++per_bank[w % 32]);
                BankStats& st = stats[kind];
                st.instructions += 1;
                st.wavefronts += std::max<long long>(most, (words.size() * 4 + 127) / 128);
                st.ideal += std::max<long long>(1, (lanes * KIND_BYTES[kind] + 127) / 128);
            }
    }
}

// 16-byte aligned storage for a blob of `bytes` (plane rows are read as 16-byte vectors).
struct Blob {
    std::vector<uint4> words;
    unsigned char* bytes(size_t n) { words.assign((n + 15) / 16, make_uint4(0, 0, 0, 0)); return reinterpret_cast<unsigned char*>(words.data()); }
};

template <int HOST_CLS, int HOST_MODE, bool HOST_BF16, bool HOST_V4, int HOST_NT8>
int cta(const char* in_path, const char* out_path) {
    FILE* f = std::fopen(in_path, "rb");
    if (!f) return fail("cannot read the input");
    int h[13];
    if (std::fread(h, sizeof h, 1, f) != 1) { std::fclose(f); return fail("short header"); }
    const int experts = h[0], rows_out = h[1], cols = h[2], top_k = h[3], lut_log2 = h[4], stages = h[5];
    const int gx = h[6], gy = h[7], gz = h[8], shared_bytes = h[9], assignments = h[10], x_rows = h[11], num_active = h[12];
    const int rows = HOST_MODE == 0 ? 2 * rows_out : rows_out;
    if (experts <= 0 || experts > 64 || rows_out <= 0 || rows_out > 4096 || cols <= 0 || cols % 32 || cols > 8192 ||
        top_k <= 0 || stages <= 0 || stages > ST_MAX_STAGES || gx <= 0 || gy <= 0 || gz <= 0 || gx * gy * gz > 4096 ||
        shared_bytes < 0 || shared_bytes + 2 * ST_MAX_STAGES * 8 > (int)APL_HOST_SHARED_BYTES || assignments <= 0 ||
        assignments > 1 << 16 || x_rows <= 0 || x_rows > 1 << 16 || num_active < 0 || num_active > experts) {
        std::fclose(f);
        return fail("unsupported input");
    }
    bool ok = true;
    std::vector<Blob> luts(experts), planes(experts);
    std::vector<long long> desc((size_t)experts * DESC_WIDTH, 0);
    for (int e = 0; e < experts && ok; ++e) {
        int bits = 0;
        ok = std::fread(&bits, 4, 1, f) == 1 && bits >= 3 && bits <= 8;
        if (!ok) break;
        const size_t lut_bytes = (size_t)rows * lut_row_entries(bits) * 2, plane_bytes = (size_t)rows * (cols / 8);
        unsigned char* lut = luts[e].bytes(lut_bytes);
        unsigned char* pl = planes[e].bytes(bits * plane_bytes);
        ok = std::fread(lut, 1, lut_bytes, f) == lut_bytes && std::fread(pl, 1, bits * plane_bytes, f) == bits * plane_bytes;
        desc[(size_t)e * DESC_WIDTH] = bits;
        desc[(size_t)e * DESC_WIDTH + 1] = (long long)lut;
        for (int p = 0; p < bits; ++p) desc[(size_t)e * DESC_WIDTH + 2 + p] = (long long)(pl + p * plane_bytes);
    }
    std::vector<int> active(3 * (size_t)std::max(num_active, 1)), sorted_slot(assignments);
    std::vector<u16> x((size_t)x_rows * cols);
    ok = ok && std::fread(active.data(), 4, 3 * (size_t)num_active, f) == 3 * (size_t)num_active &&
         std::fread(sorted_slot.data(), 4, assignments, f) == (size_t)assignments &&
         std::fread(x.data(), 2, x.size(), f) == x.size();
    std::fclose(f);
    if (!ok) return fail("short or unsupported input");
    for (int a = 0; a < num_active; ++a)
        if (active[3 * a] < 0 || active[3 * a] >= experts || active[3 * a + 1] < 0 || active[3 * a + 2] < 0 ||
            active[3 * a + 1] + active[3 * a + 2] > assignments)
            return fail("an active expert outside the layer or its assignments");
    for (int s = 0; s < assignments; ++s)
        if (sorted_slot[s] < 0 || sorted_slot[s] >= assignments || (HOST_MODE == 0 ? sorted_slot[s] / top_k : s) >= x_rows)
            return fail("a sorted slot outside the assignments or x");

    std::vector<u16> h_out(HOST_MODE == 0 ? (size_t)assignments * rows_out : 1, 0xFFFFu);
    std::vector<float> y_out(HOST_MODE == 1 ? (size_t)assignments * rows_out : 1);
    std::memset(y_out.data(), 0xFF, y_out.size() * 4);
    // The activations' tensor map, as the launcher encodes it: rows by sorted
    // position, so gate_up's x gathered into that order first (moe_gather_rows), down's h itself.
    std::vector<u16> x_sorted;
    if (HOST_MODE == 0) {
        x_sorted.resize((size_t)assignments * cols);
        for (int s = 0; s < assignments; ++s)
            std::memcpy(&x_sorted[(size_t)s * cols], &x[(size_t)(sorted_slot[s] / top_k) * cols], (size_t)cols * 2);
    }
    StagedTensorMap act_map{};
    act_map.word[0] = (unsigned long long)(HOST_MODE == 0 ? x_sorted.data() : x.data());
    act_map.word[1] = (unsigned long long)cols;
    act_map.word[2] = (unsigned long long)(HOST_MODE == 0 ? assignments : x_rows);
    act_map.word[3] = 8ull * HOST_NT8;
    act_map.word[4] = ST_KS;
    apl_host_grid_dim = make_uint3(gx, gy, gz);
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(apl_host_shared);  // the kernel's static shared array
    unsigned char* smem_raw = apl_host_shared + 2 * ST_MAX_STAGES * 8;
    apl_host_shared_limit = 2 * ST_MAX_STAGES * 8 + shared_bytes;  // the static mbarriers, then the launch's bytes
    const char* banks_path = std::getenv("APL_HOST_BANKS");
    apl_host_log_banks = banks_path != nullptr;
    BankStats banks[HOST_ACCESS_KINDS];
    for (int z = 0; z < gz; ++z)
        for (int y = 0; y < gy; ++y)
            for (int bx = 0; bx < gx; ++bx) {
                // NaN in every u16 (bf16 and fp16): what no store reaches stays visible
                std::memset(apl_host_shared, 0xFF, APL_HOST_SHARED_BYTES);
                apl_host_mbars.clear();
                apl_host_bars.clear();
                std::vector<std::thread> threads;
                std::vector<std::vector<HostAccess>> logs(staged_threads<HOST_CLS>());
                for (int t = 0; t < staged_threads<HOST_CLS>(); ++t)
                    threads.emplace_back([&, t] {
                        apl_host_accesses.clear();
                        apl_host_thread_idx = make_uint3(t, 0, 0);
                        apl_host_block_idx = make_uint3(bx, y, z);
                        staged_cta<HOST_CLS, HOST_MODE, HOST_BF16, HOST_V4, HOST_NT8>(
                            desc.data(), active.data(), &num_active, sorted_slot.data(), top_k, x.data(), rows_out, cols,
                            lut_log2, h_out.data(), y_out.data(), stages, act_map, bars, smem_raw);
                        if (!host_wgmma_all_waited()) {
                            std::fprintf(stderr, "thread %d of CTA (%d, %d, %d) left a wgmma it never waited for\n", t, bx, y, z);
                            std::_Exit(4);
                        }
                        logs[t] = std::move(apl_host_accesses);
                    });
                for (auto& th : threads) th.join();
                if (apl_host_log_banks) count_banks(logs, banks);
            }
    if (banks_path) {
        FILE* b = std::fopen(banks_path, "w");
        if (!b) return fail("cannot write the bank counts");
        std::fprintf(b, "{");
        for (int kind = 0; kind < HOST_ACCESS_KINDS; ++kind)
            std::fprintf(b, "%s\"%s\": {\"instructions\": %lld, \"wavefronts\": %lld, \"ideal\": %lld}", kind ? ", " : "",
                         KIND_NAMES[kind], banks[kind].instructions, banks[kind].wavefronts, banks[kind].ideal);
        std::fprintf(b, "}\n");
        if (std::fclose(b) != 0) return fail("cannot write the bank counts");
    }
    FILE* o = std::fopen(out_path, "wb");
    if (!o) return fail("cannot write the output");
    ok = HOST_MODE == 0 ? std::fwrite(h_out.data(), 2, h_out.size(), o) == h_out.size()
                        : std::fwrite(y_out.data(), 4, y_out.size(), o) == y_out.size();
    return std::fclose(o) == 0 && ok ? 0 : fail("cannot write the output");
}

// The cta mode of the instance named `name` ("CLS,MODE,BF16,V4,NT8"), if this binary has it.
int cta_instance(const char* name, const char* in_path, const char* out_path) {
#define HOST_CTA_CASE(CLS, MODE, BF16, V4, NT8) \
    if (std::strcmp(name, #CLS "," #MODE "," #BF16 "," #V4 "," #NT8) == 0) return cta<CLS, MODE, BF16, V4, NT8>(in_path, out_path);
    HOST_INSTANCES(HOST_CTA_CASE)
#undef HOST_CTA_CASE
    return fail("an instance this harness is not compiled with");
}

// The emulation's conversions, for the test to hold against torch's: IN is fp32 bit patterns, OUT
// their fp16 and bf16 roundings (u16 each), then every fp16 pattern 0..65535 widened (fp32).
int convert(const char* in_path, const char* out_path) {
    FILE* f = std::fopen(in_path, "rb");
    if (!f) return fail("cannot read the input");
    std::vector<float> x;
    float v;
    while (std::fread(&v, 4, 1, f) == 1) x.push_back(v);
    std::fclose(f);
    std::vector<u16> narrowed;
    for (float e : x) narrowed.push_back(float_to_half(e));
    for (float e : x) narrowed.push_back(float_to_bf16(e));
    std::vector<float> widened;
    for (unsigned h = 0; h < 65536; ++h) widened.push_back(half_to_float((u16)h));
    FILE* o = std::fopen(out_path, "wb");
    if (!o) return fail("cannot write the output");
    const bool ok = std::fwrite(narrowed.data(), 2, narrowed.size(), o) == narrowed.size() &&
                    std::fwrite(widened.data(), 4, widened.size(), o) == widened.size();
    return std::fclose(o) == 0 && ok ? 0 : fail("cannot write the output");
}

// Every code's value of one row at B bits as the kernels compute it: the row's register tables
// (RowLut) dequantise plane words whose 32 columns hold the codes 0, 1, ... in turn (dequant_chunks).
template <int B, bool BF16>
void row_values(const u16* row_lut, u16* out) {
    RowLut<B, BF16> lut;
    lut.load(row_lut, true, BF16);
    constexpr int N = 1 << B;
    for (int w = 0; w * 32 < N; ++w) {
        u32 pw[8] = {};
        for (int i = 0; i < 32; ++i) {
            const int code = (w * 32 + i) % N;
            for (int p = 0; p < B; ++p) pw[p] |= (u32)((code >> (B - 1 - p)) & 1) << i;  // plane p: code bit B-1-p
        }
        uint4 chunk[4];
        dequant_chunks<B, BF16>(lut, pw, chunk);
        const u16* values = reinterpret_cast<const u16*>(chunk);  // columns 0..31 in order
        for (int i = 0; i < 32 && w * 32 + i < N; ++i) out[w * 32 + i] = values[i];
    }
}
// The same through the decode regime's shared-memory cell table (CellTab, 5-8 bits): the row's
// column filled in the emulated shared memory (lane 5 of warp 3, row b: every part of the column
// address set), every code looked up by select2 in mma selector order.
template <int B, bool BF16>
void row_values_tab(const u16* row_lut, u16* out) {
    if constexpr (B >= 5) {
        CellTab<B, BF16> tab(((3u << 12) | (5u << 2)) + CELL_TAB_ROW_BYTES);
        tab.load(row_lut, true, BF16);
        constexpr int N = 1 << B;
        for (int w = 0; w * 32 < N; ++w) {
            u32 pw[8] = {};
            for (int i = 0; i < 32; ++i) {
                const int code = (w * 32 + i) % N;
                for (int p = 0; p < B; ++p) pw[p] |= (u32)((code >> (B - 1 - p)) & 1) << i;
            }
            const CellCodes<B> codes(pw);
            for (int s = 0; s < 4; ++s) {  // selector s: nibble n of cell word s is column 4n + s
                u32 v[4];
                tab.select2(codes, s, v);
                for (int n = 0; n < 8; ++n) {
                    const int col = 4 * n + s;
                    if (w * 32 + col < N) out[w * 32 + col] = (u16)(v[n / 2] >> (16 * (n % 2)));
                }
            }
        }
    }
}
template <int B>
void row_values(bool bf16, bool tab, const u16* row_lut, u16* out) {
    if (tab) {
        if (bf16) row_values_tab<B, true>(row_lut, out);
        else row_values_tab<B, false>(row_lut, out);
    } else if (bf16) {
        row_values<B, true>(row_lut, out);
    } else {
        row_values<B, false>(row_lut, out);
    }
}

// The tables the kernels derive from a stored LUT, for the test to hold bit for bit against the
// format's expand_lut: IN int32 bits, rows, bf16, then the stored fp16 LUT [rows][8 | 17]; OUT the
// act-dtype table [rows][2^bits]. tab (the `cells` mode, 5-8 bits): through CellTab.
int luts(const char* in_path, const char* out_path, bool tab) {
    FILE* f = std::fopen(in_path, "rb");
    if (!f) return fail("cannot read the input");
    int head[3];
    bool ok = std::fread(head, 4, 3, f) == 3 && head[0] >= (tab ? 5 : 3) && head[0] <= 8 && head[1] > 0 &&
              head[1] <= 1 << 20;
    const int bits = ok ? head[0] : 3, rows = ok ? head[1] : 0;
    const bool bf16 = ok && head[2] != 0;
    std::vector<u16> stored((size_t)rows * lut_row_entries(bits));
    ok = ok && std::fread(stored.data(), 2, stored.size(), f) == stored.size();
    std::fclose(f);
    if (!ok) return fail("bad input");
    std::vector<u16> table((size_t)rows << bits);
    for (int r = 0; r < rows; ++r) {
        const u16* row_lut = stored.data() + (size_t)r * lut_row_entries(bits);
        u16* out = table.data() + ((size_t)r << bits);
        switch (bits) {
            case 3: row_values<3>(bf16, tab, row_lut, out); break;
            case 4: row_values<4>(bf16, tab, row_lut, out); break;
            case 5: row_values<5>(bf16, tab, row_lut, out); break;
            case 6: row_values<6>(bf16, tab, row_lut, out); break;
            case 7: row_values<7>(bf16, tab, row_lut, out); break;
            default: row_values<8>(bf16, tab, row_lut, out); break;
        }
    }
    FILE* o = std::fopen(out_path, "wb");
    if (!o) return fail("cannot write the output");
    ok = std::fwrite(table.data(), 2, table.size(), o) == table.size();
    return std::fclose(o) == 0 && ok ? 0 : fail("cannot write the output");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc == 4 && std::strcmp(argv[1], "luts") == 0) return luts(argv[2], argv[3], false);
    if (argc == 4 && std::strcmp(argv[1], "cells") == 0) return luts(argv[2], argv[3], true);
    if (argc == 4 && std::strcmp(argv[1], "tiles") == 0) return tiles(argv[2], argv[3]);
    if (argc == 4 && std::strcmp(argv[1], "convert") == 0) return convert(argv[2], argv[3]);
    if (argc == 5 && std::strcmp(argv[1], "cta") == 0) return cta_instance(argv[2], argv[3], argv[4]);
    return fail("usage: harness tiles IN OUT | harness convert IN OUT | harness luts IN OUT | harness cells IN OUT | "
                "harness cta INSTANCE IN OUT");
}
#endif  // __CUDA_ARCH__
