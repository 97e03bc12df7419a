// GEMV family of the float matrices (F32, F16, BF16; the quantized ones take mmvf.cu):
// y[b, r] = sum_k W[r, k] * x[b, k] for a small batch of activation rows. One warp per output row
// (the fused gate/up: both rows of one output); blocks of 4 warps spread rows over every SM.
//
// Rows in 16-byte pieces (the common case: rows, weights and activations 16-byte aligned, K a
// whole number of pieces): lane l reads pieces l, l + 32, ... so a warp's load is 512 contiguous
// bytes, GEMV_UNROLL pieces a lane in flight before any is used (a one-row GEMV waits on memory,
// not arithmetic); each piece is converted once and applied to up to GEMV_MAXB activation rows,
// whose matching 16 or 32 bytes the warp also reads contiguously (from L1/L2: the input is small).
// Other shapes (odd K, unaligned rows) take 32-weight units a lane, one at a time.
#include "common.cuh"

#define GEMV_MAXB 8
#define GEMV_WARPS 4
#define GEMV_UNROLL 4

// weights in a 16-byte piece of a row of type QT
template <int QT> __device__ __forceinline__ constexpr int piece_elems() { return QT == QT_F32 ? 4 : 8; }

// the two 16-bit floats of p (low half first)
template <int QT> __device__ __forceinline__ void half_pair(u32 p, float& lo, float& hi) {
    lo = QT == QT_F16 ? h2f((u16)(p & 0xFFFFu)) : bf2f((u16)(p & 0xFFFFu));
    hi = QT == QT_F16 ? h2f((u16)(p >> 16)) : bf2f((u16)(p >> 16));
}

// the piece's weights as floats (w[0 .. piece_elems - 1])
template <int QT> __device__ __forceinline__ void piece_floats(const uint4& c, float (&w)[8]) {
    if constexpr (QT == QT_F32) {
        w[0] = __uint_as_float(c.x); w[1] = __uint_as_float(c.y);
        w[2] = __uint_as_float(c.z); w[3] = __uint_as_float(c.w);
    } else {
        half_pair<QT>(c.x, w[0], w[1]);
        half_pair<QT>(c.y, w[2], w[3]);
        half_pair<QT>(c.z, w[4], w[5]);
        half_pair<QT>(c.w, w[6], w[7]);
    }
}

// acc[b] += piece c of the row . the same columns of activation row b
template <int QT> __device__ __forceinline__ void piece_apply(const uint4& raw, int c, const float* __restrict__ x,
                                                               int xs, int nbl, float (&acc)[GEMV_MAXB]) {
    constexpr int E = piece_elems<QT>();
    float w[8];
    piece_floats<QT>(raw, w);
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) {
        if (b < nbl) {
            const float4* xp = (const float4*)(x + (long long)b * xs + (long long)c * E);
#pragma unroll
            for (int h = 0; h < E / 4; ++h) {
                float4 a = __ldg(xp + h);
                acc[b] = fmaf(w[4 * h], a.x, acc[b]);
                acc[b] = fmaf(w[4 * h + 1], a.y, acc[b]);
                acc[b] = fmaf(w[4 * h + 2], a.z, acc[b]);
                acc[b] = fmaf(w[4 * h + 3], a.w, acc[b]);
            }
        }
    }
}

// whether the launch takes the 16-byte pieces (uniform over the launch)
template <int QT> __device__ __forceinline__ bool pieces_ok(const u8* W, long long row_bytes, int K, const float* x,
                                                             int xs) {
    return ((((u64)W) | ((u64)row_bytes) | ((u64)x)) & 15) == 0 && (xs & 3) == 0 && K % piece_elems<QT>() == 0;
}

// the lane's partial dot products of NR rows (rows[i]) with the activation rows, by pieces
template <int QT, int NR> __device__ __forceinline__ void rows_by_pieces(const u8* const (&rows)[NR], int K,
                                                                         const float* __restrict__ x, int xs,
                                                                         int nbl, float (&acc)[NR][GEMV_MAXB]) {
    const int np = K / piece_elems<QT>(), lane = threadIdx.x & 31;
    int c = lane;
    for (; c + 32 * (GEMV_UNROLL - 1) < np; c += 32 * GEMV_UNROLL) {
        uint4 raw[NR][GEMV_UNROLL];
#pragma unroll
        for (int i = 0; i < NR; ++i)
#pragma unroll
            for (int j = 0; j < GEMV_UNROLL; ++j) raw[i][j] = __ldg((const uint4*)rows[i] + c + 32 * j);
#pragma unroll
        for (int i = 0; i < NR; ++i)
#pragma unroll
            for (int j = 0; j < GEMV_UNROLL; ++j) piece_apply<QT>(raw[i][j], c + 32 * j, x, xs, nbl, acc[i]);
    }
    for (; c < np; c += 32)
#pragma unroll
        for (int i = 0; i < NR; ++i) piece_apply<QT>(__ldg((const uint4*)rows[i] + c), c, x, xs, nbl, acc[i]);
}

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

// the lane's partial dot products of NR rows with the activation rows, by 32-weight units (any K,
// any alignment)
template <int QT, int NR> __device__ __forceinline__ void rows_by_units(const u8* const (&rows)[NR], int K,
                                                                     const float* __restrict__ x, int xs,
                                                                     int nbl, float (&acc)[NR][GEMV_MAXB]) {
    const int lane = threadIdx.x & 31, nu = (K + 31) >> 5;
    const bool vec = ((xs & 3) == 0) && ((((u64)x) & 15) == 0);
    for (int u = lane; u < nu; u += 32) {
        int nv = K - 32 * u;
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            float w[32];
            load_unit<QT>(rows[i], u, K, w);
#pragma unroll
            for (int b = 0; b < GEMV_MAXB; ++b)
                if (b < nbl) acc[i][b] += unit_dot(w, x + (long long)b * xs + 32 * u, nv, vec);
        }
    }
}

// accumulate != 0: y += result (the residual add of the output / down projections). PIECES: the
// rows by 16-byte pieces (pieces_ok), else by units.
template <int QT, bool PIECES>
__device__ __forceinline__ void gemv_body(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                          const float* __restrict__ x, int xs, float* y, int ys, int nb,
                                          const float* __restrict__ bias, int accumulate) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    int b0 = blockIdx.y * GEMV_MAXB;
    int nbl = min(GEMV_MAXB, nb - b0);
    const u8* row = W + (long long)r * row_bytes;
    float acc[1][GEMV_MAXB];
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) acc[0][b] = 0.0f;
    const u8* const rows[1] = {row};
    if constexpr (PIECES) rows_by_pieces<QT, 1>(rows, K, x + (long long)b0 * xs, xs, nbl, acc);
    else rows_by_units<QT, 1>(rows, K, x + (long long)b0 * xs, xs, nbl, acc);
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) {
        float v = warp_sum(acc[0][b]);
        if (lane == 0 && b < nbl) {
            if (bias) v += bias[r];
            float* out = y + (long long)(b0 + b) * ys + r;
            *out = accumulate ? *out + v : v;
        }
    }
}

// Fused FFN front half: a[b, r] = act(gate[r] . x[b]) * (up[r] . x[b]); both matrices share a
// type and shape, so one launch reads each activation unit once for both.
template <int QT, bool PIECES>
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
    float acc[2][GEMV_MAXB];              // gate, up
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) acc[0][b] = acc[1][b] = 0.0f;
    const u8* const rows[2] = {rg, ru};
    if constexpr (PIECES) rows_by_pieces<QT, 2>(rows, K, x + (long long)b0 * xs, xs, nbl, acc);
    else rows_by_units<QT, 2>(rows, K, x + (long long)b0 * xs, xs, nbl, acc);
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) {
        float g = warp_sum(acc[0][b]), v = warp_sum(acc[1][b]);
        if (lane == 0 && b < nbl) a[(long long)(b0 + b) * as + r] = act_f(g, act) * v;
    }
}

// One dispatch entry per float type: gemv_<type>, ffn_gate_up_<type>.
#define DEFINE_GEMV(name, QT)                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                      \
        gemv_##name(const u8* W, long long row_bytes, int N, int K, const float* x, int xs, float* y, \
                    int ys, int nb, const float* bias, int accumulate) {                              \
        if (pieces_ok<QT>(W, row_bytes, K, x, xs))                                                     \
            gemv_body<QT, true>(W, row_bytes, N, K, x, xs, y, ys, nb, bias, accumulate);               \
        else                                                                                           \
            gemv_body<QT, false>(W, row_bytes, N, K, x, xs, y, ys, nb, bias, accumulate);              \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                      \
        ffn_gate_up_##name(const u8* Wg, const u8* Wu, long long row_bytes, int N, int K,             \
                           const float* x, int xs, float* a, int as, int nb, int act) {               \
        if (pieces_ok<QT>(Wg, row_bytes, K, x, xs) && pieces_ok<QT>(Wu, row_bytes, K, x, xs))          \
            ffn_gate_up_body<QT, true>(Wg, Wu, row_bytes, N, K, x, xs, a, as, nb, act);                \
        else                                                                                           \
            ffn_gate_up_body<QT, false>(Wg, Wu, row_bytes, N, K, x, xs, a, as, nb, act);               \
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
