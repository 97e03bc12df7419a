// Flash attention on the tensor cores: what flash_prefill.cu and flash_decode.cu share.
// Scores and P.V are mma.sync m16n8k16 products (fp16 operands, fp32 accumulation). K and V tiles
// come from the paged pool (paged_kv.cuh) into shared memory by cp.async (16-byte copies, zero-filled
// for keys past a row's range, so no row outside it is ever read) and reach the tensor cores by
// ldmatrix. Shared rows are padded by 16 bytes: the 8 rows of an ldmatrix matrix then start on 8
// distinct bank groups. q is scaled by scale * log2(e) before it is rounded to fp16, so scores are
// in the log2 domain and the online softmax (fp32) uses exp2.
// Sinks (gpt-oss): one learned logit per q head joins each row's softmax denominator and weighs no
// value; it is added where a row's output is normalised (fl_sink_sum), so partials stay sink-free.
// Split-K: a row's keys may be split over several blocks; each writes a partial (its O, not yet
// divided by l, and its running max m and sum l) and the last block of a group to finish (an atomic
// counter, reset to 0 by that block, so a captured graph replays with zeroed counters) combines them.
#pragma once
#include "common.cuh"
#include "cp_async.cuh"
#include "paged_kv.cuh"

#define FL_LOG2E 1.4426950408889634f
#define FL_MAXC 8     // partials one block combines (prefill splits; each level of a decode combine)

#ifdef REALIZAR_HOST_TEST
// tests/host/cuda_emu.h emulates the warp-wide instructions on the CPU
#define FL_DYN_SMEM(name) u8* name = emu::dyn_smem()
#else
#define FL_DYN_SMEM(name)                                  \
    extern __shared__ __align__(16) u8 fl_dyn_smem_[];      \
    u8* name = fl_dyn_smem_
#endif

// c += a . b for one m16n8k16 tile: a = 16x16 fp16 (4 registers, row-major fragments), b = 16x8
// (2 registers), c = 16x8 fp32 (thread: rows lane/4 and lane/4 + 8, columns 2 (lane%4) + {0, 1})
__device__ __forceinline__ void fl_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#ifdef REALIZAR_HOST_TEST
    emu::mma16816(c, a, b0, b1);
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// four 8x8 fp16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8
__device__ __forceinline__ void fl_ldsm(u32 (&r)[4], const u16* p) {
#ifdef REALIZAR_HOST_TEST
    emu::ldmatrix_x4(r, p, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((u32)__cvta_generic_to_shared(p))
                 : "memory");
#endif
}

// the same, each matrix transposed
__device__ __forceinline__ void fl_ldsm_t(u32 (&r)[4], const u16* p) {
#ifdef REALIZAR_HOST_TEST
    emu::ldmatrix_x4(r, p, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((u32)__cvta_generic_to_shared(p))
                 : "memory");
#endif
}

// two fp32 -> one register of two fp16 (lo in the low half: the lower column of a fragment)
__device__ __forceinline__ u32 fl_pack(float lo, float hi) {
#ifdef REALIZAR_HOST_TEST
    return (u32)f2h(lo) | ((u32)f2h(hi) << 16);
#else
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

__device__ __forceinline__ float fl_h2sum(u32 x) { return h2f((u16)(x & 0xFFFFu)) + h2f((u16)(x >> 16)); }

// One online-softmax step for the two rows a thread holds (fragment rows lane/4 and lane/4 + 8):
// sc = scores of NT 8-key column tiles (log2 domain, -inf where masked); m, l, o: running max, sum
// and output (D / 8 column tiles). P goes out as the A fragments of the P.V products (pf) and l
// sums P as rounded to fp16, so the weights and their normaliser agree.
template <int NT, int DT>
__device__ __forceinline__ void fl_softmax_step(float (&sc)[NT][4], float (&m)[2], float (&l)[2], float (&o)[DT][4],
                                                u32 (&pf)[NT / 2][4]) {
    float mt[2] = {m[0], m[1]};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        mt[0] = fmaxf(mt[0], fmaxf(sc[nt][0], sc[nt][1]));
        mt[1] = fmaxf(mt[1], fmaxf(sc[nt][2], sc[nt][3]));
    }
    float mu[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        mt[i] = fmaxf(mt[i], __shfl_xor_sync(0xffffffffu, mt[i], 1));
        mt[i] = fmaxf(mt[i], __shfl_xor_sync(0xffffffffu, mt[i], 2));
        mu[i] = mt[i] == -INFINITY ? 0.0f : mt[i];      // a row with nothing seen yet: every term stays 0
        float c = exp2f(m[i] - mu[i]);
        l[i] *= c;
        m[i] = mt[i];
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[dt][2 * i] *= c;
            o[dt][2 * i + 1] *= c;
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        u32 ra = fl_pack(exp2f(sc[nt][0] - mu[0]), exp2f(sc[nt][1] - mu[0]));
        u32 rc = fl_pack(exp2f(sc[nt][2] - mu[1]), exp2f(sc[nt][3] - mu[1]));
        l[0] += fl_h2sum(ra);
        l[1] += fl_h2sum(rc);
        pf[nt / 2][(nt & 1) * 2] = ra;
        pf[nt / 2][(nt & 1) * 2 + 1] = rc;
    }
}

// o += P . V for 16 keys (one k-step, pf = its A fragments) and every dim: vs = the 16 key rows of V
// in shared memory (row stride lds halves)
template <int D>
__device__ __forceinline__ void fl_pv16(float (&o)[D / 8][4], const u32 (&pf)[4], const u16* vs, int lds, int lane) {
    const u16* base = vs + ((lane & 7) + ((lane >> 3) & 1) * 8) * lds + (lane >> 4) * 8;
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
        u32 b[4];
        fl_ldsm_t(b, base + dp * 16);
        fl_mma(o[2 * dp], pf, b[0], b[1]);
        fl_mma(o[2 * dp + 1], pf, b[2], b[3]);
    }
}

// the A fragment of rows r0..r0+15, dims 16 kk.. of a row-major fp16 tile in shared memory
__device__ __forceinline__ void fl_afrag(u32 (&a)[4], const u16* tile, int lds, int r0, int kk, int lane) {
    fl_ldsm(a, tile + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * lds + kk * 16 + (lane >> 4) * 8);
}

// the B fragments of keys n0..n0+15 (two 8-key column tiles: b[0..1], b[2..3]), dims 16 kk..
__device__ __forceinline__ void fl_kfrag(u32 (&b)[4], const u16* ks, int lds, int n0, int kk, int lane) {
    fl_ldsm(b, ks + (n0 + (lane & 7) + (lane >> 4) * 8) * lds + kk * 16 + ((lane >> 3) & 1) * 8);
}

// A row's softmax denominator: the keys' sum L at running max M (log2 domain) plus its head's sink
// logit (sink: natural units, as the model stores it; null: none). 2^(s - M) may overflow to inf
// when the sink dwarfs every key: the output then goes to 0, its limit.
__device__ __forceinline__ float fl_sink_sum(float L, float M, const float* sink) {
    return sink ? L + exp2f(*sink * FL_LOG2E - M) : L;
}

// Lane `lane` of a warp holds dim 32 c + lane of one output row; out/o16/oq point at the row's
// start, od at its first 8-bit block's (d, sum) pair. Any of them may be null (oq and od together).
__device__ __forceinline__ void fl_store32(float v, int c, int lane, float* out, u16* o16, i8* oq, float2* od) {
    int d = 32 * c + lane;
    if (out) out[d] = v;
    if (o16) o16[d] = f2h(v);
    if (oq) quant_q8_lane(v, oq + 32 * c, od + c, lane);
}

// Combine `cnt` (<= FL_MAXC) partials of each of `nitem` rows of D values: partial i of row r is
// the D floats at po + i * po_split + r * po_item, its (m, l) at pml[i * ml_split + r * ml_item].
// dst_o null: the result is normalised and stored as the final output (row r at out + r * out_item,
// likewise o16 and oq, od + r * out_item / 32). Otherwise it stays unnormalised, a partial of the
// next level: row r at dst_o + r * D, its (M, L) at dst_ml[r]. sk (final output only; null: none):
// row r's sink logit at sk[r * sk_step]. Every thread of the block calls it.
// Partials come through L2 (__ldcg): other blocks wrote them. wsm: shared, (FL_MAXC + 1) * nitem.
template <int D>
__device__ void fl_combine(int nitem, int cnt, const float* po, long long po_split, long long po_item,
                           const float2* pml, long long ml_split, long long ml_item, float* out, u16* o16, i8* oq,
                           float2* od, long long out_item, float* dst_o, float2* dst_ml, float* wsm,
                           const float* sk = nullptr, int sk_step = 0) {
    const int tid = threadIdx.x, nth = blockDim.x;
    for (int r = tid; r < nitem; r += nth) {
        float m[FL_MAXC], l[FL_MAXC], M = -INFINITY;
#pragma unroll
        for (int i = 0; i < FL_MAXC; ++i) {
            float2 v = i < cnt ? __ldcg(pml + i * ml_split + r * ml_item) : make_float2(-INFINITY, 0.0f);
            m[i] = v.x;
            l[i] = v.y;
            M = fmaxf(M, v.x);
        }
        float L = 0.0f;
#pragma unroll
        for (int i = 0; i < FL_MAXC; ++i) {
            float w = l[i] > 0.0f ? exp2f(m[i] - M) : 0.0f;    // an empty partial has m = -inf, l = 0
            if (i < cnt) wsm[i * nitem + r] = w;
            L += w * l[i];
        }
        wsm[cnt * nitem + r] = dst_o ? L : fl_sink_sum(L, M, sk ? sk + r * sk_step : nullptr);
        if (dst_o) dst_ml[r] = make_float2(M, L);
    }
    __syncthreads();
    const int lane = tid & 31, wid = tid >> 5, nw = nth >> 5;
    for (int x = wid; x < nitem * (D / 32); x += nw) {
        const int r = x / (D / 32), c = x - r * (D / 32), d = 32 * c + lane;
        float v = 0.0f;
        for (int i = 0; i < cnt; ++i) v += wsm[i * nitem + r] * __ldcg(po + i * po_split + r * po_item + d);
        if (dst_o) {
            dst_o[(long long)r * D + d] = v;
        } else {
            const long long ob = r * out_item;
            fl_store32(v / wsm[cnt * nitem + r], c, lane, out ? out + ob : nullptr, o16 ? o16 + ob : nullptr,
                       oq ? oq + ob : nullptr, od ? od + (ob >> 5) : nullptr);
        }
    }
}

// Flagged words: a float and a flag (1: written, 0: consumed) in one 64-bit word, which a store
// writes and a load reads whole. A reader that sees the flag has the value, with no fence between
// writer and reader: the writer need not wait for its stores before it signals. The reader zeroes
// the words it consumed, so every launch finds them at 0 (as the counters).
__device__ __forceinline__ void fl_flag_put(u64* p, float v) {
    const u64 w = (1ull << 32) | __float_as_uint(v);
#if defined(__CUDA_ARCH__)
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
#else
    *p = w;
#endif
}

__device__ __forceinline__ u64 fl_flag_get(const u64* p) {
#if defined(__CUDA_ARCH__)
    u64 w;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
    return w;
#else
    return *(const volatile u64*)p;
#endif
}

__device__ __forceinline__ bool fl_flagged(u64 w) { return (w >> 32) == 1u; }
__device__ __forceinline__ float fl_flag_val(u64 w) { return __uint_as_float((u32)w); }

// The block's vote after writing its partial: true in the one block that arrives last at *counter
// (of `expected`), which also resets it. Every thread calls it; partials are visible to the winner.
__device__ __forceinline__ bool fl_arrive_last(int* counter, int expected, int* s_flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int last = atomicAdd(counter, 1) == expected - 1;
        if (last) *counter = 0;
        *s_flag = last;
    }
    __syncthreads();
    bool last = *s_flag != 0;
    if (last) __threadfence();
    return last;
}
