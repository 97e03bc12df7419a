// GEMV family of the float matrices (F32, F16, BF16; the quantized ones take mmvf.cu):
// y[b, r] = sum_k W[r, k] * x[b, k] for a small batch of activation rows. One warp per output row;
// lanes stride over 32-weight units so consecutive lanes read consecutive ones; each unit is
// converted once and applied to up to GEMV_MAXB activation rows (grid.y covers larger batches).
// Blocks of 4 warps spread rows over every SM.
#include "common.cuh"

#define GEMV_MAXB 8
#define GEMV_WARPS 4

// dot of the decoded unit with xb[0..31]; vector loads when the row is 16-byte aligned
__device__ __forceinline__ float unit_dot(const float (&w)[32], const float* __restrict__ xb, int nv, bool vec) {
    float s = 0.0f;
    if (nv >= 32 && vec) {
        const float4* x4 = (const float4*)xb;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float4 v = x4[i];
            s += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i)
            if (i < nv) s += w[i] * xb[i];
    }
    return s;
}

// accumulate != 0: y += result (the residual add of the output / down projections).
template <int QT>
__device__ __forceinline__ void gemv_body(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                          const float* __restrict__ x, int xs, float* y, int ys, int nb,
                                          const float* __restrict__ bias, int accumulate) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    int b0 = blockIdx.y * GEMV_MAXB;
    int nbl = min(GEMV_MAXB, nb - b0);
    const u8* row = W + (long long)r * row_bytes;
    bool vec = ((xs & 3) == 0) && ((((u64)x) & 15) == 0);
    float acc[GEMV_MAXB];
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) acc[b] = 0.0f;
    int nu = (K + 31) >> 5;
    for (int u = lane; u < nu; u += 32) {
        float w[32];
        load_unit<QT>(row, u, K, w);
        int nv = K - 32 * u;
#pragma unroll
        for (int b = 0; b < GEMV_MAXB; ++b)
            if (b < nbl) acc[b] += unit_dot(w, x + (long long)(b0 + b) * xs + 32 * u, nv, vec);
    }
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) {
        float v = warp_sum(acc[b]);
        if (lane == 0 && b < nbl) {
            if (bias) v += bias[r];
            float* out = y + (long long)(b0 + b) * ys + r;
            *out = accumulate ? *out + v : v;
        }
    }
}

// Fused FFN front half: a[b, r] = act(gate[r] . x[b]) * (up[r] . x[b]); both matrices share a
// type and shape, so one launch reads each activation unit once for both.
template <int QT>
__device__ __forceinline__ void ffn_gate_up_body(const u8* __restrict__ Wg, const u8* __restrict__ Wu,
                                                 long long row_bytes, int N, int K,
                                                 const float* __restrict__ x, int xs, float* __restrict__ a,
                                                 int as, int nb, int act) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    int b0 = blockIdx.y * GEMV_MAXB;
    int nbl = min(GEMV_MAXB, nb - b0);
    const u8* rg = Wg + (long long)r * row_bytes;
    const u8* ru = Wu + (long long)r * row_bytes;
    bool vec = ((xs & 3) == 0) && ((((u64)x) & 15) == 0);
    float ag[GEMV_MAXB], au[GEMV_MAXB];
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) ag[b] = au[b] = 0.0f;
    int nu = (K + 31) >> 5;
    for (int u = lane; u < nu; u += 32) {
        float w[32];
        int nv = K - 32 * u;
        load_unit<QT>(rg, u, K, w);
#pragma unroll
        for (int b = 0; b < GEMV_MAXB; ++b)
            if (b < nbl) ag[b] += unit_dot(w, x + (long long)(b0 + b) * xs + 32 * u, nv, vec);
        load_unit<QT>(ru, u, K, w);
#pragma unroll
        for (int b = 0; b < GEMV_MAXB; ++b)
            if (b < nbl) au[b] += unit_dot(w, x + (long long)(b0 + b) * xs + 32 * u, nv, vec);
    }
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) {
        float g = warp_sum(ag[b]), v = warp_sum(au[b]);
        if (lane == 0 && b < nbl) a[(long long)(b0 + b) * as + r] = act_f(g, act) * v;
    }
}

// One dispatch entry per float type: gemv_<type>, ffn_gate_up_<type>.
#define DEFINE_GEMV(name, QT)                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                      \
        gemv_##name(const u8* W, long long row_bytes, int N, int K, const float* x, int xs, float* y, \
                    int ys, int nb, const float* bias, int accumulate) {                              \
        gemv_body<QT>(W, row_bytes, N, K, x, xs, y, ys, nb, bias, accumulate);                         \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                      \
        ffn_gate_up_##name(const u8* Wg, const u8* Wu, long long row_bytes, int N, int K,             \
                           const float* x, int xs, float* a, int as, int nb, int act) {               \
        ffn_gate_up_body<QT>(Wg, Wu, row_bytes, N, K, x, xs, a, as, nb, act);                          \
    }

#if QT_ON(QT_F32)
DEFINE_GEMV(f32, QT_F32)
#endif
#if QT_ON(QT_F16)
DEFINE_GEMV(f16, QT_F16)
#endif
#if QT_ON(QT_BF16)
DEFINE_GEMV(bf16, QT_BF16)
#endif
