// Gated DeltaNet (model/ops.py delta_rule): the short causal convolution over a layer's mixed q|k|v
// channels, then the gated delta rule over each value head's state with the gated RMSNorm of its
// output. Both kernels take the rows of a step as they lie in the workspace: row t belongs to
// sequence slot slots[t] at position positions[t]; consecutive rows of one slot at consecutive
// positions are one segment (a prompt chunk: many; a decode row: one), carried through its slot's
// state in order by one block, so a decode step and a prompt step are the same launch. A segment
// that starts at position 0 is a sequence's first step and starts from zero state. Rows on the
// scratch slot (the padding of a bucketed step) start from zero and write no state, so they never
// touch a live sequence's state and never race with each other on one.
//
// Long prompt segments may run their whole chunks of DN_CHUNK rows through dn_chunk first (the
// same rule in the chunked form, backends/cuda/deltanet_twin.py chunk_step), which leaves the
// slot's state after the last whole chunk; dn_delta then runs the rows after them. Both take the
// same chunk_min (0: none; else at least DN_CHUNK): a segment of a live slot of at least chunk_min
// rows is chunked. Decode steps pass 0 and never launch dn_chunk.
//
// States (float32, per recurrent layer, indexed by slot < scratch):
//   conv_state [slots][conv_kernel - 1][channels]:  the last conv_kernel - 1 inputs of the slot
//   state      [slots][v_heads][k_dim][v_dim]:      S of each value head
#include "common.cuh"

// Threads of a conv block: one channel each.
#define DN_CONV_THREADS 128
// Largest conv_kernel the conv kernel keeps in registers (Qwen3.5: 4). The backend refuses more.
#define DN_MAX_TAPS 8
// Largest k_dim: each thread of a delta-rule block holds its column of S (k_dim floats) in registers
// for the whole segment (Qwen3.5: 128). The backend refuses more.
#define DN_MAX_K 128
// k_dims with a delta-rule kernel of their own, dn_delta_k<dk> (the column's length known at compile
// time: no per-element bound checks, and no registers beyond dk for it): the real models' (Qwen3.5 and
// 3.6: 128), half that, and the tiny test models' 32 (tests/support/hybrid_models.py: through them the
// GPU tests run whole models on the chunked rule, which has these k_dims only). Other k_dims run
// dn_delta. backends/cuda/support.py DN_DELTA_K lists the same.
#define DN_DELTA_K_LIST(X) X(32) X(64) X(128)
// Largest v_dim: a delta-rule block has one thread per column of S, rounded up to a warp (Qwen3.5: 128).
// The backend refuses more.
#define DN_MAX_V 256
// Rows of a chunk of dn_chunk. Its per-row work for a column of S is about 3 dk + 2 DN_CHUNK
// multiply-adds (S^T q, S^T k and the state update over dk; the triangular solve and the
// intra-chunk output over the chunk), so without tensor cores shorter chunks cost less per row
// while they amortise the chunk's barriers; at 32 a chunk's tiles (k, q then u, and the two
// decay-weighted products) fit the 48 KB of static shared memory at dk 128. The cumulative decays
// are one warp's (a lane per row). backends/cuda/support.py DN_CHUNK is the same.
#define DN_CHUNK 32
// Largest v_dim of dn_chunk: the chunk's u (a column each) shares the q tile's rows (Qwen3.5 and 3.6:
// 128). Wider heads run dn_delta only (support.dn_chunk_kernel).
#define DN_CHUNK_MAX_V 128

// Row t starts a segment: the first row, or a change of slot, or a position that does not follow.
__device__ __forceinline__ bool dn_segment_start(const int* __restrict__ slots, const int* __restrict__ pos, int t) {
    return t == 0 || slots[t] != slots[t - 1] || pos[t] != pos[t - 1] + 1;
}

// The segment's last row + 1.
__device__ __forceinline__ int dn_segment_end(const int* __restrict__ slots, const int* __restrict__ pos, int t,
                                              int n) {
    int e = t + 1;
    while (e < n && slots[e] == slots[t] && pos[e] == pos[e - 1] + 1) ++e;
    return e;
}

// out[r][c] = silu(sum_i x_{r - K + 1 + i}[c] * w[c][i]) over the K = taps + 1 inputs ending at row r
// of its segment (those before the segment from conv_state), for the n rows of the step; the
// segment's last `taps` inputs go back to conv_state. Grid (ceil(C / DN_CONV_THREADS), n): the
// block of a segment's first row runs it, the others return.
extern "C" __global__ void dn_conv(const float* __restrict__ x, int xs, const float* __restrict__ w, int taps,
                                   float* __restrict__ conv_state, const int* __restrict__ slots,
                                   const int* __restrict__ pos, int scratch, int n, int C, float* __restrict__ out,
                                   int os) {
    const int t = blockIdx.y, c = blockIdx.x * DN_CONV_THREADS + threadIdx.x;
    if (t >= n || c >= C || !dn_segment_start(slots, pos, t)) return;
    const int end = dn_segment_end(slots, pos, t, n), slot = slots[t];
    const bool keep = slot != scratch, fresh = !keep || pos[t] == 0;
    float* cs = conv_state + (long long)slot * taps * C + c;
    float win[DN_MAX_TAPS], wc[DN_MAX_TAPS + 1];
#pragma unroll
    for (int i = 0; i < DN_MAX_TAPS; ++i) win[i] = i < taps && !fresh ? cs[(long long)i * C] : 0.0f;
#pragma unroll
    for (int i = 0; i <= DN_MAX_TAPS; ++i) wc[i] = i <= taps ? w[(long long)c * (taps + 1) + i] : 0.0f;
    for (int r = t; r < end; ++r) {
        const float xr = x[(long long)r * xs + c];
        float y = xr * wc[taps];
#pragma unroll
        for (int i = 0; i < DN_MAX_TAPS; ++i) if (i < taps) y += win[i] * wc[i];
        out[(long long)r * os + c] = silu_f(y);
        // the window moves on by one input: the oldest goes, xr comes last (static indices: the
        // window stays in registers)
#pragma unroll
        for (int i = 0; i < DN_MAX_TAPS; ++i) {
            if (i + 1 < taps) win[i] = win[i + 1 < DN_MAX_TAPS ? i + 1 : i];
            else if (i + 1 == taps) win[i] = xr;
        }
    }
    if (keep) {
#pragma unroll
        for (int i = 0; i < DN_MAX_TAPS; ++i) if (i < taps) cs[(long long)i * C] = win[i];
    }
}

__device__ __forceinline__ float dn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// The gated delta rule and the gated RMSNorm of its output. Block (h, t): value head h over the
// segment starting at row t (the other rows' blocks return); thread j holds column j of S_h.
// Per row r of the segment, from the conv output cv (row: q [nk][dk] | k [nk][dk] | v [nv][dv]):
//   q, k of key head h % nk, l2-normalised (q also / sqrt(dk)); g = a_coef_h * softplus(alpha + dt_bias_h),
//   b = sigmoid(beta);  S <- exp(g) S;  S <- S + k (b (v - S^T k))^T;  o = S^T q;
//   out[r][h] = o / rms(o) * out_norm * silu(z[r][h]).
// Block: a multiple of 32 threads, at least v_dim (<= DN_MAX_V). KD: the length of the column held in
// registers; EXACT: dk == KD (a dn_delta_k<KD> instance), else dk <= KD. chunk_min: the chunked rule
// (the header): a chunked segment runs from its first row after its whole chunks, from the state
// dn_chunk left. The general dn_delta ignores it (dn_chunk has the instances' k_dims only).
template <int KD, bool EXACT>
__device__ __forceinline__ void dn_delta_segment(const float* __restrict__ cv, int cvs, const float* __restrict__ alpha,
                                                 const float* __restrict__ beta, int abs_, const float* __restrict__ z,
                                                 int zs, const float* __restrict__ a_coef,
                                                 const float* __restrict__ dt_bias, const float* __restrict__ out_norm,
                                                 float* __restrict__ state, const int* __restrict__ slots,
                                                 const int* __restrict__ pos, int scratch, int n, int nk, int dk_arg,
                                                 int nv, int dv, float eps, float* __restrict__ out, int os,
                                                 int chunk_min) {
    __shared__ float qs[KD], ks[KD], red[32];
    const int dk = EXACT ? KD : dk_arg;
    const int h = blockIdx.x, t = blockIdx.y, j = threadIdx.x;
    if (t >= n || !dn_segment_start(slots, pos, t)) return;
    const int end = dn_segment_end(slots, pos, t, n), slot = slots[t], kh = h % nk;
    const bool keep = slot != scratch;
    bool fresh = !keep || pos[t] == 0;
    int first = t;
    if (EXACT && chunk_min > 0 && keep && end - t >= chunk_min) {
        // dn_chunk ran the segment's whole chunks and left the slot's state after them
        first = t + (end - t) / DN_CHUNK * DN_CHUNK;
        fresh = false;
        if (first == end) return;
    }
    const bool col = j < dv;
    float* S = state + ((long long)slot * nv + h) * dk * dv + j;
    float s[KD];
#pragma unroll
    for (int i = 0; i < KD; ++i) s[i] = col && i < dk && !fresh ? S[(long long)i * dv] : 0.0f;
    const float qscale = rsqrtf((float)dk);
    for (int r = first; r < end; ++r) {
        const float* row = cv + (long long)r * cvs;
        float sq = 0.0f, sk = 0.0f;
        for (int i = j; i < dk; i += blockDim.x) {
            const float qi = row[kh * dk + i], ki = row[(nk + kh) * dk + i];
            qs[i] = qi;
            ks[i] = ki;
            sq += qi * qi;
            sk += ki * ki;
        }
        // (block_reduce's barriers also publish qs and ks)
        const float rq = rsqrtf(block_reduce(sq, 0, red) + 1e-6f) * qscale;
        const float rk = rsqrtf(block_reduce(sk, 0, red) + 1e-6f);
        const float g = expf(a_coef[h] * dn_softplus(alpha[(long long)r * abs_ + h] + dt_bias[h]));
        const float b = 1.0f / (1.0f + expf(-beta[(long long)r * abs_ + h]));
        float kv = 0.0f, o = 0.0f;
        if (col) {
#pragma unroll
            for (int i = 0; i < KD; ++i) if (i < dk) kv += s[i] * ks[i];
        }
        // Both passes over the column read k from shared memory. Left alone, the compiler keeps the
        // first pass's dk values of k in registers for the second, next to the column's dk: more than
        // a thread has at dk = 128, so the column spilled. Across a warp barrier shared memory may
        // have changed (it orders the warp's memory accesses), so the second pass loads k again. Every
        // lane of the block passes it (outside `if (col)`).
        __syncwarp();
        if (col) {
            const float d = b * (row[2 * nk * dk + h * dv + j] - g * kv * rk);
#pragma unroll
            for (int i = 0; i < KD; ++i) {
                if (i < dk) {
                    s[i] = g * s[i] + ks[i] * rk * d;
                    o += s[i] * qs[i];
                }
            }
            o *= rq;
        }
        const float ss = block_reduce(col ? o * o : 0.0f, 0, red);
        if (col) {
            const float zj = z[(long long)r * zs + h * dv + j];
            out[(long long)r * os + h * dv + j] = o * rsqrtf(ss / dv + eps) * out_norm[j] * silu_f(zj);
        }
        __syncthreads();     // qs and ks are rewritten by the next row
    }
    if (keep && col) {
#pragma unroll
        for (int i = 0; i < KD; ++i) if (i < dk) S[(long long)i * dv] = s[i];
    }
}

#define DN_DELTA_PARAMS                                                                                               \
    const float* __restrict__ cv, int cvs, const float* __restrict__ alpha, const float* __restrict__ beta, int abs_, \
        const float* __restrict__ z, int zs, const float* __restrict__ a_coef, const float* __restrict__ dt_bias,     \
        const float* __restrict__ out_norm, float* __restrict__ state, const int* __restrict__ slots,                 \
        const int* __restrict__ pos, int scratch, int n, int nk, int dk, int nv, int dv, float eps,                   \
        float* __restrict__ out, int os, int chunk_min
#define DN_DELTA_ARGS cv, cvs, alpha, beta, abs_, z, zs, a_coef, dt_bias, out_norm, state, slots, pos, scratch, n, nk, \
                      dk, nv, dv, eps, out, os, chunk_min

// Any k_dim <= DN_MAX_K.
extern "C" __global__ void __launch_bounds__(DN_MAX_V) dn_delta(DN_DELTA_PARAMS) {
    dn_delta_segment<DN_MAX_K, false>(DN_DELTA_ARGS);
}

// k_dim == K exactly (the dk argument is not read).
#define DN_DELTA_K_INSTANCE(K)                                                                     \
    extern "C" __global__ void __launch_bounds__(DN_MAX_V) dn_delta_k##K(DN_DELTA_PARAMS) {        \
        dn_delta_segment<K, true>(DN_DELTA_ARGS);                                                   \
    }
DN_DELTA_K_LIST(DN_DELTA_K_INSTANCE)


// The chunked form of dn_delta_segment's rule over a segment's whole chunks of L = DN_CHUNK rows
// (deltanet_twin.py chunk_step has the derivation). Grid (nv, ceil(n / DN_CHUNK)): block (h, b) runs
// value head h over the segment of a live slot of at least chunk_min rows that starts among rows
// [b DN_CHUNK, (b + 1) DN_CHUNK), where one does (the other blocks return: a grid of one block a row
// would pass ~DN_CHUNK times as many empty blocks through the SMs). Two threads hold each column of
// S_h, half its rows each (twice the warps of a thread a column, and half the registers: a block has
// a head's columns only, and a prompt's heads are few blocks for the SMs). Per chunk, with G_r the
// cumulative log-decay of its rows 0..r (a_coef_h * softplus(alpha + dt_bias_h) summed) and
// b_r = sigmoid(beta):
//   mk[r][m] = e^{G_r - G_m} k_r . k_m (m < r),   mq[r][m] = e^{G_r - G_m} q_r . k_m (m <= r);
//   u_r = b_r (v_r - e^{G_r} S^T k_r - sum_{m<r} mk[r][m] u_m)          (forward substitution);
//   o_r = e^{G_r} S^T q_r + sum_{m<=r} mq[r][m] u_m;   S <- e^{G_L} S + sum_m e^{G_L - G_m} k_m u_m^T;
// then the gated RMSNorm of each o_r as dn_delta's. The decays are exponentials of differences of
// the cumulative logs, never ratios of products: over a chunk of strong decays the product
// underflows. out holds e^{G_r} S^T q_r between the passes over a chunk (each column's own).
// Block: 32 threads per 16 columns, v_dim <= DN_CHUNK_MAX_V (ops.dn_delta); dk == KD.
__device__ __forceinline__ float4 dn_ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// The state's dot products over dk (S^T q, S^T k) keep four partial sums (a float4's lanes): one sum
// would be a chain of dk dependent multiply-adds, and a block has few warps to hide its latency.
// (The chunk's k.k and q.k products and the solve keep one: with more there, ptxas spilled.)
// acc += a * s[0..3] lane by lane (s: a register array's static slice once unrolled)
__device__ __forceinline__ void dn_fma4(float4& acc, float4 a, const float* s) {
    acc.x += a.x * s[0];
    acc.y += a.y * s[1];
    acc.z += a.z * s[2];
    acc.w += a.w * s[3];
}

__device__ __forceinline__ float dn_sum4(float4 a) { return (a.x + a.y) + (a.z + a.w); }

template <int KD>
__device__ __forceinline__ void dn_chunk_segment(DN_DELTA_PARAMS) {
    // The tiles are read 4 floats a load (every inner loop is over k's dims); rows padded by 4 floats
    // keep them 16-byte aligned, and the products' lanes (a row m each) on distinct banks in each
    // quarter-warp. xs holds q's rows, then u's columns.
    constexpr int L = DN_CHUNK, KP = KD + 4, XW = KP > DN_CHUNK_MAX_V ? KP : DN_CHUNK_MAX_V, KH = KD / 2;
    static_assert(L == 32, "the cumulative decays are one warp's");
    static_assert(KH % 4 == 0 && XW % 4 == 0, "rows and halves of whole float4s");
    __shared__ __align__(16) float ks[L][KP];
    __shared__ __align__(16) float xs[L][XW];
    __shared__ float mk[L][L + 1], mq[L][L + 1], gs[L], bs[L], rs[L];
    __shared__ int first;
    const int h = blockIdx.x, j = threadIdx.x, nt = blockDim.x;
    const int warp = j >> 5, lane = j & 31, nw = nt >> 5;
    if (chunk_min < L) return;
    // the chunked segment starting among this block's L rows, if any: a lane a row (at most one
    // starts there: a chunked segment holds at least L rows); a candidate's rows are walked up to
    // chunk_min only
    if (j == 0) first = -1;
    __syncthreads();
    if (warp == 0) {
        const int r = blockIdx.y * L + lane;
        if (r < n && slots[r] != scratch && dn_segment_start(slots, pos, r)) {
            int e = r + 1;
            while (e < n && e - r < chunk_min && slots[e] == slots[r] && pos[e] == pos[e - 1] + 1) ++e;
            if (e - r >= chunk_min) first = r;
        }
    }
    __syncthreads();
    const int t = first;
    if (t < 0) return;
    const int end = dn_segment_end(slots, pos, t, n), slot = slots[t];
    const int kh = h % nk, last = t + (end - t) / L * L;
    // column cj of S, its rows [i0, i0 + KH): lanes l and l + 16 of a warp hold one column's halves
    const int cj = warp * 16 + (lane & 15), half = lane >> 4, i0 = half * KH;
    const bool col = cj < dv, fresh = pos[t] == 0;
    float* S = state + ((long long)slot * nv + h) * KD * dv + (long long)i0 * dv + cj;
    float s[KH];
#pragma unroll
    for (int i = 0; i < KH; ++i) s[i] = col && !fresh ? S[(long long)i * dv] : 0.0f;
    const float qscale = rsqrtf((float)KD);
    for (int c = t; c < last; c += L) {
        // the chunk's q and k, l2-normalised (q also / sqrt(dk)), a warp per row; its log-decays and betas
        for (int r = warp; r < L; r += nw) {
            const float* row = cv + (long long)(c + r) * cvs;
            float sq = 0.0f, sk = 0.0f;
            for (int i = lane; i < KD; i += 32) {
                const float qi = row[kh * KD + i], ki = row[(nk + kh) * KD + i];
                xs[r][i] = qi;
                ks[r][i] = ki;
                sq += qi * qi;
                sk += ki * ki;
            }
            const float rq = rsqrtf(warp_sum(sq) + 1e-6f) * qscale, rk = rsqrtf(warp_sum(sk) + 1e-6f);
            for (int i = lane; i < KD; i += 32) {       // (the lane's own writes above)
                xs[r][i] *= rq;
                ks[r][i] *= rk;
            }
            if (lane == 0) {
                gs[r] = a_coef[h] * dn_softplus(alpha[(long long)(c + r) * abs_ + h] + dt_bias[h]);
                bs[r] = 1.0f / (1.0f + expf(-beta[(long long)(c + r) * abs_ + h]));
            }
        }
        __syncthreads();
        if (warp == 0) {
            float g = gs[lane];
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float up = __shfl_up_sync(0xffffffffu, g, o);
                if (lane >= o) g += up;
            }
            gs[lane] = g;
        }
        __syncthreads();
        // the decay-weighted products: a warp's lanes on one row r, consecutive m
        for (int e = j; e < L * L; e += nt) {
            const int r = e / L, m = e % L;
            float kk = 0.0f, qk = 0.0f;
            if (m <= r) {
#pragma unroll 8
                for (int i = 0; i < KD; i += 4) {
                    const float4 a = dn_ld4(&ks[r][i]), b = dn_ld4(&ks[m][i]), q = dn_ld4(&xs[r][i]);
                    kk += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                    qk += q.x * b.x + q.y * b.y + q.z * b.z + q.w * b.w;
                }
            }
            const float d = m <= r ? expf(gs[r] - gs[m]) : 0.0f;
            mk[r][m] = m < r ? d * kk : 0.0f;
            mq[r][m] = d * qk;
        }
        // e^{G_r} S^T q_r into out, for the output pass below: each half's partial sum, the pair's
        // total by a shuffle (every lane of the warp passes it: a lane past dv works on zeros and
        // writes nothing global)
        for (int r = 0; r < L; ++r) {
            float4 qp = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int i = 0; i < KH; i += 4) dn_fma4(qp, dn_ld4(&xs[r][i0 + i]), s + i);
            const float o = dn_sum4(qp) + __shfl_xor_sync(0xffffffffu, dn_sum4(qp), 16);
            if (col && half == 0) out[(long long)(c + r) * os + h * dv + cj] = expf(gs[r]) * o;
        }
        __syncthreads();        // q is read; xs takes the columns of u
        {
            // both halves solve for the column's u, to the same values (the pair's sums are the same
            // floats in either order), and both write them; cj < XW for every lane (dv <= XW)
            const float* v = cv + (long long)c * cvs + 2 * nk * KD + h * dv + cj;
            for (int r = 0; r < L; ++r) {
                float4 kp = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (int i = 0; i < KH; i += 4) dn_fma4(kp, dn_ld4(&ks[r][i0 + i]), s + i);
                const float p = dn_sum4(kp) + __shfl_xor_sync(0xffffffffu, dn_sum4(kp), 16);
                float u = (col ? v[(long long)r * cvs] : 0.0f) - expf(gs[r]) * p;
                for (int m = 0; m < r; ++m) u -= mk[r][m] * xs[m][cj];
                xs[r][cj] = bs[r] * u;
            }
        }
        if (col && half == 0) {
            for (int r = 0; r < L; ++r) {
                float o = out[(long long)(c + r) * os + h * dv + cj];
                for (int m = 0; m <= r; ++m) o += mq[r][m] * xs[m][cj];
                out[(long long)(c + r) * os + h * dv + cj] = o;
            }
        }
        __syncthreads();        // every column of the chunk's outputs is in out
        for (int r = warp; r < L; r += nw) {
            float ss = 0.0f;
            for (int i = lane; i < dv; i += 32) {
                const float o = out[(long long)(c + r) * os + h * dv + i];
                ss += o * o;
            }
            ss = warp_sum(ss);
            if (lane == 0) rs[r] = rsqrtf(ss / dv + eps);
        }
        __syncthreads();
        const float gl = gs[L - 1];
        if (col) {          // the pair's halves take alternate rows
            const float nj = out_norm[cj];
            for (int r = half; r < L; r += 2) {
                const long long at = (long long)(c + r) * os + h * dv + cj;
                out[at] = out[at] * rs[r] * nj * silu_f(z[(long long)(c + r) * zs + h * dv + cj]);
            }
        }
        const float eg = expf(gl);
#pragma unroll
        for (int i = 0; i < KH; ++i) s[i] *= eg;
        for (int r = 0; r < L; ++r) {
            const float w = expf(gl - gs[r]) * xs[r][cj];
#pragma unroll
            for (int i = 0; i < KH; i += 4) {
                const float4 a = dn_ld4(&ks[r][i0 + i]);
                s[i] += a.x * w;
                s[i + 1] += a.y * w;
                s[i + 2] += a.z * w;
                s[i + 3] += a.w * w;
            }
        }
        __syncthreads();        // ks, xs, gs, bs and rs are rewritten by the next chunk
    }
    if (col) {
#pragma unroll
        for (int i = 0; i < KH; ++i) S[(long long)i * dv] = s[i];
    }
}

// dk == K exactly (the dk argument is not read): the chunked rule's instances, one per dn_delta_k<K>.
// (A minimum of one block an SM in the bounds: without it ptxas spilled a few registers on sm_90 at
// every dk, well under the registers a thread may have.)
#define DN_CHUNK_K_INSTANCE(K)                                                                        \
    extern "C" __global__ void __launch_bounds__(2 * DN_CHUNK_MAX_V, 1) dn_chunk_k##K(DN_DELTA_PARAMS) { \
        dn_chunk_segment<K>(DN_DELTA_ARGS);                                                         \
    }
DN_DELTA_K_LIST(DN_CHUNK_K_INSTANCE)
