// RMSNorm family. One block per row; float sum of squares reduced with warp shuffles.
// mode 0: out = x / rms(x) * w            (pre-norms, final norm, in-place QK-norm)
// mode 1: out += x / rms(x) * w           (gemma post-norms fused with the residual add)
#include "common.cuh"

extern "C" __global__ void rms_norm(const float* x, int xs, const float* __restrict__ w, float* out, int os,
                                    int rows, int width, float eps, int mode) {
    __shared__ float partial[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * xs;
    float* orow = out + (long long)r * os;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = xr[i];
        ss += v * v;
    }
    ss = warp_sum(ss);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0) partial[wid] = ss;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nw ? partial[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) partial[0] = t;
    }
    __syncthreads();
    float inv = rsqrtf(partial[0] / width + eps);
    // each thread rewrites only the elements it read, so x == out (in place) is safe
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = xr[i] * inv * w[i];
        orow[i] = mode ? orow[i] + v : v;
    }
}

// RMSNorm feeding projections: out = x / rms(x) * w written as 8-bit blocks (xq, xd) for the
// integer GEMVs, and optionally as fp32 (out32) and fp16 (out16, the prefill GEMM input).
// width is a multiple of 32 and at most NQ_MAXK * blockDim. Thread tid owns elements
// tid + k * blockDim, which is also "warp w owns 32-value blocks w + k * warps", so the values
// stay in registers between the sum of squares and the quantization (no second, serial pass
// over global memory: that latency chain dominated this tiny kernel).
#define NQ_MAXK 8
extern "C" __global__ void rms_norm_q8(const float* __restrict__ x, int xs, const float* __restrict__ w,
                                       float* out32, u16* out16, i8* xq, float2* xd, int rows, int width,
                                       float eps) {
    __shared__ float partial[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * xs;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float xv[NQ_MAXK], wv[NQ_MAXK];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NQ_MAXK; ++k) {
        int i = threadIdx.x + k * blockDim.x;
        xv[k] = i < width ? xr[i] : 0.0f;
        wv[k] = i < width ? w[i] : 0.0f;
        ss += xv[k] * xv[k];
    }
    ss = warp_sum(ss);
    if (lane == 0) partial[wid] = ss;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nw ? partial[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) partial[0] = t;
    }
    __syncthreads();
    float inv = rsqrtf(partial[0] / width + eps);
    long long o = (long long)r * width;
#pragma unroll
    for (int k = 0; k < NQ_MAXK; ++k) {
        int g = wid + k * nw;             // warp-uniform
        if (32 * g >= width) break;
        int i = 32 * g + lane;
        float v = xv[k] * inv * wv[k];
        if (out32) out32[o + i] = v;
        if (out16) out16[o + i] = f2h(v);
        if (xq) quant_q8_lane(v, xq + o + 32 * g, xd + (long long)r * (width >> 5) + g, lane);
    }
}
