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
// ffnf_nbNB: gate and up of one FFN (same type and shape) in one launch, a = act(g) * u, fp32.
// NB (1, 2, 4, 8) activation rows share each decoded unit; grid.y covers larger batches.
// Requirements (checked on the host): K % 32 == 0, x 16-byte aligned, xs % 4 == 0.
//
// RMSNorm folded in (nw != 0): the block normalizes its activation rows (x / rms(x) * nw) into
// dynamic shared memory before the GEMV and reads them from there. Every block recomputes the
// norm of a few KB from L2, which costs less than a separate norm launch and its graph node.
// Argmax folded in (amax != 0, one segment): each output packs (value, row) into an order-keeping
// 64-bit key and atomicMax'es it into amax[b] (max is order-independent: deterministic); the
// first index wins ties like argmax_rows. argmax_unpack (elementwise.cu) reads and resets it.
#include "common.cuh"

#ifndef MMVF_WARPS
#define MMVF_WARPS 4
#endif
#ifndef MMVF_R
#define MMVF_R 2
#endif
#ifndef MMVF_UNROLL
#define MMVF_UNROLL 1
#endif
constexpr int kMmvfUnroll = MMVF_UNROLL;   // the pragma needs a constant expression, not a macro

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
            for (int i = 0; i < MMVF_R; ++i) load_funit<QT>(rows[m][i], u, w[m][i]);
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (b < nbl) {
                const float4* xp = (const float4*)(x + (long long)b * xs + 32 * u);
                float xv[32];
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float4 t = staged ? xp[i] : __ldg(xp + i);   // shared memory or global
                    xv[4 * i] = t.x; xv[4 * i + 1] = t.y; xv[4 * i + 2] = t.z; xv[4 * i + 3] = t.w;
                }
                float sl = ((xv[0] + xv[1]) + (xv[2] + xv[3])) + ((xv[4] + xv[5]) + (xv[6] + xv[7])) +
                           (((xv[8] + xv[9]) + (xv[10] + xv[11])) + ((xv[12] + xv[13]) + (xv[14] + xv[15])));
                float sh = ((xv[16] + xv[17]) + (xv[18] + xv[19])) + ((xv[20] + xv[21]) + (xv[22] + xv[23])) +
                           (((xv[24] + xv[25]) + (xv[26] + xv[27])) + ((xv[28] + xv[29]) + (xv[30] + xv[31])));
#pragma unroll
                for (int m = 0; m < M; ++m)
#pragma unroll
                    for (int i = 0; i < MMVF_R; ++i) acc[m][i][b] += funit_dot<QT>(w[m][i], xv, sl, sh);
            }
        }
    }
}

template <int NB, int M>
__device__ __forceinline__ void mmvf_dispatch(int qt, const u8* const (&W)[M], long long rb, int r0, int rlast,
                                              int nu, int u0, int ustep, const float* x, int xs, int nbl,
                                              bool staged, float (&acc)[M][MMVF_R][NB]) {
#define MMVF_CASE(Q) case Q: mmvf_rows<Q, NB, M>(W, rb, r0, rlast, nu, u0, ustep, x, xs, nbl, staged, acc); break;
    switch (qt) {
        MMVF_CASE(QT_Q4_0)
        MMVF_CASE(QT_Q4_1)
        MMVF_CASE(QT_Q5_0)
        MMVF_CASE(QT_Q5_1)
        MMVF_CASE(QT_Q8_0)
        MMVF_CASE(QT_Q4_K)
        MMVF_CASE(QT_Q5_K)
        MMVF_CASE(QT_Q6_K)
        default: break;
    }
#undef MMVF_CASE
}

// warp sums, then (wpr > 1) the sum over the warps of a group, in a fixed order; on return every
// lane of the group's first warp (sub == 0) holds the totals. Block-uniform barrier.
template <int NB, int M>
__device__ __forceinline__ void mmvf_reduce(float (&acc)[M][MMVF_R][NB], int wpr, int wid, int sub, int lane) {
    __shared__ float red[MMVF_WARPS][M][MMVF_R][NB];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i = 0; i < MMVF_R; ++i)
#pragma unroll
            for (int b = 0; b < NB; ++b) acc[m][i][b] = warp_sum(acc[m][i][b]);
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

// RMSNorm of the block's nbl activation rows into shared memory (row stride K); all threads.
// Returns the pointer the GEMV reads: the staged rows, or x itself when there is no norm.
template <int NB>
__device__ __forceinline__ const float* mmvf_stage(const float* __restrict__ x, int xs, int K, int nbl,
                                                   const float* __restrict__ nw, float eps, float* sm) {
    if (!nw) return x;
    __shared__ float part[MMVF_WARPS][NB];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    float ss[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        ss[b] = 0.0f;
        if (b < nbl)
            for (int i = 4 * threadIdx.x; i < K; i += 4 * blockDim.x) {
                float4 v = __ldg((const float4*)(x + (long long)b * xs + i));
                ss[b] += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
            }
        ss[b] = warp_sum(ss[b]);
    }
    if (lane == 0)
#pragma unroll
        for (int b = 0; b < NB; ++b) part[wid][b] = ss[b];
    __syncthreads();
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        if (b >= nbl) break;
        float t = 0.0f;
#pragma unroll
        for (int w = 0; w < MMVF_WARPS; ++w) t += part[w][b];
        float inv = rsqrtf(t / K + eps);
        for (int i = 4 * threadIdx.x; i < K; i += 4 * blockDim.x) {
            float4 v = __ldg((const float4*)(x + (long long)b * xs + i));
            float4 g = __ldg((const float4*)(nw + i));
            *(float4*)(sm + b * K + i) = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
        }
    }
    __syncthreads();
    return sm;
}

__device__ __forceinline__ unsigned long long argmax_key(float v, int r) {
    u32 u = __float_as_uint(v);
    u ^= (u >> 31) ? 0xFFFFFFFFu : 0x80000000u;          // order-keeping: larger float, larger key
    if (v != v) u = 0u;                                   // NaN never wins (as argmax_rows)
    return ((unsigned long long)u << 32) | (u32)(0xFFFFFFFFu - (u32)r);   // ties: lowest row wins
}

template <int NB>
__device__ __forceinline__ void mmvf_body(
    const u8* W0, long long rb0, int n0, int qt0, const float* b0, float* y0, int ys0,
    const u8* W1, long long rb1, int n1, int qt1, const float* b1, float* y1, int ys1,
    const u8* W2, long long rb2, int n2, int qt2, const float* b2, float* y2, int ys2,
    int K, const float* __restrict__ x, int xs, int nb, int wpr, int accumulate, const float* nw, float eps,
    unsigned long long* amax) {
    extern __shared__ float4 mmvf_sm[];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int G = blockIdx.x * (MMVF_WARPS / wpr) + wid / wpr, sub = wid % wpr;
    int bb = blockIdx.y * NB;
    int nbl = min(NB, nb - bb);
    const float* xb = mmvf_stage<NB>(x + (long long)bb * xs, xs, K, nbl, nw, eps, (float*)mmvf_sm);
    int xst = nw ? K : xs;
    int g0 = (n0 + MMVF_R - 1) / MMVF_R, g1 = (n1 + MMVF_R - 1) / MMVF_R, g2 = (n2 + MMVF_R - 1) / MMVF_R;
    // the group's segment (warp-uniform)
    const u8* W = W0; long long rb = rb0; int n = n0, qt = qt0, g = G; const float* bias = b0; float* y = y0;
    int ys = ys0;
    if (G >= g0) {
        g = G - g0;
        if (g < g1) { W = W1; rb = rb1; n = n1; qt = qt1; bias = b1; y = y1; ys = ys1; }
        else { g -= g1; W = W2; rb = rb2; n = n2; qt = qt2; bias = b2; y = y2; ys = ys2; }
    }
    bool live = G < g0 + g1 + g2;
    int r0 = g * MMVF_R;
    float acc[1][MMVF_R][NB];
#pragma unroll
    for (int i = 0; i < MMVF_R; ++i)
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[0][i][b] = 0.0f;
    const u8* const Ws[1] = {W};
    if (live)
        mmvf_dispatch<NB, 1>(qt, Ws, rb, r0, n - 1, K >> 5, sub * 32 + lane, 32 * wpr, xb, xst, nbl, nw != 0,
                             acc);
    mmvf_reduce<NB, 1>(acc, wpr, wid, sub, lane);
    if (!live || sub != 0) return;
    // outputs spread over the lanes
#pragma unroll
    for (int i = 0; i < MMVF_R; ++i)
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            int r = r0 + i;
            if (lane == ((i * NB + b) & 31) && r < n && b < nbl) {
                float v = acc[0][i][b] + (bias ? bias[r] : 0.0f);
                float* out = y + (long long)(bb + b) * ys + r;
                *out = accumulate ? *out + v : v;
                if (amax) atomicMax(amax + bb + b, argmax_key(v, r));
            }
        }
}

template <int NB>
__device__ __forceinline__ void ffnf_body(const u8* Wg, const u8* Wu, long long rb, int N, int K, int qt,
                                          const float* __restrict__ x, int xs, int nb, int act, float* a, int as,
                                          int wpr, const float* nw, float eps) {
    extern __shared__ float4 mmvf_sm[];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int G = blockIdx.x * (MMVF_WARPS / wpr) + wid / wpr, sub = wid % wpr;
    int bb = blockIdx.y * NB;
    int nbl = min(NB, nb - bb);
    const float* xb = mmvf_stage<NB>(x + (long long)bb * xs, xs, K, nbl, nw, eps, (float*)mmvf_sm);
    int xst = nw ? K : xs;
    bool live = G < (N + MMVF_R - 1) / MMVF_R;
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
        mmvf_dispatch<NB, 2>(qt, Ws, rb, r0, N - 1, K >> 5, sub * 32 + lane, 32 * wpr, xb, xst, nbl, nw != 0,
                             acc);
    mmvf_reduce<NB, 2>(acc, wpr, wid, sub, lane);
    if (!live || sub != 0) return;
#pragma unroll
    for (int i = 0; i < MMVF_R; ++i)
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            int r = r0 + i;
            if (lane == ((i * NB + b) & 31) && r < N && b < nbl)
                a[(long long)(bb + b) * as + r] = act_f(acc[0][i][b], act) * acc[1][i][b];
        }
}

#define DEFINE_MMVF(NB)                                                                                  \
    extern "C" __global__ void __launch_bounds__(MMVF_WARPS * 32) mmvf_nb##NB(                          \
        const u8* W0, long long rb0, int n0, int qt0, const float* b0, float* y0, int ys0,               \
        const u8* W1, long long rb1, int n1, int qt1, const float* b1, float* y1, int ys1,               \
        const u8* W2, long long rb2, int n2, int qt2, const float* b2, float* y2, int ys2,               \
        int K, const float* x, int xs, int nb, int wpr, int accumulate, const float* nw, float eps,       \
        unsigned long long* amax) {                                                                      \
        mmvf_body<NB>(W0, rb0, n0, qt0, b0, y0, ys0, W1, rb1, n1, qt1, b1, y1, ys1, W2, rb2, n2, qt2, b2, \
                      y2, ys2, K, x, xs, nb, wpr, accumulate, nw, eps, amax);                            \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(MMVF_WARPS * 32) ffnf_nb##NB(                          \
        const u8* Wg, const u8* Wu, long long rb, int N, int K, int qt, const float* x, int xs, int nb,  \
        int act, float* a, int as, int wpr, const float* nw, float eps) {                                \
        ffnf_body<NB>(Wg, Wu, rb, N, K, qt, x, xs, nb, act, a, as, wpr, nw, eps);                        \
    }

DEFINE_MMVF(1)
DEFINE_MMVF(2)
DEFINE_MMVF(4)
DEFINE_MMVF(8)
