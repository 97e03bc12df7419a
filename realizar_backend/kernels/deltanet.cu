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
// 3.6: 128) and half that. Other k_dims run dn_delta. backends/cuda/support.py DN_DELTA_K lists the same.
#define DN_DELTA_K_LIST(X) X(64) X(128)
// Largest v_dim: a delta-rule block has one thread per column of S, rounded up to a warp (Qwen3.5: 128).
// The backend refuses more.
#define DN_MAX_V 256

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
// registers; EXACT: dk == KD (a dn_delta_k<KD> instance), else dk <= KD.
template <int KD, bool EXACT>
__device__ __forceinline__ void dn_delta_segment(const float* __restrict__ cv, int cvs, const float* __restrict__ alpha,
                                                 const float* __restrict__ beta, int abs_, const float* __restrict__ z,
                                                 int zs, const float* __restrict__ a_coef,
                                                 const float* __restrict__ dt_bias, const float* __restrict__ out_norm,
                                                 float* __restrict__ state, const int* __restrict__ slots,
                                                 const int* __restrict__ pos, int scratch, int n, int nk, int dk_arg,
                                                 int nv, int dv, float eps, float* __restrict__ out, int os) {
    __shared__ float qs[KD], ks[KD], red[32];
    const int dk = EXACT ? KD : dk_arg;
    const int h = blockIdx.x, t = blockIdx.y, j = threadIdx.x;
    if (t >= n || !dn_segment_start(slots, pos, t)) return;
    const int end = dn_segment_end(slots, pos, t, n), slot = slots[t], kh = h % nk;
    const bool keep = slot != scratch, fresh = !keep || pos[t] == 0;
    const bool col = j < dv;
    float* S = state + ((long long)slot * nv + h) * dk * dv + j;
    float s[KD];
#pragma unroll
    for (int i = 0; i < KD; ++i) s[i] = col && i < dk && !fresh ? S[(long long)i * dv] : 0.0f;
    const float qscale = rsqrtf((float)dk);
    for (int r = t; r < end; ++r) {
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
        float* __restrict__ out, int os
#define DN_DELTA_ARGS cv, cvs, alpha, beta, abs_, z, zs, a_coef, dt_bias, out_norm, state, slots, pos, scratch, n, nk, \
                      dk, nv, dv, eps, out, os

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
