// Sampling on the GPU: penalties, temperature, top-k, top-p, min-p and a seeded draw per row, so
// that only token ids (and logprobs where asked) go back to the host. The algorithm is the one
// backends/sampling.py defines (its NumPy twin), reproduced bit for bit: float32 operations are the
// explicitly rounded intrinsics (no contraction into FMA), the weights of tokens are 40-bit
// fixed-point integers (sums independent of order, so atomics stay deterministic), and the
// random bits come from Philox4x32-10 keyed by (seed, index of the draw in its sequence).
//
// No sort of the vocabulary: tokens are binned by d = z - max z (SAMPLE_NB bins of 1/128 nat,
// a monotone function of the token's place in the order z desc / index asc), and a row's count
// and weight per bin locate every cut (top-k, top-p, the draw) in one bin. Only the elements of
// the bins that matter are gathered into shared memory and sorted; a bin too dense for that is
// resolved by a radix select on the keys, and ties by their index order.
//
// Constrained rows (an allowed-token bitmask from a grammar, a logit bias) are penalised rows
// without counts: sample_prep writes their changed logits into zbuf (a masked-out token is -inf,
// which every later pass already treats as a token of weight 0), and the rest reads zbuf. A row
// without constraints reads neither the masks nor the biases.
//
// Three launches per step, each over the rows of the batch:
//   sample_prep      several blocks per row (rows that sample, have penalties or constraints):
//                    the row's max into rowmax (atomicMax); with penalties it first counts the
//                    newest token; with penalties or constraints it writes the changed, scaled
//                    logits into zbuf;
//   sample_hist      several blocks per row: per-bin count / weight, the min-p mass, and the
//                    pieces of the raw log-sum-exp (for logprobs);
//   sample_final     one block per row: the cuts, the draw, the outputs; it leaves the per-row
//                    scratch (histograms, rowmax, zmass) zeroed for the next step.
#include "common.cuh"

#define SAMPLE_NB 4096              // bins over d in (-32, 0]; the last one takes everything below
#define SAMPLE_SUB 256              // sub-bins of one radix-select pass (8 bits)
#define SAMPLE_PW 16                // int32 words of parameters per row

// parameter words (backends/cuda/sampling.py writes them)
#define PW_SLOT 0
#define PW_FLAGS 1
#define PW_TOPK 2                   // 0: off
#define PW_TOPP 3                   // round(top_p * 2^32) as u32 (with F_TOPP)
#define PW_INVT 4                   // float32 1 / temperature
#define PW_REP 5
#define PW_FREQ 6
#define PW_PRES 7
#define PW_MINP 8                   // float32 log(min_p) (with F_MINP)
#define PW_SEED 9                   // two words, low first
#define PW_STEP 11                  // two words, low first
#define PW_TOKIN 13                 // token fed to this step, counted as generated; -1: none
#define PW_MASK 14                  // row of the step's packed masks (with F_MASK)
#define PW_BIAS 15                  // offset of the row's bias in the step's packed biases (with F_BIAS):
                                    // [n, ids[n], float32 bits of the values[n]]

#define F_GREEDY 1
#define F_PEN 2
#define F_LP 4
#define F_TOPP 8
#define F_MINP 16
#define F_MASK 32
#define F_BIAS 64
#define F_ZBUF (F_PEN | F_MASK | F_BIAS)   // sample_prep writes the row's logits into zbuf

#define FULL_MASK 0xffffffffu

// The host test harness (tests/host/sampling_emu.cpp) runs these kernels on the CPU and provides
// dynamic shared memory its own way.
#ifndef SAMPLE_DYN_SMEM
#define SAMPLE_DYN_SMEM(name) extern __shared__ __align__(16) u64 name[]
#endif

__device__ __forceinline__ float f32_bits(u32 b) { return __uint_as_float(b); }

// ------------------------------------------------------------------ the twin's arithmetic

__device__ __forceinline__ u32 fkey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float fkey_inv(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// W = floor(exp(d) * 2^40), exp in plain float32 operations (backends/sampling.py: fx_weights)
__device__ __forceinline__ u64 fx_weight(float d) {
    if (!(d >= -30.0f)) return 0;
    float n = rintf(__fmul_rn(d, f32_bits(0x3FB8AA3Bu)));                        // log2(e)
    float r = __fsub_rn(__fsub_rn(d, __fmul_rn(n, f32_bits(0x3F318000u))),       // ln2 hi
                        __fmul_rn(n, f32_bits(0xB95E8083u)));                    // ln2 lo
    float p = f32_bits(0x3AB60B61u);
    p = __fadd_rn(__fmul_rn(p, r), f32_bits(0x3C088889u));
    p = __fadd_rn(__fmul_rn(p, r), f32_bits(0x3D2AAAABu));
    p = __fadd_rn(__fmul_rn(p, r), f32_bits(0x3E2AAAABu));
    p = __fadd_rn(__fmul_rn(p, r), f32_bits(0x3F000000u));
    p = __fadd_rn(__fmul_rn(p, r), f32_bits(0x3F800000u));
    p = __fadd_rn(__fmul_rn(p, r), f32_bits(0x3F800000u));
    float e = __fmul_rn(p, __int_as_float((127 + (int)n) << 23));                // exact: 2^n, n >= -44
    return (u64)__fmul_rn(e, 1099511627776.0f);                                  // 2^40, truncated
}

// counts: bit 0 = in the prompt, the rest = times generated
__device__ __forceinline__ float penalize(float x, int c, float rep, float freq, float pres) {
    if (c != 0) x = x > 0.0f ? __fdiv_rn(x, rep) : __fmul_rn(x, rep);
    int o = c >> 1;
    float pen = __fadd_rn(__fmul_rn(freq, (float)o), o > 0 ? pres : 0.0f);
    return __fsub_rn(x, pen);
}

__device__ __forceinline__ float make_z(float x, float inv_t) {
    float z = __fmul_rn(x, inv_t);
    if (z != z) z = -INFINITY;
    else if (z == INFINITY) z = f32_bits(0x7F7FFFFFu);
    return __fadd_rn(z, 0.0f);  // -0 -> +0: equal values share a key
}

// bin of d = z - m (d <= 0): monotone, so a key-descending order is a bin-ascending one
__device__ __forceinline__ int bin_of(float d) {
    float v = __fmul_rn(-d, 128.0f);
    return v < (float)SAMPLE_NB ? (int)v : SAMPLE_NB - 1;
}

__device__ __forceinline__ void philox4x32_10(u32 (&c)[4], u32 k0, u32 k1) {
#pragma unroll
    for (int i = 0; i < 10; ++i) {
        u32 lo0 = 0xD2511F53u * c[0], hi0 = __umulhi(0xD2511F53u, c[0]);
        u32 lo1 = 0xCD9E8D57u * c[2], hi1 = __umulhi(0xCD9E8D57u, c[2]);
        u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

// ceil(z * pfx / 2^32) for z < 2^63, pfx < 2^32
__device__ __forceinline__ u64 ceil_frac32(u64 z, u32 pfx) {
    u64 lo = z * (u64)pfx, hi = __umul64hi(z, (u64)pfx);
    u64 s = lo + 0xFFFFFFFFull;
    hi += s < lo ? 1 : 0;
    return (hi << 32) | (s >> 32);
}

struct RowIn {
    const float* x;      // raw logits of the row
    const float* z;      // penalised and scaled logits (zbuf), or null: z = make_z(x)
    float inv_t;
    float m;             // max z
};

__device__ __forceinline__ float row_z(const RowIn& R, int i) { return R.z ? R.z[i] : make_z(R.x[i], R.inv_t); }

// max z of a sampled row (sample_prep's rowmax)
__device__ __forceinline__ float row_max(const u64* rowmax, int r) { return fkey_inv((u32)(rowmax[r] >> 32)); }

// ------------------------------------------------------------------ block-wide helpers
// blockDim.x is a multiple of 32; every thread of the block calls them; tmp: __shared__ u64[33]

__device__ __forceinline__ u64 warp_incl_scan_u64(u64 v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u64 t = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += t;
    }
    return v;
}

// exclusive prefix sum over the threads of the block; *total = the block's sum
__device__ u64 block_excl_scan_u64(u64 v, u64* tmp, u64* total) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u64 inc = warp_incl_scan_u64(v, lane);
    __syncthreads();
    if (lane == 31) tmp[wid] = inc;
    __syncthreads();
    if (wid == 0) {
        u64 t = lane < nw ? tmp[lane] : 0;
        t = warp_incl_scan_u64(t, lane);
        if (lane < nw) tmp[lane] = t;
    }
    __syncthreads();
    u64 before = wid ? tmp[wid - 1] : 0;
    *total = tmp[nw - 1];
    return before + inc - v;
}

// op 0: sum, 1: max, 2: min
template <int OP>
__device__ __forceinline__ u64 red_op(u64 a, u64 b) {
    return OP == 0 ? a + b : OP == 1 ? (a > b ? a : b) : (a < b ? a : b);
}

template <int OP>
__device__ u64 block_reduce_u64(u64 v, u64* tmp) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = red_op<OP>(v, __shfl_xor_sync(FULL_MASK, v, o));
    __syncthreads();
    if (lane == 0) tmp[wid] = v;
    __syncthreads();
    if (wid == 0) {
        u64 id = OP == 2 ? ~0ull : 0ull;
        v = lane < nw ? tmp[lane] : id;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = red_op<OP>(v, __shfl_xor_sync(FULL_MASK, v, o));
        if (lane == 0) tmp[32] = v;
    }
    __syncthreads();
    return tmp[32];
}

// (max, sum of exp(x - max)) pairs of an online log-sum-exp
__device__ __forceinline__ void lse_add(float& m, float& s, float x) {
    if (!(x > -INFINITY)) return;                      // -inf and NaN add nothing
    if (x > m) {
        s = (m == -INFINITY ? 0.0f : s * expf(m - x)) + 1.0f;
        m = x;
    } else {
        s += expf(x - m);
    }
}

__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) { m = m2; s = s2; return; }
    float mm = fmaxf(m, m2);
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}

// inclusive prefix sums, in place, of nb (count, weight) bins
__device__ void scan_bins(u32* c, u64* w, int nb, u64* tmp) {
    int per = (nb + blockDim.x - 1) / blockDim.x;
    int lo = threadIdx.x * per, hi = min(nb, lo + per);
    u64 sc = 0, sw = 0, total;
    for (int b = lo; b < hi; ++b) { sc += c[b]; sw += w[b]; }
    __syncthreads();
    u64 oc = block_excl_scan_u64(sc, tmp, &total);
    u64 ow = block_excl_scan_u64(sw, tmp, &total);
    for (int b = lo; b < hi; ++b) {
        oc += c[b];
        c[b] = (u32)oc;
        ow += w[b];
        w[b] = ow;
    }
    __syncthreads();
}

// first i in [0, n) with a[i] >= t (ge) or a[i] > t (!ge) in a non-decreasing array; n if none.
// Every thread runs it on shared memory, so the result is uniform without a broadcast.
template <class T>
__device__ __forceinline__ int first_at(const T* a, int n, u64 t, bool ge) {
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        bool hit = ge ? (u64)a[mid] >= t : (u64)a[mid] > t;
        if (hit) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// ------------------------------------------------------------------ 1. penalties and the max

__device__ __forceinline__ bool mask_allows(const u32* mk, int i) { return (mk[i >> 5] >> (i & 31)) & 1u; }

// grid (G, rows): block g of row r handles [g * slice, (g + 1) * slice).
// masks: [.., mwords] the step's packed allowed-token bitmasks; bias: the step's packed biases.
extern "C" __global__ void sample_prep(const float* __restrict__ logits, int ld, int V,
                                       const int* __restrict__ params, int* __restrict__ counts,
                                       const u32* __restrict__ masks, int mwords, const int* __restrict__ bias,
                                       float* __restrict__ zbuf, u64* __restrict__ rowmax, int slice) {
    __shared__ u64 tmp[33];
    int r = blockIdx.y;
    const int* P = params + r * SAMPLE_PW;
    int flags = P[PW_FLAGS];
    bool greedy = flags & F_GREEDY, pen = flags & F_PEN;
    if (greedy && !(flags & F_ZBUF)) return;   // the forward pass's argmax is the answer
    const float* x = logits + (long long)r * ld;
    int* cnt = counts + (long long)P[PW_SLOT] * V;
    float* z = zbuf + (long long)r * V;
    const u32* mk = (flags & F_MASK) ? masks + (long long)P[PW_MASK] * mwords : nullptr;
    const int* bl = (flags & F_BIAS) ? bias + P[PW_BIAS] : nullptr;
    int tin = P[PW_TOKIN];
    float inv_t = __int_as_float(P[PW_INVT]), rep = __int_as_float(P[PW_REP]);
    float freq = __int_as_float(P[PW_FREQ]), pres = __int_as_float(P[PW_PRES]);
    int lo = blockIdx.x * slice, hi = min(V, lo + slice);
    if (bl) {
        // the biased tokens are anywhere in the slice: first the masked logits into zbuf, then
        // the biases added there (ids are unique: one writer each), then the pass below reads zbuf
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x)
            z[i] = (mk && !mask_allows(mk, i)) ? -INFINITY : x[i];
        __syncthreads();
        int nb = bl[0];
        for (int j = threadIdx.x; j < nb; j += blockDim.x) {
            int id = bl[1 + j];
            if (id >= lo && id < hi) z[id] = __fadd_rn(z[id], __int_as_float(bl[1 + nb + j]));
        }
        __syncthreads();
    }
    u64 best = 0;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v;
        if (bl) v = z[i];
        else v = (mk && !mask_allows(mk, i)) ? -INFINITY : x[i];
        if (pen) {
            int c = cnt[i];
            if (i == tin) {            // the one thread that owns it: no other reader this step
                c += 2;
                cnt[i] = c;
            }
            v = penalize(v, c, rep, freq, pres);
        }
        u64 key;
        if (greedy) {                  // first index of the max: larger key, then smaller index
            v = v != v ? -INFINITY : __fadd_rn(v, 0.0f);
            key = ((u64)fkey(v) << 32) | (u64)(0xFFFFFFFFu - (u32)i);
        } else {
            v = make_z(v, inv_t);
            if (flags & F_ZBUF) z[i] = v;
            key = (u64)fkey(v) << 32;
        }
        best = best > key ? best : key;
    }
    best = block_reduce_u64<1>(best, tmp);
    if (threadIdx.x == 0) atomicMax(&rowmax[r], best);
}

// ------------------------------------------------------------------ 2. histograms

// grid (G, rows); dynamic shared memory: SAMPLE_NB u64 weights + SAMPLE_NB u32 counts
extern "C" __global__ void sample_hist(const float* __restrict__ logits, int ld, int V,
                                       const int* __restrict__ params, const float* __restrict__ zbuf, const u64* __restrict__ rowmax,
                                       u32* __restrict__ hcnt, u64* __restrict__ hw, u64* __restrict__ zmass,
                                       float2* __restrict__ lsep, int slice) {
    SAMPLE_DYN_SMEM(dyn);
    __shared__ u64 tmp[33];
    __shared__ float lm[32], ls[32];
    u64* sw = dyn;
    u32* sc = (u32*)(dyn + SAMPLE_NB);
    int r = blockIdx.y;
    const int* P = params + r * SAMPLE_PW;
    int flags = P[PW_FLAGS];
    bool lp = flags & F_LP;
    const float* x = logits + (long long)r * ld;
    RowIn R;
    R.x = x;
    R.z = (flags & F_ZBUF) ? zbuf + (long long)r * V : nullptr;
    R.inv_t = __int_as_float(P[PW_INVT]);
    bool hist = !(flags & F_GREEDY);
    if (hist) {
        R.m = row_max(rowmax, r);
        if (R.m == -INFINITY) hist = false;            // sample_final answers 0
    }
    if (!hist && !lp) return;
    bool minp = flags & F_MINP;
    float L = __int_as_float(P[PW_MINP]);
    if (hist) {
        for (int b = threadIdx.x; b < SAMPLE_NB; b += blockDim.x) { sw[b] = 0; sc[b] = 0; }
        __syncthreads();
    }
    int lo = blockIdx.x * slice, hi = min(V, lo + slice);
    float m = -INFINITY, s = 0.0f;
    u64 zacc = 0;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float xi = x[i];
        if (lp) lse_add(m, s, xi);
        if (hist) {
            float z = R.z ? R.z[i] : make_z(xi, R.inv_t);
            float d = __fsub_rn(z, R.m);
            int b = bin_of(d);
            atomicAdd(&sc[b], 1u);
            u64 w = fx_weight(d);
            if (w) {
                atomicAdd(&sw[b], w);
                if (minp && d >= L) zacc += w;
            }
        }
    }
    if (hist) {
        __syncthreads();
        u64* gw = hw + (long long)r * SAMPLE_NB;
        u32* gc = hcnt + (long long)r * SAMPLE_NB;
        for (int b = threadIdx.x; b < SAMPLE_NB; b += blockDim.x) {
            if (sc[b]) atomicAdd(&gc[b], sc[b]);
            if (sw[b]) atomicAdd(&gw[b], sw[b]);
        }
        if (minp) {
            zacc = block_reduce_u64<0>(zacc, tmp);
            if (threadIdx.x == 0 && zacc) atomicAdd(&zmass[r], zacc);
        }
    }
    if (lp) {   // a fixed tree: the same sums every run
        int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o);
            lse_merge(m, s, m2, s2);
        }
        if (lane == 0) { lm[wid] = m; ls[wid] = s; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < nw; ++w) lse_merge(m, s, lm[w], ls[w]);
            lsep[(long long)r * gridDim.x + blockIdx.x] = make_float2(m, s);
        }
    }
}

// ------------------------------------------------------------------ 3. cuts and the draw

struct Final {
    RowIn R;
    int V, cap;
    u32* cc;             // [SAMPLE_NB] inclusive counts per bin
    u64* cw;             // [SAMPLE_NB] inclusive weights per bin
    u64* sbuf;           // [cap] gathered elements: (~key << 32) | index, sorted ascending
    u64* cum;            // [cap] inclusive weights in that order
    u64* tmp;            // [33]
    u32* scal;           // [4] shared scalars
    int g_lo, g_hi, g_n; // bins held in sbuf (g_lo > g_hi: none)
};

// gather every element of bins [lo, hi] (n of them, n <= cap), sort, weigh
__device__ void gather(Final& F, int lo, int hi) {
    int n = (int)(F.cc[hi] - (lo ? F.cc[lo - 1] : 0u));
    __syncthreads();
    if (threadIdx.x == 0) F.scal[0] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < F.V; i += blockDim.x) {
        float z = row_z(F.R, i);
        int b = bin_of(__fsub_rn(z, F.R.m));
        if (b >= lo && b <= hi) {
            u32 p = atomicAdd(&F.scal[0], 1u);
            if (p < (u32)F.cap) F.sbuf[p] = ((u64)(~fkey(z)) << 32) | (u32)i;
        }
    }
    int np2 = 1;
    while (np2 < n) np2 <<= 1;
    for (int j = n + threadIdx.x; j < np2; j += blockDim.x) F.sbuf[j] = ~0ull;
    __syncthreads();
    // bitonic sort, ascending
    for (int k = 2; k <= np2; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < np2; i += blockDim.x) {
                int ixj = i ^ j;
                if (ixj > i) {
                    u64 a = F.sbuf[i], b = F.sbuf[ixj];
                    bool up = (i & k) == 0;
                    if ((a > b) == up) { F.sbuf[i] = b; F.sbuf[ixj] = a; }
                }
            }
            __syncthreads();
        }
    }
    // inclusive weights in sorted order: a contiguous run per thread
    int per = (n + blockDim.x - 1) / blockDim.x;
    int a = threadIdx.x * per, e = min(n, a + per);
    u64 sum = 0, total;
    for (int j = a; j < e; ++j) sum += fx_weight(__fsub_rn(fkey_inv(~(u32)(F.sbuf[j] >> 32)), F.R.m));
    u64 off = block_excl_scan_u64(sum, F.tmp, &total);
    for (int j = a; j < e; ++j) {
        off += fx_weight(__fsub_rn(fkey_inv(~(u32)(F.sbuf[j] >> 32)), F.R.m));
        F.cum[j] = off;
    }
    __syncthreads();
    F.g_lo = lo;
    F.g_hi = hi;
    F.g_n = n;
}

// index of the j-th (1-based) element, in index order, whose key is tau
__device__ u32 select_tie(Final& F, u32 tau, u64 j) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int chunk = ((F.V + nw - 1) / nw + 31) & ~31;
    int w0 = wid * chunk, w1 = min(F.V, w0 + chunk);
    u32 n = 0;
    for (int base = w0; base < w1; base += 32) {
        int i = base + lane;
        bool hit = i < w1 && fkey(row_z(F.R, i)) == tau;
        n += __popc(__ballot_sync(FULL_MASK, hit));
    }
    __syncthreads();
    if (lane == 0) F.tmp[wid] = n;
    __syncthreads();
    u64 before = 0;
    int ws = 0;
    for (; ws < nw - 1; ++ws) {
        if (before + F.tmp[ws] >= j) break;
        before += F.tmp[ws];
    }
    if (wid == ws) {
        u64 acc = before;
        for (int base = w0; base < w1; base += 32) {
            int i = base + lane;
            bool hit = i < w1 && fkey(row_z(F.R, i)) == tau;
            u32 bal = __ballot_sync(FULL_MASK, hit);
            u32 pc = __popc(bal);
            if (acc + pc >= j) {
                for (u64 k = acc + 1; k < j; ++k) bal &= bal - 1;
                if (lane == 0) F.scal[1] = (u32)(base + __ffs(bal) - 1);
                break;
            }
            acc += pc;
        }
    }
    __syncthreads();
    return F.scal[1];
}

// kind 0: the t-th element (count >= t): returns the weight through its last tie (top-k);
// kind 1: first element where the cumulative weight >= t: returns that cumulative weight (top-p);
// kind 2: first element where the cumulative weight > t: returns its index (the draw).
struct Found {
    u64 w;
    u32 index;
};

// the cut in bin b, which holds more elements than fit in shared memory: radix select on the keys
// of the bin, 8 bits per pass, then the tie by index order
__device__ Found locate_dense(Final& F, int kind, u64 t, int b) {
    u32* sc = (u32*)F.cum;           // the gather buffers serve as sub-histograms
    u64* sw = F.sbuf;
    F.g_lo = 1;
    F.g_hi = 0;
    u64 kmin = ~0ull, kmax = 0;
    for (int i = threadIdx.x; i < F.V; i += blockDim.x) {
        float z = row_z(F.R, i);
        if (bin_of(__fsub_rn(z, F.R.m)) == b) {
            u64 k = fkey(z);
            kmin = k < kmin ? k : kmin;
            kmax = k > kmax ? k : kmax;
        }
    }
    u32 lo = (u32)block_reduce_u64<2>(kmin, F.tmp);
    u32 hi = (u32)block_reduce_u64<1>(kmax, F.tmp);
    u64 above_c = b ? F.cc[b - 1] : 0, above_w = b ? F.cw[b - 1] : 0;
    u32 tau = hi;
    u64 n_tau = 0, w_sum = 0;
    while (true) {
        u32 span = hi - lo;
        int shift = span < SAMPLE_SUB ? 0 : 32 - __clz(span) - 8;
        for (int s = threadIdx.x; s < SAMPLE_SUB; s += blockDim.x) { sc[s] = 0; sw[s] = 0; }
        __syncthreads();
        for (int i = threadIdx.x; i < F.V; i += blockDim.x) {
            float z = row_z(F.R, i);
            float d = __fsub_rn(z, F.R.m);
            u32 k = fkey(z);
            if (k >= lo && k <= hi && bin_of(d) == b) {
                int s = (int)((hi - k) >> shift);   // sub-bin 0 holds the largest keys
                atomicAdd(&sc[s], 1u);
                u64 w = fx_weight(d);
                if (w) atomicAdd(&sw[s], w);
            }
        }
        __syncthreads();
        scan_bins(sc, sw, SAMPLE_SUB, F.tmp);
        int s = kind == 0 ? first_at(sc, SAMPLE_SUB, t - above_c, true)
                          : first_at(sw, SAMPLE_SUB, t - above_w, kind == 1);
        s = min(s, SAMPLE_SUB - 1);
        u64 pc = s ? sc[s - 1] : 0, pw = s ? sw[s - 1] : 0;
        n_tau = sc[s] - pc;
        w_sum = sw[s] - pw;
        above_c += pc;
        above_w += pw;
        __syncthreads();
        u32 top = hi - ((u32)s << shift);
        u32 width = (1u << shift) - 1u;
        if (shift == 0) { tau = top; break; }
        hi = top;
        lo = top - lo > width ? top - width : lo;
    }
    Found f;
    f.index = 0;
    f.w = above_w + w_sum;
    if (kind == 0) return f;
    u64 w_tau = fx_weight(__fsub_rn(fkey_inv(tau), F.R.m));   // every tie weighs the same
    if (w_tau == 0) w_tau = 1;                                // unreachable: the cut has weight
    u64 rest = t - above_w;
    if (kind == 1) {
        u64 j = (rest + w_tau - 1) / w_tau;
        j = j < 1 ? 1 : (j > n_tau ? n_tau : j);
        f.w = above_w + j * w_tau;
        return f;
    }
    u64 j = rest / w_tau + 1;
    j = j > n_tau ? n_tau : j;
    f.index = select_tie(F, tau, j);
    return f;
}

__device__ Found locate(Final& F, int kind, u64 t) {
    int b = kind == 0 ? first_at(F.cc, SAMPLE_NB, t, true) : first_at(F.cw, SAMPLE_NB, t, kind == 1);
    b = min(b, SAMPLE_NB - 1);
    if (!(F.g_lo <= b && b <= F.g_hi)) {
        u32 nb = F.cc[b] - (b ? F.cc[b - 1] : 0u);
        if (nb > (u32)F.cap) return locate_dense(F, kind, t, b);
        gather(F, b, b);
    }
    u64 base_c = F.g_lo ? F.cc[F.g_lo - 1] : 0, base_w = F.g_lo ? F.cw[F.g_lo - 1] : 0;
    int n = F.g_n;
    Found f;
    f.index = 0;
    if (kind == 0) {
        int j = (int)(t - 1 - base_c);
        u64 last = F.sbuf[j] | 0xFFFFFFFFull;                 // past every tie of the t-th key
        int q = first_at(F.sbuf, n, last, false);
        f.w = base_w + F.cum[q - 1];
        return f;
    }
    int j = first_at(F.cum, n, t - base_w, kind == 1);
    j = min(j, n - 1);
    f.w = base_w + F.cum[j];
    f.index = (u32)(F.sbuf[j] & 0xFFFFFFFFull);
    return f;
}

// grid (rows,); dynamic shared memory: SAMPLE_NB u64 + 2 * cap u64 + SAMPLE_NB u32.
// out[r] = {token, raw argmax, logprob of token (float bits), logprob of the argmax}.
// io != 0 (a decode step's ws.dec_io row 0): the token also becomes the row's next decode input,
// so the next step's forward can run before the host has read this one (CUDABackend's pipelined
// sampled steps); the forward pass already advanced the position.
extern "C" __global__ void __launch_bounds__(1024)
sample_final(const float* __restrict__ logits, int ld, int V, const int* __restrict__ params,
             const int* __restrict__ argmax, const float* __restrict__ zbuf, u64* __restrict__ rowmax,
             u32* __restrict__ hcnt, u64* __restrict__ hw, u64* __restrict__ zmass,
             const float2* __restrict__ lsep, int G, int* __restrict__ out, int cap, int* __restrict__ io) {
    SAMPLE_DYN_SMEM(dyn);
    __shared__ u64 tmp[33];
    __shared__ u32 scal[4];
    int r = blockIdx.x;
    const int* P = params + r * SAMPLE_PW;
    int flags = P[PW_FLAGS];
    const float* x = logits + (long long)r * ld;
    int top = argmax[r];
    int tok = 0;
    if (flags & F_GREEDY) {
        if (threadIdx.x == 0) {
            if (flags & F_ZBUF) {       // the argmax of the changed logits, from sample_prep
                tok = (int)(0xFFFFFFFFu - (u32)rowmax[r]);
                rowmax[r] = 0;
            } else {
                tok = top;
            }
        }
    } else {
        Final F;
        F.V = V;
        F.cap = cap;
        F.R.x = x;
        F.R.z = (flags & F_ZBUF) ? zbuf + (long long)r * V : nullptr;
        F.R.inv_t = __int_as_float(P[PW_INVT]);
        F.R.m = row_max(rowmax, r);
        F.cw = dyn;
        F.sbuf = dyn + SAMPLE_NB;
        F.cum = F.sbuf + cap;
        F.cc = (u32*)(F.cum + cap);
        F.tmp = tmp;
        F.scal = scal;
        F.g_lo = 1;
        F.g_hi = 0;
        F.g_n = 0;
        __syncthreads();                          // every thread has read rowmax
        if (threadIdx.x == 0) rowmax[r] = 0;
        if (F.R.m != -INFINITY) {
            u32* gc = hcnt + (long long)r * SAMPLE_NB;
            u64* gw = hw + (long long)r * SAMPLE_NB;
            for (int b = threadIdx.x; b < SAMPLE_NB; b += blockDim.x) {
                F.cc[b] = gc[b];
                F.cw[b] = gw[b];
                gc[b] = 0;
                gw[b] = 0;
            }
            u64 zm = zmass[r];
            __syncthreads();
            if (threadIdx.x == 0) zmass[r] = 0;
            scan_bins(F.cc, F.cw, SAMPLE_NB, tmp);

            u64 z_all = F.cw[SAMPLE_NB - 1];
            int K = P[PW_TOPK];
            bool ka = K > 0 && K < V, pa = flags & F_TOPP, ma = flags & F_MINP;
            u32 pfx = (u32)P[PW_TOPP];
            int bk = ka ? min(first_at(F.cc, SAMPLE_NB, (u64)K, true), SAMPLE_NB - 1) : SAMPLE_NB - 1;
            // below 32 nats every weight is 0: a top-k cut there keeps every token that can be drawn
            if (bk == SAMPLE_NB - 1) ka = false;
            bool k_inside = ka && (u32)K < F.cc[bk];
            u64 zk_up = ka ? F.cw[bk] : z_all;
            int bpu = pa ? min(first_at(F.cw, SAMPLE_NB, ceil_frac32(zk_up, pfx), true), SAMPLE_NB - 1) : SAMPLE_NB - 1;
            int bm = ma ? bin_of(__int_as_float(P[PW_MINP])) : SAMPLE_NB - 1;
            int B = SAMPLE_NB - 1;
            if (ka) B = min(B, bk);
            if (pa) B = min(B, bpu);
            if (ma) B = min(B, bm);
            // the exact top-k weight matters unless min-p alone cuts earlier
            bool need_k = k_inside && (pa || !(ma && bm < bk));
            int bg = need_k ? bk : B;
            if (F.cc[bg] <= (u32)cap) gather(F, 0, bg);   // usually every cut lands here

            u64 zk = ka ? F.cw[bk] : z_all;
            if (need_k) zk = locate(F, 0, (u64)K).w;
            u64 zf = zk;
            if (pa) {
                u64 zp = locate(F, 1, ceil_frac32(zk, pfx)).w;
                zf = zp < zf ? zp : zf;
            }
            if (ma) zf = zm < zf ? zm : zf;
            u32 c[4] = {(u32)P[PW_STEP], (u32)P[PW_STEP + 1], 0u, 0u};
            philox4x32_10(c, (u32)P[PW_SEED], (u32)P[PW_SEED + 1]);
            u64 rnd = ((u64)c[1] << 32) | c[0];
            tok = (int)locate(F, 2, __umul64hi(rnd, zf)).index;
        }
    }
    if (threadIdx.x == 0) {
        float lp = 0.0f, top_lp = 0.0f;
        if (flags & F_LP) {
            float m = -INFINITY, s = 0.0f;
            for (int g = 0; g < G; ++g) {
                float2 p = lsep[(long long)r * G + g];
                lse_merge(m, s, p.x, p.y);
            }
            float lse = m + logf(s);
            lp = x[tok] - lse;
            top_lp = x[top] - lse;
        }
        int* o = out + r * 4;
        o[0] = tok;
        o[1] = top;
        o[2] = __float_as_int(lp);
        o[3] = __float_as_int(top_lp);
        if (io) io[r] = tok;
    }
}

// A sequence with penalties starts in this row of counts: zero it, then mark the prompt's tokens.
// One block.
extern "C" __global__ void counts_reset(int* __restrict__ row, int V, const int* __restrict__ prompt, int n) {
    for (int i = threadIdx.x; i < V; i += blockDim.x) row[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        int t = prompt[i];
        if (t >= 0 && t < V) row[t] = 1;
    }
}
