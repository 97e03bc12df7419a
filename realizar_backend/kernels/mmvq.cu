// Quantized GEMV on 8-bit activations (the decode hot path): y[b, r] = W[r] . x[b] with x given
// as int8 values plus a (scale, scaled sum) pair per 32 (common.cuh), integer dot products
// (__dp4a) against the weights decoded in registers, fp32 accumulation.
//
// mmv_q8_nbNB: up to three matrices ("segments") in one launch (Q, K and V share an input),
// each with its own type, bias and output; rows of all segments are laid end to end over the
// grid, a warp picks its row's segment, so segments of different types can share a block.
// `wpr` warps share one row (1, 2 or 4: long rows get more warps so every SM has loads in flight),
// reduced through shared memory. accumulate != 0 adds into y (the residual stream).
//
// ffn_q8_nbNB: gate and up of one FFN (same type and shape) in one launch, act(g) * u, and the
// result quantized again to 8 bits for the down projection: a block owns 32 consecutive rows
// (8 warps x 4 rows), so the quantization block is complete inside it.
// NB (1, 2, 4, 8) activation rows share each decoded weight unit; grid.y covers larger batches.
#include "common.cuh"

#define MMV_WARPS 4
#define FFN_WARPS 8
#define FFN_ROWS_PER_WARP 4

template <int QT, int NB>
__device__ __forceinline__ void mmv_row_partial(const u8* __restrict__ row, int nu, int u0, int ustep,
                                                const i8* __restrict__ xq, const float2* __restrict__ xd,
                                                int K, int nbl, float (&acc)[NB]) {
    for (int u = u0; u < nu; u += ustep) {
        QUnit w;
        load_qunit<QT>(row, u, nu, w);
#pragma unroll
        for (int b = 0; b < NB; ++b)
            if (b < nbl)
                acc[b] += qunit_dot(w, (const int*)(xq + (long long)b * K + 32 * u), xd[(long long)b * (K >> 5) + u]);
    }
}

template <int NB>
__device__ __forceinline__ void mmv_dispatch(int qt, const u8* row, int nu, int u0, int ustep, const i8* xq,
                                             const float2* xd, int K, int nbl, float (&acc)[NB]) {
    switch (qt) {
        case QT_Q4_0: if constexpr (QT_ON(QT_Q4_0)) mmv_row_partial<QT_Q4_0, NB>(row, nu, u0, ustep, xq, xd, K, nbl, acc); break;
        case QT_Q4_1: if constexpr (QT_ON(QT_Q4_1)) mmv_row_partial<QT_Q4_1, NB>(row, nu, u0, ustep, xq, xd, K, nbl, acc); break;
        case QT_Q5_0: if constexpr (QT_ON(QT_Q5_0)) mmv_row_partial<QT_Q5_0, NB>(row, nu, u0, ustep, xq, xd, K, nbl, acc); break;
        case QT_Q5_1: if constexpr (QT_ON(QT_Q5_1)) mmv_row_partial<QT_Q5_1, NB>(row, nu, u0, ustep, xq, xd, K, nbl, acc); break;
        case QT_Q8_0: if constexpr (QT_ON(QT_Q8_0)) mmv_row_partial<QT_Q8_0, NB>(row, nu, u0, ustep, xq, xd, K, nbl, acc); break;
        case QT_Q4_K: if constexpr (QT_ON(QT_Q4_K)) mmv_row_partial<QT_Q4_K, NB>(row, nu, u0, ustep, xq, xd, K, nbl, acc); break;
        case QT_Q5_K: if constexpr (QT_ON(QT_Q5_K)) mmv_row_partial<QT_Q5_K, NB>(row, nu, u0, ustep, xq, xd, K, nbl, acc); break;
        case QT_Q6_K: if constexpr (QT_ON(QT_Q6_K)) mmv_row_partial<QT_Q6_K, NB>(row, nu, u0, ustep, xq, xd, K, nbl, acc); break;
        default: break;
    }
}

template <int NB>
__device__ __forceinline__ void mmv_body(
    const u8* W0, long long rb0, int n0, int qt0, const float* b0, float* y0, int ys0,
    const u8* W1, long long rb1, int n1, int qt1, const float* b1, float* y1, int ys1,
    const u8* W2, long long rb2, int n2, int qt2, const float* b2, float* y2, int ys2,
    int K, const i8* __restrict__ xq, const float2* __restrict__ xd, int nb, int wpr, int accumulate) {
    __shared__ float red[MMV_WARPS][NB];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int rpb = MMV_WARPS / wpr;
    int R = blockIdx.x * rpb + wid / wpr, sub = wid % wpr;
    int bb = blockIdx.y * NB;
    int nbl = min(NB, nb - bb);
    const i8* xqb = xq + (long long)bb * K;
    const float2* xdb = xd + (long long)bb * (K >> 5);
    // the row's segment (warp-uniform)
    const u8* W = W0; long long rb = rb0; int qt = qt0, r = R; const float* bias = b0; float* y = y0; int ys = ys0;
    if (R >= n0) {
        r = R - n0;
        if (r < n1) { W = W1; rb = rb1; qt = qt1; bias = b1; y = y1; ys = ys1; }
        else { r -= n1; W = W2; rb = rb2; qt = qt2; bias = b2; y = y2; ys = ys2; }
    }
    bool live = R < n0 + n1 + n2;
    float acc[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[b] = 0.0f;
    if (live) mmv_dispatch<NB>(qt, W + (long long)r * rb, K >> 5, sub * 32 + lane, 32 * wpr, xqb, xdb, K, nbl, acc);
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[b] = warp_sum(acc[b]);
    if (wpr > 1) {  // block-uniform: every thread reaches the barrier
        if (lane == 0)
#pragma unroll
            for (int b = 0; b < NB; ++b) red[wid][b] = acc[b];
        __syncthreads();
        if (sub == 0 && lane == 0)
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                float s = 0.0f;
                for (int w = 0; w < wpr; ++w) s += red[wid + w][b];
                acc[b] = s;
            }
    }
    if (!live || sub != 0 || lane != 0) return;
    float bv = bias ? bias[r] : 0.0f;
#pragma unroll
    for (int b = 0; b < NB; ++b)
        if (b < nbl) {
            float* out = y + (long long)(bb + b) * ys + r;
            float v = acc[b] + bv;
            *out = accumulate ? *out + v : v;
        }
}

template <int QT, int NB>
__device__ __forceinline__ void ffn_rows(const u8* __restrict__ Wg, const u8* __restrict__ Wu, long long rb,
                                         int r0, int N, int nu, int lane, const i8* __restrict__ xq,
                                         const float2* __restrict__ xd, int K, int nbl,
                                         float (&ag)[FFN_ROWS_PER_WARP][NB], float (&au)[FFN_ROWS_PER_WARP][NB]) {
    for (int u = lane; u < nu; u += 32) {
#pragma unroll
        for (int i = 0; i < FFN_ROWS_PER_WARP; ++i) {
            int r = r0 + i;
            if (r >= N) break;
            QUnit g, v;
            load_qunit<QT>(Wg + (long long)r * rb, u, nu, g);
            load_qunit<QT>(Wu + (long long)r * rb, u, nu, v);
#pragma unroll
            for (int b = 0; b < NB; ++b)
                if (b < nbl) {
                    const int* x = (const int*)(xq + (long long)b * K + 32 * u);
                    float2 ds = xd[(long long)b * (K >> 5) + u];
                    ag[i][b] += qunit_dot(g, x, ds);
                    au[i][b] += qunit_dot(v, x, ds);
                }
        }
    }
}

// a (N values per activation row) is written as 8-bit blocks (aq, ad) and, if af != 0, as fp32.
template <int NB>
__device__ __forceinline__ void ffn_body(const u8* Wg, const u8* Wu, long long rb, int N, int K, int qt,
                                         const i8* __restrict__ xq, const float2* __restrict__ xd, int nb,
                                         int act, i8* aq, float2* ad, float* af) {
    __shared__ float res[NB][32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int r0 = blockIdx.x * 32 + wid * FFN_ROWS_PER_WARP;
    int bb = blockIdx.y * NB;
    int nbl = min(NB, nb - bb);
    const i8* xqb = xq + (long long)bb * K;
    const float2* xdb = xd + (long long)bb * (K >> 5);
    float ag[FFN_ROWS_PER_WARP][NB], au[FFN_ROWS_PER_WARP][NB];
#pragma unroll
    for (int i = 0; i < FFN_ROWS_PER_WARP; ++i)
#pragma unroll
        for (int b = 0; b < NB; ++b) ag[i][b] = au[i][b] = 0.0f;
    int nu = K >> 5;
    switch (qt) {
        case QT_Q4_0: if constexpr (QT_ON(QT_Q4_0)) ffn_rows<QT_Q4_0, NB>(Wg, Wu, rb, r0, N, nu, lane, xqb, xdb, K, nbl, ag, au); break;
        case QT_Q4_1: if constexpr (QT_ON(QT_Q4_1)) ffn_rows<QT_Q4_1, NB>(Wg, Wu, rb, r0, N, nu, lane, xqb, xdb, K, nbl, ag, au); break;
        case QT_Q5_0: if constexpr (QT_ON(QT_Q5_0)) ffn_rows<QT_Q5_0, NB>(Wg, Wu, rb, r0, N, nu, lane, xqb, xdb, K, nbl, ag, au); break;
        case QT_Q5_1: if constexpr (QT_ON(QT_Q5_1)) ffn_rows<QT_Q5_1, NB>(Wg, Wu, rb, r0, N, nu, lane, xqb, xdb, K, nbl, ag, au); break;
        case QT_Q8_0: if constexpr (QT_ON(QT_Q8_0)) ffn_rows<QT_Q8_0, NB>(Wg, Wu, rb, r0, N, nu, lane, xqb, xdb, K, nbl, ag, au); break;
        case QT_Q4_K: if constexpr (QT_ON(QT_Q4_K)) ffn_rows<QT_Q4_K, NB>(Wg, Wu, rb, r0, N, nu, lane, xqb, xdb, K, nbl, ag, au); break;
        case QT_Q5_K: if constexpr (QT_ON(QT_Q5_K)) ffn_rows<QT_Q5_K, NB>(Wg, Wu, rb, r0, N, nu, lane, xqb, xdb, K, nbl, ag, au); break;
        case QT_Q6_K: if constexpr (QT_ON(QT_Q6_K)) ffn_rows<QT_Q6_K, NB>(Wg, Wu, rb, r0, N, nu, lane, xqb, xdb, K, nbl, ag, au); break;
        default: break;
    }
#pragma unroll
    for (int i = 0; i < FFN_ROWS_PER_WARP; ++i)
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            float g = warp_sum(ag[i][b]), v = warp_sum(au[i][b]);
            if (lane == 0) res[b][wid * FFN_ROWS_PER_WARP + i] = act_f(g, act) * v;
        }
    __syncthreads();
    // N is a multiple of 32 (checked on the host): block blockIdx.x is one whole 8-bit block
    if (wid < nbl) {
        int b = wid;
        float v = res[b][lane];
        long long row = (long long)(bb + b);
        quant_q8_lane(v, aq + row * N + blockIdx.x * 32, ad + row * (N >> 5) + blockIdx.x, lane);
        if (af) af[row * N + blockIdx.x * 32 + lane] = v;
    }
}

#define DEFINE_MMVQ(NB)                                                                                  \
    extern "C" __global__ void __launch_bounds__(MMV_WARPS * 32) mmv_q8_nb##NB(                         \
        const u8* W0, long long rb0, int n0, int qt0, const float* b0, float* y0, int ys0,               \
        const u8* W1, long long rb1, int n1, int qt1, const float* b1, float* y1, int ys1,               \
        const u8* W2, long long rb2, int n2, int qt2, const float* b2, float* y2, int ys2,               \
        int K, const i8* xq, const float2* xd, int nb, int wpr, int accumulate) {                       \
        mmv_body<NB>(W0, rb0, n0, qt0, b0, y0, ys0, W1, rb1, n1, qt1, b1, y1, ys1, W2, rb2, n2, qt2, b2, \
                     y2, ys2, K, xq, xd, nb, wpr, accumulate);                                           \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(FFN_WARPS * 32) ffn_q8_nb##NB(                         \
        const u8* Wg, const u8* Wu, long long rb, int N, int K, int qt, const i8* xq, const float2* xd,  \
        int nb, int act, i8* aq, float2* ad, float* af) {                                                \
        ffn_body<NB>(Wg, Wu, rb, N, K, qt, xq, xd, nb, act, aq, ad, af);                                 \
    }

DEFINE_MMVQ(1)
DEFINE_MMVQ(2)
DEFINE_MMVQ(4)
DEFINE_MMVQ(8)
