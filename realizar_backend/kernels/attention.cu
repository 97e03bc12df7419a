// Attention over the fp16 KV cache, one block (16 warps) per (query row, head). Each warp walks
// its share of the keys with an online softmax (running max m, sum l, weighted V in registers;
// lane owns dims lane + 32 i), then the warps merge through shared memory. GQA: head h reads KV
// head h / (H / KVH). The same kernel serves decode (one row per sequence) and prefill (one row
// per prompt token, all tokens already written to the cache): row t sees cache positions
// [start, positions[t]] of slot slots[t], which is exactly causal (and sliding-window) masking.
// fuse != 0 (decode only: one row per sequence): RoPE and the KV-cache write are done here
// instead of by rope_kv. Every block ropes its q head and its KV head's new k (rounded to fp16
// like the cache) in shared memory and uses them for the newest key; the first q head of each
// KV group writes the new k and v to the cache. No block reads the row another block writes.
#include "common.cuh"

#define ATT_WARPS 16
#define ATT_MAXD 256

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
    attn_decode(const float* __restrict__ q, float* __restrict__ out, const u16* __restrict__ kcache,
                const u16* __restrict__ vcache, const int* __restrict__ slots,
                const int* __restrict__ positions, int ctx, int H, int KVH, int D, float scale,
                int window, int n, i8* oq, float2* od, u16* o16, const float* __restrict__ kin,
                const float* __restrict__ vin, int rope_dim, float theta, int style, int fuse) {
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS], sm_acc[ATT_WARPS][ATT_MAXD];
    __shared__ float rq[2][ATT_MAXD], rk[2][ATT_MAXD], rv[ATT_MAXD];   // fuse: raw / roped q and k, v
    int t = blockIdx.x, h = blockIdx.y;
    if (t >= n) return;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int kh = h / (H / KVH);
    int pos = positions[t];
    int start = window > 0 ? max(0, pos - window + 1) : 0;
    const float* qr = q + ((long long)t * H + h) * D;
    long long base = (long long)slots[t] * ctx;
    if (fuse) {
        const float* kr = kin + ((long long)t * KVH + kh) * D;
        const float* vr = vin + ((long long)t * KVH + kh) * D;
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            rq[0][i] = rq[1][i] = qr[i];
            rk[0][i] = rk[1][i] = kr[i];
            rv[i] = vr[i];
        }
        __syncthreads();
        int half = rope_dim / 2;
        for (int i = threadIdx.x; i < 2 * half; i += blockDim.x) {
            if (i < half) rope_pair(rq[0], rq[1], i, pos, rope_dim, theta, style);
            else rope_pair(rk[0], rk[1], i - half, pos, rope_dim, theta, style);
        }
        __syncthreads();
        long long row = ((base + pos) * KVH + kh) * D;
        bool writer = h % (H / KVH) == 0;
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            u16 k16 = f2h(rk[1][i]), v16 = f2h(rv[i]);
            if (writer) {          // rows no block of this launch reads: the read-only path stays valid
                ((u16*)kcache)[row + i] = k16;
                ((u16*)vcache)[row + i] = v16;
            }
            rk[1][i] = h2f(k16);       // the newest key and value as the cache holds them
            rv[i] = h2f(v16);
        }
        __syncthreads();
        qr = rq[1];
    }
    float qv[ATT_MAXD / 32], acc[ATT_MAXD / 32];
#pragma unroll
    for (int i = 0; i < ATT_MAXD / 32; ++i) {
        int d = lane + 32 * i;
        qv[i] = d < D ? qr[d] * scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    int last = fuse ? pos - 1 : pos;    // fuse: the newest key comes from shared memory, below
    // two keys per pass: both rows' loads are in flight together (a pass is one memory latency)
    for (int s = start + wid; s <= last; s += 2 * ATT_WARPS) {
        int s1 = s + ATT_WARPS;
        bool two = s1 <= last;
        long long off0 = ((base + s) * KVH + kh) * D, off1 = ((base + (two ? s1 : s)) * KVH + kh) * D;
        float k0[ATT_MAXD / 32], k1[ATT_MAXD / 32], v0[ATT_MAXD / 32], v1[ATT_MAXD / 32];
#pragma unroll
        for (int i = 0; i < ATT_MAXD / 32; ++i) {
            int d = lane + 32 * i;
            bool in = d < D;
            k0[i] = in ? h2f(kcache[off0 + d]) : 0.0f;
            k1[i] = in ? h2f(kcache[off1 + d]) : 0.0f;
            v0[i] = in ? h2f(vcache[off0 + d]) : 0.0f;
            v1[i] = in ? h2f(vcache[off1 + d]) : 0.0f;
        }
        float dot0 = 0.0f, dot1 = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAXD / 32; ++i) {
            dot0 += qv[i] * k0[i];
            dot1 += qv[i] * k1[i];
        }
        dot0 = warp_sum(dot0);
        dot1 = two ? warp_sum(dot1) : -INFINITY;
        float mn = fmaxf(m, fmaxf(dot0, dot1));
        float c = expf(m - mn), p0 = expf(dot0 - mn), p1 = two ? expf(dot1 - mn) : 0.0f;
        l = l * c + p0 + p1;
#pragma unroll
        for (int i = 0; i < ATT_MAXD / 32; ++i) acc[i] = acc[i] * c + p0 * v0[i] + p1 * v1[i];
        m = mn;
    }
    if (fuse && wid == ATT_WARPS - 1) {     // the newest key, on the warp with the fewest cached keys
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAXD / 32; ++i) {
            int d = lane + 32 * i;
            dot += d < D ? qv[i] * rk[1][d] : 0.0f;
        }
        dot = warp_sum(dot);
        float mn = fmaxf(m, dot);
        float c = expf(m - mn), p = expf(dot - mn);
        l = l * c + p;
#pragma unroll
        for (int i = 0; i < ATT_MAXD / 32; ++i) {
            int d = lane + 32 * i;
            acc[i] = acc[i] * c + p * (d < D ? rv[d] : 0.0f);
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
    // D is a multiple of 32 and at most ATT_MAXD <= 32 * ATT_WARPS: warp w finishes dims 32w..32w+31 and,
    // if asked, writes them as one 8-bit block (the o-projection input) and/or fp16 (prefill GEMM)
    long long ob = ((long long)t * H + h) * D;
    if (32 * wid < D) {
        int d = 32 * wid + lane;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) s += sm_acc[w][d] * f[w];
        s /= L;
        out[ob + d] = s;
        if (o16) o16[ob + d] = f2h(s);
        if (oq) quant_q8_lane(s, oq + ob + 32 * wid, od + (ob >> 5) + wid, lane);
    }
}
