// split16 prefill (backends/cuda/split16.py): every projection's two GEMM inputs as fp16 values for
// the tensor cores (fp32 accumulation), in one of two precisions (Settings.gemm_precision):
// "split": each input a pair of fp16 values, so that the products have about fp32's accuracy:
//   W   = Wh + Wl * 2^-12   weight row n of the workspace:    [ Wl * 2^12 | Wh ]        (2K fp16)
//   s x = xh + xl           activation row t of the workspace: [ xh * 2^-12 | xh | xl ] (3K fp16)
//   s y = [xh*2^-12 | xh] . [Wl*2^12 | Wh]  +  xl . Wh    (cuBLAS, fp32 out)
// xl * Wl, at most 2^-22 |x| |W| per term, is dropped.
// Paired rows (steps of few tokens, where the GEMM is bound by reading the weights): token t's
// activations are two rows of 2K instead, [ xh * 2^-12 | xh ] and [ 0 | xl ] (4K fp16 in all), so
// one pass over [Wl * 2^12 | Wh] gives both products as rows 2t and 2t + 1 of the output, added
// on the way out (the split weights read once a step, not 1.5 times).
// "fp16": the high halves alone, weight rows [ Wh ] (K) and activation rows [ xh ] (K):
//   s y = xh . Wh: each input rounded to fp16 once (a relative error of 2^-11 per value), one pass
// of a third of the split's tensor-core work over half its weight bytes.
// s is a per-row power of two putting the row's max |x| in [2^14, 2^15): exact both ways, and no
// bound on x is needed (the FFN down input has none fp16 could hold). The 2^12 keeps Wl (about
// 2^-12 |W|) out of fp16's subnormals; its 2^-12 goes on the activation copy, where only values
// below 2^-16 of the row's max lose bits. The low halves come first along K so the tensor cores'
// accumulator (which truncates) is still small while it adds the small terms.
// Kernels: split_weights (dequantize up to three matrices into one workspace of split or fp16 rows),
// norm_split (RMSNorm or plain rows -> activation rows), act_split (act(g) * u of the gate/up GEMM
// -> activation rows), unscale_scatter (Q/K/V GEMM rows -> q, k, v with 1/s and biases),
// unscale_add (o / down GEMM rows -> residual, optionally through the gemma post-norm).
#include "common.cuh"

#define LO_UP 4096.0f                 // 2^12
#define LO_DOWN 0.000244140625f       // 2^-12
#define SW_WARPS 8                    // split_weights: blocks of up to 256 threads
// activation row layouts (split16.py LAYOUTS): split [xh*2^-12 | xh | xl], paired [xh*2^-12 | xh | 0 | xl]
// (two GEMM rows, summed on the way out), fp16 [xh]
#define LAYOUT_SPLIT 0
#define LAYOUT_PAIRED 1
#define LAYOUT_FP16 2

// ------------------------------------------------------------------ weights
// the three matrices of one launch may differ in type (attn_v is often Q6_K beside Q4_K q and k)
__device__ __forceinline__ void load_unit_rt(int qt, const u8* __restrict__ row, int u, int K, float (&w)[32]) {
    switch (qt) {
        case QT_F32: if constexpr (QT_ON(QT_F32)) load_unit<QT_F32>(row, u, K, w); break;
        case QT_F16: if constexpr (QT_ON(QT_F16)) load_unit<QT_F16>(row, u, K, w); break;
        case QT_BF16: if constexpr (QT_ON(QT_BF16)) load_unit<QT_BF16>(row, u, K, w); break;
        case QT_Q4_0: if constexpr (QT_ON(QT_Q4_0)) load_unit<QT_Q4_0>(row, u, K, w); break;
        case QT_Q4_1: if constexpr (QT_ON(QT_Q4_1)) load_unit<QT_Q4_1>(row, u, K, w); break;
        case QT_Q5_0: if constexpr (QT_ON(QT_Q5_0)) load_unit<QT_Q5_0>(row, u, K, w); break;
        case QT_Q5_1: if constexpr (QT_ON(QT_Q5_1)) load_unit<QT_Q5_1>(row, u, K, w); break;
        case QT_Q8_0: if constexpr (QT_ON(QT_Q8_0)) load_unit<QT_Q8_0>(row, u, K, w); break;
        case QT_Q4_K: if constexpr (QT_ON(QT_Q4_K)) load_unit<QT_Q4_K>(row, u, K, w); break;
        case QT_Q5_K: if constexpr (QT_ON(QT_Q5_K)) load_unit<QT_Q5_K>(row, u, K, w); break;
        case QT_Q6_K: if constexpr (QT_ON(QT_Q6_K)) load_unit<QT_Q6_K>(row, u, K, w); break;
        case QT_Q2_K: if constexpr (QT_ON(QT_Q2_K)) load_unit<QT_Q2_K>(row, u, K, w); break;
        case QT_Q3_K: if constexpr (QT_ON(QT_Q3_K)) load_unit<QT_Q3_K>(row, u, K, w); break;
        case QT_IQ4_NL: if constexpr (QT_ON(QT_IQ4_NL)) load_unit<QT_IQ4_NL>(row, u, K, w); break;
        case QT_IQ4_XS: if constexpr (QT_ON(QT_IQ4_XS)) load_unit<QT_IQ4_XS>(row, u, K, w); break;
        case QT_MXFP4: if constexpr (QT_ON(QT_MXFP4)) load_unit<QT_MXFP4>(row, u, K, w); break;
        case QT_IQ2_XXS: if constexpr (QT_ON(QT_IQ2_XXS)) load_unit<QT_IQ2_XXS>(row, u, K, w); break;
        case QT_IQ2_XS: if constexpr (QT_ON(QT_IQ2_XS)) load_unit<QT_IQ2_XS>(row, u, K, w); break;
        case QT_IQ2_S: if constexpr (QT_ON(QT_IQ2_S)) load_unit<QT_IQ2_S>(row, u, K, w); break;
        case QT_IQ3_XXS: if constexpr (QT_ON(QT_IQ3_XXS)) load_unit<QT_IQ3_XXS>(row, u, K, w); break;
        case QT_IQ3_S: if constexpr (QT_ON(QT_IQ3_S)) load_unit<QT_IQ3_S>(row, u, K, w); break;
        default:
#pragma unroll
            for (int i = 0; i < 32; ++i) w[i] = __int_as_float(0x7fffffff);  // an unknown type reads as NaN, never as numbers
    }
}

// Warp-cooperative store of 32 units of 32 fp16 values (as dequant.cu's warp_store_units with
// 4 chunks per unit): lane l stages its 64 bytes in shared memory, then stores chunks l, l + 32,
// l + 64, l + 96 of the warp's 32 units, so one store instruction writes 512 contiguous bytes.
// v: the lane's values packed in pairs; dst[0 .. nv) their destination (nv = 0: no unit).
// Slot of chunk j of lane l: 4l + ((j + l/2) % 4), conflict-free both ways.
__device__ __forceinline__ void warp_store16(const u32 (&v)[16], u16* dst, int nv, uint4* sm) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < 4; ++j)
        sm[4 * lane + ((j + (lane >> 1)) & 3)] = make_uint4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int c = 32 * r + lane, o = c >> 2, j = c & 3;
        u16* d = (u16*)__shfl_sync(0xffffffffu, (u64)dst, o);
        const int n = __shfl_sync(0xffffffffu, nv, o);
        const uint4 q = sm[4 * o + ((j + (o >> 1)) & 3)];
        const int e0 = 8 * j;
        u16* p = d + e0;
        if (e0 + 8 <= n && ((u64)p & 15) == 0) {
            *(uint4*)p = q;
        } else if (e0 < n) {
            const u32 w4[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (e0 + i < n) p[i] = (u16)(w4[i >> 1] >> (16 * (i & 1)));
        }
    }
    __syncwarp();
}

// Rows n0 + n1 + n2 of K columns (matrix s: raw GGUF rows W_s, row_bytes rb_s, ggml type qt_s)
// -> out row R = [fp16((w - fp16(w)) * 2^12) | fp16(w)], row stride 2K (lo != 0), or [fp16(w)],
// row stride K (lo == 0). One thread per 32-weight unit in flattened row-major order; grid =
// ceil(rows * ceil(K/32) / blockDim).
extern "C" __global__ void split_weights(const u8* __restrict__ W0, long long rb0, int n0, int qt0,
                                         const u8* __restrict__ W1, long long rb1, int n1, int qt1,
                                         const u8* __restrict__ W2, long long rb2, int n2, int qt2,
                                         int K, u16* __restrict__ out, int lo_half) {
    __shared__ uint4 sm[SW_WARPS * 32 * 4];
    const int nu = (K + 31) >> 5;
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float w[32];
    u16* lo = out;
    int nv = 0;
    if (g < (long long)(n0 + n1 + n2) * nu) {
        const int R = (int)(g / nu), u = (int)(g - (long long)R * nu);
        const u8* W = W0;
        long long rb = rb0;
        int qt = qt0, r = R;
        if (r >= n0) {
            r -= n0;
            if (r < n1) {
                W = W1; rb = rb1; qt = qt1;
            } else {
                r -= n1; W = W2; rb = rb2; qt = qt2;
            }
        }
        load_unit_rt(qt, W + (long long)r * rb, u, K, w);
        lo = out + (long long)R * (lo_half ? 2 * K : K) + 32 * u;
        nv = min(32, K - 32 * u);
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = 0.0f;
    }
    u32 hv[16], lv[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const u16 h0 = f2h(w[2 * i]), h1 = f2h(w[2 * i + 1]);
        // w - fp16(w) is exact in fp32; scaling by 2^12 is exact; one rounding to fp16
        const u16 l0 = f2h((w[2 * i] - h2f(h0)) * LO_UP), l1 = f2h((w[2 * i + 1] - h2f(h1)) * LO_UP);
        hv[i] = (u32)h0 | ((u32)h1 << 16);
        lv[i] = (u32)l0 | ((u32)l1 << 16);
    }
    uint4* wsm = sm + (threadIdx.x >> 5) * 32 * 4;
    if (lo_half) {              // uniform over the launch: every lane of a warp takes the same branch
        warp_store16(lv, lo, nv, wsm);
        warp_store16(hv, lo + K, nv, wsm);
    } else {
        warp_store16(hv, lo, nv, wsm);
    }
}

// ------------------------------------------------------------------ activations
// v = s * value (|v| < 2^15) -> column i of an activation row in `layout`: [xh * 2^-12 | xh | xl]
// (3K), the row pair [xh * 2^-12 | xh | 0 | xl] (4K), or [xh] (K)
__device__ __forceinline__ void split3(float v, u16* __restrict__ row, int K, int i, int layout) {
    const u16 h = f2h(v);
    if (layout == LAYOUT_FP16) {
        row[i] = h;
        return;
    }
    const float hf = h2f(h);
    row[i] = f2h(hf * LO_DOWN);
    row[K + i] = h;
    const u16 l = f2h(v - hf);      // exact difference, rounded once
    if (layout == LAYOUT_PAIRED) {
        row[2 * K + i] = 0;
        row[3 * K + i] = l;
    } else {
        row[2 * K + i] = l;
    }
}

// column c of a GEMM output row r (stride ys): the row itself, or (paired) the sum of its pair 2r, 2r + 1
__device__ __forceinline__ float gemm_out(const float* __restrict__ y, long long ys, int r, int c, int layout) {
    return layout == LAYOUT_PAIRED ? y[2 * r * ys + c] + y[(2 * r + 1) * ys + c] : y[r * ys + c];
}

// Row r of x (stride xs), RMSNorm'ed with weight w (w == 0: taken as it is), as an activation row
// of out in `layout` (stride ld >= its width); inv[r] = 1/s. One block per row.
extern "C" __global__ void norm_split(const float* __restrict__ x, int xs, const float* __restrict__ w,
                                      int rows, int K, float eps, u16* __restrict__ out, int ld,
                                      float* __restrict__ inv, int layout) {
    __shared__ float sm[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * xs;
    float rs = 1.0f;
    if (w) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < K; i += blockDim.x) {
            const float v = xr[i];
            ss += v * v;
        }
        rs = rsqrtf(block_reduce(ss, 0, sm) / K + eps);
    }
    float m = 0.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) m = fmaxf(m, fabsf(w ? xr[i] * rs * w[i] : xr[i]));
    float iv;
    const float s = row_scale(block_reduce(m, 1, sm), iv);
    u16* o = out + (long long)r * ld;
    for (int i = threadIdx.x; i < K; i += blockDim.x) split3((w ? xr[i] * rs * w[i] : xr[i]) * s, o, K, i, layout);
    if (threadIdx.x == 0) inv[r] = iv;
}

// a = act(g) * u from the gate/up GEMM's rows y[r] = s_r * [g | u] (F each, stride ys; inv_in[r]
// = 1/s_r; paired layout: row pairs), as an activation row of out in `layout` (stride ld >= its
// width); inv[r] = 1/s of the new row. One block per row.
extern "C" __global__ void act_split(const float* __restrict__ y, int ys, int F, const float* __restrict__ inv_in,
                                     int act, int rows, u16* __restrict__ out, int ld, float* __restrict__ inv,
                                     int layout) {
    __shared__ float sm[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float vi = inv_in[r];
    float m = 0.0f;
    for (int i = threadIdx.x; i < F; i += blockDim.x)
        m = fmaxf(m, fabsf(act_f(gemm_out(y, ys, r, i, layout) * vi, act) * (gemm_out(y, ys, r, F + i, layout) * vi)));
    float iv;
    const float s = row_scale(block_reduce(m, 1, sm), iv);
    u16* o = out + (long long)r * ld;
    for (int i = threadIdx.x; i < F; i += blockDim.x)
        split3(act_f(gemm_out(y, ys, r, i, layout) * vi, act) * (gemm_out(y, ys, r, F + i, layout) * vi) * s, o, F, i,
               layout);
    if (threadIdx.x == 0) inv[r] = iv;
}

// ------------------------------------------------------------------ GEMM outputs
// Columns [0, n0) of the scaled rows y (stride ys; paired layout: row pairs) go to d0, [n0, n0 + n1) to
// d1, the rest of the n0 + n1 + n2 to d2: d_s[r, c] = y[r, off_s + c] * inv[r] + (b_s ? b_s[c] : 0).
// grid (ceil((n0 + n1 + n2) / blockDim), rows).
extern "C" __global__ void unscale_scatter(const float* __restrict__ y, int ys, const float* __restrict__ inv, int rows,
                                           float* d0, int ds0, int n0, const float* __restrict__ b0,
                                           float* d1, int ds1, int n1, const float* __restrict__ b1,
                                           float* d2, int ds2, int n2, const float* __restrict__ b2, int layout) {
    const int r = blockIdx.y;
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows || c >= n0 + n1 + n2) return;
    const float v = gemm_out(y, ys, r, c, layout) * inv[r];
    float* d = d0;
    const float* b = b0;
    int ds = ds0;
    if (c >= n0) {
        c -= n0;
        if (c < n1) {
            d = d1; b = b1; ds = ds1;
        } else {
            c -= n1; d = d2; b = b2; ds = ds2;
        }
    }
    d[(long long)r * ds + c] = v + (b ? b[c] : 0.0f);
}

// x[r] += t[r] * inv[r], or with the gemma post-norm (w != 0): x[r] += RMSNorm(t[r] * inv[r]) * w.
// t is the o / down GEMM's scaled rows (stride ts; paired layout: row pairs), x the residual stream. One
// block per row.
extern "C" __global__ void unscale_add(float* __restrict__ x, int xs, const float* __restrict__ t, int ts,
                                       const float* __restrict__ inv, const float* __restrict__ w,
                                       int rows, int H, float eps, int layout) {
    __shared__ float sm[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* xr = x + (long long)r * xs;
    const float iv = inv[r];
    float rs = 1.0f;
    if (w) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < H; i += blockDim.x) {
            const float v = gemm_out(t, ts, r, i, layout) * iv;
            ss += v * v;
        }
        rs = rsqrtf(block_reduce(ss, 0, sm) / H + eps);
    }
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float v = gemm_out(t, ts, r, i, layout) * iv;
        xr[i] += w ? v * rs * w[i] : v;
    }
}
