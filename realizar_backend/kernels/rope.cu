// RoPE + KV-cache write, one launch per layer. Block (t, head): heads < H rotate q in place;
// the KV heads rotate k and store k and v as fp16 into the cache row of the token's position
// (paged: the row comes from the slot's block table, paged_kv.cuh). Positions and slots come
// from device buffers (graph replay needs no re-capture).
// style 0 = "normal" (adjacent pairs, GGUF llama), 1 = "neox" (halves). rt: cos/sin of every
// (position, pair), float2 [positions][rope_dim / 2], made on the host (ops.rope_table: rope
// scaling lives there), the same table decode attention reads.
// Decode steps fold this into attention (attention.cu, `fuse`); prefill needs it as its own launch,
// since a prompt's rows read each other's cache rows.
#include "common.cuh"
#include "paged_kv.cuh"

extern "C" __global__ void rope_kv(float* q, float* k, const float* __restrict__ v,
                                   const int* __restrict__ positions, const int* __restrict__ slots,
                                   const int* __restrict__ bt, int max_blocks, int bs_log2,
                                   u16* kcache, u16* vcache, int H, int KVH, int D,
                                   int rope_dim, const float2* __restrict__ rt, int style, int n) {
    __shared__ float src[512], dst[512];
    int t = blockIdx.x, hh = blockIdx.y;
    if (t >= n) return;
    int pos = positions[t];
    bool is_q = hh < H;
    int kh = hh - H;
    float* p = is_q ? q + ((long long)t * H + hh) * D : k + ((long long)t * KVH + kh) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) src[i] = dst[i] = p[i];
    __syncthreads();
    int half = rope_dim / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float2 cs = rt[(long long)pos * half + i];
        int ia = style ? i : 2 * i, ib = style ? i + half : 2 * i + 1;
        float a = src[ia], b = src[ib];
        const float2 r2 = rope_rot(a, b, cs.x, cs.y);
        dst[ia] = r2.x;
        dst[ib] = r2.y;
    }
    __syncthreads();
    if (is_q) {
        for (int i = threadIdx.x; i < D; i += blockDim.x) p[i] = dst[i];
    } else {
        long long row = (kv_row(bt, max_blocks, bs_log2, slots[t], pos) * KVH + kh) * D;
        const float* vr = v + ((long long)t * KVH + kh) * D;
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            p[i] = dst[i];
            kcache[row + i] = f2h(dst[i]);
            vcache[row + i] = f2h(vr[i]);
        }
    }
}
