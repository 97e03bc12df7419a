// RMSNorm family. One block per row; float sum of squares reduced with warp shuffles.
// mode 0: out = x / rms(x) * w            (pre-norms, final norm, in-place QK-norm)
// mode 1: out += x / rms(x) * w           (gemma post-norms fused with the residual add)
// May be a programmatic dependent launch (ops.rms_norm pdl): it waits for the kernel before it
// before reading x, and lets the next one be scheduled at once (one block a row: every block of a
// decode step's launch is placed with the first).
#include "common.cuh"

extern "C" __global__ void rms_norm(const float* x, int xs, const float* __restrict__ w, float* out, int os,
                                    int rows, int width, float eps, int mode) {
    __shared__ float partial[32];
    pdl_wait();
    pdl_trigger();
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
