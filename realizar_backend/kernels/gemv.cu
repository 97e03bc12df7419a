// GEMV family of the float matrices (F32, F16, BF16; the quantized ones take mmvf.cu):
// y[b, r] = sum_k W[r, k] * x[b, k] for a small batch of activation rows. `wpr` warps per output row
// (the fused gate/up: both rows of one output), chosen by the host (ops.gemv_wpr): 1 where the launch
// has rows enough to occupy the GPU, blocks of GEMV_WARPS warps spreading rows over every SM; more in a
// launch of few rows (a mixture of experts' router, a shared expert's one-row gate), where one warp
// walking a whole row would leave most of the GPU idle and few loads in flight. A block then holds
// max(GEMV_WARPS, wpr) warps, GEMV_WARPS / wpr rows (at least one); the row's wpr warps take its
// pieces (units) interleaved, warp s of them pieces 32 s + lane, 32 (wpr + s) + lane, ..., and their
// sums are added through shared memory in warp order once the row is read (gemv_reduce: a fixed
// order, so a launch gives the same bits every time), then the epilogue runs once per row.
//
// Rows in 16-byte pieces (the common case: rows, weights and activations 16-byte aligned, K a
// whole number of pieces): lane l reads pieces l, l + 32, ... so a warp's load is 512 contiguous
// bytes, GEMV_UNROLL pieces a lane in flight before any is used (a one-row GEMV waits on memory,
// not arithmetic); each piece is converted once and applied to up to GEMV_MAXB activation rows,
// whose matching 16 or 32 bytes the warp also reads contiguously (from L1/L2: the input is small).
// Other shapes (odd K, unaligned rows) take 32-weight units a lane, one at a time.
// A launch may be a programmatic dependent one (ops.gemv pdl): every thread waits for the kernel
// before (pdl_wait) before it reads x, and lets the next be scheduled once its row's loads are done.
#include "common.cuh"

#define GEMV_MAXB 8
#define GEMV_WARPS 4
#define GEMV_UNROLL 4
// most warps sharing one row: a block of one row holds GEMV_MAX_WPR warps (gemv's __launch_bounds__:
// up to 128 registers a thread). The fused gate/up holds twice the pieces, more registers than that
// allows, so its rows take at most GEMV_FFN_MAX_WPR warps and its blocks stay GEMV_WARPS warps.
#define GEMV_MAX_WPR 16
#define GEMV_FFN_MAX_WPR GEMV_WARPS
static_assert(GEMV_MAX_WPR >= GEMV_WARPS && (GEMV_MAX_WPR & (GEMV_MAX_WPR - 1)) == 0, "GEMV_MAX_WPR");

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
// (the lane's pieces: first c0, then every `step`: the row's pieces interleaved over its warps)
template <int QT, int NR> __device__ __forceinline__ void rows_by_pieces(const u8* const (&rows)[NR], int K,
                                                                         const float* __restrict__ x, int xs,
                                                                         int nbl, int c0, int step,
                                                                         float (&acc)[NR][GEMV_MAXB]) {
    const int np = K / piece_elems<QT>();
    int c = c0;
    for (; c + step * (GEMV_UNROLL - 1) < np; c += step * GEMV_UNROLL) {
        uint4 raw[NR][GEMV_UNROLL];
#pragma unroll
        for (int i = 0; i < NR; ++i)
#pragma unroll
            for (int j = 0; j < GEMV_UNROLL; ++j) raw[i][j] = __ldg((const uint4*)rows[i] + c + step * j);
#pragma unroll
        for (int i = 0; i < NR; ++i)
#pragma unroll
            for (int j = 0; j < GEMV_UNROLL; ++j) piece_apply<QT>(raw[i][j], c + step * j, x, xs, nbl, acc[i]);
    }
    for (; c < np; c += step)
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
// any alignment; the lane's units: first u0, then every `step`)
template <int QT, int NR> __device__ __forceinline__ void rows_by_units(const u8* const (&rows)[NR], int K,
                                                                     const float* __restrict__ x, int xs,
                                                                     int nbl, int u0, int step,
                                                                     float (&acc)[NR][GEMV_MAXB]) {
    const int nu = (K + 31) >> 5;
    const bool vec = ((xs & 3) == 0) && ((((u64)x) & 15) == 0);
    for (int u = u0; u < nu; u += step) {
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

// The warp's row (r) and its place among the row's wpr warps (sub): blocks of max(GEMV_WARPS, wpr)
// warps (the host's block), GEMV_WARPS / wpr rows each, a row's warps adjacent.
__device__ __forceinline__ int gemv_row(int wpr, int& sub) {
    const int wid = threadIdx.x >> 5;
    sub = wid % wpr;
    return blockIdx.x * ((blockDim.x >> 5) / wpr) + wid / wpr;
}

// The lanes' partial sums summed over the warp, then (wpr > 1) over the row's wpr warps in warp order
// (sub 0, 1, ...: fixed, so the same inputs give the same bits every launch); on return the lanes of
// the row's first warp (sub == 0) hold the totals. A block-wide barrier when wpr > 1: every warp of
// the block must get here, those of rows past N too.
template <int NR> __device__ __forceinline__ void gemv_reduce(float (&acc)[NR][GEMV_MAXB], int wpr, int sub) {
    __shared__ float red[GEMV_MAX_WPR][NR][GEMV_MAXB];
#pragma unroll
    for (int i = 0; i < NR; ++i)
#pragma unroll
        for (int b = 0; b < GEMV_MAXB; ++b) acc[i][b] = warp_sum(acc[i][b]);
    if (wpr > 1) {
        const int wid = threadIdx.x >> 5;
        if ((threadIdx.x & 31) == 0)
#pragma unroll
            for (int i = 0; i < NR; ++i)
#pragma unroll
                for (int b = 0; b < GEMV_MAXB; ++b) red[wid][i][b] = acc[i][b];
        __syncthreads();
        if (sub == 0)
#pragma unroll
            for (int i = 0; i < NR; ++i)
#pragma unroll
                for (int b = 0; b < GEMV_MAXB; ++b) {
                    float s = acc[i][b];
                    for (int w = 1; w < wpr; ++w) s += red[wid + w][i][b];
                    acc[i][b] = s;
                }
    }
}

// accumulate != 0: y += result (the residual add of the output / down projections). PIECES: the
// rows by 16-byte pieces (pieces_ok), else by units.
template <int QT, bool PIECES>
__device__ __forceinline__ void gemv_body(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                          const float* __restrict__ x, int xs, float* y, int ys, int nb,
                                          const float* __restrict__ bias, int accumulate, int wpr) {
    int lane = threadIdx.x & 31, sub;
    int r = gemv_row(wpr, sub);
    pdl_wait();                              // x: the kernel before's output
    if (r >= N && wpr == 1) return;          // (wpr > 1: on to the barrier in gemv_reduce)
    int b0 = blockIdx.y * GEMV_MAXB;
    int nbl = min(GEMV_MAXB, nb - b0);
    float acc[1][GEMV_MAXB];
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) acc[0][b] = 0.0f;
    if (r < N) {
        const u8* const rows[1] = {W + (long long)r * row_bytes};
        if constexpr (PIECES) rows_by_pieces<QT, 1>(rows, K, x + (long long)b0 * xs, xs, nbl, sub * 32 + lane,
                                                    32 * wpr, acc);
        else rows_by_units<QT, 1>(rows, K, x + (long long)b0 * xs, xs, nbl, sub * 32 + lane, 32 * wpr, acc);
    }
    pdl_trigger();
    gemv_reduce<1>(acc, wpr, sub);
    if (r >= N || sub != 0) return;
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) {
        float v = acc[0][b];
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
                                                 int as, int nb, int act, int wpr) {
    int lane = threadIdx.x & 31, sub;
    int r = gemv_row(wpr, sub);
    pdl_wait();
    if (r >= N && wpr == 1) return;          // (wpr > 1: on to the barrier in gemv_reduce)
    int b0 = blockIdx.y * GEMV_MAXB;
    int nbl = min(GEMV_MAXB, nb - b0);
    float acc[2][GEMV_MAXB];              // gate, up
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) acc[0][b] = acc[1][b] = 0.0f;
    if (r < N) {
        const u8* const rows[2] = {Wg + (long long)r * row_bytes, Wu + (long long)r * row_bytes};
        if constexpr (PIECES) rows_by_pieces<QT, 2>(rows, K, x + (long long)b0 * xs, xs, nbl, sub * 32 + lane,
                                                    32 * wpr, acc);
        else rows_by_units<QT, 2>(rows, K, x + (long long)b0 * xs, xs, nbl, sub * 32 + lane, 32 * wpr, acc);
    }
    pdl_trigger();
    gemv_reduce<2>(acc, wpr, sub);
    if (r >= N || sub != 0) return;
#pragma unroll
    for (int b = 0; b < GEMV_MAXB; ++b) {
        float g = acc[0][b], v = acc[1][b];
        if (lane == 0 && b < nbl) a[(long long)(b0 + b) * as + r] = act_f(g, act) * v;
    }
}

// One dispatch entry per float type: gemv_<type>, ffn_gate_up_<type>. wpr: warps per output row, a
// power of two up to GEMV_MAX_WPR (ffn_gate_up: GEMV_FFN_MAX_WPR); the block: 32 max(GEMV_WARPS, wpr)
// threads; the grid: one block per GEMV_WARPS / wpr rows (at least one) by one per GEMV_MAXB
// activation rows.
#define DEFINE_GEMV(name, QT)                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_MAX_WPR * 32)                                    \
        gemv_##name(const u8* W, long long row_bytes, int N, int K, const float* x, int xs, float* y, \
                    int ys, int nb, const float* bias, int accumulate, int wpr) {                     \
        if (pieces_ok<QT>(W, row_bytes, K, x, xs))                                                     \
            gemv_body<QT, true>(W, row_bytes, N, K, x, xs, y, ys, nb, bias, accumulate, wpr);          \
        else                                                                                           \
            gemv_body<QT, false>(W, row_bytes, N, K, x, xs, y, ys, nb, bias, accumulate, wpr);         \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_FFN_MAX_WPR * 32)                                \
        ffn_gate_up_##name(const u8* Wg, const u8* Wu, long long row_bytes, int N, int K,             \
                           const float* x, int xs, float* a, int as, int nb, int act, int wpr) {      \
        if (pieces_ok<QT>(Wg, row_bytes, K, x, xs) && pieces_ok<QT>(Wu, row_bytes, K, x, xs))          \
            ffn_gate_up_body<QT, true>(Wg, Wu, row_bytes, N, K, x, xs, a, as, nb, act, wpr);           \
        else                                                                                           \
            ffn_gate_up_body<QT, false>(Wg, Wu, row_bytes, N, K, x, xs, a, as, nb, act, wpr);          \
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
