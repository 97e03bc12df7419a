// Attention over the paged fp16 KV cache (paged_kv.cuh), one block (16 warps) per (query row, head). Each warp walks
// its share of the keys, KPP per pass, with an online softmax (running max m, sum l, weighted V
// in registers; lane owns dims 2 lane + 64 i: 4-byte loads of fp16 pairs), then the warps merge
// through shared memory. GQA: head h reads KV head h / (H / KVH). The same kernel serves decode
// (one row per sequence) and prefill (one row per prompt token, all tokens already written to the
// cache): row t sees cache positions [start, positions[t]] of slot slots[t], which is exactly
// causal (and sliding-window) masking.
// fuse != 0 (decode only: one row per sequence): RoPE and the KV-cache write are done here
// instead of by rope_kv. Every block ropes its q head and its KV head's new k (rounded to fp16
// like the cache) into shared memory and uses them for the newest key; the first q head of each
// KV group writes the new k and v to the cache. No block reads the row another block writes.
// rt: cos/sin of every (position, pair), float2 [positions][rope_dim / 2] (ops.rope_table, made on
// the host in float64 as the CPU backend makes them, rope scaling included): read before pdl_wait,
// so the rotation costs no transcendental math on the step's critical path.
// sinks (null: none): head h's sink logit (gpt-oss) joins each of its rows' softmax denominators and
// weighs no value: exp(sink - M) added to the sum where the row is normalised.
// qnw, knw (fuse only; null: none): the per-head q and k norms (head_norm.cuh), applied to the q
// head and the new k before they rotate; every warp finds both heads' RMS itself (no barrier).
#include "common.cuh"
#include "paged_kv.cuh"
#include "head_norm.cuh"

#define ATT_WARPS 16
#define ATT_MAXD 256
#define ATT_DV (ATT_MAXD / 64)   // 2-dim slices per lane for the largest head

// the prompt tiles' dynamic shared memory (tests/host/cuda_emu.h hands out its own on the CPU)
#ifdef REALIZAR_HOST_TEST
#define ATT_DYN_SMEM(name) float* name = (float*)emu::dyn_smem()
#else
#define ATT_DYN_SMEM(name) extern __shared__ float name[]
#endif

// the block's shared memory (declared once per entry point: each instance of attn_body would have its own)
struct AttSmem {
    float m[ATT_WARPS], l[ATT_WARPS], acc[ATT_WARPS][ATT_MAXD];
    float rq[ATT_MAXD], rk[ATT_MAXD], rv[ATT_MAXD];   // fuse: roped q and k (k as cached), v
};

// DV: 2-dim slices per lane (D <= 64 DV); KPP: keys per warp per pass
template <int KPP, int DV>
__device__ __forceinline__ void attn_body(const float* __restrict__ q, float* __restrict__ out,
                                          const u16* __restrict__ kcache, const u16* __restrict__ vcache,
                                          const int* __restrict__ slots, const int* __restrict__ positions,
                                          const int* __restrict__ bt, int max_blocks, int bs_log2, int H, int KVH,
                                          int D, float scale, int window, int n, i8* oq, float2* od, u16* o16,
                                          const float* __restrict__ kin, const float* __restrict__ vin, int rope_dim,
                                          int style, int fuse, const float2* __restrict__ rt,
                                          const float* __restrict__ sinks, const float* __restrict__ qnw,
                                          const float* __restrict__ knw, float eps, AttSmem& sm) {
    float *sm_m = sm.m, *sm_l = sm.l, *rq = sm.rq, *rk = sm.rk, *rv = sm.rv;
    float(&sm_acc)[ATT_WARPS][ATT_MAXD] = sm.acc;
    int t = blockIdx.x, h = blockIdx.y;
    if (t >= n) return;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int kh = h / (H / KVH);
    int pos = positions[t];
    int start = window > 0 ? max(0, pos - window + 1) : 0;
    const float* qr = q + ((long long)t * H + h) * D;
    const int slot = slots[t];
    // the row's cached keys and values (all KV heads) towards L2 first: their loads then overlap
    // the RoPE prologue; the heads of the row split the blocks, one block (K or V) per thread
    {
        const int b0 = start >> bs_log2, nblk = (pos >> bs_log2) - b0 + 1;
        for (int j = h + H * (threadIdx.x >> 1); j < nblk; j += H * (blockDim.x >> 1)) {
            long long row = kv_row(bt, max_blocks, bs_log2, slot, (b0 + j) << bs_log2);
            l2_prefetch((threadIdx.x & 1 ? vcache : kcache) + row * KVH * D, 2LL * (KVH * D << bs_log2));
        }
    }
    int last = fuse ? pos - 1 : pos;    // fuse: the newest key comes from shared memory, below
    // KPP keys per pass, all their loads in flight together (a pass is one memory latency); the
    // spare rows of the last pass re-read key s and weigh nothing. Raw fp16 pairs: the first
    // pass's are loaded here, before the wait
    u32 k2[KPP][DV], v2[KPP][DV];
    auto load_pass = [&](int s) {
#pragma unroll
        for (int j = 0; j < KPP; ++j) {
            int sj = s + j * ATT_WARPS;
            long long off = (kv_row(bt, max_blocks, bs_log2, slot, sj <= last ? sj : s) * KVH + kh) * D;
#pragma unroll
            for (int i = 0; i < DV; ++i) {
                int d = 2 * lane + 64 * i;
                k2[j][i] = d < D ? __ldg((const u32*)(kcache + off + d)) : 0u;
                v2[j][i] = d < D ? __ldg((const u32*)(vcache + off + d)) : 0u;
            }
        }
    };
    if (start + wid <= last) load_pass(start + wid);
    // fuse: thread i < rope_dim rotates pair i % half of q (i < half) or of k; its cos/sin now
    int half = rope_dim / 2;
    float rc = 1.0f, rs = 0.0f;
    if (fuse && threadIdx.x < rope_dim) {
        float2 cs = rt[(long long)pos * half + threadIdx.x % half];
        rc = cs.x;
        rs = cs.y;
    }
    // everything above reads only step inputs (positions, slots), cached rows that no kernel of
    // this step writes and constants: it may overlap the kernel before (common.cuh pdl_wait)
    pdl_wait();
    if (fuse) {
        // one pass, one barrier: rotated pairs, unrotated dims and v each go straight from the
        // step's q/k/v rows to shared memory (k and v rounded to fp16 as the cache holds them, and
        // written to the cache by the first q head of the KV group: rows no block of this launch
        // reads, so the read-only path stays valid)
        const float* kr = kin + ((long long)t * KVH + kh) * D;
        const float* vr = vin + ((long long)t * KVH + kh) * D;
        const long long prow = (kv_row(bt, max_blocks, bs_log2, slot, pos) * KVH + kh) * D;
        u16* kdst = (u16*)kcache + prow;
        u16* vdst = (u16*)vcache + prow;
        bool writer = h % (H / KVH) == 0;
        int rest = D - rope_dim;
        const float iq = qnw ? head_rms_inv(qr, D, eps) : 1.0f, ik = knw ? head_rms_inv(kr, D, eps) : 1.0f;
        for (int i = threadIdx.x; i < rope_dim + D + 2 * rest; i += blockDim.x) {
            if (i < rope_dim) {                              // a pair of q (i < half) or of k
                bool isk = i >= half;
                int p = isk ? i - half : i;
                int ia = style ? p : 2 * p, ib = style ? p + half : 2 * p + 1;
                const float* src = isk ? kr : qr;
                const float* nw = isk ? knw : qnw;
                const float inv = isk ? ik : iq;
                float a = head_normed(src, ia, inv, nw), b = head_normed(src, ib, inv, nw);
                const float2 r2 = rope_rot(a, b, rc, rs);
                float ra = r2.x, rb = r2.y;
                if (isk) {
                    u16 ka = f2h(ra), kb = f2h(rb);
                    if (writer) {
                        kdst[ia] = ka;
                        kdst[ib] = kb;
                    }
                    rk[ia] = h2f(ka);
                    rk[ib] = h2f(kb);
                } else {
                    rq[ia] = ra;
                    rq[ib] = rb;
                }
            } else if (i < rope_dim + D) {                   // v
                int d = i - rope_dim;
                u16 v16 = f2h(vr[d]);
                if (writer) vdst[d] = v16;
                rv[d] = h2f(v16);
            } else {                                         // dims past rope_dim: q, then k
                int j = i - rope_dim - D;
                bool isk = j >= rest;
                int d = rope_dim + (isk ? j - rest : j);
                if (isk) {
                    u16 k16 = f2h(head_normed(kr, d, ik, knw));
                    if (writer) kdst[d] = k16;
                    rk[d] = h2f(k16);
                } else {
                    rq[d] = head_normed(qr, d, iq, qnw);
                }
            }
        }
        __syncthreads();
        qr = rq;
    }
    // lane owns dims 2 lane + 64 i, i < DV (a 4-byte load of two fp16 values per key row)
    float qv[DV][2], acc[DV][2];
#pragma unroll
    for (int i = 0; i < DV; ++i) {
        int d = 2 * lane + 64 * i;
        qv[i][0] = d < D ? qr[d] * scale : 0.0f;
        qv[i][1] = d < D ? qr[d + 1] * scale : 0.0f;
        acc[i][0] = acc[i][1] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int s = start + wid; s <= last; s += KPP * ATT_WARPS) {
        if (s != start + wid) load_pass(s);
        float kk[KPP][DV][2], vv[KPP][DV][2], dot[KPP];
#pragma unroll
        for (int j = 0; j < KPP; ++j)
#pragma unroll
            for (int i = 0; i < DV; ++i) {
                kk[j][i][0] = h2f((u16)(k2[j][i] & 0xFFFF)); kk[j][i][1] = h2f((u16)(k2[j][i] >> 16));
                vv[j][i][0] = h2f((u16)(v2[j][i] & 0xFFFF)); vv[j][i][1] = h2f((u16)(v2[j][i] >> 16));
            }
        float mn = m;
#pragma unroll
        for (int j = 0; j < KPP; ++j) {
            float t = 0.0f;
#pragma unroll
            for (int i = 0; i < DV; ++i) t += qv[i][0] * kk[j][i][0] + qv[i][1] * kk[j][i][1];
            t = warp_sum(t);
            dot[j] = s + j * ATT_WARPS <= last ? t : -INFINITY;
            mn = fmaxf(mn, dot[j]);
        }
        float c = expf(m - mn);
        l *= c;
#pragma unroll
        for (int i = 0; i < DV; ++i) {
            acc[i][0] *= c;
            acc[i][1] *= c;
        }
#pragma unroll
        for (int j = 0; j < KPP; ++j) {
            float p = expf(dot[j] - mn);       // 0 for the spare rows (dot = -inf)
            l += p;
#pragma unroll
            for (int i = 0; i < DV; ++i) {
                acc[i][0] += p * vv[j][i][0];
                acc[i][1] += p * vv[j][i][1];
            }
        }
        m = mn;
    }
    if (fuse && wid == ATT_WARPS - 1) {     // the newest key, on the warp with the fewest cached keys
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < DV; ++i) {
            int d = 2 * lane + 64 * i;
            dot += d < D ? qv[i][0] * rk[d] + qv[i][1] * rk[d + 1] : 0.0f;
        }
        dot = warp_sum(dot);
        float mn = fmaxf(m, dot);
        float c = expf(m - mn), p = expf(dot - mn);
        l = l * c + p;
#pragma unroll
        for (int i = 0; i < DV; ++i) {
            int d = 2 * lane + 64 * i;
            acc[i][0] = acc[i][0] * c + p * (d < D ? rv[d] : 0.0f);
            acc[i][1] = acc[i][1] * c + p * (d < D ? rv[d + 1] : 0.0f);
        }
        m = mn;
    }
    pdl_trigger();       // every key read: the next kernel may park its blocks (common.cuh)
    if (lane == 0) {
        sm_m[wid] = m;
        sm_l[wid] = l;
    }
#pragma unroll
    for (int i = 0; i < DV; ++i) {
        int d = 2 * lane + 64 * i;
        if (d < D) *(float2*)&sm_acc[wid][d] = make_float2(acc[i][0], acc[i][1]);
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
    if (sinks) L += expf(sinks[h] - M);
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

// ATT_KIND selects one entry point per compilation (1 attn_decode, 2 attn_tile, 3 attn_tile_v2;
// unset or 0: all): the loader compiles them as separate modules, in parallel, so a cold start waits
// for the slowest one, not for all three in one NVRTC call
#ifndef ATT_KIND
#define ATT_KIND 0
#endif
#define ATT_ON(kind) (ATT_KIND == 0 || ATT_KIND == (kind))

#if ATT_ON(1)
// decode: a few rows, short chains of memory latency: heads of up to 128 dims take 8 keys per warp
// per pass (the registers the head size frees: a first pass of 128 keys is loaded before pdl_wait)
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
    attn_decode(const float* q, float* out, const u16* kcache, const u16* vcache, const int* slots,
                const int* positions, const int* bt, int max_blocks, int bs_log2, int H, int KVH, int D, float scale,
                int window, int n, i8* oq, float2* od, u16* o16, const float* kin, const float* vin, int rope_dim,
                int style, int fuse, const float2* rt, const float* sinks, const float* qnw, const float* knw,
                float eps) {
    __shared__ AttSmem sm;
#ifdef ATT_HEAD_DIM
    // the loader compiles the model's head size only (one body: a third of the compile time)
    constexpr int dv = ATT_HEAD_DIM <= 64 ? 1 : (ATT_HEAD_DIM <= 128 ? 2 : ATT_DV);
    attn_body<dv == ATT_DV ? 4 : 8, dv>(q, out, kcache, vcache, slots, positions, bt, max_blocks, bs_log2, H, KVH, D, scale, window, n, oq,
                                        od, o16, kin, vin, rope_dim, style, fuse, rt, sinks, qnw, knw, eps, sm);
#else
    if (D <= 64)
        attn_body<8, 1>(q, out, kcache, vcache, slots, positions, bt, max_blocks, bs_log2, H, KVH, D, scale, window, n, oq, od, o16, kin,
                        vin, rope_dim, style, fuse, rt, sinks, qnw, knw, eps, sm);
    else if (D <= 128)
        attn_body<8, 2>(q, out, kcache, vcache, slots, positions, bt, max_blocks, bs_log2, H, KVH, D, scale, window, n, oq, od, o16, kin,
                        vin, rope_dim, style, fuse, rt, sinks, qnw, knw, eps, sm);
    else
        attn_body<4, ATT_DV>(q, out, kcache, vcache, slots, positions, bt, max_blocks, bs_log2, H, KVH, D, scale, window, n, oq, od, o16,
                             kin, vin, rope_dim, style, fuse, rt, sinks, qnw, knw, eps, sm);
#endif
}
#endif

// ------------------------------------------------------------------ prompt rows, tiled
// A block takes ATT_TQ consecutive rows of one head. Rows of one sequence at consecutive positions
// (a "run": normally the whole tile) share every K/V tile the block stages in shared memory, so
// K/V traffic falls by the tile height against one block per row. Warp w owns row w of the run; lane j scores key j of a tile of ATT_KT keys, then the
// warp adds the V rows weighted by the tile's probabilities (broadcast by shuffles); lane l owns dims
// VEC l + 32 VEC i (VEC = 4: 16-byte reads and writes, for D % 128 == 0; 2 otherwise, so D = 64 keeps
// every lane busy). A tile holding rows of two sequences runs one run after the other. Rows see keys
// [start, positions[t]] of their slot, as in attn_body. Dynamic shared memory: ops.attention sizes it.
#define ATT_TQ 16
#define ATT_KT 32

#define ATT_LD (ATT_KT * ATT_MAXD / 2 / (ATT_TQ * 32))   // 4-byte words of a K (and a V) tile per thread

// keys k0 .. k0+nk-1 of KV head kh into registers: word it of this thread is word
// threadIdx.x + it * blockDim.x of the tile (key-major, D/2 words per key)
__device__ __forceinline__ void attn_tile_load(const u16* __restrict__ kcache, const u16* __restrict__ vcache,
                                               const int* __restrict__ bt, int max_blocks, int bs_log2, int slot,
                                               int KVH, int kh, int D, int k0, int nk,
                                               u32 (&kr)[ATT_LD], u32 (&vr)[ATT_LD]) {
#pragma unroll
    for (int it = 0; it < ATT_LD; ++it) {
        int i = threadIdx.x + it * ATT_TQ * 32;
        if (i < nk * (D / 2)) {
            int j = i / (D / 2), c = i - j * (D / 2);
            long long off = ((kv_row(bt, max_blocks, bs_log2, slot, k0 + j) * KVH + kh) * D >> 1) + c;
            kr[it] = __ldg((const u32*)kcache + off);
            vr[it] = __ldg((const u32*)vcache + off);
        }
    }
}

template <int VEC>
__device__ __forceinline__ void attn_tile_body(const float* __restrict__ q, float* __restrict__ out,
                                               const u16* __restrict__ kcache, const u16* __restrict__ vcache,
                                               const int* __restrict__ slots, const int* __restrict__ positions,
                                               const int* __restrict__ bt, int max_blocks, int bs_log2, int H,
                                               int KVH, int D, float scale, int window, int n,
                                               u16* o16, const float* __restrict__ sinks) {
    constexpr int DW = ATT_MAXD / (32 * VEC);             // slices of VEC dims per lane
    ATT_DYN_SMEM(att_sm);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    // the last tiles of a prompt see the most keys: they start first, so the short ones fill the tail
    const int t0 = (gridDim.x - 1 - blockIdx.x) * ATT_TQ, h = blockIdx.y, kh = h / (H / KVH);
    // K/V rows padded by 16 bytes: lane j's row starts on bank group j (16-byte reads conflict-free)
    const int tend = min(t0 + ATT_TQ, n), KS = D + 4;
    float* qs = att_sm;                                   // [ATT_TQ][D], pre-scaled
    float* ks = qs + ATT_TQ * D;                          // [ATT_KT][D + 4]
    float* vs = ks + ATT_KT * KS;
    pdl_wait();                   // (a no-op in the prompt path, which is never a programmatic launch)
    for (int i = threadIdx.x; i < (tend - t0) * D; i += blockDim.x) {
        int r = i / D, d = i - r * D;
        qs[i] = q[((long long)(t0 + r) * H + h) * D + d] * scale;
    }
    for (int rb = t0; rb < tend;) {                       // block-uniform: every thread reads the same rows
        const int slot = slots[rb], p0 = positions[rb];
        int re = rb + 1;
        while (re < tend && slots[re] == slot && positions[re] == p0 + (re - rb)) ++re;
        const int r = rb + w;
        const bool live = r < re;
        const int pos = p0 + w;
        const int start = window > 0 ? max(0, pos - window + 1) : 0;
        const int kbeg = window > 0 ? max(0, p0 - window + 1) : 0, kend = p0 + (re - rb) - 1;
        float m = -INFINITY, l = 0.0f;
        float acc[DW][VEC];
#pragma unroll
        for (int i = 0; i < DW; ++i)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[i][e] = 0.0f;
        // K/V tiles pass through registers: the next tile's loads are in flight while this one computes
        u32 kr2[ATT_LD], vr2[ATT_LD];
        attn_tile_load(kcache, vcache, bt, max_blocks, bs_log2, slot, KVH, kh, D, kbeg, min(ATT_KT, kend - kbeg + 1), kr2, vr2);
        for (int k0 = kbeg; k0 <= kend; k0 += ATT_KT) {
            const int nk = min(ATT_KT, kend - k0 + 1);
            __syncthreads();                              // the previous tile is consumed, q is staged
#pragma unroll
            for (int it = 0; it < ATT_LD; ++it) {
                int i = threadIdx.x + it * ATT_TQ * 32;
                if (i < nk * (D / 2)) {
                    int j = i / (D / 2), c = i - j * (D / 2);
                    *(float2*)(ks + j * KS + 2 * c) = make_float2(h2f((u16)(kr2[it] & 0xFFFF)), h2f((u16)(kr2[it] >> 16)));
                    *(float2*)(vs + j * KS + 2 * c) = make_float2(h2f((u16)(vr2[it] & 0xFFFF)), h2f((u16)(vr2[it] >> 16)));
                }
            }
            __syncthreads();
            if (k0 + ATT_KT <= kend)
                attn_tile_load(kcache, vcache, bt, max_blocks, bs_log2, slot, KVH, kh, D, k0 + ATT_KT, min(ATT_KT, kend - k0 - ATT_KT + 1),
                               kr2, vr2);
            // warp-uniform: the tile holds at least one of this row's keys
            if (!live || k0 > pos || k0 + nk - 1 < start) continue;
            const int key = k0 + lane;
            float s = -INFINITY;
            if (lane < nk && key >= start && key <= pos) {
                const float* qr = qs + (r - t0) * D;
                const float* kr = ks + lane * KS;
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma unroll 4
                for (int d = 0; d < D; d += 4) {
                    float4 qv = *(const float4*)(qr + d);   // the same address in every lane: broadcast
                    float4 kv = *(const float4*)(kr + d);
                    a0 = fmaf(qv.x, kv.x, a0);
                    a1 = fmaf(qv.y, kv.y, a1);
                    a2 = fmaf(qv.z, kv.z, a2);
                    a3 = fmaf(qv.w, kv.w, a3);
                }
                s = (a0 + a1) + (a2 + a3);
            }
            const float mn = fmaxf(m, warp_max(s));        // finite: the tile holds a key of this row
            const float c = expf(m - mn), p = expf(s - mn);
            l = l * c + warp_sum(p);
#pragma unroll
            for (int i = 0; i < DW; ++i)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[i][e] *= c;
            for (int j = 0; j < nk; ++j) {
                const float pj = __shfl_sync(0xFFFFFFFFu, p, j);
                const float* vr = vs + j * KS + VEC * lane;
#pragma unroll
                for (int i = 0; i < DW; ++i)
                    if (VEC * lane + 32 * VEC * i < D) {
                        float v[VEC];
                        if constexpr (VEC == 4) {
                            float4 t = *(const float4*)(vr + 128 * i);
                            v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
                        } else {
                            float2 t = *(const float2*)(vr + 64 * i);
                            v[0] = t.x; v[1] = t.y;
                        }
#pragma unroll
                        for (int e = 0; e < VEC; ++e) acc[i][e] = fmaf(pj, v[e], acc[i][e]);
                    }
            }
            m = mn;
        }
        if (live) {
            const float inv = 1.0f / (sinks ? l + expf(sinks[h] - m) : l);
            const long long ob = ((long long)r * H + h) * D;
#pragma unroll
            for (int i = 0; i < DW; ++i) {
                int d = VEC * lane + 32 * VEC * i;
                if (d < D) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        out[ob + d + e] = acc[i][e] * inv;
                        if (o16) o16[ob + d + e] = f2h(acc[i][e] * inv);
                    }
                }
            }
        }
        rb = re;
    }
}

#if ATT_ON(2)
// two blocks per SM (64 registers): one block of 16 warps cannot hide the staging barriers
extern "C" __global__ void __launch_bounds__(ATT_TQ * 32, 2)
    attn_tile(const float* q, float* out, const u16* kcache, const u16* vcache, const int* slots,
              const int* positions, const int* bt, int max_blocks, int bs_log2, int H, int KVH, int D, float scale,
              int window, int n, u16* o16, const float* sinks) {
    attn_tile_body<4>(q, out, kcache, vcache, slots, positions, bt, max_blocks, bs_log2, H, KVH, D, scale, window, n, o16,
                      sinks);
}
#endif

#if ATT_ON(3)
extern "C" __global__ void __launch_bounds__(ATT_TQ * 32, 2)
    attn_tile_v2(const float* q, float* out, const u16* kcache, const u16* vcache, const int* slots,
                 const int* positions, const int* bt, int max_blocks, int bs_log2, int H, int KVH, int D, float scale,
              int window, int n, u16* o16, const float* sinks) {
    attn_tile_body<2>(q, out, kcache, vcache, slots, positions, bt, max_blocks, bs_log2, H, KVH, D, scale, window, n, o16,
                      sinks);
}
#endif
