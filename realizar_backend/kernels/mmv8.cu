// One-row quantized GEMV on 8-bit activations (the q8_1 scheme of llama.cpp's mmvq): y[r] = W[r] . x
// with x quantized per 32 values (q = rint(x / d), d = max|x| / 127) into shared memory by the block
// itself, and each weight unit applied by 8 dp4a on its int8 values (common.cuh QUnit). For the
// types with a QUnit decoder (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); the others stay on
// mmvf.cu. Same arguments as mmvf.cu's mmvf_nb1 / ffnf_nb1 (the host swaps the function only).
//
// Why not mmvf.cu's layout at one row: its fp32 rows staged in shared memory take 4 K bytes (76 KB
// at K = 18944), so 2 blocks fit an SM, and its 32 activations a unit take 32 registers and 32 FMA
// + 32 PRMT per unit and row: few warps, each long in its arithmetic, cannot keep enough weight loads
// in flight. Here a row takes 1.25 K bytes (8 bits a value + 8 bytes a unit), a unit's activations
// 10 registers (two 16-byte and one 8-byte shared load) and 8 dp4a, so __launch_bounds__(MMV8_WARPS
// * 32, MMV8_MINB) holds the registers to 64 and the blocks to half the SM's warps (50% occupancy),
// every warp with MMV8_R x MMV8_UNROLL weight units (16-byte loads) in flight. The longest rows (the
// 32B down projection, K = 27648: 35 KB) stage too, so K is never split across blocks (no partial
// sums through global memory to add in a fixed order).
//
// A warp owns MMV8_R consecutive rows (of every matrix of the launch: ffn8's gate and up) and its
// lanes stride over 32-weight units; `wpr` warps share one row group for long rows, each a strided
// share of the units, their sums added through shared memory in a fixed order (bitwise the same
// result every run: no atomics on floats, the split of K stays inside a block). Blocks stride over
// the row groups (one resident wave, one staging per block). grid.y: one block column per
// activation row (rows past the first re-read the weights: the dispatcher sends one-row steps here).
// RMSNorm folded in (nw != 0): x / rms(x) * nw before the quantization. Argmax folded in (amax != 0,
// mmvf.cu's rule: an order-keeping 64-bit key per output, one atomicMax per block).
// Requirements (checked on the host): K % 32 == 0, x 16-byte aligned, xs % 4 == 0, 1.25 K bytes of
// dynamic shared memory (catalog.mmv8_smem). The defines' values: catalog.mmv8_options.
#include "common.cuh"

#ifndef MMV8_WARPS
#define MMV8_WARPS 16      // blocks of 16 warps: each block quantizes the whole input, 2 blocks an SM
#endif
#ifndef MMV8_R
#define MMV8_R 2
#endif
#ifndef MMV8_MINB
#define MMV8_MINB 2        // blocks per SM the registers must allow: 2 x 16 warps = 32 warps, 64 registers
#endif
#ifndef MMV8_UNROLL
#define MMV8_UNROLL 1      // loop trips a lane's loads are issued for at once (one memory latency)
#endif
#ifndef MMV8_STAGE_UNROLL
#define MMV8_STAGE_UNROLL 8   // float4 loads in flight per thread while quantizing the input (catalog.py)
#endif
constexpr int kMmv8Unroll = MMV8_UNROLL;

#ifdef REALIZAR_HOST_TEST
#define MMV8_DYN_SMEM(name) u8* name = emu::dyn_smem()
#else
#define MMV8_DYN_SMEM(name) extern __shared__ __align__(16) u8 name[]
#endif

// Staged row: unit u's 32 int8 values at bytes 32u.., its 16-byte halves swapped when bit 2 of u is
// set (the 8 lanes of a quarter-warp read units u..u+7: without the swap 4 of them share banks),
// then one float2 (d, d * sum q) per unit at byte K.
__device__ __forceinline__ int mmv8_half(int u, int h) { return 16 * (h ^ ((u >> 2) & 1)); }

// sum over the 8 lanes of an aligned lane group (the 8 float4 pieces of one unit)
__device__ __forceinline__ float mmv8_sum8(float v) {
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float mmv8_max8(float v) {
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Quantize one activation row x[0..K) (times inv * nw[k] when nw) into the staged layout at sm. A
// thread takes float4 pieces g = tid + i * blockDim (piece g & 7 of unit g >> 3: the 8 pieces of a
// unit are 8 neighbouring lanes), MMV8_STAGE_UNROLL loads issued before any is used. Block-uniform
// trip counts (the shuffles need every lane); a lane group is wholly inside or past the row.
__device__ __forceinline__ void mmv8_quant(const float* __restrict__ x, int K, const float* __restrict__ nw, float inv,
                                           u8* sm) {
    const int n4 = K >> 2, step = blockDim.x * MMV8_STAGE_UNROLL;
    float2* ds = (float2*)(sm + K);
    for (int base = 0; base < n4; base += step) {
        float4 v[MMV8_STAGE_UNROLL];
#pragma unroll
        for (int i = 0; i < MMV8_STAGE_UNROLL; ++i) {
            int g = base + threadIdx.x + i * blockDim.x;
            v[i] = g < n4 ? __ldg((const float4*)x + g) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (nw && g < n4) {
                float4 w = __ldg((const float4*)nw + g);
                v[i] = make_float4(v[i].x * inv * w.x, v[i].y * inv * w.y, v[i].z * inv * w.z, v[i].w * inv * w.w);
            }
        }
#pragma unroll
        for (int i = 0; i < MMV8_STAGE_UNROLL; ++i) {
            int g = base + threadIdx.x + i * blockDim.x, u = g >> 3, c = g & 7;
            float m = mmv8_max8(fmaxf(fmaxf(fabsf(v[i].x), fabsf(v[i].y)), fmaxf(fabsf(v[i].z), fabsf(v[i].w))));
            float d = m / 127.0f;                              // as quant_q8_lane (common.cuh)
            float id = d > 0.0f ? 1.0f / d : 0.0f;
            int q0 = (int)rintf(v[i].x * id), q1 = (int)rintf(v[i].y * id);
            int q2 = (int)rintf(v[i].z * id), q3 = (int)rintf(v[i].w * id);
            float s = mmv8_sum8((float)((q0 + q1) + (q2 + q3)));    // |sum| <= 32 * 127: exact
            if (g < n4) {
                *(u32*)(sm + 32 * u + mmv8_half(u, c >> 2) + 4 * (c & 3)) =
                    (u32)(q0 & 255) | ((u32)(q1 & 255) << 8) | ((u32)(q2 & 255) << 16) | ((u32)(q3 & 255) << 24);
                if (c == 0) ds[u] = make_float2(d, d * s);
            }
        }
    }
}

// 1 / rms(x) over the block (the folded norm's scale); block-uniform barriers
__device__ __forceinline__ float mmv8_inv_rms(const float* __restrict__ x, int K, float eps) {
    __shared__ float part[MMV8_WARPS];
    __shared__ float inv_s;
    float ss = 0.0f;
#pragma unroll 4
    for (int g = threadIdx.x; g < (K >> 2); g += blockDim.x) {
        float4 v = __ldg((const float4*)x + g);
        ss += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (int w = 0; w < MMV8_WARPS; ++w) t += part[w];
        inv_s = rsqrtf(t / K + eps);
    }
    __syncthreads();
    return inv_s;
}

// the dot of a decoded unit with staged unit u (halves a, c; (d, d * sum q) ds), as qunit_dot
__device__ __forceinline__ float mmv8_dot(const QUnit& w, int4 a, int4 c, float2 ds) {
    int lo = __dp4a(w.v[0], a.x, __dp4a(w.v[1], a.y, __dp4a(w.v[2], a.z, __dp4a(w.v[3], a.w, 0))));
    int hi = __dp4a(w.v[4], c.x, __dp4a(w.v[5], c.y, __dp4a(w.v[6], c.z, __dp4a(w.v[7], c.w, 0))));
    return w.A * ds.x * (float)(w.s0 * lo + w.s1 * hi) + w.C * ds.y;
}

// rows of a group whose units a lane loads together: all MMV8_R, but Q5_K's unit (four 16-byte loads
// and its fifth bits) takes so many registers that two rows of them spill at 64: one row at a time
__host__ __device__ constexpr int mmv8_flight(int qt) { return qt == QT_Q5_K ? 1 : MMV8_R; }

// partial sums of rows r0 .. r0+R-1 (clamped to rlast: rows past the end repeat the last one and
// are never stored) of M matrices over units u0, u0 + ustep, ... . The units' weight loads of a trip
// (mmv8_flight rows of them) are issued before the first shared-memory read, so that many x M x
// MMV8_UNROLL are in flight.
template <int QT, int M>
__device__ __forceinline__ void mmv8_rows(const u8* const (&W)[M], long long rb, int r0, int rlast, int nu, int u0,
                                          int ustep, const u8* sm, float (&acc)[M][MMV8_R]) {
    const u8* rows[M][MMV8_R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i = 0; i < MMV8_R; ++i) rows[m][i] = W[m] + (long long)min(r0 + i, rlast) * rb;
    const float2* ds = (const float2*)(sm + 32 * nu);
#pragma unroll kMmv8Unroll
    for (int u = u0; u < nu; u += ustep) {
        constexpr int F = mmv8_flight(QT);
        int4 a, c;
        float2 d;
#pragma unroll
        for (int i0 = 0; i0 < MMV8_R; i0 += F) {
            QUnit w[M][F];
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int i = 0; i < F; ++i) load_qunit<QT>(rows[m][i0 + i], u, nu, w[m][i]);
            if (i0 == 0) {
                a = *(const int4*)(sm + 32 * u + mmv8_half(u, 0));
                c = *(const int4*)(sm + 32 * u + mmv8_half(u, 1));
                d = ds[u];
            }
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int i = 0; i < F; ++i) acc[m][i0 + i] += mmv8_dot(w[m][i], a, c, d);
        }
    }
}

template <int M>
__device__ __forceinline__ void mmv8_dispatch(int qt, const u8* const (&W)[M], long long rb, int r0, int rlast, int nu,
                                              int u0, int ustep, const u8* sm, float (&acc)[M][MMV8_R]) {
#define MMV8_CASE(Q) case Q: if constexpr (QT_ON(Q)) mmv8_rows<Q, M>(W, rb, r0, rlast, nu, u0, ustep, sm, acc); break;
    switch (qt) {
        MMV8_CASE(QT_Q4_0)
        MMV8_CASE(QT_Q4_1)
        MMV8_CASE(QT_Q5_0)
        MMV8_CASE(QT_Q5_1)
        MMV8_CASE(QT_Q8_0)
        MMV8_CASE(QT_Q4_K)
        MMV8_CASE(QT_Q5_K)
        MMV8_CASE(QT_Q6_K)
        default: break;
    }
#undef MMV8_CASE
}

// sums over the warp's lanes, then (wpr > 1) over the warps of a group in warp order; on return
// every lane of the group's first warp (sub == 0) holds the totals. Block-uniform barrier.
template <int M>
__device__ __forceinline__ void mmv8_reduce(float (&acc)[M][MMV8_R], int wpr, int wid, int sub, int lane) {
    __shared__ float red[MMV8_WARPS][M][MMV8_R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i = 0; i < MMV8_R; ++i) acc[m][i] = warp_sum(acc[m][i]);
    if (wpr > 1) {
        if (lane == 0)
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int i = 0; i < MMV8_R; ++i) red[wid][m][i] = acc[m][i];
        __syncthreads();
        if (sub == 0)
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int i = 0; i < MMV8_R; ++i) {
                    float s = red[wid][m][i];
                    for (int w = 1; w < wpr; ++w) s += red[wid + w][m][i];
                    acc[m][i] = s;
                }
    }
}

// mmvf.cu's fused argmax: the block's largest key into amax[0] by one atomicMax; block-uniform barrier
__device__ __forceinline__ void mmv8_argmax(unsigned long long best, unsigned long long* amax) {
    __shared__ unsigned long long red[MMV8_WARPS];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long t = __shfl_xor_sync(0xffffffffu, best, o);
        best = t > best ? t : best;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long m = 0ull;
        for (int w = 0; w < MMV8_WARPS; ++w) m = red[w] > m ? red[w] : m;
        atomicMax(amax, m);
    }
}

// One matrix of an mmv8 launch and where its outputs go (mmvf.cu's MmvfSeg).
struct Mmv8Seg {
    const u8* W;
    long long rb;
    int n, qt;
    const float* bias;
    float* y;
    int ys;
};

// the segment holding launch-wide row group G, and G's index inside it (g); warp-uniform
__device__ __forceinline__ Mmv8Seg mmv8_seg(const Mmv8Seg (&s)[3], int G, int& g) {
    int g0 = (s[0].n + MMV8_R - 1) / MMV8_R, g1 = (s[1].n + MMV8_R - 1) / MMV8_R;
    g = G;
    if (G < g0) return s[0];
    g -= g0;
    if (g < g1) return s[1];
    g -= g1;
    return s[2];
}

// the block's activation row (blockIdx.y) quantized into sm, after the first round's rows went
// towards L2 (prefetch(G) names them) and the kernel before finished; block-uniform barriers
__device__ __forceinline__ void mmv8_stage(const float* __restrict__ x, int xs, int K, const float* nw, float eps,
                                           u8* sm) {
    pdl_wait();
    const float* xr = x + (long long)blockIdx.y * xs;
    float inv = nw ? mmv8_inv_rms(xr, K, eps) : 1.0f;
    mmv8_quant(xr, K, nw, inv, sm);
    __syncthreads();
}

__device__ __forceinline__ void mmv8_body(const Mmv8Seg (&seg)[3], int K, const float* __restrict__ x, int xs,
                                          int wpr, int accumulate, const float* nw, float eps,
                                          unsigned long long* amax) {
    MMV8_DYN_SMEM(sm);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int gpb = MMV8_WARPS / wpr, sub = wid % wpr;
    int groups = 0;
#pragma unroll
    for (int i = 0; i < 3; ++i) groups += (seg[i].n + MMV8_R - 1) / MMV8_R;
    int b = blockIdx.y;
    unsigned long long best = 0ull;       // this thread's largest argmax key (amax)
    {   // the first round's rows towards L2 while the kernel before may still run
        int G = blockIdx.x * gpb + wid / wpr, g;
        if (sub == 0 && lane == 0 && G < groups) {
            Mmv8Seg s = mmv8_seg(seg, G, g);
            l2_prefetch(s.W + (long long)g * MMV8_R * s.rb, (long long)min(MMV8_R, s.n - g * MMV8_R) * s.rb);
        }
    }
    mmv8_stage(x, xs, K, nw, eps, sm);
    for (int base = blockIdx.x * gpb; base < groups; base += gridDim.x * gpb) {   // block-uniform trips
        int G = base + wid / wpr;
        bool live = G < groups;
        int g;
        Mmv8Seg s = mmv8_seg(seg, live ? G : 0, g);
        int r0 = g * MMV8_R;
        float acc[1][MMV8_R];
#pragma unroll
        for (int i = 0; i < MMV8_R; ++i) acc[0][i] = 0.0f;
        const u8* const Ws[1] = {s.W};
        if (live) mmv8_dispatch<1>(s.qt, Ws, s.rb, r0, s.n - 1, K >> 5, sub * 32 + lane, 32 * wpr, sm, acc);
        if (base + gridDim.x * gpb >= groups) pdl_trigger();     // the block's last round: loads issued
        mmv8_reduce<1>(acc, wpr, wid, sub, lane);
        if (live && sub == 0) {
#pragma unroll
            for (int i = 0; i < MMV8_R; ++i) {
                int r = r0 + i;
                if (lane == i && r < s.n) {                      // outputs spread over the lanes
                    float v = acc[0][i] + (s.bias ? s.bias[r] : 0.0f);
                    float* out = s.y + (long long)b * s.ys + r;
                    *out = accumulate ? *out + v : v;
                    if (amax) {
                        unsigned long long k = argmax_key(v, r);
                        best = k > best ? k : best;
                    }
                }
            }
        }
        if (wpr > 1) __syncthreads();      // mmv8_reduce's shared buffer is reused next round
    }
    if (amax) mmv8_argmax(best, amax + b);
}

__device__ __forceinline__ void ffn8_body(const u8* Wg, const u8* Wu, long long rb, int N, int K, int qt,
                                          const float* __restrict__ x, int xs, int act, float* a, int as, int wpr,
                                          const float* nw, float eps) {
    MMV8_DYN_SMEM(sm);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int gpb = MMV8_WARPS / wpr, sub = wid % wpr;
    int groups = (N + MMV8_R - 1) / MMV8_R;
    int b = blockIdx.y;
    {   // as mmv8_body: the first round's gate and up rows towards L2
        int G = blockIdx.x * gpb + wid / wpr;
        if (sub == 0 && lane < 2 && G < groups)
            l2_prefetch((lane ? Wu : Wg) + (long long)G * MMV8_R * rb, (long long)min(MMV8_R, N - G * MMV8_R) * rb);
    }
    mmv8_stage(x, xs, K, nw, eps, sm);
    for (int base = blockIdx.x * gpb; base < groups; base += gridDim.x * gpb) {   // as mmv8_body
        int G = base + wid / wpr;
        bool live = G < groups;
        int r0 = G * MMV8_R;
        float acc[2][MMV8_R];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int i = 0; i < MMV8_R; ++i) acc[m][i] = 0.0f;
        const u8* const Ws[2] = {Wg, Wu};
        if (live) mmv8_dispatch<2>(qt, Ws, rb, r0, N - 1, K >> 5, sub * 32 + lane, 32 * wpr, sm, acc);
        if (base + gridDim.x * gpb >= groups) pdl_trigger();
        mmv8_reduce<2>(acc, wpr, wid, sub, lane);
        if (live && sub == 0) {
#pragma unroll
            for (int i = 0; i < MMV8_R; ++i)
                if (lane == i && r0 + i < N) a[(long long)b * as + r0 + i] = act_f(acc[0][i], act) * acc[1][i];
        }
        if (wpr > 1) __syncthreads();
    }
}

// MMV8_KIND: 1 = mmv8_nb1 only, 2 = ffn8_nb1 only, unset = both (separate modules, as mmvf.cu's).
// The arguments are mmvf.cu's (nb, stage and lpg unused: one activation row a block column, always
// staged, a warp a group).
#if !defined(MMV8_KIND) || MMV8_KIND == 1
extern "C" __global__ void __launch_bounds__(MMV8_WARPS * 32, MMV8_MINB) mmv8_nb1(
    const u8* W0, long long rb0, int n0, int qt0, const float* b0, float* y0, int ys0,
    const u8* W1, long long rb1, int n1, int qt1, const float* b1, float* y1, int ys1,
    const u8* W2, long long rb2, int n2, int qt2, const float* b2, float* y2, int ys2,
    int K, const float* x, int xs, int nb, int wpr, int accumulate, int stage, const float* nw,
    float eps, unsigned long long* amax) {
    const Mmv8Seg seg[3] = {{W0, rb0, n0, qt0, b0, y0, ys0}, {W1, rb1, n1, qt1, b1, y1, ys1},
                            {W2, rb2, n2, qt2, b2, y2, ys2}};
    mmv8_body(seg, K, x, xs, wpr, accumulate, nw, eps, amax);
}
#endif
#if !defined(MMV8_KIND) || MMV8_KIND == 2
extern "C" __global__ void __launch_bounds__(MMV8_WARPS * 32, MMV8_MINB) ffn8_nb1(
    const u8* Wg, const u8* Wu, long long rb, int N, int K, int qt, const float* x, int xs, int nb,
    int act, float* a, int as, int wpr, int stage, const float* nw, float eps, int lpg) {
    ffn8_body(Wg, Wu, rb, N, K, qt, x, xs, act, a, as, wpr, nw, eps);
}
#endif
