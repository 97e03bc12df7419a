// Batched decode of small batches on the tensor cores (the dispatcher, backends/cuda/dispatch.py, picks
// it when every matrix of a projection has one of its types): y[t, r] = W[r] . h[t], with mmq.cu's
// numerics (the same prep records from mmq_prep: row-scaled fp16 hi/lo halves and unit sums; exact
// products summed in fp32 per 32-column unit, sub-block scales and mins applied by fp32 FMAs). What
// differs is the data path: the weights go from global memory straight into the mma A fragments,
// with no shared-memory tile and no barrier in the K loop, so the hot loop is a few hundred
// instructions. mmq.cu's block-wide tile pipeline is bound by instruction fetch at small M, and
// the GEMVs (mmvf.cu) pay per activation row for every weight.
//
// A warp computes one tile of 16 weight rows (the fused FFN: 16 gate rows and the same 16 up rows)
// for up to 8 NT tokens, over every W-th 64-column item (two units) of K. Thread (gid, tig) loads,
// for rows gid and gid + 8, the bytes holding columns 4 tig .. 4 tig + 3 and 16 + 4 tig .. 16 + 4 tig
// + 3 of each unit: under mmq.cu's k order those are exactly the k positions of its A fragments
// (step s: columns 16 s + 4 tig + {0, 1} and {2, 3}), and its B fragments are the 16-byte pieces
// 8 tig .. 8 tig + 7 of the token's prep record. A warp keeps P items of weights in flight.
// The W warps of a block share the rows and split K; their sums are added in warp order through
// shared memory (deterministic), then warp 0 runs the epilogue (1/s, bias, residual, act(g) * u,
// the LM head's argmax), as mmq.cu's.
//
// mmqs_tT (T = 8 or 16 tokens): segments, mode, act, accumulate and amax as mmq_bnBN; more than T
// tokens in groups of T (one block per weight tile and group). K is split over CTAs only within a
// thread-block cluster (sm_90): the blocks' sums meet in distributed shared memory, in rank order,
// with no scratch, fence or counter in global memory (mmq.cu's split pays those, which at these few
// rows cost more than the split gains). Requirements (checked on the host): K % 64 == 0 (K-quants:
// K % 256 == 0).
#include "common.cuh"
#include "mma.cuh"
#include "cluster.cuh"

#define MMQS_MAXW 8          // warps per block (they split K)
#define MMQS_ITEMS 4         // 64-column items of one 16-row tile a warp loads before using them
#define MMQS_REC 528         // mmq.cu MMQ_REC: bytes per (token, 128-column chunk) prep record

// items a warp keeps in flight per type: fewer where one item's registers are many (Q5_K: its fifth
// bits; Q3_K: four words and its scale bytes; the I-quants with a second index or sign word), so
// that the loop does not spill
__host__ __device__ constexpr int mmqs_items(int qt) {
    return qt == QT_Q5_K || qt == QT_Q3_K || qt == QT_IQ2_XXS || qt == QT_IQ2_XS || qt == QT_IQ2_S || qt == QT_IQ3_S
               ? 2 : MMQS_ITEMS;
}

// ------------------------------------------------------------------ weights -> A fragments
// Per type: Raw holds the registers of one item for rows gid (r = 0) and gid + 8 (r = 1); load()
// fills it; unit() decodes unit e (0, 1) of the item: the A fragments of its two k16 steps, the
// scale of each row and step, and each row's min (w = scale q + min; 0 for types without one).
template <int QT> struct Mqs;

// A fragments of one step from the rows' four values (q + offset in the bytes of v0, v1)
__device__ __forceinline__ void mmqs_frag(u32 (&a)[4], u32 v0, u32 v1, u32 off2) {
    a[0] = mmq_pair<0>(v0, off2);
    a[1] = mmq_pair<0>(v1, off2);
    a[2] = mmq_pair<1>(v0, off2);
    a[3] = mmq_pair<1>(v1, off2);
}

// Q4_K: {d, dmin, scales[12], qs[128]}; item i: qs bytes 32 (i & 3) .. + 31 of block i >> 2, byte
// c holding column c of unit 2 (i & 3) (low nibble) and of unit 2 (i & 3) + 1 (high nibble)
template <> struct Mqs<QT_Q4_K> {
    static constexpr bool MIN = true, HALF = false;
    struct Raw {
        u32 q[2][2];     // [row][step]: qs words at 4 tig and 16 + 4 tig
        uint4 h[2];      // the block headers
    };
    static __device__ __forceinline__ void load(const u8* r0, const u8* r1, int i, int, int tig, Raw& w) {
        const u8* rows[2] = {r0, r1};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u8* b = rows[r] + (i >> 2) * 144;
            w.h[r] = __ldg((const uint4*)b);
            w.q[r][0] = __ldg((const u32*)(b + 16 + 32 * (i & 3) + 4 * tig));
            w.q[r][1] = __ldg((const u32*)(b + 32 + 32 * (i & 3) + 4 * tig));
        }
    }
    static __device__ __forceinline__ void unit(const Raw& w, int i, int e, int, u32 (&a)[2][4], float (&d)[2][2],
                                                float (&mn)[2]) {
        const u32 M4 = 0x0F0F0F0Fu, off = mmq_off2(0);
#pragma unroll
        for (int s = 0; s < 2; ++s)
            mmqs_frag(a[s], (w.q[0][s] >> (4 * e)) & M4, (w.q[1][s] >> (4 * e)) & M4, off);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int sc, m;
            scale_min_k4w(2 * (i & 3) + e, w.h[r].y, w.h[r].z, w.h[r].w, sc, m);
            d[r][0] = d[r][1] = h2f((u16)(w.h[r].x & 0xFFFF)) * sc;
            mn[r] = -h2f((u16)(w.h[r].x >> 16)) * m;
        }
    }
};

// Q6_K (device layout, common.cuh q6k_unit): per unit 16 low-nibble bytes, 8 high-part bytes and
// two int8 scales (columns 0..15, 16..31) in a 208-byte block of 8 units; the blocks' d after them
template <> struct Mqs<QT_Q6_K> {
    static constexpr bool MIN = false, HALF = true;
    struct Raw {
        u32 lo[2][2];    // [row][unit]: low-nibble word at 4 tig
        uint2 hi[2][2];  // the unit's high parts
        u32 sc[2][2];    // the unit's two scales
        u32 d[2];        // the block's d
    };
    static __device__ __forceinline__ void load(const u8* r0, const u8* r1, int i, int nu, int tig, Raw& w) {
        const u8* rows[2] = {r0, r1};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u8* b = rows[r] + (i >> 2) * 208;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = 2 * (i & 3) + e;
                w.lo[r][e] = __ldg((const u32*)(b + 16 * j + 4 * tig));
                w.hi[r][e] = __ldg((const uint2*)(b + 128 + 8 * j));
                w.sc[r][e] = ld16(b + 192 + 2 * j);
            }
            w.d[r] = ld16(rows[r] + 26 * nu + 2 * (i >> 2));
        }
    }
    static __device__ __forceinline__ void unit(const Raw& w, int, int e, int tig, u32 (&a)[2][4], float (&d)[2][2],
                                                float (&mn)[2]) {
        const u32 M4 = 0x0F0F0F0Fu, H = 0x30303030u, off = mmq_off2(32);
        u32 v[2][2];     // [row][step]: the high parts of columns 4 tig + k sit at bits 2 tig of hi's bytes
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            v[r][0] = (w.lo[r][e] & M4) | (((w.hi[r][e].x >> (2 * tig)) << 4) & H);
            v[r][1] = ((w.lo[r][e] >> 4) & M4) | (((w.hi[r][e].y >> (2 * tig)) << 4) & H);
            const float dd = h2f((u16)w.d[r]);
            d[r][0] = dd * (float)(i8)(w.sc[r][e] & 255);
            d[r][1] = dd * (float)(i8)(w.sc[r][e] >> 8);
            mn[r] = 0.0f;
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) mmqs_frag(a[s], v[0][s], v[1][s], off);
    }
};

// Q8_0 (device layout: 32 int8 per unit, then the d values); signed bytes flipped to q + 128
template <> struct Mqs<QT_Q8_0> {
    static constexpr bool MIN = false, HALF = false;
    struct Raw {
        u32 q[2][2][2];  // [row][unit][step]
        u32 d[2][2];
    };
    static __device__ __forceinline__ void load(const u8* r0, const u8* r1, int i, int nu, int tig, Raw& w) {
        const u8* rows[2] = {r0, r1};
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int u = 2 * i + e;
                w.q[r][e][0] = __ldg((const u32*)(rows[r] + 32 * u + 4 * tig));
                w.q[r][e][1] = __ldg((const u32*)(rows[r] + 32 * u + 16 + 4 * tig));
                w.d[r][e] = ld16(rows[r] + 32 * nu + 2 * u);
            }
    }
    static __device__ __forceinline__ void unit(const Raw& w, int, int e, int, u32 (&a)[2][4], float (&d)[2][2],
                                                float (&mn)[2]) {
        const u32 F = 0x80808080u, off = mmq_off2(128);
#pragma unroll
        for (int s = 0; s < 2; ++s) mmqs_frag(a[s], w.q[0][e][s] ^ F, w.q[1][e][s] ^ F, off);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            d[r][0] = d[r][1] = h2f((u16)w.d[r][e]);
            mn[r] = 0.0f;
        }
    }
};

// Q5_0 (device layout, common.cuh q5_0_unit): per unit 16 quant bytes (byte 4k + c: column 4k + c in
// the low nibble, 16 + 4k + c in the high one), then the regrouped fifth bits, then the d values
template <> struct Mqs<QT_Q5_0> {
    static constexpr bool MIN = false, HALF = false;
    struct Raw {
        u32 x[2][2];     // [row][unit]: quant word at 4 tig
        u32 qh[2][2];
        u32 d[2][2];
    };
    static __device__ __forceinline__ void load(const u8* r0, const u8* r1, int i, int nu, int tig, Raw& w) {
        const u8* rows[2] = {r0, r1};
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int u = 2 * i + e;
                w.x[r][e] = __ldg((const u32*)(rows[r] + 16 * u + 4 * tig));
                w.qh[r][e] = __ldg((const u32*)(rows[r] + 16 * nu + 4 * u));
                w.d[r][e] = ld16(rows[r] + 20 * nu + 2 * u);
            }
    }
    static __device__ __forceinline__ void unit(const Raw& w, int, int e, int tig, u32 (&a)[2][4], float (&d)[2][2],
                                                float (&mn)[2]) {
        const u32 M4 = 0x0F0F0F0Fu, B4 = 0x10101010u, off = mmq_off2(16);
        u32 v[2][2];     // q5_0_bits<0> for i = tig: the fifth bits of columns 4 tig + k at bit tig of qh's bytes
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            v[r][0] = (w.x[r][e] & M4) | ((w.qh[r][e] << (4 - tig)) & B4);
            v[r][1] = ((w.x[r][e] >> 4) & M4) | ((w.qh[r][e] >> tig) & B4);
            d[r][0] = d[r][1] = h2f((u16)w.d[r][e]);
            mn[r] = 0.0f;
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) mmqs_frag(a[s], v[0][s], v[1][s], off);
    }
};

// Q5_K: {d, dmin, scales[12], qh[32], qs[128]}; items as Q4_K's (qs at byte 48), plus the qh words
// at 4 tig and 16 + 4 tig, whose bit j is the fifth bit of those columns of block unit j
template <> struct Mqs<QT_Q5_K> {
    static constexpr bool MIN = true, HALF = false;
    struct Raw {
        u32 q[2][2];     // [row][step]: qs words at 4 tig and 16 + 4 tig
        u32 qh[2][2];    // [row][step]: qh words at the same columns
        uint4 h[2];      // the block headers
    };
    static __device__ __forceinline__ void load(const u8* r0, const u8* r1, int i, int, int tig, Raw& w) {
        const u8* rows[2] = {r0, r1};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u8* b = rows[r] + (i >> 2) * 176;
            w.h[r] = __ldg((const uint4*)b);
            w.qh[r][0] = __ldg((const u32*)(b + 16 + 4 * tig));
            w.qh[r][1] = __ldg((const u32*)(b + 32 + 4 * tig));
            w.q[r][0] = __ldg((const u32*)(b + 48 + 32 * (i & 3) + 4 * tig));
            w.q[r][1] = __ldg((const u32*)(b + 64 + 32 * (i & 3) + 4 * tig));
        }
    }
    static __device__ __forceinline__ void unit(const Raw& w, int i, int e, int, u32 (&a)[2][4], float (&d)[2][2],
                                                float (&mn)[2]) {
        const u32 M4 = 0x0F0F0F0Fu, B1 = 0x01010101u, off = mmq_off2(0);
        const int j = 2 * (i & 3) + e;                    // the unit within its block
#pragma unroll
        for (int s = 0; s < 2; ++s)
            mmqs_frag(a[s], ((w.q[0][s] >> (4 * e)) & M4) | (((w.qh[0][s] >> j) & B1) << 4),
                      ((w.q[1][s] >> (4 * e)) & M4) | (((w.qh[1][s] >> j) & B1) << 4), off);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int sc, m;
            scale_min_k4w(j, w.h[r].y, w.h[r].z, w.h[r].w, sc, m);
            d[r][0] = d[r][1] = h2f((u16)(w.h[r].x & 0xFFFF)) * sc;
            mn[r] = -h2f((u16)(w.h[r].x >> 16)) * m;
        }
    }
};

// Q5_1: GGUF's {d, m, qh, qs[16]} (24 bytes): the quant word at 4 tig holds columns 4 tig + k (low
// nibbles) and 16 + 4 tig + k (high); qh bit j is the fifth bit of column j; w = d q + m
template <> struct Mqs<QT_Q5_1> {
    static constexpr bool MIN = true, HALF = false;
    struct Raw {
        u32 x[2][2];     // [row][unit]: quant word at 4 tig
        u32 qh[2][2];
        u32 dm[2][2];    // d | m << 16
    };
    static __device__ __forceinline__ void load(const u8* r0, const u8* r1, int i, int, int tig, Raw& w) {
        const u8* rows[2] = {r0, r1};
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u8* b = rows[r] + 24 * (2 * i + e);
                w.dm[r][e] = __ldg((const u32*)b);
                w.qh[r][e] = __ldg((const u32*)(b + 4));
                w.x[r][e] = __ldg((const u32*)(b + 8 + 4 * tig));
            }
    }
    static __device__ __forceinline__ void unit(const Raw& w, int, int e, int tig, u32 (&a)[2][4], float (&d)[2][2],
                                                float (&mn)[2]) {
        const u32 M4 = 0x0F0F0F0Fu, off = mmq_off2(0);
        u32 v[2][2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            v[r][0] = (w.x[r][e] & M4) | (u32)bits_to_b4(w.qh[r][e] >> (4 * tig));
            v[r][1] = ((w.x[r][e] >> 4) & M4) | (u32)bits_to_b4(w.qh[r][e] >> (16 + 4 * tig));
            d[r][0] = d[r][1] = h2f((u16)(w.dm[r][e] & 0xFFFF));
            mn[r] = h2f((u16)(w.dm[r][e] >> 16));
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) mmqs_frag(a[s], v[0][s], v[1][s], off);
    }
};

// The types of lowbit.cuh (Q3_K, the I-quants, MXFP4): each thread's two words of a unit from
// lt_load / lt_decode (values b = q + OFF, a scale per half unit, no min)
template <int QT> struct MqsLow {
    static constexpr bool MIN = false, HALF = QT == QT_Q3_K || QT == QT_IQ2_XS || QT == QT_IQ2_S;
    struct Raw {
        LRaw l[2][2];    // [row][unit]
    };
    static __device__ __forceinline__ void load(const u8* r0, const u8* r1, int i, int nu, int tig, Raw& w) {
        const u8* rows[2] = {r0, r1};
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e) lt_load<QT>(rows[r], 2 * i + e, nu, tig, w.l[r][e]);
    }
    static __device__ __forceinline__ void unit(const Raw& w, int i, int e, int tig, u32 (&a)[2][4], float (&d)[2][2],
                                                float (&mn)[2]) {
        u32 v[2][2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            lt_decode<QT>(w.l[r][e], 2 * i + e, tig, v[r][0], v[r][1], d[r][0], d[r][1]);
            mn[r] = 0.0f;
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) mmqs_frag(a[s], v[0][s], v[1][s], mmq_off2(lowbit_off(QT)));
    }
};
template <> struct Mqs<QT_Q3_K> : MqsLow<QT_Q3_K> {};
template <> struct Mqs<QT_IQ4_NL> : MqsLow<QT_IQ4_NL> {};
template <> struct Mqs<QT_IQ4_XS> : MqsLow<QT_IQ4_XS> {};
template <> struct Mqs<QT_MXFP4> : MqsLow<QT_MXFP4> {};
template <> struct Mqs<QT_IQ2_XXS> : MqsLow<QT_IQ2_XXS> {};
template <> struct Mqs<QT_IQ2_XS> : MqsLow<QT_IQ2_XS> {};
template <> struct Mqs<QT_IQ2_S> : MqsLow<QT_IQ2_S> {};
template <> struct Mqs<QT_IQ3_XXS> : MqsLow<QT_IQ3_XXS> {};
template <> struct Mqs<QT_IQ3_S> : MqsLow<QT_IQ3_S> {};

// ------------------------------------------------------------------ the K loop
// acc[m][n] += the items w, w + W, ... of the MT 16-row tiles (rows[m]: the rows gid and gid + 8
// of tile m) for the token tiles n (xr[n]: this thread's B-fragment token's prep records; sr[n][j]:
// the records of tokens 8 n + 2 tig + j, for the unit sums).
template <int QT, int MT, int NT>
__device__ __forceinline__ void mmqs_k(const u8* const (&rows)[MT][2], int nu, int w, int W, int tig,
                                       const u8* const (&xr)[NT], const u8* const (&sr)[NT][2],
                                       float (&acc)[MT][NT][4]) {
    using T = Mqs<QT>;
    constexpr int IT = mmqs_items(QT), P = IT / (MT * NT) > 0 ? IT / (MT * NT) : 1;
    const int nit = nu >> 1;
#pragma unroll 1
    for (int i0 = w; i0 < nit; i0 += P * W) {
        typename T::Raw raw[P][MT];
#pragma unroll
        for (int p = 0; p < P; ++p)
            if (i0 + p * W < nit)
#pragma unroll
                for (int m = 0; m < MT; ++m) T::load(rows[m][0], rows[m][1], i0 + p * W, nu, tig, raw[p][m]);
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int i = i0 + p * W;
            if (i >= nit) break;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int u = 2 * i + e, ro = (u >> 2) * MMQS_REC + (u & 3) * 128;
                uint4 bh[NT], bl[NT];
                float sx[NT][2];
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    bh[n] = __ldg((const uint4*)(xr[n] + ro + 16 * tig));
                    bl[n] = __ldg((const uint4*)(xr[n] + ro + 64 + 16 * tig));
                    if (T::MIN) {
                        const int so = (u >> 2) * MMQS_REC + 512 + 4 * (u & 3);
                        sx[n][0] = __ldg((const float*)(sr[n][0] + so));
                        sx[n][1] = __ldg((const float*)(sr[n][1] + so));
                    }
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    u32 a[2][4];
                    float d[2][2], mn[2];
                    T::unit(raw[p][m], i, e, tig, a, d, mn);
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        float* c = acc[m][n];
                        if (!T::HALF) {
                            float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                            mmq_mma(t, a[0], bh[n].x, bh[n].y);
                            mmq_mma(t, a[0], bl[n].x, bl[n].y);
                            mmq_mma(t, a[1], bh[n].z, bh[n].w);
                            mmq_mma(t, a[1], bl[n].z, bl[n].w);
                            c[0] = fmaf(t[0], d[0][0], c[0]);
                            c[1] = fmaf(t[1], d[0][0], c[1]);
                            c[2] = fmaf(t[2], d[1][0], c[2]);
                            c[3] = fmaf(t[3], d[1][0], c[3]);
                        } else {
#pragma unroll
                            for (int s = 0; s < 2; ++s) {
                                float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                                mmq_mma(t, a[s], s ? bh[n].z : bh[n].x, s ? bh[n].w : bh[n].y);
                                mmq_mma(t, a[s], s ? bl[n].z : bl[n].x, s ? bl[n].w : bl[n].y);
                                c[0] = fmaf(t[0], d[0][s], c[0]);
                                c[1] = fmaf(t[1], d[0][s], c[1]);
                                c[2] = fmaf(t[2], d[1][s], c[2]);
                                c[3] = fmaf(t[3], d[1][s], c[3]);
                            }
                        }
                        if (T::MIN) {
                            c[0] = fmaf(mn[0], sx[n][0], c[0]);
                            c[1] = fmaf(mn[0], sx[n][1], c[1]);
                            c[2] = fmaf(mn[1], sx[n][0], c[2]);
                            c[3] = fmaf(mn[1], sx[n][1], c[3]);
                        }
                    }
                }
            }
        }
    }
}

// ------------------------------------------------------------------ the kernel
template <int MT, int NT>
__device__ __forceinline__ void mmqs_run(int qt, const u8* const (&rows)[MT][2], int nu, int w, int W, int tig,
                                         const u8* const (&xr)[NT], const u8* const (&sr)[NT][2],
                                         float (&acc)[MT][NT][4]) {
    bool known = false;
#define MMQS_CASE(Q) case Q: if constexpr (QT_ON(Q)) { mmqs_k<Q, MT, NT>(rows, nu, w, W, tig, xr, sr, acc); known = true; } break;
    switch (qt) {
        MMQS_CASE(QT_Q4_K)
        MMQS_CASE(QT_Q6_K)
        MMQS_CASE(QT_Q8_0)
        MMQS_CASE(QT_Q5_0)
        MMQS_CASE(QT_Q5_K)
        MMQS_CASE(QT_Q5_1)
        MMQS_CASE(QT_Q3_K)
        MMQS_CASE(QT_IQ4_NL)
        MMQS_CASE(QT_IQ4_XS)
        MMQS_CASE(QT_MXFP4)
        MMQS_CASE(QT_IQ2_XXS)
        MMQS_CASE(QT_IQ2_XS)
        MMQS_CASE(QT_IQ2_S)
        MMQS_CASE(QT_IQ3_XXS)
        MMQS_CASE(QT_IQ3_S)
        default: break;
    }
#undef MMQS_CASE
    if (!known) mmq_fill_nan(acc);
}

// warps 1.. W-1 hand their sums to warp 0, which adds them in warp order; then, in a cluster of C
// blocks (which split K between them), blocks 1.. C-1 hand theirs to block 0 through distributed
// shared memory, added in rank order. True for warp 0 of block 0, which holds the total.
template <int E>
__device__ __forceinline__ bool mmqs_reduce(float (&v)[E], int w, int W, int lane, int rank, int C) {
    __shared__ float red[MMQS_MAXW - 1][E][32];
    if (w > 0)
#pragma unroll
        for (int j = 0; j < E; ++j) red[w - 1][j][lane] = v[j];
    __syncthreads();
    if (w == 0)
        for (int k = 1; k < W; ++k)
#pragma unroll
            for (int j = 0; j < E; ++j) v[j] += red[k - 1][j][lane];
    if (C > 1) {
        __syncthreads();                          // warp 0 is done reading red
        if (w == 0 && rank > 0)
#pragma unroll
            for (int j = 0; j < E; ++j) red[0][j][lane] = v[j];
        cluster_sync();
        if (w == 0 && rank == 0)
            for (int r = 1; r < C; ++r)
#pragma unroll
                for (int j = 0; j < E; ++j) v[j] += cluster_ld(&red[0][j][lane], (unsigned)r);
        cluster_sync();                           // a block's shared memory outlives its readers
    }
    return w == 0 && rank == 0;
}

template <int NT>
__device__ __forceinline__ void mmqs_body(const MmqSeg (&seg)[3], int K, const u8* __restrict__ xp, long long xps,
                                          const float* __restrict__ inv, int M, int mode, int act, int accumulate, int tile,
                                          unsigned long long* amax, int rank, int C) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, W = blockDim.x >> 5;
    const int wk = rank * W + w, WK = C * W;      // this warp's share of K among the cluster's warps
    const int gid = lane >> 2, tig = lane & 3, nu = K >> 5;
    int lt = tile, si = 0;
    if (!mode) {
        const int t0 = (seg[0].n + 15) >> 4, t1 = (seg[1].n + 15) >> 4;
        if (lt >= t0) {
            lt -= t0;
            si = 1;
            if (lt >= t1) {
                lt -= t1;
                si = 2;
            }
        }
    }
    const MmqSeg S = si == 0 ? seg[0] : (si == 1 ? seg[1] : seg[2]);
    const int r0 = 16 * lt;
    // token rows past M repeat the last one: their columns of C are never stored
    const u8* xr[NT];
    const u8* sr[NT][2];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        xr[n] = xp + (long long)min(8 * n + gid, M - 1) * xps;
        sr[n][0] = xp + (long long)min(8 * n + 2 * tig, M - 1) * xps;
        sr[n][1] = xp + (long long)min(8 * n + 2 * tig + 1, M - 1) * xps;
    }
    pdl_wait();

    if (mode) {
        // fused FFN: tile 0 the gate's rows r0.., tile 1 the same rows of up (same type and shape)
        const int F = seg[0].n;
        const u8* const rows[2][2] = {
            {seg[0].W + (long long)min(r0 + gid, F - 1) * seg[0].rb, seg[0].W + (long long)min(r0 + gid + 8, F - 1) * seg[0].rb},
            {seg[1].W + (long long)min(r0 + gid, F - 1) * seg[1].rb, seg[1].W + (long long)min(r0 + gid + 8, F - 1) * seg[1].rb}};
        float acc[2][NT][4] = {};
        mmqs_run<2, NT>(seg[0].qt, rows, nu, wk, WK, tig, xr, sr, acc);
        pdl_trigger();
        if (!mmqs_reduce<2 * NT * 4>(reinterpret_cast<float (&)[2 * NT * 4]>(acc), w, W, lane, rank, C)) return;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = r0 + gid + 8 * (j >> 1), t = 8 * n + 2 * tig + (j & 1);
                if (r < F && t < M)
                    seg[0].y[(long long)t * seg[0].ys + r] = act_f(acc[0][n][j] * inv[t], act) * (acc[1][n][j] * inv[t]);
            }
        return;
    }

    const u8* const rows[1][2] = {{S.W + (long long)min(r0 + gid, S.n - 1) * S.rb,
                                   S.W + (long long)min(r0 + gid + 8, S.n - 1) * S.rb}};
    float acc[1][NT][4] = {};
    mmqs_run<1, NT>(S.qt, rows, nu, wk, WK, tig, xr, sr, acc);
    pdl_trigger();
    if (!mmqs_reduce<NT * 4>(reinterpret_cast<float (&)[NT * 4]>(acc), w, W, lane, rank, C)) return;
    unsigned long long best[NT][2];          // argmax keys of this thread's tokens (amax)
#pragma unroll
    for (int n = 0; n < NT; ++n) best[n][0] = best[n][1] = 0ull;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = r0 + gid + 8 * (j >> 1), t = 8 * n + 2 * tig + (j & 1);
            if (r < S.n && t < M) {
                const float v = acc[0][n][j] * inv[t] + (S.bias ? S.bias[r] : 0.0f);
                float* out = S.y + (long long)t * S.ys + r;
                *out = accumulate ? *out + v : v;
                if (amax) {
                    const unsigned long long k = argmax_key(v, r);
                    best[n][j & 1] = k > best[n][j & 1] ? k : best[n][j & 1];
                }
            }
        }
    if (amax)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                unsigned long long b = best[n][j];
#pragma unroll
                for (int o = 4; o < 32; o <<= 1) {       // over the rows (gid) of the tile
                    const unsigned long long x = __shfl_xor_sync(0xffffffffu, b, o);
                    b = x > b ? x : b;
                }
                const int t = 8 * n + 2 * tig + j;
                if (gid == 0 && t < M && b) atomicMax(amax + t, b);
            }
}

// groups: token groups of T tokens (M > T: tokens g T .. g T + T - 1 of group g), the fastest-varying
// part of the block index after the cluster rank, so that the blocks sharing a weight tile run
// together (through L2). A cluster of C blocks (launched with a cluster size: pdl.py) splits one
// weight tile's K, for matrices with too few tiles to fill the GPU.
#define DEFINE_MMQS(T)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * MMQS_MAXW, 2) mmqs_t##T(                            \
        const u8* W0, long long rb0, int n0, int qt0, const float* b0, float* y0, int ys0,                \
        const u8* W1, long long rb1, int n1, int qt1, const float* b1, float* y1, int ys1,                \
        const u8* W2, long long rb2, int n2, int qt2, const float* b2, float* y2, int ys2,                \
        int K, const u8* xp, long long xps, const float* inv, int M, int mode, int act, int accumulate,   \
        unsigned long long* amax, int groups) {                                                           \
        const uint2 cl = cluster_place();                                                                 \
        const int C = (int)cl.y, b = blockIdx.x / C;                                                      \
        const int g = b % groups, t0 = g * T;                                                             \
        const MmqSeg seg[3] = {{W0, rb0, n0, qt0, b0, y0 + (long long)t0 * ys0, ys0},                    \
                                {W1, rb1, n1, qt1, b1, y1 + (long long)t0 * ys1, ys1},                    \
                                {W2, rb2, n2, qt2, b2, y2 + (long long)t0 * ys2, ys2}};                   \
        mmqs_body<T / 8>(seg, K, xp + t0 * xps, xps, inv + t0, min(T, M - t0), mode, act, accumulate,     \
                         b / groups, amax ? amax + t0 : amax, (int)cl.x, C);                              \
    }
DEFINE_MMQS(8)
DEFINE_MMQS(16)
