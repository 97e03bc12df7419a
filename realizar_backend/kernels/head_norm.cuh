// The per-head RMSNorm of q and k (qwen3, gemma3: q_norm and k_norm over each head's D values,
// before RoPE) inside the decode attention launches that load those heads anyway (attention.cu,
// flash_decode.cu with RoPE fused): the normed value of x[d] is x[d] * inv * w[d], inv from
// head_rms_inv. Null weights: no norm.
//
// head_rms_inv: 1 / sqrt(mean(x^2) + eps) of one head of D floats (D a multiple of 32, at most 256),
// in every lane of the calling warp (all 32 lanes call it). It sums in the order norm.cu's rms_norm
// sums a row of D values when launched with D threads, as ops.rms_norm launches one of at most 256:
// warp j of that block adds the squares of x[32 j .. 32 j + 31] by warp_sum, then warp 0 adds the
// warps' sums (lane j holding warp j's, the other lanes 0) by warp_sum. The one warp here replays
// both levels, so the fused norm writes the bits that the separate rms_norm launch would.
#pragma once
#include "common.cuh"

#define HN_MAXW 8     // warps of norm.cu's block for the largest head (256 dims)

__device__ __forceinline__ float head_rms_inv(const float* __restrict__ x, int D, float eps) {
    const int lane = threadIdx.x & 31, nw = D >> 5;
    float t = 0.0f;
#pragma unroll
    for (int j = 0; j < HN_MAXW; ++j) {
        if (j < nw) {                                    // warp-uniform
            const float v = x[32 * j + lane];
            const float s = warp_sum(__fmul_rn(v, v));   // the square rounded on its own, as norm.cu's
            if (lane == j) t = s;
        }
    }
    return rsqrtf(warp_sum(t) / D + eps);
}

// x[d] normed by inv and the weight w (null: x[d] as it is)
__device__ __forceinline__ float head_normed(const float* __restrict__ x, int d, float inv,
                                             const float* __restrict__ w) {
    return w ? x[d] * inv * w[d] : x[d];
}
