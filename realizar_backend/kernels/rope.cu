// RoPE + KV-cache write, one launch per layer. Block (t, head): heads < H rotate q in place;
// the KV heads rotate k and store k and v as fp16 into the slot's cache rows at the token's
// position. Positions and slots come from device buffers (graph replay needs no re-capture).
// style 0 = "normal" (adjacent pairs, GGUF llama), 1 = "neox" (halves): rope_pair in common.cuh.
// Decode steps fold this into attention (attention.cu, `fuse`); prefill needs it as its own launch,
// since a prompt's rows read each other's cache rows.
#include "common.cuh"

extern "C" __global__ void rope_kv(float* q, float* k, const float* __restrict__ v,
                                   const int* __restrict__ positions, const int* __restrict__ slots,
                                   u16* kcache, u16* vcache, int ctx, int H, int KVH, int D,
                                   int rope_dim, float theta, int style, int n) {
    __shared__ float src[512], dst[512];
    int t = blockIdx.x, hh = blockIdx.y;
    if (t >= n) return;
    int pos = positions[t];
    bool is_q = hh < H;
    int kh = hh - H;
    float* p = is_q ? q + ((long long)t * H + hh) * D : k + ((long long)t * KVH + kh) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) src[i] = dst[i] = p[i];
    __syncthreads();
    for (int i = threadIdx.x; i < rope_dim / 2; i += blockDim.x) rope_pair(src, dst, i, pos, rope_dim, theta, style);
    __syncthreads();
    if (is_q) {
        for (int i = threadIdx.x; i < D; i += blockDim.x) p[i] = dst[i];
    } else {
        long long row = (((long long)slots[t] * ctx + pos) * KVH + kh) * D;
        const float* vr = v + ((long long)t * KVH + kh) * D;
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            p[i] = dst[i];
            kcache[row + i] = f2h(dst[i]);
            vcache[row + i] = f2h(vr[i]);
        }
    }
}
