// Attention over the fp16 KV cache, one block (8 warps) per (query row, head). Each warp walks
// its share of the keys with an online softmax (running max m, sum l, weighted V in registers;
// lane owns dims lane + 32 i), then the warps merge through shared memory. GQA: head h reads KV
// head h / (H / KVH). The same kernel serves decode (one row per sequence) and prefill (one row
// per prompt token, all tokens already written to the cache): row t sees cache positions
// [start, positions[t]] of slot slots[t], which is exactly causal (and sliding-window) masking.
#include "common.cuh"

#define ATT_WARPS 8
#define ATT_MAXD 256

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
    attn_decode(const float* __restrict__ q, float* __restrict__ out, const u16* __restrict__ kcache,
                const u16* __restrict__ vcache, const int* __restrict__ slots,
                const int* __restrict__ positions, int ctx, int H, int KVH, int D, float scale,
                int window, int n) {
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS], sm_acc[ATT_WARPS][ATT_MAXD];
    int t = blockIdx.x, h = blockIdx.y;
    if (t >= n) return;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int kh = h / (H / KVH);
    int pos = positions[t];
    int start = window > 0 ? max(0, pos - window + 1) : 0;
    const float* qr = q + ((long long)t * H + h) * D;
    float qv[ATT_MAXD / 32], acc[ATT_MAXD / 32];
#pragma unroll
    for (int i = 0; i < ATT_MAXD / 32; ++i) {
        int d = lane + 32 * i;
        qv[i] = d < D ? qr[d] * scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    long long base = (long long)slots[t] * ctx;
    for (int s = start + wid; s <= pos; s += ATT_WARPS) {
        long long off = ((base + s) * KVH + kh) * D;
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAXD / 32; ++i) {
            int d = lane + 32 * i;
            if (d < D) dot += qv[i] * h2f(kcache[off + d]);
        }
        dot = warp_sum(dot);
        float mn = fmaxf(m, dot);
        float c = expf(m - mn), p = expf(dot - mn);
        l = l * c + p;
#pragma unroll
        for (int i = 0; i < ATT_MAXD / 32; ++i) {
            int d = lane + 32 * i;
            if (d < D) acc[i] = acc[i] * c + p * h2f(vcache[off + d]);
        }
        m = mn;
    }
    if (lane == 0) {
        sm_m[wid] = m;
        sm_l[wid] = l;
    }
#pragma unroll
    for (int i = 0; i < ATT_MAXD / 32; ++i) {
        int d = lane + 32 * i;
        if (d < D) sm_acc[wid][d] = acc[i];
    }
    __syncthreads();
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, sm_m[w]);
    float L = 0.0f, f[ATT_WARPS];
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) {
        f[w] = sm_l[w] > 0.0f ? expf(sm_m[w] - M) : 0.0f;  // a warp with no keys has m = -inf
        L += sm_l[w] * f[w];
    }
    float* o = out + ((long long)t * H + h) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) s += sm_acc[w][d] * f[w];
        o[d] = s / L;
    }
}
