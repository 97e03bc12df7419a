// Routed experts of a mixture-of-experts layer (model/ops.py norm_moe_residual), as launches over a
// step's rows that keep every expert id on the device, so that a decode step stays one fixed launch
// sequence that a CUDA graph captures:
//   moe_topk         per row t: the softmax of its E router logits, its top k experts (ties: the
//                    lower index) and their probabilities, renormalised over the k where asked:
//                    ids [T, k] (int32), weights [T, k]
//   moe_gate_up_<t>  per (row, expert) pair p = t * k + j, e = ids[p]:
//                    a[p] = act(gate_e . x[t] + bg_e, up_e . x[t] + bu_e)  (gate and up of type t;
//                    act: common.cuh gated_f, act(g) * u or gpt-oss's clamped SwiGLU)
//   moe_gemv_<t>     per pair: y[p] = W_e . x[p / xdiv] + b_e  (the down projection: xdiv 1; gate or
//                    up on its own where their types differ: xdiv k)
//   moe_combine      x[t] += sum_j w[t, j] * y[t * k + j], j in order (deterministic, no atomics)
//   moe_shared_add   x[t] += sigmoid(s[t]) * y[t]: a shared expert's output y (qwen35moe; its MLP
//                    and its gate logit s run on the GEMVs, backends/cuda/experts.py)
//   moe_bucket_count, moe_bucket_fill   the grouped path's lists (wide steps, mmq.cu mmq_moe_bnBN):
//                    the pairs of each expert in row order, in a slot range padded to the tile height,
//                    and the table of the token tiles over them; counts, offsets and lists stay on the
//                    device, the launches fixed by the pair count
// The experts' biases (gpt-oss; null pointers: none) are float [E, N], expert e's row r at e * N + r.
// The per-pair GEMVs follow gemv.cu: one warp per output row, lanes over the row's 32-weight units
// (common.cuh load_unit<QT>), here with the row's matrix found through the pair's expert id. Each
// pair reads its expert's rows on its own (pairs that share an expert share them only through L2):
// the path of narrow steps; wide ones take the grouped tiles (pairs bucketed per expert here, then
// mmq.cu's tensor-core tiles per expert); backends/cuda/dispatch.py says which runs.
#include "common.cuh"

#define MOE_WARPS 4             // output rows per block of the per-pair GEMVs, a warp each
#define MOE_TOPK_ROWS 4         // router rows per block of moe_topk, a warp each
#define MOE_MAX_K 32            // experts per token: moe_topk keeps the j-th on lane j
#define MOE_TOPK_HELD 8         // router logits a lane of moe_topk keeps in registers (E <= 256: read once)
#define MOE_COMBINE_THREADS 256 // residual columns per block of moe_combine
#define MOE_BUCKET_THREADS 256  // segments of the pairs per block of the bucketing, a thread each

// an output of a pair whose expert id is out of range: visible, never a read out of the weights
#define MOE_NAN __int_as_float(0x7fc00000)

// dot of a decoded unit with xb[0..nv-1] (nv < 32 only in a float row's last unit); vector loads
// where the activation rows are 16-byte aligned
__device__ __forceinline__ float moe_unit_dot(const float (&w)[32], const float* __restrict__ xb, int nv, bool vec) {
    float s = 0.0f;
    if (nv >= 32 && vec) {
        const float4* x4 = (const float4*)xb;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float4 v = x4[i];
            s += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i)
            if (i < nv) s += w[i] * xb[i];
    }
    return s;
}

// a router logit as moe_topk ranks it: NaN ranks as -inf (last, by index)
__device__ __forceinline__ float moe_logit(float v) { return v != v ? -INFINITY : v; }

// ------------------------------------------------------------------ routing
// One warp per row. Round j takes the best expert ranked below the one round j - 1 took (rank:
// larger logit first, then lower index), so no expert is taken twice and no flags are kept; lane j
// keeps round j's expert. The softmax's maximum is round 0's logit, so the weights are
// exp(l - max) over the sum of the k taken (renormalised) or of all E. A row of up to
// 32 MOE_TOPK_HELD logits is read once into the lanes' registers (lane l: l, l + 32, ...: the order
// of the loop over memory, so the same picks and the same sums), not once a round: k rounds of one
// row were k memory latencies on the step's critical path. May be a programmatic
// dependent launch (ops.moe_topk pdl): it waits for the router's logits, then lets the experts'
// launch be scheduled (its few blocks are all placed by then).
extern "C" __global__ void __launch_bounds__(MOE_TOPK_ROWS * 32)
    moe_topk(const float* __restrict__ logits, int ls, int T, int E, int k, int renorm, int* __restrict__ ids,
             float* __restrict__ w) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * MOE_TOPK_ROWS + (threadIdx.x >> 5);
    pdl_wait();
    pdl_trigger();
    if (t >= T) return;
    const float* l = logits + (long long)t * ls;
    const bool held = E <= 32 * MOE_TOPK_HELD;            // warp-uniform
    float lv[MOE_TOPK_HELD];
#pragma unroll
    for (int r = 0; r < MOE_TOPK_HELD; ++r) {
        const int i = lane + 32 * r;
        lv[r] = held && i < E ? moe_logit(l[i]) : -INFINITY;
    }
    float pv = INFINITY, top = -INFINITY, mine_v = -INFINITY;
    int pi = -1, mine_i = -1;
    for (int j = 0; j < k; ++j) {
        float bv = -INFINITY;
        int bi = -1;
        // ascending i: a tie keeps the lower index
        auto take = [&](float v, int i) {
            if ((v < pv || (v == pv && i > pi)) && (bi < 0 || v > bv)) {
                bv = v;
                bi = i;
            }
        };
        if (held) {
#pragma unroll
            for (int r = 0; r < MOE_TOPK_HELD; ++r)
                if (lane + 32 * r < E) take(lv[r], lane + 32 * r);
        } else {
            for (int i = lane; i < E; i += 32) take(moe_logit(l[i]), i);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {               // every lane ends with the warp's best
            float ov = __shfl_sync(0xffffffffu, bv, lane ^ o);
            int oi = __shfl_sync(0xffffffffu, bi, lane ^ o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        if (j == 0) top = bv;
        if (lane == j) {
            mine_v = bv;
            mine_i = bi;
        }
        pv = bv;
        pi = bi;
    }
    const float ev = lane < k ? expf(mine_v - top) : 0.0f;
    float denom;
    if (renorm) {
        denom = warp_sum(ev);
    } else {
        float s = 0.0f;
        if (held) {
#pragma unroll
            for (int r = 0; r < MOE_TOPK_HELD; ++r)
                if (lane + 32 * r < E) s += expf(lv[r] - top);
        } else {
            for (int i = lane; i < E; i += 32) s += expf(moe_logit(l[i]) - top);
        }
        denom = warp_sum(s);
    }
    if (lane < k) {
        ids[(long long)t * k + lane] = mine_i;
        w[(long long)t * k + lane] = ev / denom;
    }
}

// ------------------------------------------------------------------ the experts' projections
// Grid: (pairs, ceil(N / MOE_WARPS)); warp w of block (p, b) computes output row b * MOE_WARPS + w
// of pair p. W: expert 0's matrix, expert e's at W + e * expert_bytes; row r at + r * row_bytes.

template <int QT>
__device__ __forceinline__ void moe_gate_up_body(const u8* __restrict__ Wg, const u8* __restrict__ Wu,
                                                 long long row_bytes, long long expert_bytes, int E, int N, int K,
                                                 const int* __restrict__ ids, int k, const float* __restrict__ x,
                                                 int xs, float* __restrict__ a, int as, int act,
                                                 const float* __restrict__ bg, const float* __restrict__ bu) {
    const int lane = threadIdx.x & 31;
    const int p = blockIdx.x;
    const int r = blockIdx.y * MOE_WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    const int e = ids[p];
    float* out = a + (long long)p * as + r;
    if (e < 0 || e >= E) {
        if (lane == 0) *out = MOE_NAN;
        return;
    }
    const long long off = (long long)e * expert_bytes + (long long)r * row_bytes;
    const u8* rg = Wg + off;
    const u8* ru = Wu + off;
    const float* xr = x + (long long)(p / k) * xs;
    const bool vec = ((xs & 3) == 0) && ((((u64)x) & 15) == 0);
    float sg = 0.0f, su = 0.0f;
    const int nu = (K + 31) >> 5;
    for (int u = lane; u < nu; u += 32) {
        float w[32];
        const int nv = K - 32 * u;
        load_unit<QT>(rg, u, K, w);
        sg += moe_unit_dot(w, xr + 32 * u, nv, vec);
        load_unit<QT>(ru, u, K, w);
        su += moe_unit_dot(w, xr + 32 * u, nv, vec);
    }
    sg = warp_sum(sg);
    su = warp_sum(su);
    if (lane == 0) {
        const long long b = (long long)e * N + r;
        *out = gated_f(bg ? sg + bg[b] : sg, bu ? su + bu[b] : su, act);
    }
}

template <int QT>
__device__ __forceinline__ void moe_gemv_body(const u8* __restrict__ W, long long row_bytes, long long expert_bytes,
                                              int E, int N, int K, const int* __restrict__ ids,
                                              const float* __restrict__ x, int xs, int xdiv, float* __restrict__ y,
                                              int ys, const float* __restrict__ bias) {
    const int lane = threadIdx.x & 31;
    const int p = blockIdx.x;
    const int r = blockIdx.y * MOE_WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    const int e = ids[p];
    float* out = y + (long long)p * ys + r;
    if (e < 0 || e >= E) {
        if (lane == 0) *out = MOE_NAN;
        return;
    }
    const u8* row = W + (long long)e * expert_bytes + (long long)r * row_bytes;
    const float* xr = x + (long long)(p / xdiv) * xs;
    const bool vec = ((xs & 3) == 0) && ((((u64)x) & 15) == 0);
    float s = 0.0f;
    const int nu = (K + 31) >> 5;
    for (int u = lane; u < nu; u += 32) {
        float w[32];
        load_unit<QT>(row, u, K, w);
        s += moe_unit_dot(w, xr + 32 * u, K - 32 * u, vec);
    }
    s = warp_sum(s);
    if (lane == 0) *out = bias ? s + bias[(long long)e * N + r] : s;
}

// One pair of entry points per weight type: moe_gate_up_<type>, moe_gemv_<type>.
#define DEFINE_MOE(name, QT)                                                                                 \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)                                             \
        moe_gate_up_##name(const u8* Wg, const u8* Wu, long long row_bytes, long long expert_bytes, int E,   \
                           int N, int K, const int* ids, int k, const float* x, int xs, float* a, int as,    \
                           int act, const float* bg, const float* bu) {                                      \
        moe_gate_up_body<QT>(Wg, Wu, row_bytes, expert_bytes, E, N, K, ids, k, x, xs, a, as, act, bg, bu);  \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)                                             \
        moe_gemv_##name(const u8* W, long long row_bytes, long long expert_bytes, int E, int N, int K,       \
                        const int* ids, const float* x, int xs, int xdiv, float* y, int ys, const float* b) { \
        moe_gemv_body<QT>(W, row_bytes, expert_bytes, E, N, K, ids, x, xs, xdiv, y, ys, b);                \
    }

#if QT_ON(QT_F32)
DEFINE_MOE(f32, QT_F32)
#endif
#if QT_ON(QT_F16)
DEFINE_MOE(f16, QT_F16)
#endif
#if QT_ON(QT_BF16)
DEFINE_MOE(bf16, QT_BF16)
#endif
#if QT_ON(QT_Q4_0)
DEFINE_MOE(q4_0, QT_Q4_0)
#endif
#if QT_ON(QT_Q4_1)
DEFINE_MOE(q4_1, QT_Q4_1)
#endif
#if QT_ON(QT_Q5_0)
DEFINE_MOE(q5_0, QT_Q5_0)
#endif
#if QT_ON(QT_Q5_1)
DEFINE_MOE(q5_1, QT_Q5_1)
#endif
#if QT_ON(QT_Q8_0)
DEFINE_MOE(q8_0, QT_Q8_0)
#endif
#if QT_ON(QT_Q4_K)
DEFINE_MOE(q4_k, QT_Q4_K)
#endif
#if QT_ON(QT_Q5_K)
DEFINE_MOE(q5_k, QT_Q5_K)
#endif
#if QT_ON(QT_Q6_K)
DEFINE_MOE(q6_k, QT_Q6_K)
#endif
#if QT_ON(QT_Q2_K)
DEFINE_MOE(q2_k, QT_Q2_K)
#endif
#if QT_ON(QT_Q3_K)
DEFINE_MOE(q3_k, QT_Q3_K)
#endif
#if QT_ON(QT_IQ4_NL)
DEFINE_MOE(iq4_nl, QT_IQ4_NL)
#endif
#if QT_ON(QT_IQ4_XS)
DEFINE_MOE(iq4_xs, QT_IQ4_XS)
#endif
#if QT_ON(QT_MXFP4)
DEFINE_MOE(mxfp4, QT_MXFP4)
#endif
#if QT_ON(QT_IQ2_XXS)
DEFINE_MOE(iq2_xxs, QT_IQ2_XXS)
#endif
#if QT_ON(QT_IQ2_XS)
DEFINE_MOE(iq2_xs, QT_IQ2_XS)
#endif
#if QT_ON(QT_IQ2_S)
DEFINE_MOE(iq2_s, QT_IQ2_S)
#endif
#if QT_ON(QT_IQ3_XXS)
DEFINE_MOE(iq3_xxs, QT_IQ3_XXS)
#endif
#if QT_ON(QT_IQ3_S)
DEFINE_MOE(iq3_s, QT_IQ3_S)
#endif

// ------------------------------------------------------------------ into the residual
// Grid: (T, ceil(H / MOE_COMBINE_THREADS)). y's rows of row t are t * k .. t * k + k - 1.
extern "C" __global__ void __launch_bounds__(MOE_COMBINE_THREADS)
    moe_combine(float* __restrict__ x, int xs, const float* __restrict__ y, int ys, const float* __restrict__ w, int k,
                int H) {
    const int t = blockIdx.x;
    const int c = blockIdx.y * MOE_COMBINE_THREADS + threadIdx.x;
    if (c >= H) return;
    const float* wt = w + (long long)t * k;
    const float* yt = y + (long long)t * k * ys + c;
    float s = 0.0f;
    for (int j = 0; j < k; ++j) s += wt[j] * yt[(long long)j * ys];
    x[(long long)t * xs + c] += s;
}

// Grid: (T, ceil(H / MOE_COMBINE_THREADS)).
extern "C" __global__ void __launch_bounds__(MOE_COMBINE_THREADS)
    moe_shared_add(float* __restrict__ x, int xs, const float* __restrict__ y, int ys, const float* __restrict__ s,
                   int H) {
    const int t = blockIdx.x;
    const int c = blockIdx.y * MOE_COMBINE_THREADS + threadIdx.x;
    if (c >= H) return;
    x[(long long)t * xs + c] += y[(long long)t * ys + c] / (1.0f + expf(-s[t]));
}

// ------------------------------------------------------------------ the grouped path's lists
// Inclusive prefix sum of v over the block's MOE_BUCKET_THREADS threads (sm: as many ints), and the
// block's total. Block-uniform barriers.
__device__ __forceinline__ int moe_block_scan(int v, int* sm, int& total) {
    const int tid = threadIdx.x;
    __syncthreads();                                     // sm may still be read from the last scan
    sm[tid] = v;
    __syncthreads();
    for (int o = 1; o < MOE_BUCKET_THREADS; o <<= 1) {
        const int a = tid >= o ? sm[tid - o] : 0;
        __syncthreads();
        sm[tid] += a;
        __syncthreads();
    }
    total = sm[MOE_BUCKET_THREADS - 1];
    return sm[tid];
}

// Grid: E blocks of MOE_BUCKET_THREADS. cnt[e] = the pairs p < P (ids int32 [P], P = rows x k) with
// ids[p] == e (integer counts: the same in any order).
extern "C" __global__ void __launch_bounds__(MOE_BUCKET_THREADS)
    moe_bucket_count(const int* __restrict__ ids, int P, int* __restrict__ cnt) {
    __shared__ int sm[MOE_BUCKET_THREADS];
    const int e = blockIdx.x;
    int c = 0;
    for (int p = threadIdx.x; p < P; p += MOE_BUCKET_THREADS) c += ids[p] == e;
    int total;
    moe_block_scan(c, sm, total);
    if (threadIdx.x == 0) cnt[e] = total;
}

// Grid: E blocks of MOE_BUCKET_THREADS, after moe_bucket_count. Expert e's slots start at BN times
// the tiles of the experts before it (each ceil(cnt / BN) tiles): list[slot] = its pairs p in
// ascending order (so by row: a row takes an expert once), then -1 up to its last tile's end; its
// tiles' entries tiles[3 tb ..] = (e, first slot of the tile, end of its pairs' slots). The last
// block marks the tiles past the step's last one (up to the host's bound TB) with e = -1. Thread i
// takes the pairs of segment i (ceil(P / threads) consecutive pairs): their places in the list are
// the prefix sum of the segments' counts, so the order does not depend on scheduling. Pairs whose
// id is out of range are in no list (moe_topk writes none).
extern "C" __global__ void __launch_bounds__(MOE_BUCKET_THREADS)
    moe_bucket_fill(const int* __restrict__ ids, int P, int E, int BN, const int* __restrict__ cnt,
                    int* __restrict__ list, int* __restrict__ tiles, int TB) {
    __shared__ int sm[MOE_BUCKET_THREADS];
    const int e = blockIdx.x, tid = threadIdx.x;
    int pad = 0;                                         // tiles of the experts before e
    for (int i = tid; i < e; i += MOE_BUCKET_THREADS) pad += (cnt[i] + BN - 1) / BN;
    int first;
    moe_block_scan(pad, sm, first);
    const int c = cnt[e], nt = (c + BN - 1) / BN, s0 = first * BN;
    const int seg = (P + MOE_BUCKET_THREADS - 1) / MOE_BUCKET_THREADS;
    const int p0 = min(P, tid * seg), p1 = min(P, p0 + seg);
    int mine = 0;
    for (int p = p0; p < p1; ++p) mine += ids[p] == e;
    int total;
    int slot = s0 + moe_block_scan(mine, sm, total) - mine;
    for (int p = p0; p < p1; ++p)
        if (ids[p] == e) list[slot++] = p;
    for (int i = c + tid; i < nt * BN; i += MOE_BUCKET_THREADS) list[s0 + i] = -1;
    for (int j = tid; j < nt; j += MOE_BUCKET_THREADS) {
        tiles[3 * (first + j)] = e;
        tiles[3 * (first + j) + 1] = s0 + j * BN;
        tiles[3 * (first + j) + 2] = s0 + c;
    }
    if (e == E - 1)
        for (int j = first + nt + tid; j < TB; j += MOE_BUCKET_THREADS) {
            tiles[3 * j] = -1;
            tiles[3 * j + 1] = 0;
            tiles[3 * j + 2] = 0;
        }
}
