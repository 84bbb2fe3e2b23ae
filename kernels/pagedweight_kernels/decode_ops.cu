// Small fused kernels of a decode layer: each replaces a chain of 3-8 torch
// launches whose every link is a short kernel over a few KB. Each computes what its
// chain computes, rounding to the activation dtype where the chain's links round, so the
// result equals the chain's up to the fp32 order of a reduction (decode_ops.py holds the
// chains as the references; tests/kernels/test_decode_ops_gpu.py compares them).
//
// DT: the element type of activations and weights: 0 float32, 1 bfloat16, 2 float16.
// No headers (NVRTC through cupy): u16, u32 and the conversions come from
// dtype_conversions.cu, which module_source (cuda_packages.py) prepends.

template <int DT> __device__ __forceinline__ float ld(const void* p, long long i) {
    if (DT == 0) return ((const float*)p)[i];
    const u16 v = ((const u16*)p)[i];
    return DT == 1 ? bf16_to_float(v) : half_to_float(v);
}
template <int DT> __device__ __forceinline__ void st(void* p, long long i, float f) {
    if (DT == 0) ((float*)p)[i] = f;
    else ((u16*)p)[i] = DT == 1 ? float_to_bf16(f) : float_to_half(f);
}
// f rounded to DT and back: where the torch chain stores an intermediate tensor
template <int DT> __device__ __forceinline__ float rnd(float f) {
    if (DT == 0) return f;
    return DT == 1 ? bf16_to_float(float_to_bf16(f)) : half_to_float(float_to_half(f));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}
__device__ __forceinline__ int warp_sum_int(int v) {
    for (int off = 16; off; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int off = 16; off; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// The experts' activation act(gate) as torch computes it (ACT 0 SiLU, 1 GELU-tanh).
template <int ACT> __device__ __forceinline__ float activate(float g) {
    if (ACT == 1) {
        const float k = 0.7978845608028654f;  // sqrt(2 / pi)
        return 0.5f * g * (1.f + tanhf(k * (g + 0.044715f * g * g * g)));
    }
    return g / (1.f + expf(-g));
}

// ---------------------------------------------------------------- residual add + RMSNorm
// One block per token row. MODE 0: out = norm(x) (the residual is x, not written);
// 1: residual = x + delta; 2: residual = x + (delta + sigmoid(gate) * shared) (Qwen's gated
// shared expert, added where the MoE block's chain adds it); then out = the RMSNorm of the
// residual, normalised in fp32 and, by SCALE, 0: cast, then scaled by w (the Llama-style
// RMSNorm); 1: scaled by w in fp32, then cast (Gemma-4's); 2: cast, no scale (Gemma-4's value
// and router norms; weight unused). The row stays in registers (VPT elements per thread,
// H <= VPT * blockDim): its loads are all in flight at once, not each behind the previous
// element's store.
template <int DT, int MODE, int VPT, int SCALE>
__global__ void add_rms_norm(const void* __restrict__ x, const void* __restrict__ delta,
                             const void* __restrict__ shared, const void* __restrict__ gate, long long gate_stride,
                             const void* __restrict__ weight, void* __restrict__ residual, void* __restrict__ out,
                             int H, float eps) {
    __shared__ float partial[32];
    const long long row = (long long)blockIdx.x * H;
    float g = 0.f;
    if (MODE == 2) g = rnd<DT>(1.f / (1.f + expf(-ld<DT>(gate, (long long)blockIdx.x * gate_stride))));
    float vals[VPT], w[VPT];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {  // the scale's loads too, before the reduction waits on the row's
        const int i = threadIdx.x + j * blockDim.x;
        w[j] = i < H && SCALE != 2 ? ld<DT>(weight, i) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        float v = 0.f;
        if (i < H) {
            v = ld<DT>(x, row + i);
            if (MODE >= 1) {
                float d = ld<DT>(delta, row + i);
                // __fmul_rn: no contraction into an FMA, which would round once where the chain rounds twice
                if (MODE == 2) d = rnd<DT>(d + rnd<DT>(__fmul_rn(g, ld<DT>(shared, row + i))));
                v = rnd<DT>(v + d);
            }
        }
        vals[j] = v;
        ss += v * v;
    }
    if (MODE >= 1) {
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < H) st<DT>(residual, row + i, vals[j]);
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    ss = warp_sum(ss);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        ss = warp_sum(lane < warps ? partial[lane] : 0.f);
        if (lane == 0) partial[0] = ss;
    }
    __syncthreads();
    const float r = rsqrtf(partial[0] / (float)H + eps);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < H) {
            const float n = __fmul_rn(vals[j], r);
            st<DT>(out, row + i, SCALE == 0 ? w[j] * rnd<DT>(n) : SCALE == 1 ? __fmul_rn(n, w[j]) : n);
        }
    }
}

// ---------------------------------------------------------------- routing
// One warp per token: softmax over the E router logits in fp32, the k largest (ties: the
// lower expert id), optionally renormalised to sum 1, weights cast to OUT. p: E floats of
// shared memory per warp.
template <int DT, int OUT>
__global__ void route_topk(const void* __restrict__ logits, long long stride, int T, int E, int k, int renorm,
                           long long* __restrict__ ids, void* __restrict__ weights) {
    extern __shared__ float p_all[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= T) return;  // a whole warp leaves; only warp-level synchronisation below
    float* p = p_all + warp * E;
    float m = __int_as_float(0xff800000);  // -inf
    for (int e = lane; e < E; e += 32) {
        const float v = ld<DT>(logits, t * stride + e);
        p[e] = v;
        m = fmaxf(m, v);
    }
    m = warp_max(m);
    float s = 0.f;
    for (int e = lane; e < E; e += 32) {
        const float v = expf(p[e] - m);
        p[e] = v;
        s += v;
    }
    s = warp_sum(s);
    for (int e = lane; e < E; e += 32) p[e] = p[e] / s;
    __syncwarp();
    float mine = 0.f, total = 0.f;  // lane j keeps the j-th weight
    for (int j = 0; j < k; ++j) {
        float best = -2.f;
        int bi = 0x7fffffff;
        for (int e = lane; e < E; e += 32) {
            if (p[e] > best) { best = p[e]; bi = e; }
        }
        for (int off = 16; off; off >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, off);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == j) mine = best;
        total += best;
        __syncwarp();
        if (lane == 0) {
            ids[(long long)t * k + j] = bi;
            p[bi] = -1.f;  // probabilities are >= 0: never chosen again
        }
        __syncwarp();
    }
    if (lane < k) st<OUT>(weights, (long long)t * k + lane, renorm ? mine / total : mine);
}

// ---------------------------------------------------------------- gated activation
// h [T, I] = round(round(act(gate)) * up) with gate = gu[t, :I], up = gu[t, I:2I] (row stride ld).
template <int DT, int ACT>
__global__ void gated_rows(const void* __restrict__ gu, long long ld_gu, int T, int I, void* __restrict__ h) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * I) return;
    const long long t = idx / I, i = idx - t * I;
    const float a = rnd<DT>(activate<ACT>(ld<DT>(gu, t * ld_gu + i)));
    st<DT>(h, idx, a * ld<DT>(gu, t * ld_gu + I + i));
}

// ---------------------------------------------------------------- grouping by expert
// The n = T * k assignments (flat ids [n]) sorted stably by expert, as torch.sort(stable)
// orders them: assignment i goes to pos = start[e] + #{j < i : ids[j] == e}. Every block
// sorts the (small) list in shared memory and copies its share of the rows
// rows[pos] = x[i / k] (row_words 4-byte words per row); block 0 writes every inv[i] = pos
// and the groups' ends offs[e] (int32, as torch._grouped_mm takes them).
// Shared memory: (n + 2 E) ints.
__global__ void group_rows(const long long* __restrict__ ids, int n, int k, int E,
                           const u32* __restrict__ x, int row_words, u32* __restrict__ rows,
                           int* __restrict__ inv, int* __restrict__ offs) {
    extern __shared__ int sm[];
    int* id_s = sm;
    int* count = sm + n;
    int* start = count + E;
    for (int i = threadIdx.x; i < n; i += blockDim.x) id_s[i] = (int)ids[i];
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int c = 0;
        for (int j = 0; j < n; ++j) c += id_s[j] == e;
        count[e] = c;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int s = 0;
        for (int j = 0; j < e; ++j) s += count[j];
        start[e] = s;
        if (blockIdx.x == 0) offs[e] = s + count[e];
    }
    __syncthreads();
    // positions of this block's rows (i = blockIdx.x, + gridDim.x, ...), then their copies
    for (int i = blockIdx.x; i < n; i += gridDim.x) {
        const int e = id_s[i];
        int r = 0;
        for (int j = threadIdx.x; j < i; j += blockDim.x) r += id_s[j] == e;
        r = warp_sum_int(r);
        __shared__ int rank_parts[32];
        if ((threadIdx.x & 31) == 0) rank_parts[threadIdx.x >> 5] = r;
        __syncthreads();
        int pos = start[e];
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) pos += rank_parts[w];
        __syncthreads();  // rank_parts is rewritten by the next row
        const u32* src = x + (long long)(i / k) * row_words;
        u32* dst = rows + (long long)pos * row_words;
        for (int w = threadIdx.x; w < row_words; w += blockDim.x) dst[w] = src[w];
    }
    if (blockIdx.x == 0) {  // every position, for the combine
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const int e = id_s[i];
            int r = 0;
            for (int j = 0; j < i; ++j) r += id_s[j] == e;
            inv[i] = start[e] + r;
        }
    }
}

// ---------------------------------------------------------------- top-k combine
// One routing weight times one expert output, as the torch chain computes it: with weights in
// the activations' dtype (WDT == DT) the product rounded to it; with fp32 weights (WDT 0,
// Gemma-4's router) the product kept in fp32, so the sum over k is rounded once at the end.
template <int DT, int WDT>
__device__ __forceinline__ float weighted(const void* w, long long a, float y) {
    const float p = __fmul_rn(ld<WDT>(w, a), y);  // not an FMA
    return WDT == 0 ? p : rnd<DT>(p);
}

// out[t] = round(sum_j weighted(w[t, j], y[inv[t k + j]])): the grouped products' rows (sorted
// by expert) back to their tokens, weighted and summed over k as the torch chain does it.
template <int DT, int WDT>
__global__ void combine_rows(const void* __restrict__ y, const int* __restrict__ inv, const void* __restrict__ w,
                             int T, int k, int H, void* __restrict__ out) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * H) return;
    const long long t = idx / H, h = idx - t * H;
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
        const long long a = t * k + j;
        acc += weighted<DT, WDT>(w, a, ld<DT>(y, (long long)inv[a] * H + h));
    }
    st<DT>(out, idx, acc);
}

// ---------------------------------------------------------------- RoPE + KV write
// qkv [T, ld] holds q (N heads), k (G), v (G) of D each, from the fused projection. q and k
// are rotated as x * cos + roll(x, D / 2) * signed_sin (rounding x * cos first, as the torch
// chain's addcmul does); q goes to q_out [T, N, D], k and v straight into the cache's flat
// storage, token t's G * D elements at k_start[t] and v_start[t] (any tile layout).
// cos, ssin: [T, D].
template <int DT>
__global__ void rope_write(const void* __restrict__ qkv, long long ld_qkv, const void* __restrict__ cos,
                           const void* __restrict__ ssin, int N, int G, int D, void* __restrict__ q_out,
                           void* cache, const long long* __restrict__ k_start, const long long* __restrict__ v_start) {
    const int t = blockIdx.y;
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (N + 2 * G) * D) return;
    const int head = e / D, d = e - head * D;
    float v = ld<DT>(qkv, t * ld_qkv + e);
    if (head < N + G) {
        const int half = D / 2;
        const float partner = ld<DT>(qkv, t * ld_qkv + head * D + (d < half ? d + half : d - half));
        const long long c = (long long)t * D + d;
        v = rnd<DT>(v * ld<DT>(cos, c)) + partner * ld<DT>(ssin, c);
    }
    if (head < N) st<DT>(q_out, (long long)t * N * D + e, v);
    else if (head < N + G) st<DT>(cache, k_start[t] + (e - N * D), v);
    else st<DT>(cache, v_start[t] + (e - (N + G) * D), v);
}
