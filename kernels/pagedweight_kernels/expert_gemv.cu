// The routed experts of a decode step with few tokens per expert, dense bf16/fp16/fp32
// weights: two launches instead of the seven of group_rows, two torch._grouped_mm (each with
// its prepare kernel), gated_rows and combine_rows. At one token per expert the grouped
// product's 128-row tiles waste most of their work; a GEMV reads each weight row once with
// 16-byte loads, many rows in flight, and nothing else.
//
//   expert_gate_up<DT, ACT, ...>  h [n, I] = round(round(act(round(x gate^T))) * round(x up^T))
//                                 for each assignment a = t k + j of the n = T k (the chain's
//                                 roundings: grouped product, then decode_ops' gated_rows);
//   expert_down_combine<DT, ...>  out [T, H] = round(sum_j round(w[t, j] * round(h[t k + j] down^T)))
//                                 (the combine in combine_rows' order: fixed, no atomics, so
//                                 reruns are bit-identical).
//
// The grid is persistent (at most two CTAs per SM, the register budget's occupancy, so one
// wave): every CTA groups the assignments by expert once (one per thread, O(n) each, so n is
// small: the launcher takes at most GV_MAX_ASSIGN), then walks tiles of output rows
// blockIdx.x, + gridDim.x, ..., each across every expert present: its warps take (expert,
// rows) items in turn. A warp computes one item, two weight rows at once, for up to R of the
// expert's assignments per pass (more: another pass, whose weights come from L2), its lanes
// splitting K in 16-byte vectors, U vectors per row in flight. The down CTA holds its tile's
// results of every assignment in shared memory (two buffers, one barrier per tile), so it
// also forms the weighted sum over k: no combine launch. The grid depends on shapes only
// (graph-safe); being persistent, it groups once per CTA and runs no tail of short CTAs.
//
// Compiled in decode_ops' module, after decode_ops.cu (ld, st, rnd, activate, warp_sum).

#define GV_WARPS 8
#define GV_MAX_ASSIGN (GV_WARPS * 32)  // the grouping gives each thread one assignment
#define GV_MAX_ROWS_PER_CTA 8           // the down tile's rows (shared memory: 2 x 8 results per assignment)

// The n assignments grouped by expert in shared memory, in torch.sort(stable)'s order
// (experts ascending, assignments in order inside one): sorted[pos] = a, and per group g its
// expert, first position and size. Returns the number of groups (every thread).
__device__ __forceinline__ int group_assignments(const long long* __restrict__ ids, int n, int* id_s, int* first_s,
                                                 int* sorted, int* g_expert, int* g_start, int* g_count) {
    const int a = threadIdx.x;
    if (a < n) id_s[a] = (int)ids[a];
    __syncthreads();
    int e = -1, less = 0, same = 0, before = 0;
    if (a < n) {
        e = id_s[a];
        for (int j = 0; j < n; ++j) {  // every thread reads the same id_s[j]: a broadcast
            const int v = id_s[j];
            less += v < e;
            same += v == e;
            before += (v == e) & (j < a);
        }
        sorted[less + before] = a;
        first_s[a] = before == 0;
    }
    __syncthreads();
    const bool first = a < n && before == 0;
    if (first) {
        int g = 0;
        for (int j = 0; j < n; ++j) g += first_s[j] & (id_s[j] < e);
        g_expert[g] = e;
        g_start[g] = less;
        g_count[g] = same;
    }
    return __syncthreads_count(first);  // also the barrier after the group writes
}

template <int DT> struct GV {
    static constexpr int ES = DT == 0 ? 4 : 2;  // element bytes
    static constexpr int V = 16 / ES;           // elements per 16-byte vector
};

// The V floats of a 16-byte vector of DT elements.
template <int DT> __device__ __forceinline__ void unpack16(const uint4 v, float* f) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (DT == 0) {
            f[i] = __uint_as_float(w[i]);
        } else if (DT == 1) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        } else {
            f[2 * i] = half_to_float((u16)(w[i] & 0xffffu));
            f[2 * i + 1] = half_to_float((u16)(w[i] >> 16));
        }
    }
}

// acc[r][j] = sum_c w_r[c] x_j[c] over c < K, reduced over the warp (every lane gets the sums):
// NR weight rows, m <= R input rows. VEC: 16-byte vectors (K a multiple of V, rows aligned),
// U per row in flight per lane; otherwise one element per lane at a time (odd shapes).
template <int DT, int NR, int R, int U, bool VEC>
__device__ __forceinline__ void warp_dots(const char* const (&w)[NR], const char* const (&x)[R], int m, int K,
                                          float (&acc)[NR][R]) {
    constexpr int ES = GV<DT>::ES, V = GV<DT>::V;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int j = 0; j < R; ++j) acc[r][j] = 0.f;
    if (VEC) {
        for (int c0 = lane * V; c0 < K; c0 += 32 * V * U) {
            uint4 wv[U][NR];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + u * 32 * V;
#pragma unroll
                for (int r = 0; r < NR; ++r)
                    wv[u][r] = c < K ? __ldg((const uint4*)(w[r] + (long long)c * ES)) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + u * 32 * V;
                if (c >= K) break;
                float fw[NR][V];
#pragma unroll
                for (int r = 0; r < NR; ++r) unpack16<DT>(wv[u][r], fw[r]);
#pragma unroll
                for (int j = 0; j < R; ++j) {
                    if (j >= m) break;
                    float fx[V];
                    unpack16<DT>(__ldg((const uint4*)(x[j] + (long long)c * ES)), fx);
#pragma unroll
                    for (int r = 0; r < NR; ++r)
#pragma unroll
                        for (int i = 0; i < V; ++i) acc[r][j] = fmaf(fw[r][i], fx[i], acc[r][j]);
                }
            }
        }
    } else {
        for (int c = lane; c < K; c += 32) {
            float fw[NR];
#pragma unroll
            for (int r = 0; r < NR; ++r) fw[r] = ld<DT>(w[r], c);
#pragma unroll
            for (int j = 0; j < R; ++j) {
                if (j >= m) break;
                const float fx = ld<DT>(x[j], c);
#pragma unroll
                for (int r = 0; r < NR; ++r) acc[r][j] = fmaf(fw[r], fx, acc[r][j]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int j = 0; j < R; ++j)
            if (j < m) acc[r][j] = warp_sum(acc[r][j]);
}

// One pass over an expert's group: its assignments start .. start + m (m <= R; the tail
// repeats the last, whose sums are not stored) and their input rows, base + (a / div) * stride
// bytes (x rows are per token, div = k; h rows per assignment, div = 1).
template <int R>
__device__ __forceinline__ void pass_rows(const int* sorted, int start, int m, const void* base, int div,
                                          long long stride, int (&as)[R], const char* (&xs)[R]) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
        as[j] = sorted[start + min(j, m - 1)];
        xs[j] = (const char*)base + (long long)(as[j] / div) * stride;
    }
}

#define GV_GROUPING_SHARED                                                                         \
    __shared__ int id_s[GV_MAX_ASSIGN], first_s[GV_MAX_ASSIGN], sorted[GV_MAX_ASSIGN];             \
    __shared__ int g_expert[GV_MAX_ASSIGN], g_start[GV_MAX_ASSIGN], g_count[GV_MAX_ASSIGN];

// x [T, H] (row stride ld_x), ids [T k], w_gu [E, 2I, H] (gate rows first) -> h [n, I]
// (assignment order). Tile: P rows of gate and up (P: the host's pairs per tile); an item is
// one pair (gate row i, up row i) of one expert.
template <int DT, int ACT, int R, int U, bool VEC>
__global__ void __launch_bounds__(GV_MAX_ASSIGN, 2)
expert_gate_up(const void* __restrict__ x, long long ld_x, const long long* __restrict__ ids, int n, int k,
               const void* __restrict__ w_gu, int I, int H, int P, void* __restrict__ h) {
    GV_GROUPING_SHARED
    const int groups = group_assignments(ids, n, id_s, first_s, sorted, g_expert, g_start, g_count);
    constexpr int ES = GV<DT>::ES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tiles = (I + P - 1) / P;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {  // no barrier: warps run ahead freely
        for (int q = warp; q < groups * P; q += GV_WARPS) {
            const int g = q / P, i = tile * P + q % P;
            if (i >= I) continue;
            const int start = g_start[g], count = g_count[g];
            const char* gate = (const char*)w_gu + ((long long)g_expert[g] * 2 * I + i) * H * ES;
            const char* const rows[2] = {gate, gate + (long long)I * H * ES};
            for (int c0 = 0; c0 < count; c0 += R) {
                const int m = min(R, count - c0);
                int as[R];
                const char* xs[R];
                pass_rows<R>(sorted, start + c0, m, x, k, ld_x * ES, as, xs);
                float acc[2][R];
                warp_dots<DT, 2, R, U, VEC>(rows, xs, m, H, acc);
                if (lane == 0) {
#pragma unroll
                    for (int j = 0; j < R; ++j) {
                        if (j >= m) break;
                        const float a = rnd<DT>(activate<ACT>(rnd<DT>(acc[0][j])));
                        st<DT>(h, (long long)as[j] * I + i, a * rnd<DT>(acc[1][j]));
                    }
                }
            }
        }
    }
}

// h [n, I], w_d [E, H, I], weights [T, k] (WDT: fp32 or the activations' dtype) -> out [T, H].
// Tile: RB rows of down (even, <= GV_MAX_ROWS_PER_CTA) for every assignment, then each token's
// sum over its k (decode_ops.cu's weighted); an item is two consecutive rows of one expert.
template <int DT, int R, int U, bool VEC, int WDT>
__global__ void __launch_bounds__(GV_MAX_ASSIGN, 2)
expert_down_combine(const void* __restrict__ h, const long long* __restrict__ ids, const void* __restrict__ weights,
                    int n, int k, const void* __restrict__ w_d, int H, int I, int RB, void* __restrict__ out) {
    GV_GROUPING_SHARED
    __shared__ float y_s[2][GV_MAX_ASSIGN * GV_MAX_ROWS_PER_CTA];  // [tile parity][assignment][row of the tile]
    const int groups = group_assignments(ids, n, id_s, first_s, sorted, g_expert, g_start, g_count);
    constexpr int ES = GV<DT>::ES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tiles = (H + RB - 1) / RB, pairs = RB / 2, T = n / k;
    for (int tile = blockIdx.x, parity = 0; tile < tiles; tile += gridDim.x, parity ^= 1) {
        const int h0 = tile * RB;
        float* y = y_s[parity];
        for (int q = warp; q < groups * pairs; q += GV_WARPS) {
            const int g = q / pairs, r = 2 * (q % pairs);
            if (h0 + r >= H) continue;
            const bool second = h0 + r + 1 < H;  // else the first row twice, its copy not stored
            const int start = g_start[g], count = g_count[g];
            const char* row = (const char*)w_d + ((long long)g_expert[g] * H + h0 + r) * I * ES;
            const char* const rows[2] = {row, second ? row + (long long)I * ES : row};
            for (int c0 = 0; c0 < count; c0 += R) {
                const int m = min(R, count - c0);
                int as[R];
                const char* xs[R];
                pass_rows<R>(sorted, start + c0, m, h, 1, (long long)I * ES, as, xs);
                float acc[2][R];
                warp_dots<DT, 2, R, U, VEC>(rows, xs, m, I, acc);
                if (lane == 0) {
#pragma unroll
                    for (int j = 0; j < R; ++j) {
                        if (j >= m) break;
                        y[as[j] * RB + r] = rnd<DT>(acc[0][j]);
                        if (second) y[as[j] * RB + r + 1] = rnd<DT>(acc[1][j]);
                    }
                }
            }
        }
        // One barrier per tile: the next tile writes the other buffer, and this buffer is
        // written again only after every thread has passed the next tile's barrier.
        __syncthreads();
        for (int idx = threadIdx.x; idx < T * RB; idx += blockDim.x) {
            const int t = idx / RB, r = idx - t * RB;
            if (h0 + r >= H) continue;
            float acc = 0.f;
            for (int j = 0; j < k; ++j) {
                const int a = t * k + j;
                acc += weighted<DT, WDT>(weights, a, y[a * RB + r]);  // as combine_rows
            }
            st<DT>(out, (long long)t * H + h0 + r, acc);
        }
    }
}
