// Batched decode of small batches (2 to 16 rows) on the tensor cores (backends/cuda/mmq.py picks it
// when every matrix of a projection has one of its types): y[t, r] = W[r] . h[t], with mmq.cu's
// numerics (the same prep records from mmq_prep: row-scaled fp16 hi/lo halves and unit sums; exact
// products summed in fp32 per 32-column unit, sub-block scales and mins applied by fp32 FMAs). What
// differs is the data path: the weights go from global memory straight into the mma A fragments,
// with no shared-memory tile and no barrier in the K loop, so the hot loop is a few hundred
// instructions. mmq.cu's block-wide tile pipeline is bound by instruction fetch at small M
// (perf-notes v17), and the GEMVs (mmvf.cu) pay per activation row for every weight.
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
// mmqs_tT (T = 8 or 16 tokens): segments, mode, act, accumulate and amax as mmq_bnBN; no K split
// over CTAs. Requirements (checked on the host): M <= T, K % 64 == 0 (K-quants: K % 256 == 0).
#include "common.cuh"
#include "mma.cuh"

#define MMQS_MAXW 8          // warps per block (they split K)
#define MMQS_ITEMS 4         // 64-column items of one 16-row tile a warp loads before using them
#define MMQS_REC 528         // mmq.cu MMQ_REC: bytes per (token, 128-column chunk) prep record

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

// ------------------------------------------------------------------ activations -> B fragments
// Where a step's activations come from: prep records (mmq_prep: scaled per row, 1/s applied in the
// epilogue) or, for inputs that only a few blocks read, the fp32 rows themselves (x, times the norm
// weight nw when given): each unit is scaled by its own power of two (max |v| in [2^14, 2^15), as
// mmq_prep's row scale: exact) and split into fp16 hi/lo halves in registers, so no prep launch
// runs before the projection. The norm's 1/rms is a per-token factor of the result: the squares are
// summed along the way and applied in the epilogue.
struct MmqsIn {
    const u8* rec;          // prep records (x == nullptr)
    long long rs;           // their row stride, bytes
    const float* x;         // fp32 rows (row stride xs floats), or nullptr
    int xs;
    const float* nw;        // x's norm weight, or nullptr
};

// unit u of this thread's B-fragment token (row pointer xr / record rr) as hi/lo fragments bh, bl;
// iv: the token's 1/scale of this unit (records: 1), sm: the unit's sum (records: their unit sum),
// ss += the squares of the thread's eight raw values
template <bool F32>
__device__ __forceinline__ void mmqs_b(const MmqsIn& in, const u8* rr, const float* xr, int u, int tig,
                                       const float (&nv)[8], uint4& bh, uint4& bl, float& iv, float& sm, float& ss) {
    if (!F32) {
        const int ro = (u >> 2) * MMQS_REC + (u & 3) * 128;
        bh = __ldg((const uint4*)(rr + ro + 16 * tig));
        bl = __ldg((const uint4*)(rr + ro + 64 + 16 * tig));
        sm = __ldg((const float*)(rr + (u >> 2) * MMQS_REC + 512 + 4 * (u & 3)));
        iv = 1.0f;
        return;
    }
    const float4 a = __ldg((const float4*)(xr + 32 * u + 4 * tig)), b = __ldg((const float4*)(xr + 32 * u + 16 + 4 * tig));
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    float m = 0.0f, t = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        ss = fmaf(v[j], v[j], ss);
        v[j] *= nv[j];
        m = fmaxf(m, fabsf(v[j]));
        t += v[j];
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    t += __shfl_xor_sync(0xffffffffu, t, 1);
    t += __shfl_xor_sync(0xffffffffu, t, 2);
    sm = t;
    const float sc = row_scale(m, iv);
    u32 h[4], l[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float x0 = v[2 * j] * sc, x1 = v[2 * j + 1] * sc;
        const u16 h0 = f2h(x0), h1 = f2h(x1);
        h[j] = h0 | ((u32)h1 << 16);
        l[j] = f2h(x0 - h2f(h0)) | ((u32)f2h(x1 - h2f(h1)) << 16);
    }
    bh = make_uint4(h[0], h[1], h[2], h[3]);
    bl = make_uint4(l[0], l[1], l[2], l[3]);
}

// ------------------------------------------------------------------ the K loop
// acc[m][n] += the items w, w + W, ... of the MT 16-row tiles (rows[m]: the rows gid and gid + 8
// of tile m) for the token tiles n: tk[n] is this thread's B-fragment token, tc[n][j] the token of
// its C columns j (8 n + 2 tig + j), both clamped to M - 1; ss[n]: the squares of token tk[n]'s
// values this thread read (F32 only).
template <int QT, int MT, int NT, bool F32>
__device__ __forceinline__ void mmqs_k(const u8* const (&rows)[MT][2], int nu, int w, int W, int tig, const MmqsIn& in,
                                       const int (&tk)[NT], const int (&tc)[NT][2], float (&acc)[MT][NT][4],
                                       float (&ss)[NT]) {
    using T = Mqs<QT>;
    constexpr int P = MMQS_ITEMS / (MT * NT) > 0 ? MMQS_ITEMS / (MT * NT) : 1;
    const int nit = nu >> 1;
    const u8* rr[NT];
    const float* xr[NT];
    const u8* sr[NT][2];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        rr[n] = in.rec + (long long)tk[n] * in.rs;
        xr[n] = in.x + (long long)tk[n] * in.xs;
        sr[n][0] = in.rec + (long long)tc[n][0] * in.rs;
        sr[n][1] = in.rec + (long long)tc[n][1] * in.rs;
    }
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
                const int u = 2 * i + e;
                float nv[8] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
                if (F32 && in.nw) {
                    const float4 a = __ldg((const float4*)(in.nw + 32 * u + 4 * tig));
                    const float4 b = __ldg((const float4*)(in.nw + 32 * u + 16 + 4 * tig));
                    nv[0] = a.x; nv[1] = a.y; nv[2] = a.z; nv[3] = a.w;
                    nv[4] = b.x; nv[5] = b.y; nv[6] = b.z; nv[7] = b.w;
                }
                uint4 bh[NT], bl[NT];
                float sx[NT][2], iv[NT][2];
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    float ivb, smb;
                    mmqs_b<F32>(in, rr[n], xr[n], u, tig, nv, bh[n], bl[n], ivb, smb, ss[n]);
                    if (F32) {     // the C columns' tokens are those of the B fragments of quads 2 tig, 2 tig + 1
                        iv[n][0] = __shfl_sync(0xffffffffu, ivb, 8 * tig);
                        iv[n][1] = __shfl_sync(0xffffffffu, ivb, 8 * tig + 4);
                        if (T::MIN) {
                            sx[n][0] = __shfl_sync(0xffffffffu, smb, 8 * tig);
                            sx[n][1] = __shfl_sync(0xffffffffu, smb, 8 * tig + 4);
                        }
                    } else {
                        iv[n][0] = iv[n][1] = 1.0f;
                        if (T::MIN) {
                            const int so = (u >> 2) * MMQS_REC + 512 + 4 * (u & 3);
                            sx[n][0] = __ldg((const float*)(sr[n][0] + so));
                            sx[n][1] = __ldg((const float*)(sr[n][1] + so));
                        }
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
                            c[0] = fmaf(t[0], d[0][0] * iv[n][0], c[0]);
                            c[1] = fmaf(t[1], d[0][0] * iv[n][1], c[1]);
                            c[2] = fmaf(t[2], d[1][0] * iv[n][0], c[2]);
                            c[3] = fmaf(t[3], d[1][0] * iv[n][1], c[3]);
                        } else {
#pragma unroll
                            for (int s = 0; s < 2; ++s) {
                                float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                                mmq_mma(t, a[s], s ? bh[n].z : bh[n].x, s ? bh[n].w : bh[n].y);
                                mmq_mma(t, a[s], s ? bl[n].z : bl[n].x, s ? bl[n].w : bl[n].y);
                                c[0] = fmaf(t[0], d[0][s] * iv[n][0], c[0]);
                                c[1] = fmaf(t[1], d[0][s] * iv[n][1], c[1]);
                                c[2] = fmaf(t[2], d[1][s] * iv[n][0], c[2]);
                                c[3] = fmaf(t[3], d[1][s] * iv[n][1], c[3]);
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
struct MmqsSeg {
    const u8* W;
    long long rb;
    int n, qt;
    const float* bias;
    float* y;
    int ys;
};

template <int MT, int NT>
__device__ __forceinline__ void mmqs_run(int qt, const u8* const (&rows)[MT][2], int nu, int w, int W, int tig,
                                         const MmqsIn& in, const int (&tk)[NT], const int (&tc)[NT][2],
                                         float (&acc)[MT][NT][4], float (&ss)[NT]) {
    bool known = false;
#define MMQS_CASE(Q)                                                                   \
    case Q:                                                                            \
        if constexpr (QT_ON(Q)) {                                                      \
            if (in.x) mmqs_k<Q, MT, NT, true>(rows, nu, w, W, tig, in, tk, tc, acc, ss);  \
            else mmqs_k<Q, MT, NT, false>(rows, nu, w, W, tig, in, tk, tc, acc, ss);      \
            known = true;                                                              \
        }                                                                              \
        break;
    switch (qt) {
        MMQS_CASE(QT_Q4_K)
        MMQS_CASE(QT_Q6_K)
        MMQS_CASE(QT_Q8_0)
        MMQS_CASE(QT_Q5_0)
        default: break;
    }
#undef MMQS_CASE
    if (!known)              // a type not compiled in (the host checks types): NaN rather than numbers
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[m][n][j] = __int_as_float(0x7fffffff);
}

// warps 1 .. W-1 hand their sums to warp 0, which adds them in warp order; true for warp 0
template <int E>
__device__ __forceinline__ bool mmqs_reduce(float (&v)[E], int w, int W, int lane) {
    __shared__ float red[MMQS_MAXW - 1][E][32];
    if (w > 0)
#pragma unroll
        for (int j = 0; j < E; ++j) red[w - 1][j][lane] = v[j];
    __syncthreads();
    if (w > 0) return false;
    for (int k = 1; k < W; ++k)
#pragma unroll
        for (int j = 0; j < E; ++j) v[j] += red[k - 1][j][lane];
    return true;
}

// the rows' sums and, for fp32 inputs, the squares of each token (quad-reduced first), through
// warp 0; then each C value's factor: 1/s (records) or 1/rms (fp32 rows with a norm weight) or 1
template <int MT, int NT>
__device__ __forceinline__ bool mmqs_finish(float (&acc)[MT][NT][4], float (&ss)[NT], const MmqsIn& in,
                                            const float* __restrict__ inv, int K, float eps, const int (&tc)[NT][2],
                                            int w, int W, int lane, int tig, float (&f)[NT][2]) {
    constexpr int E = MT * NT * 4;
    float v[E + NT];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) v[(m * NT + n) * 4 + j] = acc[m][n][j];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        float q = ss[n];
        q += __shfl_xor_sync(0xffffffffu, q, 1);
        q += __shfl_xor_sync(0xffffffffu, q, 2);
        v[E + n] = q;
    }
    if (!mmqs_reduce<E + NT>(v, w, W, lane)) return false;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[m][n][j] = v[(m * NT + n) * 4 + j];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const float r = in.x && in.nw ? rsqrtf(v[E + n] / K + eps) : 1.0f;    // of token tk[n] (quad gid)
        const float r0 = __shfl_sync(0xffffffffu, r, 8 * tig), r1 = __shfl_sync(0xffffffffu, r, 8 * tig + 4);
        f[n][0] = in.x ? r0 : inv[tc[n][0]];
        f[n][1] = in.x ? r1 : inv[tc[n][1]];
    }
    return true;
}

template <int NT>
__device__ __forceinline__ void mmqs_body(const MmqsSeg (&seg)[3], int K, const MmqsIn& in,
                                          const float* __restrict__ inv, float eps, int M, int mode, int act,
                                          int accumulate, unsigned long long* amax) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, W = blockDim.x >> 5;
    const int gid = lane >> 2, tig = lane & 3, nu = K >> 5;
    int lt = blockIdx.x, si = 0;
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
    const MmqsSeg S = si == 0 ? seg[0] : (si == 1 ? seg[1] : seg[2]);
    const int r0 = 16 * lt;
    // tokens past M repeat the last one: their columns of C are never stored
    int tk[NT], tc[NT][2];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        tk[n] = min(8 * n + gid, M - 1);
        tc[n][0] = min(8 * n + 2 * tig, M - 1);
        tc[n][1] = min(8 * n + 2 * tig + 1, M - 1);
    }
    float ss[NT], f[NT][2];
#pragma unroll
    for (int n = 0; n < NT; ++n) ss[n] = 0.0f;
    pdl_wait();

    if (mode) {
        // fused FFN: tile 0 the gate's rows r0.., tile 1 the same rows of up (same type and shape)
        const int F = seg[0].n;
        const u8* const rows[2][2] = {
            {seg[0].W + (long long)min(r0 + gid, F - 1) * seg[0].rb, seg[0].W + (long long)min(r0 + gid + 8, F - 1) * seg[0].rb},
            {seg[1].W + (long long)min(r0 + gid, F - 1) * seg[1].rb, seg[1].W + (long long)min(r0 + gid + 8, F - 1) * seg[1].rb}};
        float acc[2][NT][4] = {};
        mmqs_run<2, NT>(seg[0].qt, rows, nu, w, W, tig, in, tk, tc, acc, ss);
        pdl_trigger();
        if (!mmqs_finish<2, NT>(acc, ss, in, inv, K, eps, tc, w, W, lane, tig, f)) return;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = r0 + gid + 8 * (j >> 1), t = 8 * n + 2 * tig + (j & 1);
                if (r < F && t < M)
                    seg[0].y[(long long)t * seg[0].ys + r] = act_f(acc[0][n][j] * f[n][j & 1], act) * (acc[1][n][j] * f[n][j & 1]);
            }
        return;
    }

    const u8* const rows[1][2] = {{S.W + (long long)min(r0 + gid, S.n - 1) * S.rb,
                                   S.W + (long long)min(r0 + gid + 8, S.n - 1) * S.rb}};
    float acc[1][NT][4] = {};
    mmqs_run<1, NT>(S.qt, rows, nu, w, W, tig, in, tk, tc, acc, ss);
    pdl_trigger();
    if (!mmqs_finish<1, NT>(acc, ss, in, inv, K, eps, tc, w, W, lane, tig, f)) return;
    unsigned long long best[NT][2];          // argmax keys of this thread's tokens (amax)
#pragma unroll
    for (int n = 0; n < NT; ++n) best[n][0] = best[n][1] = 0ull;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = r0 + gid + 8 * (j >> 1), t = 8 * n + 2 * tig + (j & 1);
            if (r < S.n && t < M) {
                const float v = acc[0][n][j] * f[n][j & 1] + (S.bias ? S.bias[r] : 0.0f);
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

// x != nullptr: fp32 input rows (row stride xs floats, RMSNorm weight nw or nullptr, eps), and xp,
// xps, inv unused; else the prep records xp (row stride xps bytes) and their 1/s in inv
#define DEFINE_MMQS(T)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * MMQS_MAXW, 2) mmqs_t##T(                            \
        const u8* W0, long long rb0, int n0, int qt0, const float* b0, float* y0, int ys0,                \
        const u8* W1, long long rb1, int n1, int qt1, const float* b1, float* y1, int ys1,                \
        const u8* W2, long long rb2, int n2, int qt2, const float* b2, float* y2, int ys2,                \
        int K, const u8* xp, long long xps, const float* inv, const float* x, int xs, const float* nw,    \
        float eps, int M, int mode, int act, int accumulate, unsigned long long* amax) {                  \
        const MmqsSeg seg[3] = {{W0, rb0, n0, qt0, b0, y0, ys0}, {W1, rb1, n1, qt1, b1, y1, ys1},         \
                                {W2, rb2, n2, qt2, b2, y2, ys2}};                                         \
        const MmqsIn in{xp, xps, x, xs, nw};                                                              \
        mmqs_body<T / 8>(seg, K, in, inv, eps, M, mode, act, accumulate, amax);                           \
    }
DEFINE_MMQS(8)
DEFINE_MMQS(16)
