// Quantized GEMV on fp32 activations, built like mmvq.cu (the decode hot path when activations
// stay in float32): y[b, r] = W[r] . x[b], weights decoded in registers (common.cuh FUnit: one PRMT
// per weight, no integer->float conversion), fp32 FMA and fp32 accumulation.
//
// A warp owns a group of MMVF_R consecutive rows (of every matrix of the launch) and its lanes
// stride over 32-weight units; each lane loads its unit of the R rows first (16-byte loads where
// the block alignment allows), then per activation row reads the 32 fp32 activations once (8
// float4 loads, through L1) and applies them to all R (x M) decoded units: the activation bytes,
// 8x the weight bytes of a 4-bit format, are shared that way. `wpr` warps share one row group for
// long rows (reduced through shared memory); blocks of MMVF_WARPS warps.
//
// mmvf_nbNB: up to three matrices ("segments") sharing one input (Q, K, V), each with its own
// type, bias and output; row groups of all segments are laid end to end over the grid (a group
// never straddles two segments). accumulate != 0 adds into y (the residual stream).
// ffnf_nbNB: gate and up of one FFN (same type and shape) in one launch, a = act(g) * u, fp32. Its
// groups may be half-warps (lpg 16, with wpr 1): rows whose units leave a pass of 32 lanes half
// empty (K = 1536: 48 units) then take 3 full passes of 16 lanes (ops.ffnf_lanes).
// NB (1, 2, 4, 8) activation rows share each decoded unit; grid.y covers larger batches.
// Requirements (checked on the host): K % 32 == 0, x 16-byte aligned, xs % 4 == 0.
//
// Activations staged in shared memory (stage != 0, mmvf_stage): read from global memory, each lane's
// 128-byte unit is a different cache line, so 8 float4 loads cost 256 L1 wavefronts per warp and
// bound the kernel; staged and swizzled they cost 32. RMSNorm folded in (nw != 0, needs stage): the
// block normalizes its rows (x / rms(x) * nw) while staging them; recomputing the norm of a few KB
// per block costs less than a separate norm launch and its graph node.
// Argmax folded in (amax != 0, one segment): each output packs (value, row) into an order-keeping
// 64-bit key; the block's largest goes into amax[b] by one atomicMax (max is order-independent:
// deterministic); the first index wins ties like argmax_rows. argmax_unpack (elementwise.cu) reads and resets it.
#include "common.cuh"

#ifndef MMVF_WARPS
#define MMVF_WARPS 8       // half the blocks of 4 warps: each block stages the input, so half the staging
#endif
#ifndef MMVF_R
#define MMVF_R 2
#endif
#ifndef MMVF_UNROLL
#define MMVF_UNROLL 2      // two units' loads in flight per lane: one memory latency covers both
#endif
constexpr int kMmvfUnroll = MMVF_UNROLL;   // the pragma needs a constant expression, not a macro

// activations of unit u of row b as 32 floats and their half sums (sl: 0..15, sh: 16..31)
__device__ __forceinline__ void mmvf_x(const float* x, int xs, int b, int u, int nu, bool staged, float (&xv)[32],
                                       float& sl, float& sh) {
    if (staged) {
        // shared memory, swizzled (mmvf_stage): conflict-free 16-byte reads, sums precomputed
        const float* xr = x + b * xs;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float4 t = *(const float4*)(xr + 32 * u + 4 * ((i + u) & 7));
            xv[4 * i] = t.x; xv[4 * i + 1] = t.y; xv[4 * i + 2] = t.z; xv[4 * i + 3] = t.w;
        }
        float2 s2 = *(const float2*)(xr + 32 * nu + 2 * u);
        sl = s2.x;
        sh = s2.y;
        return;
    }
    const float4* xp = (const float4*)(x + (long long)b * xs + 32 * u);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float4 t = __ldg(xp + i);
        xv[4 * i] = t.x; xv[4 * i + 1] = t.y; xv[4 * i + 2] = t.z; xv[4 * i + 3] = t.w;
    }
    sl = ((xv[0] + xv[1]) + (xv[2] + xv[3])) + ((xv[4] + xv[5]) + (xv[6] + xv[7])) +
         (((xv[8] + xv[9]) + (xv[10] + xv[11])) + ((xv[12] + xv[13]) + (xv[14] + xv[15])));
    sh = ((xv[16] + xv[17]) + (xv[18] + xv[19])) + ((xv[20] + xv[21]) + (xv[22] + xv[23])) +
         (((xv[24] + xv[25]) + (xv[26] + xv[27])) + ((xv[28] + xv[29]) + (xv[30] + xv[31])));
}

// acc += the decoded units w (unit u of every row) applied to every activation row. Row 0 always
// exists: no branch around it, or the compiler sinks the weight loads into the branch, after the
// activation reads (one memory latency more per pass).
template <int QT, int NB, int M>
__device__ __forceinline__ void mmvf_apply(const FUnit (&w)[M][MMVF_R], int u, int nu, const float* x, int xs,
                                           int nbl, bool staged, float (&acc)[M][MMVF_R][NB]) {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        if (b == 0 || b < nbl) {
            float xv[32], sl, sh;
            mmvf_x(x, xs, b, u, nu, staged, xv, sl, sh);
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int i = 0; i < MMVF_R; ++i) acc[m][i][b] += funit_dot<QT>(w[m][i], xv, sl, sh);
        }
    }
}

// partial sums of rows r0 .. r0+R-1 (clamped to rlast: rows past the end repeat the last one and
// are never stored) of M matrices over units u0, u0 + ustep, ...
template <int QT, int NB, int M>
__device__ __forceinline__ void mmvf_rows(const u8* const (&W)[M], long long rb, int r0, int rlast, int nu, int u0,
                                          int ustep, const float* x, int xs, int nbl, bool staged,
                                          float (&acc)[M][MMVF_R][NB]) {
    const u8* rows[M][MMVF_R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i = 0; i < MMVF_R; ++i) rows[m][i] = W[m] + (long long)min(r0 + i, rlast) * rb;
#pragma unroll kMmvfUnroll
    for (int u = u0; u < nu; u += ustep) {
        FUnit w[M][MMVF_R];
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int i = 0; i < MMVF_R; ++i) load_funit<QT>(rows[m][i], u, nu, w[m][i]);
        mmvf_apply<QT, NB, M>(w, u, nu, x, xs, nbl, staged, acc);
    }
}

template <int NB, int M>
__device__ __forceinline__ void mmvf_dispatch(int qt, const u8* const (&W)[M], long long rb, int r0, int rlast,
                                              int nu, int u0, int ustep, const float* x, int xs, int nbl,
                                              bool staged, float (&acc)[M][MMVF_R][NB]) {
#define MMVF_CASE(Q) case Q: if constexpr (QT_ON(Q)) mmvf_rows<Q, NB, M>(W, rb, r0, rlast, nu, u0, ustep, x, xs, nbl, staged, acc); break;
    switch (qt) {
        MMVF_CASE(QT_Q4_0)
        MMVF_CASE(QT_Q4_1)
        MMVF_CASE(QT_Q5_0)
        MMVF_CASE(QT_Q5_1)
        MMVF_CASE(QT_Q8_0)
        MMVF_CASE(QT_Q4_K)
        MMVF_CASE(QT_Q5_K)
        MMVF_CASE(QT_Q6_K)
        MMVF_CASE(QT_Q2_K)
        MMVF_CASE(QT_Q3_K)
        MMVF_CASE(QT_IQ4_NL)
        MMVF_CASE(QT_IQ4_XS)
        MMVF_CASE(QT_MXFP4)
        MMVF_CASE(QT_IQ2_XXS)
        MMVF_CASE(QT_IQ2_XS)
        MMVF_CASE(QT_IQ2_S)
        MMVF_CASE(QT_IQ3_XXS)
        MMVF_CASE(QT_IQ3_S)
        default: break;
    }
#undef MMVF_CASE
}

// sums over each group's lanes (the warp, or its halves: lpg 16), then (wpr > 1) the sum over the warps
// of a group, in a fixed order; on return every lane of the group's first warp (sub == 0) holds the
// totals. Block-uniform barrier.
template <int NB, int M>
__device__ __forceinline__ void mmvf_reduce(float (&acc)[M][MMVF_R][NB], int wpr, int wid, int sub, int lane,
                                            int lpg = 32) {
    __shared__ float red[MMVF_WARPS][M][MMVF_R][NB];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i = 0; i < MMVF_R; ++i)
#pragma unroll
            for (int b = 0; b < NB; ++b)
                for (int o = lpg >> 1; o > 0; o >>= 1)          // over each group's lanes (lpg: 32 or 16)
                    acc[m][i][b] += __shfl_xor_sync(0xffffffffu, acc[m][i][b], o);
    if (wpr > 1) {
        if (lane == 0)
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int i = 0; i < MMVF_R; ++i)
#pragma unroll
                    for (int b = 0; b < NB; ++b) red[wid][m][i][b] = acc[m][i][b];
        __syncthreads();
        if (sub == 0)
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int i = 0; i < MMVF_R; ++i)
#pragma unroll
                    for (int b = 0; b < NB; ++b) {
                        float s = red[wid][m][i][b];
                        for (int w = 1; w < wpr; ++w) s += red[wid + w][m][i][b];
                        acc[m][i][b] = s;
                    }
    }
}

// Stage the block's nbl activation rows in shared memory (when the host asks: `stage`, always with
// a folded norm), optionally as RMSNorm(x) * nw. Layout per row (stride mmvf_stride(K) floats): unit
// u's 8 float4 chunks with chunk c at slot (c + u) & 7, so the 8 lanes of a quarter-warp, which read
// 8 consecutive units, hit 8 different bank groups (unswizzled, every lane's unit starts on bank 0);
// then the unit sums (low 16, high 16) that every row's dot needs. Global loads here are coalesced;
// reading units straight from global memory costs a 128-byte line per lane per float4.
// Returns what the GEMV reads (the staged rows, or x) ; block-uniform barriers.
__device__ __forceinline__ int mmvf_stride(int K) { return K + (((K >> 4) + 3) & ~3); }

template <int NB>
__device__ __forceinline__ const float* mmvf_stage(const float* __restrict__ x, int xs, int K, int nbl, int stage,
                                                   const float* __restrict__ nw, float eps, float* sm) {
    if (!stage) return x;
    __shared__ float part[MMVF_WARPS][NB];
    __shared__ float inv_s[NB];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int nu = K >> 5, st = mmvf_stride(K);
    // the raw rows first, by asynchronous copies: all of a thread's pieces in flight together (one
    // memory latency per row, where a load-store loop pays one per few trips); each thread later
    // reads back only its own pieces, so its own wait is enough until the barrier
    for (int b = 0; b < nbl; ++b)
#pragma unroll 4
        for (int g = threadIdx.x; g < 8 * nu; g += blockDim.x) {
            int u = g >> 3;
            cp_async16(sm + b * st + 32 * u + 4 * (((g & 7) + u) & 7), x + (long long)b * xs + 4 * g);
        }
    cp_async_wait_all();
    if (nw) {
        float ss[NB];
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            ss[b] = 0.0f;
            if (b < nbl)
#pragma unroll 4
                for (int g = threadIdx.x; g < 8 * nu; g += blockDim.x) {
                    int u = g >> 3;
                    float4 v = *(const float4*)(sm + b * st + 32 * u + 4 * (((g & 7) + u) & 7));
                    ss[b] += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
                }
            ss[b] = warp_sum(ss[b]);
        }
        if (lane == 0)
#pragma unroll
            for (int b = 0; b < NB; ++b) part[wid][b] = ss[b];
        __syncthreads();
        if (threadIdx.x < NB) {
            float t = 0.0f;
#pragma unroll
            for (int w = 0; w < MMVF_WARPS; ++w) t += part[w][threadIdx.x];
            inv_s[threadIdx.x] = rsqrtf(t / K + eps);
        }
        __syncthreads();
        for (int b = 0; b < nbl; ++b) {
            float inv = inv_s[b];
#pragma unroll 4
            for (int g = threadIdx.x; g < 8 * nu; g += blockDim.x) {
                int u = g >> 3;
                float4* p = (float4*)(sm + b * st + 32 * u + 4 * (((g & 7) + u) & 7));
                float4 v = *p, w = __ldg((const float4*)nw + g);
                *p = make_float4(v.x * inv * w.x, v.y * inv * w.y, v.z * inv * w.z, v.w * inv * w.w);
            }
        }
    }
    __syncthreads();
    for (int h = threadIdx.x; h < 2 * nu * nbl; h += blockDim.x) {
        int b = h / (2 * nu), r = h - b * 2 * nu, u = r >> 1;
        const float* xr = sm + b * st + 32 * u;
        float q[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float4 t = *(const float4*)(xr + 4 * ((4 * (r & 1) + c + u) & 7));
            q[c] = (t.x + t.y) + (t.z + t.w);
        }
        sm[b * st + 32 * nu + r] = (q[0] + q[1]) + (q[2] + q[3]);   // the unstaged path's order
    }
    __syncthreads();
    return sm;
}

// the block's largest key per activation row into amax[b]: one atomic per block, not per output
// (the LM head writes ~150k outputs into one address, and same-address atomics serialize at L2).
// Block-uniform barrier.
template <int NB>
__device__ __forceinline__ void argmax_block(unsigned long long (&best)[NB], unsigned long long* amax, int nbl) {
    __shared__ unsigned long long red[MMVF_WARPS][NB];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
#pragma unroll
    for (int b = 0; b < NB; ++b) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            unsigned long long t = __shfl_xor_sync(0xffffffffu, best[b], o);
            best[b] = t > best[b] ? t : best[b];
        }
        if (lane == 0) red[wid][b] = best[b];
    }
    __syncthreads();
    if (threadIdx.x < nbl) {
        unsigned long long m = 0ull;
#pragma unroll
        for (int w = 0; w < MMVF_WARPS; ++w) m = red[w][threadIdx.x] > m ? red[w][threadIdx.x] : m;
        atomicMax(amax + threadIdx.x, m);
    }
}

// One matrix of an mmvf launch and where its outputs go.
struct MmvfSeg {
    const u8* W;
    long long rb;
    int n, qt;
    const float* bias;
    float* y;
    int ys;
};

// the segment holding launch-wide row group G, and G's index inside it (g); warp-uniform
__device__ __forceinline__ MmvfSeg mmvf_seg(const MmvfSeg (&s)[3], int G, int& g) {
    int g0 = (s[0].n + MMVF_R - 1) / MMVF_R, g1 = (s[1].n + MMVF_R - 1) / MMVF_R;
    g = G;
    if (G < g0) return s[0];
    g -= g0;
    if (g < g1) return s[1];
    g -= g1;
    return s[2];
}

template <int NB>
__device__ __forceinline__ void mmvf_body(const MmvfSeg (&seg)[3], int K, const float* __restrict__ x, int xs,
                                          int nb, int wpr, int accumulate, int stage, const float* nw, float eps,
                                          unsigned long long* amax) {
    extern __shared__ float4 mmvf_sm[];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int gpb = MMVF_WARPS / wpr, sub = wid % wpr;
    int groups = 0;
#pragma unroll
    for (int i = 0; i < 3; ++i) groups += (seg[i].n + MMVF_R - 1) / MMVF_R;
    int bb = blockIdx.y * NB;
    int nbl = min(NB, nb - bb);
    unsigned long long best[NB];          // this thread's largest argmax key per row (amax)
#pragma unroll
    for (int b = 0; b < NB; ++b) best[b] = 0ull;   // below every key
    {   // the first round's rows towards L2 while the kernel before may still run
        int G = blockIdx.x * gpb + wid / wpr, g;
        if (sub == 0 && lane == 0 && G < groups) {
            MmvfSeg s = mmvf_seg(seg, G, g);
            l2_prefetch(s.W + (long long)g * MMVF_R * s.rb, (long long)min(MMVF_R, s.n - g * MMVF_R) * s.rb);
        }
    }
    pdl_wait();
    const float* xb = mmvf_stage<NB>(x + (long long)bb * xs, xs, K, nbl, stage, nw, eps, (float*)mmvf_sm);
    int xst = stage ? mmvf_stride(K) : xs;
    // the grid may hold fewer blocks than there are groups (one wave, staged once per block): blocks
    // stride over the groups; the trip count is block-uniform, for the barriers inside
    for (int base = blockIdx.x * gpb; base < groups; base += gridDim.x * gpb) {
        int G = base + wid / wpr;
        bool live = G < groups;
        int g;
        MmvfSeg s = mmvf_seg(seg, live ? G : 0, g);
        int r0 = g * MMVF_R;
        float acc[1][MMVF_R][NB];
#pragma unroll
        for (int i = 0; i < MMVF_R; ++i)
#pragma unroll
            for (int b = 0; b < NB; ++b) acc[0][i][b] = 0.0f;
        const u8* const Ws[1] = {s.W};
        if (live)
            mmvf_dispatch<NB, 1>(s.qt, Ws, s.rb, r0, s.n - 1, K >> 5, sub * 32 + lane, 32 * wpr, xb, xst, nbl,
                                 stage != 0, acc);
        if (base + gridDim.x * gpb >= groups) pdl_trigger();     // the block's last round: loads issued
        mmvf_reduce<NB, 1>(acc, wpr, wid, sub, lane);
        if (live && sub == 0) {
            // outputs spread over the lanes
#pragma unroll
            for (int i = 0; i < MMVF_R; ++i)
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    int r = r0 + i;
                    if (lane == ((i * NB + b) & 31) && r < s.n && b < nbl) {
                        float v = acc[0][i][b] + (s.bias ? s.bias[r] : 0.0f);
                        float* out = s.y + (long long)(bb + b) * s.ys + r;
                        *out = accumulate ? *out + v : v;
                        if (amax) {
                            unsigned long long k = argmax_key(v, r);
                            best[b] = k > best[b] ? k : best[b];
                        }
                    }
                }
        }
        if (wpr > 1) __syncthreads();      // mmvf_reduce's shared buffer is reused next round
    }
    if (amax) argmax_block<NB>(best, amax + bb, nbl);
}

template <int NB>
__device__ __forceinline__ void ffnf_body(const u8* Wg, const u8* Wu, long long rb, int N, int K, int qt,
                                          const float* __restrict__ x, int xs, int nb, int act, float* a, int as,
                                          int wpr, int stage, const float* nw, float eps, int lpg) {
    extern __shared__ float4 mmvf_sm[];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    // lpg 16 (with wpr 1): each half-warp owns a row group, so that rows of 16 x odd units (K = 1536:
    // 48) fill every pass; lpg 32: a warp (or wpr of them) a group. 8 rows: always 32 (registers)
    if constexpr (NB > 4) lpg = 32;
    const int per = 32 / lpg, vw = wid * per + lane / lpg, ln = lane % lpg;
    int gpb = MMVF_WARPS * per / wpr, sub = vw % wpr;
    int groups = (N + MMVF_R - 1) / MMVF_R;
    int bb = blockIdx.y * NB;
    int nbl = min(NB, nb - bb);
    {   // as mmvf_body: the first round's gate and up rows towards L2, then wait for the kernel before
        int G = blockIdx.x * gpb + vw / wpr;
        if (sub == 0 && ln < 2 && G < groups)
            l2_prefetch((ln ? Wu : Wg) + (long long)G * MMVF_R * rb, (long long)min(MMVF_R, N - G * MMVF_R) * rb);
    }
    pdl_wait();
    const float* xb = mmvf_stage<NB>(x + (long long)bb * xs, xs, K, nbl, stage, nw, eps, (float*)mmvf_sm);
    int xst = stage ? mmvf_stride(K) : xs;
    for (int base = blockIdx.x * gpb; base < groups; base += gridDim.x * gpb) {   // as mmvf_body
        int G = base + vw / wpr;
        bool live = G < groups;
        int r0 = G * MMVF_R;
        float acc[2][MMVF_R][NB];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int i = 0; i < MMVF_R; ++i)
#pragma unroll
                for (int b = 0; b < NB; ++b) acc[m][i][b] = 0.0f;
        const u8* const Ws[2] = {Wg, Wu};
        if (live)
            mmvf_dispatch<NB, 2>(qt, Ws, rb, r0, N - 1, K >> 5, sub * lpg + ln, lpg * wpr, xb, xst, nbl,
                                 stage != 0, acc);
        if (base + gridDim.x * gpb >= groups) pdl_trigger();     // the block's last round: loads issued
        mmvf_reduce<NB, 2>(acc, wpr, wid, sub, lane, lpg);
        if (live && sub == 0) {
#pragma unroll
            for (int i = 0; i < MMVF_R; ++i)
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    int r = r0 + i;
                    if (ln == ((i * NB + b) & (lpg - 1)) && r < N && b < nbl)
                        a[(long long)(bb + b) * as + r] = act_f(acc[0][i][b], act) * acc[1][i][b];
                }
        }
        if (wpr > 1) __syncthreads();
    }
}

// MMVF_KIND: 1 = the mmvf kernels only, 2 = the ffnf kernels only, unset = both (the loader
// compiles them as separate modules, in parallel: a cold start waits for the slower one only)
#if !defined(MMVF_KIND) || MMVF_KIND == 1
#define DEFINE_MMVF(NB)                                                                                  \
    extern "C" __global__ void __launch_bounds__(MMVF_WARPS * 32) mmvf_nb##NB(                           \
        const u8* W0, long long rb0, int n0, int qt0, const float* b0, float* y0, int ys0,               \
        const u8* W1, long long rb1, int n1, int qt1, const float* b1, float* y1, int ys1,               \
        const u8* W2, long long rb2, int n2, int qt2, const float* b2, float* y2, int ys2,               \
        int K, const float* x, int xs, int nb, int wpr, int accumulate, int stage, const float* nw,      \
        float eps, unsigned long long* amax) {                                                           \
        const MmvfSeg seg[3] = {{W0, rb0, n0, qt0, b0, y0, ys0}, {W1, rb1, n1, qt1, b1, y1, ys1},         \
                                {W2, rb2, n2, qt2, b2, y2, ys2}};                                         \
        mmvf_body<NB>(seg, K, x, xs, nb, wpr, accumulate, stage, nw, eps, amax);                         \
    }
#else
#define DEFINE_MMVF(NB)
#endif
#if !defined(MMVF_KIND) || MMVF_KIND == 2
#define DEFINE_FFNF(NB)                                                                                  \
    extern "C" __global__ void __launch_bounds__(MMVF_WARPS * 32) ffnf_nb##NB(                           \
        const u8* Wg, const u8* Wu, long long rb, int N, int K, int qt, const float* x, int xs, int nb,  \
        int act, float* a, int as, int wpr, int stage, const float* nw, float eps, int lpg) {            \
        ffnf_body<NB>(Wg, Wu, rb, N, K, qt, x, xs, nb, act, a, as, wpr, stage, nw, eps, lpg);            \
    }
#else
#define DEFINE_FFNF(NB)
#endif

// MMVF_NB: one batch width per compilation (the loader compiles the widths as separate modules,
// in parallel); unset: all four
#if !defined(MMVF_NB) || MMVF_NB == 1
DEFINE_MMVF(1)
DEFINE_FFNF(1)
#endif
#if !defined(MMVF_NB) || MMVF_NB == 2
DEFINE_MMVF(2)
DEFINE_FFNF(2)
#endif
#if !defined(MMVF_NB) || MMVF_NB == 4
DEFINE_MMVF(4)
DEFINE_FFNF(4)
#endif
#if !defined(MMVF_NB) || MMVF_NB == 8
DEFINE_MMVF(8)
DEFINE_FFNF(8)
#endif
