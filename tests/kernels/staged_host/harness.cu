// The staged producer on the CPU (tests/kernels/test_staged_host_cpu.py builds and runs this).
//
// Compiled by nvcc with the kernel module's text exactly as the launcher builds it (module.cu,
// written by the test) and the launcher's defines; the host pass runs the APL_HD helpers with
// apl_host.h's stand-ins for their PTX. Per 64-column step, every producer row stages its weights
// into one A tile by stage_weights, as staged_produce does on the device; the tile's bytes go to
// the output, and the test reads them back by the wgmma operand layout of the PTX ISA.
//
//   harness tiles IN OUT    IN: int32 bits, rows (= ST_ROWS), cols, bf16, lut_log2, unit; then
//                           fp16 LUT [rows][2^bits]; then u32 plane words [bits][rows][cols / 32].
//                           OUT: the A tile's bytes after each step, [steps][ST_ROWS * ST_KS] u16.
//                           lut_log2: the LUT room of a 5-8-bit row (its own bits, or a merged
//                           launch's 8); unit: steps per unit of plane words (APL_STAGED_UNIT).
//   harness chunks NT OUT   tile_chunk(0, NT, r, c) for r < NT, c < 8, as int32 [NT][8].
// Exit 2 with one line on stderr for an input it cannot take.

#include "apl_host.h"
#include "module.cu"

#include <algorithm>
#include <cstdio>
#include <vector>

namespace {

int fail(const char* what) {
    std::fprintf(stderr, "harness: %s\n", what);
    return 2;
}

struct Input {
    int bits, rows, cols, bf16, lut_log2, unit;
    std::vector<u16> lut;     // [rows][2^bits] fp16
    std::vector<u32> planes;  // [bits][rows][cols / 32]
};

bool read_input(const char* path, Input& in) {
    FILE* f = std::fopen(path, "rb");
    if (!f) return false;
    int head[6];
    bool ok = std::fread(head, sizeof head, 1, f) == 1;
    if (ok) {
        in.bits = head[0]; in.rows = head[1]; in.cols = head[2];
        in.bf16 = head[3]; in.lut_log2 = head[4]; in.unit = head[5];
        ok = in.bits >= 3 && in.bits <= 8 && in.rows == ST_ROWS && in.cols > 0 && in.cols % ST_KS == 0 &&
             in.cols <= 1 << 16 && (in.unit == 2 || in.unit == 4) &&
             (in.bits <= 4 || (in.lut_log2 >= in.bits && in.lut_log2 <= 8));
    }
    if (ok) {
        in.lut.resize((size_t)in.rows << in.bits);
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

// The steps of one width: LUT rows into shared memory as apl_staged's prologue puts them (5-8
// bits), then per step every row's unit of plane words and stage_weights.
template <int B, int U>
void stage_all(const Input& in, std::vector<u16>& out) {
    constexpr int W = 2 * U;
    const int wpr = in.cols / 32, steps = in.cols / ST_KS, nent = 1 << B;
    const int lut_stride = B <= 4 ? 0 : 1 << in.lut_log2;
    if constexpr (B >= 5) {
        u16* lut_s = reinterpret_cast<u16*>(apl_host_shared + LUT_AT);
        for (int lw = 0; lw < ST_ROWS; ++lw)
            for (int ent = 0; ent < nent; ++ent) {
                const u16 v = in.lut[(size_t)lw * nent + ent];
                lut_s[lw * lut_stride + lut_stagger(lw, B, lut_stride) + ent] = in.bf16 ? lut_to_act<true>(v) : lut_to_act<false>(v);
            }
    }
    std::vector<RegLut<(B <= 4 ? B : 4)>> rluts(ST_ROWS);
    if constexpr (B <= 4)
        for (int pt = 0; pt < ST_ROWS; ++pt) rluts[pt].load(in.lut.data() + (size_t)pt * nent, true, in.bf16 != 0);
    for (int step = 0; step < steps; ++step) {
        const int u = step / U, half = step % U;
        for (int pt = 0; pt < ST_ROWS; ++pt) {
            u32 unit[B][W];
            for (int p = 0; p < B; ++p)
                for (int i = 0; i < W; ++i)
                    unit[p][i] = in.planes[((size_t)p * ST_ROWS + pt) * wpr + std::min(W * u + i, wpr - 1)];
            const u32 lut_base = LUT_AT + 2u * (u32)(pt * lut_stride + lut_stagger(pt, B, lut_stride));
            stage_weights<B, W>(rluts[pt], lut_base, unit, half, TILE_AT, pt);
        }
        const u16* tile = reinterpret_cast<const u16*>(apl_host_shared + TILE_AT);
        out.insert(out.end(), tile, tile + ST_ROWS * ST_KS);
    }
}

template <int B>
void stage_width(const Input& in, std::vector<u16>& out) {
    if (in.unit == 4) stage_all<B, 4>(in, out);
    else stage_all<B, 2>(in, out);
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

int chunks(int nt, const char* out_path) {
    if (nt <= 0 || nt > 256 || nt % 8) return fail("NT must be a multiple of 8 up to 256");
    std::vector<int> out;
    for (int r = 0; r < nt; ++r)
        for (int c = 0; c < 8; ++c) out.push_back((int)tile_chunk(0, nt, r, c));
    FILE* f = std::fopen(out_path, "wb");
    if (!f) return fail("cannot write the output");
    const bool ok = std::fwrite(out.data(), 4, out.size(), f) == out.size();
    return std::fclose(f) == 0 && ok ? 0 : fail("cannot write the output");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc == 4 && std::strcmp(argv[1], "tiles") == 0) return tiles(argv[2], argv[3]);
    if (argc == 4 && std::strcmp(argv[1], "chunks") == 0) return chunks(std::atoi(argv[2]), argv[3]);
    return fail("usage: harness tiles IN OUT | harness chunks NT OUT");
}
