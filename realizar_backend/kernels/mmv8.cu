// One-row quantized GEMV on 8-bit activations (the q8_1 scheme of llama.cpp's mmvq): y[r] = W[r] . x
// with x quantized per 32 values (q = rint(x / d), d = max|x| / 127) once per input by mmv8_q8 (the
// RMSNorm folded in there), and each weight unit applied by dp4a on its int8 values. For the types
// with a QUnit decoder (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K in common.cuh; IQ4_NL,
// IQ4_XS and MXFP4 below, through their levels tables); the others stay on mmvf.cu.
//
// Why the input is quantized by its own launch: every block of a GEMV needs the whole row, and a
// block that quantized it itself (a read of K floats and the arithmetic, before any weight is used)
// spent a fifth of a down projection's time there; copying the 8-bit row (1.25 K bytes) costs one
// 16-byte asynchronous copy per thread. mmv8_q8 is a few blocks (one per 1024 values); the GEMV that
// follows waits for it with pdl_wait, the head of its first rows on the way to L2 by then.
//
// A block stages the quantized row in shared memory (mmv8_smem bytes) and its warps stride over row
// groups: a warp owns MMV8_R consecutive rows (of every matrix of the launch: ffn8's gate and up),
// `wpr` warps share one group for long rows, each a strided share of it, their sums added through
// shared memory in a fixed order (bitwise the same result every run: no atomics on floats, the split
// of K stays inside a block). Blocks stride over the groups (one resident wave). grid.y: one block
// column per activation row (rows past the first re-read the weights: the dispatcher sends one-row
// steps here). Argmax folded in (amax != 0, mmvf.cu's rule: an order-keeping 64-bit key per output,
// one atomicMax per block).
//
// Q4_K (most of a Q4_K_M model's bytes) has a loop of its own: a lane takes one 16-byte piece of a
// super-block's 128 quant bytes (both nibbles: values l..l+15 of units 2p and 2p + 1), so the 8
// lanes of a quarter-warp cover one super-block and a warp four, every quant byte loaded once:
// mmv8_nb1 and ffn8_nb1 through a ring of MMV8_RING trips in shared memory (mmv8_q4k_ring), the
// experts' kernels, whose shared memory holds several rows, MMV8_LD trips in registers. The other
// types take one 32-value unit a lane (QUnit, common.cuh).
// Requirements (checked on the host): K % 32 == 0, x 16-byte aligned, xs % 4 == 0, mmv8_smem(K)
// bytes of dynamic shared memory, and the warps' rings after them (catalog.mmv8_ring_smem). The
// defines' values: catalog.mmv8_options.
#include "common.cuh"
#include "cp_async.cuh"

#ifndef MMV8_WARPS
#define MMV8_WARPS 16      // blocks of 16 warps, 2 blocks an SM
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
#ifndef MMV8_LD
#define MMV8_LD 1          // trips of Q4_K weights a lane holds in registers (the one it works on included)
#endif
#ifndef MMV8_RING
#define MMV8_RING 0        // Q4_K trips a warp's shared-memory ring holds (mmv8_q4k_ring); 0: mmv8_q4k
#endif
#if MMV8_RING > 0 && (!defined(MMV8_KIND) || MMV8_KIND == 3)
#error "the Q4_K ring follows a single staged row: mmv8_nb1 and ffn8_nb1 only (MMV8_KIND 1 or 2)"
#endif
#ifndef MMV8_PF_BYTES
#define MMV8_PF_BYTES 2048 // the head of each first-round row sent towards L2 while mmv8_q8 runs (~3 trips)
#endif
constexpr int kMmv8Unroll = MMV8_UNROLL;

#ifdef REALIZAR_HOST_TEST
#define MMV8_DYN_SMEM(name) u8* name = emu::dyn_smem()
#define MMV8_PIN(x) (void)0
#define MMV8_PIN64(x) (void)0
#else
#define MMV8_DYN_SMEM(name) extern __shared__ __align__(16) u8 name[]
// keeps a lane constant in its register: the compiler would recompute it in every loop trip
#define MMV8_PIN(x) asm volatile("" : "+r"(x))
#define MMV8_PIN64(x) asm volatile("" : "+l"(x))
#endif

// ------------------------------------------------------------------ the 8-bit row
// Unit u's 32 int8 values (half h: values 16h..16h+15) at byte mmv8_off(u, h): super-block s = u >> 3
// takes bytes 256 s .. 256 s + 255, its even units the first 128, its odd units the second. The 8
// lanes of a quarter-warp then read 128 distinct contiguous bytes in both loops: Q4_K's lanes read
// half (c & 1) of units 2p and 2p + 1 (c = 2p + (c & 1)); a unit-per-lane loop reads half (u & 1)
// of unit u first, then the other. The int8 part is padded to mmv8_kpad(K) bytes; (d, d * sum q) as a
// float2 per unit follows it. The row takes catalog.mmv8_smem(K) bytes (whole 16-byte pieces).
__host__ __device__ constexpr int mmv8_kpad(int K) { return (K + 255) & ~255; }
// bytes of one staged row (catalog.mmv8_smem): the int8 part, the float2 per unit, whole 16-byte pieces
__host__ __device__ constexpr int mmv8_row_bytes(int K) { return (mmv8_kpad(K) + 8 * (K >> 5) + 15) & ~15; }
__device__ __forceinline__ int mmv8_off(int u, int h) {
    return 256 * (u >> 3) + 128 * (u & 1) + 32 * ((u >> 1) & 3) + 16 * h;
}

// sum and max over the 8 lanes of an aligned lane group (the 8 float4 pieces of one unit)
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

#if !defined(MMV8_KIND) || MMV8_KIND == 1 || defined(REALIZAR_HOST_TEST)
// xq[b] = the 8-bit form of x[b] (times 1 / rms(x[b]) * nw when nw): a thread per float4 piece g
// (piece g & 7 of unit g >> 3: the 8 pieces of a unit are 8 neighbouring lanes), grid.y rows.
// Every block computes the row's sum of squares itself (a read of K floats from L2), so the blocks
// never wait on each other. Rounding as quant_q8_lane (common.cuh), the norm as mmvf.cu folds it.
// 256 threads (catalog.MMV8_Q8_THREADS)
extern "C" __global__ void __launch_bounds__(256) mmv8_q8(const float* __restrict__ x, int xs, int K,
                                                          const float* __restrict__ nw, float eps, u8* xq,
                                                          long long xqs) {
    pdl_wait();
    pdl_trigger();     // a few blocks, all placed at once: the GEMV's blocks may take the SMs' rest
    const float* xr = x + (long long)blockIdx.y * xs;
    u8* out = xq + blockIdx.y * xqs;
    const int n4 = K >> 2, g = blockIdx.x * blockDim.x + threadIdx.x;
    float inv = 1.0f;
    if (nw) {
        __shared__ float red[32];
        float ss = 0.0f;
        for (int i = threadIdx.x; i < n4; i += blockDim.x) {
            float4 v = __ldg((const float4*)xr + i);
            ss += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
        }
        inv = rsqrtf(block_reduce(ss, 0, red) / K + eps);
    }
    float4 v = g < n4 ? __ldg((const float4*)xr + g) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (nw && g < n4) {
        float4 w = __ldg((const float4*)nw + g);
        v = make_float4(v.x * inv * w.x, v.y * inv * w.y, v.z * inv * w.z, v.w * inv * w.w);
    }
    int u = g >> 3, c = g & 7;
    float m = mmv8_max8(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    float d = m / 127.0f;                                  // as quant_q8_lane (common.cuh)
    float id = d > 0.0f ? 1.0f / d : 0.0f;
    int q0 = (int)rintf(v.x * id), q1 = (int)rintf(v.y * id);
    int q2 = (int)rintf(v.z * id), q3 = (int)rintf(v.w * id);
    float s = mmv8_sum8((float)((q0 + q1) + (q2 + q3)));      // |sum| <= 32 * 127: exact
    if (g < n4) {
        *(u32*)(out + mmv8_off(u, c >> 2) + 4 * (c & 3)) =
            (u32)(q0 & 255) | ((u32)(q1 & 255) << 8) | ((u32)(q2 & 255) << 16) | ((u32)(q3 & 255) << 24);
        if (c == 0) ((float2*)(out + mmv8_kpad(K)))[u] = make_float2(d, d * s);
    }
}
#endif

// the block's activation row (row: blockIdx.y, moe8's a pair's token) copied into sm once the launch
// before (mmv8_q8) finished; block-uniform barrier. Only the head of each first-round row goes towards L2 before it
// (MMV8_PF_BYTES): one resident wave reads every row in its first round, and a bulk prefetch of
// whole rows ran ahead of the loads and was evicted before use (a down projection took 30% longer)
__device__ __forceinline__ void mmv8_stage(const u8* __restrict__ xq, long long xqs, int K, u8* sm, int row) {
    pdl_wait();
    const u8* src = xq + row * xqs;
    const int n16 = mmv8_row_bytes(K) >> 4;
    for (int i = threadIdx.x; i < n16; i += blockDim.x) cp_async16(sm + 16 * i, src + 16 * i);
    cp_async_wait_all();
    __syncthreads();
}

// as mmv8_stage, rows row0 .. row0 + n - 1 (each xqs bytes apart in xq), back to back in sm: row j at
// sm + j mmv8_row_bytes(K) (moe8_down_combine's pairs of one token)
__device__ __forceinline__ void mmv8_stage_rows(const u8* __restrict__ xq, long long xqs, int K, u8* sm, int row0,
                                                int n) {
    pdl_wait();
    const u8* src = xq + row0 * xqs;
    const int n16 = mmv8_row_bytes(K) >> 4;
    for (int i = threadIdx.x; i < n * n16; i += blockDim.x) {
        const int j = i / n16;
        cp_async16(sm + 16 * i, src + j * xqs + 16 * (i - j * n16));
    }
    cp_async_wait_all();
    __syncthreads();
}

// ------------------------------------------------------------------ one unit a lane (QUnit types)
// the QUnit of the 4-bit level types (lowbit.cuh; one scale a unit, no min): the stored byte
// b = q + 128 with its top bit flipped is q as an int8 (levels -127..113; MXFP4's -12..12), the
// weight a0 q
template <int QT>
__device__ __forceinline__ void mmv8_level_unit(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    LUnit x;
    load_lunit<QT>(row, u, nu, x);
#pragma unroll
    for (int i = 0; i < 8; ++i) w.v[i] = (int)(x.v[i] ^ 0x80808080u);
    w.A = x.a0; w.C = 0.0f; w.s0 = w.s1 = 1;
}
template <> __device__ __forceinline__ void load_qunit<QT_IQ4_NL>(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    mmv8_level_unit<QT_IQ4_NL>(row, u, nu, w);
}
template <> __device__ __forceinline__ void load_qunit<QT_IQ4_XS>(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    mmv8_level_unit<QT_IQ4_XS>(row, u, nu, w);
}
// MXFP4 (gpt-oss's experts): E2M1 values doubled, -12..12, with the halved power-of-two scale in a0
template <> __device__ __forceinline__ void load_qunit<QT_MXFP4>(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    mmv8_level_unit<QT_MXFP4>(row, u, nu, w);
}

// the dot of a decoded unit with activation halves a (values 0..15), c (16..31) and (d, d * sum q)
__device__ __forceinline__ float mmv8_dot(const QUnit& w, int4 a, int4 c, float2 ds) {
    int lo = __dp4a(w.v[0], a.x, __dp4a(w.v[1], a.y, __dp4a(w.v[2], a.z, __dp4a(w.v[3], a.w, 0))));
    int hi = __dp4a(w.v[4], c.x, __dp4a(w.v[5], c.y, __dp4a(w.v[6], c.z, __dp4a(w.v[7], c.w, 0))));
    return w.A * ds.x * (float)(w.s0 * lo + w.s1 * hi) + w.C * ds.y;
}

__device__ __forceinline__ int4 mmv8_sel(bool s, int4 a, int4 b) {
    return make_int4(s ? a.x : b.x, s ? a.y : b.y, s ? a.z : b.z, s ? a.w : b.w);
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
    const float2* ds = (const float2*)(sm + mmv8_kpad(32 * nu));
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
            if (i0 == 0) {     // half (u & 1) first: the quarter-warp's 8 units fill 8 distinct 16-byte slots
                const bool odd = u & 1;
                int4 f = *(const int4*)(sm + mmv8_off(u, odd)), s = *(const int4*)(sm + mmv8_off(u, !odd));
                a = mmv8_sel(odd, s, f);
                c = mmv8_sel(odd, f, s);
                d = ds[u];
            }
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int i = 0; i < F; ++i) acc[m][i0 + i] += mmv8_dot(w[m][i], a, c, d);
        }
    }
}

// ------------------------------------------------------------------ Q4_K: a 16-byte piece a lane
// 16-byte weight load, not kept in L1 (read once); a plain load on the host
__device__ __forceinline__ uint4 mmv8_ldw(const u8* p) {
#if defined(__CUDA_ARCH__)
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
#else
    return *(const uint4*)p;
#endif
}

// dp4a with unsigned bytes in a (Q4_K's high nibbles in place: 16 x their value, up to 240)
__device__ __forceinline__ int dp4a_u8s8(u32 a, int b, int c) {
#if defined(__CUDA_ARCH__)
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    for (int k = 0; k < 4; ++k) c += (int)((a >> (8 * k)) & 255u) * (int)(signed char)((u32)b >> (8 * k));
    return c;
#endif
}

// A Q4_K lane's constants: the scale and min of units 2p, 2p + 1 are bytes of 16-bit half (p & 1) of
// the scale words; pairs 2, 3 take their low 4 bits from word 2 and their high 2 from bits 6-7 of
// words 0 / 1
struct Mmv8Q4kLane {
    u32 sh, shA, sh4, mA, mC;
};
__device__ __forceinline__ Mmv8Q4kLane mmv8_q4k_lane(int p) {
    const u32 sh = 16 * (p & 1);
    return {sh, sh + (p >= 2 ? 2u : 0u), sh + 4, p >= 2 ? 0x3030u : 0x3F3Fu, p >= 2 ? 0x0F0Fu : 0u};
}

// A lane's activations of a trip (the same for every row): the halves a0 (units 2p's) and a1 (2p +
// 1's) at sm + ao, their (d, d sum q) pairs at sm + dof; dz carries the high nibbles' 1/16, and my, mw
// (d x sum q) are scaled by hm (1.0f on a unit's first half, 0 on its second: the min term once a unit)
struct Mmv8Q4kAct {
    int4 a0, a1;
    float dx, dz, my, mw;
};
__device__ __forceinline__ Mmv8Q4kAct mmv8_q4k_act(const u8* sm, int ao, int dof, u32 hm) {
    const float4 dd = *(const float4*)(sm + dof);
    return {*(const int4*)(sm + ao), *(const int4*)(sm + ao + 128), dd.x, dd.z * 0.0625f,
            dd.y * __uint_as_float(hm), dd.w * __uint_as_float(hm)};
}

// acc plus one row's piece: w its 16 quant bytes (units 2p, 2p + 1: low nibbles against x.a0, high
// nibbles, 16 x their value, against x.a1), h its super-block's head (d, dmin, 12 scale bytes)
__device__ __forceinline__ float mmv8_q4k_piece(uint4 w, uint4 h, const Mmv8Q4kAct& x, const Mmv8Q4kLane& ks,
                                                float acc) {
    const u32 L = 0x0F0F0F0Fu;
    int s0 = __dp4a((int)(w.x & L), x.a0.x, __dp4a((int)(w.y & L), x.a0.y,
             __dp4a((int)(w.z & L), x.a0.z, __dp4a((int)(w.w & L), x.a0.w, 0))));
    int s1 = dp4a_u8s8(w.x & ~L, x.a1.x, dp4a_u8s8(w.y & ~L, x.a1.y,
             dp4a_u8s8(w.z & ~L, x.a1.z, dp4a_u8s8(w.w & ~L, x.a1.w, 0))));
    u32 sc = ((h.w >> ks.sh) & ks.mC) | ((h.y >> ks.shA) & ks.mA);       // scales of units 2p, 2p + 1
    u32 mn = ((h.w >> ks.sh4) & ks.mC) | ((h.z >> ks.shA) & ks.mA);      // their mins
    float d = h2f((u16)(h.x & 0xFFFF)), dmin = h2f((u16)(h.x >> 16));
    float v = (float)((int)(sc & 255) * s0) * x.dx + (float)((int)(sc >> 8) * s1) * x.dz;
    float mt = (float)(mn & 255) * x.my + (float)(mn >> 8) * x.mw;
    return fmaf(d, v, fmaf(-dmin, mt, acc));
}

// Partial sums of rows r0 .. r0+R-1 (clamped to rlast) of M Q4_K matrices over super-block trips
// t0, t0 + tstep, ... (a trip: 4 super-blocks, 576 bytes of a row). Lane: super-block 4t + (lane >> 3)
// of the trip, piece c = lane & 7 of its 128 quant bytes (c = 2p + h: values 16h..16h+15 of units 2p
// (low nibbles) and 2p + 1 (high nibbles)), and the block's 16-byte head (d, dmin, 12 scale bytes),
// which the 8 lanes of the super-block load alike (one L1 line). Loads of trip k + MMV8_LD - 1 are
// issued before trip k is worked on.
template <int M>
__device__ __forceinline__ void mmv8_q4k(const u8* const (&W)[M], long long rb, int r0, int rlast, int nu, int t0,
                                         int tstep, const u8* sm, float (&acc)[M][MMV8_R]) {
    constexpr int S = M * MMV8_R, D = MMV8_LD;
    const int lane = threadIdx.x & 31, c = lane & 7, q = lane >> 3, p = c >> 1;
    const int nsb = nu >> 3, trips = (nsb + 3) >> 2;
    Mmv8Q4kLane ks = mmv8_q4k_lane(p);
    u32 hm = (c & 1) ? 0u : 0x3F800000u;                  // 1.0f: the min term once a unit (first half)
    int ql = (nsb - q + 3) >> 2;                          // trips in which this lane has a super-block
    MMV8_PIN(ks.sh); MMV8_PIN(ks.shA); MMV8_PIN(ks.sh4); MMV8_PIN(ks.mA); MMV8_PIN(ks.mC); MMV8_PIN(hm); MMV8_PIN(ql);
    const u8* rows[S];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i = 0; i < MMV8_R; ++i)
            rows[m * MMV8_R + i] = W[m] + (long long)min(r0 + i, rlast) * rb + 144 * q + 16 + 16 * c;
    // the halves of units 2p, 2p + 1 of the lane's super-block at act + 1024 t, their (d, d sum q)
    // pairs at dsp + 256 t; a lane past the row's end reads super-block 0's instead (discarded)
    int aoff = 16 * c + 256 * q, doff = mmv8_kpad(32 * nu) + 16 * p + 64 * q;
    const int a0off = 16 * c, d0off = mmv8_kpad(32 * nu) + 16 * p;
    MMV8_PIN(aoff); MMV8_PIN(doff);
    uint4 wq[D][S], wh[D][S];
    auto load = [&](int k, int t) {
        if (t < trips && t < ql)
#pragma unroll
            for (int s = 0; s < S; ++s) {
                wq[k][s] = mmv8_ldw(rows[s] + 576 * t);
                wh[k][s] = mmv8_ldw(rows[s] + 576 * t - 16 - 16 * c);
            }
    };
#pragma unroll
    for (int k = 0; k < D - 1; ++k) load(k, t0 + k * tstep);
    for (int t = t0; t < trips; t += D * tstep) {
#pragma unroll
        for (int k = 0; k < D; ++k) {
            const int tk = t + k * tstep;
            if (tk >= trips) break;
            load((k + D - 1) % D, tk + (D - 1) * tstep);
            const bool ok = tk < ql;
            const Mmv8Q4kAct x = mmv8_q4k_act(sm, ok ? aoff + 1024 * tk : a0off, ok ? doff + 256 * tk : d0off, hm);
#pragma unroll
            for (int s = 0; s < S; ++s) {
                float& r = acc[s / MMV8_R][s % MMV8_R];
                const float n = mmv8_q4k_piece(wq[k][s], wh[k][s], x, ks, r);
                r = ok ? n : r;
            }
        }
    }
}

// bytes of one Q4_K trip of a row (4 super-blocks), and of a warp's ring for M matrices: MMV8_RING
// trips of each of its M x MMV8_R rows (catalog.mmv8_ring_smem: the launch's dynamic shared memory
// holds the staged row, then MMV8_WARPS such rings)
#define MMV8_TRIP 576
template <int M> __host__ __device__ constexpr int mmv8_ring_bytes() { return MMV8_RING * M * MMV8_R * MMV8_TRIP; }

// As mmv8_q4k (same lanes, same arithmetic, the same sums), the weights through a ring of MMV8_RING
// trips in shared memory: a trip's 576 bytes of each row are copied by the warp's lanes (16-byte
// cp.async, chunks lane and lane + 32) MMV8_RING - 1 trips before they are used, so that many trips'
// loads are in flight per warp with no register held for them (the register path keeps one: at 64
// registers a second spills). Each trip commits one copy group on every lane (empty past the end),
// waits for its own oldest, and meets the warp at __syncwarp before reading the stage (other lanes
// copied it) and again before the stage is refilled. Chunks of super-blocks past the row's end are
// zero-filled, not read (their sums are discarded, as mmv8_q4k's).
template <int M>
__device__ __forceinline__ void mmv8_q4k_ring(const u8* const (&W)[M], long long rb, int r0, int rlast, int nu,
                                              int t0, int tstep, const u8* sm, u8* ring,
                                              float (&acc)[M][MMV8_R]) {
    constexpr int S = M * MMV8_R, NS = MMV8_RING, NC = MMV8_TRIP / 16;
    const int lane = threadIdx.x & 31, c = lane & 7, q = lane >> 3, p = c >> 1;
    const int nsb = nu >> 3, trips = (nsb + 3) >> 2;
    Mmv8Q4kLane ks = mmv8_q4k_lane(p);
    u32 hm = (c & 1) ? 0u : 0x3F800000u;
    int ql = (nsb - q + 3) >> 2;
    MMV8_PIN(ks.sh); MMV8_PIN(ks.shA); MMV8_PIN(ks.sh4); MMV8_PIN(ks.mA); MMV8_PIN(ks.mC); MMV8_PIN(hm); MMV8_PIN(ql);
    // stage k, row s at ring + (k S + s) MMV8_TRIP. Trips are copied in order (tc: the next), each
    // row's source advancing by its warp's trip step. The lane copies chunk `lane` of each row's trip
    // (super-block 4 tc + lane / 9's bytes: there while tc < tl0) and lanes 0-3 chunk 32 + lane too
    // (super-block 4 tc + 3's: tc < tl1)
    static_assert(NC > 32 && NC <= 64, "a trip is 33 to 64 chunks: one or two a lane");
    const u8* src[S];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i = 0; i < MMV8_R; ++i) {
            src[m * MMV8_R + i] = W[m] + (long long)min(r0 + i, rlast) * rb + (long long)MMV8_TRIP * t0 + 16 * lane;
            MMV8_PIN64(src[m * MMV8_R + i]);
        }
    const long long step = (long long)MMV8_TRIP * tstep;
    const int tl0 = (nsb - lane / 9 + 3) >> 2, tl1 = (nsb - (32 + lane) / 9 + 3) >> 2;
    const bool two = lane < NC - 32;
    u8* const dst = ring + 16 * lane;
    int tc = t0;
    auto copy = [&](int k) {
        if (tc < trips) {
#pragma unroll
            for (int s = 0; s < S; ++s) {
                u8* d = dst + (k * S + s) * MMV8_TRIP;
                cp16z(d, src[s], tc < tl0);
                if (two) cp16z(d + 512, src[s] + 512, tc < tl1);
                src[s] += step;
            }
        }
        tc += tstep;
        cp_commit();
    };
#pragma unroll
    for (int k = 0; k < NS - 1; ++k) copy(k);
    int aoff = 16 * c + 256 * q, doff = mmv8_kpad(32 * nu) + 16 * p + 64 * q;
    const int a0off = 16 * c, d0off = mmv8_kpad(32 * nu) + 16 * p;
    MMV8_PIN(aoff); MMV8_PIN(doff);
    int k = 0;
    for (int t = t0; t < trips; t += tstep) {
        copy(k == 0 ? NS - 1 : k - 1);                               // trip t + (NS - 1) tstep, into the
                                                                     // stage used a trip ago
        cp_wait<NS - 1>();
        __syncwarp();
        const bool ok = t < ql;
        const Mmv8Q4kAct x = mmv8_q4k_act(sm, ok ? aoff + 1024 * t : a0off, ok ? doff + 256 * t : d0off, hm);
        const u8* st = ring + k * S * MMV8_TRIP + 144 * q;
#pragma unroll
        for (int s = 0; s < S; ++s) {
            float& r = acc[s / MMV8_R][s % MMV8_R];
            const float n = mmv8_q4k_piece(*(const uint4*)(st + s * MMV8_TRIP + 16 + 16 * c),
                                           *(const uint4*)(st + s * MMV8_TRIP), x, ks, r);
            r = ok ? n : r;
        }
        __syncwarp();                                                // every lane is done with stage k
        k = k + 1 == NS ? 0 : k + 1;
    }
    cp_wait<0>();                                                    // the empty groups past the end
}

// the partial sums of one row group: Q4_K by trips of 4 super-blocks (a warp group's `wpr` warps
// take every wpr-th trip), the other types by units (every 32 wpr-th unit a lane)
template <int M>
__device__ __forceinline__ void mmv8_dispatch(int qt, const u8* const (&W)[M], long long rb, int r0, int rlast, int nu,
                                              int sub, int wpr, const u8* sm, float (&acc)[M][MMV8_R]) {
    const int u0 = sub * 32 + (threadIdx.x & 31), ustep = 32 * wpr;
#define MMV8_CASE(Q) case Q: if constexpr (QT_ON(Q)) mmv8_rows<Q, M>(W, rb, r0, rlast, nu, u0, ustep, sm, acc); break;
    switch (qt) {
        MMV8_CASE(QT_Q4_0)
        MMV8_CASE(QT_Q4_1)
        MMV8_CASE(QT_Q5_0)
        MMV8_CASE(QT_Q5_1)
        MMV8_CASE(QT_Q8_0)
        case QT_Q4_K:
            if constexpr (QT_ON(QT_Q4_K)) {
                if constexpr (MMV8_RING > 0)
                    mmv8_q4k_ring<M>(W, rb, r0, rlast, nu, sub, wpr, sm,
                                     (u8*)sm + mmv8_row_bytes(32 * nu) + (threadIdx.x >> 5) * mmv8_ring_bytes<M>(), acc);
                else
                    mmv8_q4k<M>(W, rb, r0, rlast, nu, sub, wpr, sm, acc);
            }
            break;
        MMV8_CASE(QT_Q5_K)
        MMV8_CASE(QT_Q6_K)
        MMV8_CASE(QT_IQ4_NL)
        MMV8_CASE(QT_IQ4_XS)
        MMV8_CASE(QT_MXFP4)
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

__device__ __forceinline__ void mmv8_body(const Mmv8Seg (&seg)[3], int K, const u8* __restrict__ xq, long long xqs,
                                          int wpr, int accumulate, unsigned long long* amax) {
    MMV8_DYN_SMEM(sm);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int gpb = MMV8_WARPS / wpr, sub = wid % wpr;
    int groups = 0;
#pragma unroll
    for (int i = 0; i < 3; ++i) groups += (seg[i].n + MMV8_R - 1) / MMV8_R;
    int b = blockIdx.y;
    unsigned long long best = 0ull;       // this thread's largest argmax key (amax)
    {   // the head of the first round's rows towards L2 while mmv8_q8 may still run
        int G = blockIdx.x * gpb + wid / wpr, g;
        if (MMV8_PF_BYTES && sub == 0 && lane < MMV8_R && G < groups) {
            Mmv8Seg s = mmv8_seg(seg, G, g);
            int r = g * MMV8_R + lane;
            if (r < s.n) l2_prefetch(s.W + (long long)r * s.rb, min(s.rb, (long long)MMV8_PF_BYTES * wpr));
        }
    }
    mmv8_stage(xq, xqs, K, sm, blockIdx.y);
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
        if (live) mmv8_dispatch<1>(s.qt, Ws, s.rb, r0, s.n - 1, K >> 5, sub, wpr, sm, acc);
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
                                          const u8* __restrict__ xq, long long xqs, int act, float* a, int as,
                                          int wpr) {
    MMV8_DYN_SMEM(sm);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int gpb = MMV8_WARPS / wpr, sub = wid % wpr;
    int groups = (N + MMV8_R - 1) / MMV8_R;
    int b = blockIdx.y;
    {   // as mmv8_body: the head of the first round's gate and up rows towards L2
        int G = blockIdx.x * gpb + wid / wpr;
        if (MMV8_PF_BYTES && sub == 0 && lane < 2 * MMV8_R && G * MMV8_R + (lane >> 1) < N)
            l2_prefetch((lane & 1 ? Wu : Wg) + (long long)(G * MMV8_R + (lane >> 1)) * rb,
                        min(rb, (long long)MMV8_PF_BYTES * wpr));
    }
    mmv8_stage(xq, xqs, K, sm, blockIdx.y);
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
        if (live) mmv8_dispatch<2>(qt, Ws, rb, r0, N - 1, K >> 5, sub, wpr, sm, acc);
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

// an output of a pair whose expert id is out of range (moe.cu MOE_NAN): visible, never a read outside
// the weights
#define MMV8_NAN __int_as_float(0x7fc00000)

// A mixture of experts' (row, expert) pairs at one-row steps (moe.cu's per-pair GEMVs on 8-bit
// activations): block column p = blockIdx.y is pair p, expert e = ids[p] (its matrices at W + e eb),
// input row p / xdiv of xq (the token's row for gate and up, the pair's own for the down projection);
// the block's warps stride over its output rows, one row group (MMV8_R rows) a warp, every lane over
// the row's units (mmv8_dispatch with one warp a row). moe8_gate_up: y[p] = act(gate_e . x + bg_e,
// up_e . x + bu_e); moe8_gemv: y[p] = W_e . x + b_e. A pair whose id is out of range writes NaN
// (moe.cu's rule: visible, never a read outside the weights).
template <int M>
__device__ __forceinline__ void moe8_body(const u8* Wg, const u8* Wu, long long rb, long long eb, int E, int N, int K,
                                          int qt, const int* __restrict__ ids, int xdiv, const u8* __restrict__ xq,
                                          long long xqs, int act, const float* bg, const float* bu, float* y,
                                          int ys) {
    MMV8_DYN_SMEM(sm);
    const int p = blockIdx.y, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    mmv8_stage(xq, xqs, K, sm, p / xdiv);
    pdl_trigger();
    const int e = ids[p];
    const bool ok = e >= 0 && e < E;
    const int groups = (N + MMV8_R - 1) / MMV8_R;
    for (int G = blockIdx.x * MMV8_WARPS + wid; G < groups; G += gridDim.x * MMV8_WARPS) {    // warp-uniform
        const int r0 = G * MMV8_R;
        float acc[M][MMV8_R];
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int i = 0; i < MMV8_R; ++i) acc[m][i] = 0.0f;
        if (ok) {
            const long long off = (long long)e * eb;
            if constexpr (M == 2) {
                const u8* const Ws[2] = {Wg + off, Wu + off};
                mmv8_dispatch<2>(qt, Ws, rb, r0, N - 1, K >> 5, 0, 1, sm, acc);
            } else {
                const u8* const Ws[1] = {Wg + off};
                mmv8_dispatch<1>(qt, Ws, rb, r0, N - 1, K >> 5, 0, 1, sm, acc);
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int i = 0; i < MMV8_R; ++i) acc[m][i] = warp_sum(acc[m][i]);
#pragma unroll
        for (int i = 0; i < MMV8_R; ++i) {
            const int r = r0 + i;
            if (lane == i && r < N) {
                float v = MMV8_NAN;
                if (ok) {          // the biases read only where e is an expert of the stack
                    const long long b = (long long)e * N + r;
                    const float g = bg ? acc[0][i] + bg[b] : acc[0][i];
                    v = M == 2 ? gated_f(g, bu ? acc[M - 1][i] + bu[b] : acc[M - 1][i], act) : g;
                }
                y[(long long)p * ys + r] = v;
            }
        }
    }
}

// experts a token (moe.cu MOE_MAX_K, support.MOE_MAX_K): the pair values moe8_down_combine holds
#define MMV8_MOE_MAX_K 32

// The down projection of a token's pairs fused with their combine (moe8_gemv_nb1 over the pairs, then
// moe.cu's moe_combine, in one launch; one-row steps): block column t = blockIdx.y is token t, whose
// pairs p = t top + j (j < top) have expert e_j = ids[p], weight w[p] and input row p of xq (the pairs'
// gated rows, quantized by mmv8_q8). The block stages all `top` rows (top x mmv8_row_bytes(K) bytes)
// and its warps stride over the output row groups, `wpr` warps a group, each taking the pairs
// j = sub, sub + wpr, ...: a whole row for each (mmv8_dispatch with one warp a row, as moe8_body), so
// y_j = W_e_j[r] . a_j + b_e_j[r] is the value moe8_gemv_nb1 writes to y. The group's first warp then
// adds, j in order,
//     x[t, r] += ((0 + w_0 y_0) + w_1 y_1) + ... + w_{top-1} y_{top-1}
// as moe_combine sums y's rows, so the fused path matches the unfused one as far as the compiler
// rounds both alike; one lane writes each output (no atomics: the same bits every run). A pair whose
// id is out of range has y_j = NaN (moe8_body's rule), which its token's x then shows.
__device__ __forceinline__ void moe8_combine_body(const u8* W, long long rb, long long eb, int E, int N, int K, int qt,
                                                  const int* __restrict__ ids, int top, const u8* __restrict__ xq,
                                                  long long xqs, const float* bias, const float* __restrict__ w,
                                                  float* x, int xs, int wpr) {
    MMV8_DYN_SMEM(sm);
    __shared__ float pv[MMV8_WARPS][MMV8_MOE_MAX_K][MMV8_R];    // y_j of each row group of the round
    const int t = blockIdx.y, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int gpb = MMV8_WARPS / wpr, gl = wid / wpr, sub = wid % wpr, S = mmv8_row_bytes(K);
    mmv8_stage_rows(xq, xqs, K, sm, t * top, top);
    pdl_trigger();
    const int groups = (N + MMV8_R - 1) / MMV8_R;
    for (int base = blockIdx.x * gpb; base < groups; base += gridDim.x * gpb) {   // block-uniform trips
        const int G = base + gl, r0 = G * MMV8_R;
        if (G < groups)
            for (int j = sub; j < top; j += wpr) {                              // warp-uniform
                const int e = ids[t * top + j];
                const bool ok = e >= 0 && e < E;
                float acc[1][MMV8_R];
#pragma unroll
                for (int i = 0; i < MMV8_R; ++i) acc[0][i] = 0.0f;
                if (ok) {
                    const u8* const Ws[1] = {W + (long long)e * eb};
                    mmv8_dispatch<1>(qt, Ws, rb, r0, N - 1, K >> 5, 0, 1, sm + j * S, acc);
                }
#pragma unroll
                for (int i = 0; i < MMV8_R; ++i) acc[0][i] = warp_sum(acc[0][i]);
#pragma unroll
                for (int i = 0; i < MMV8_R; ++i)
                    if (lane == i && r0 + i < N)
                        pv[gl][j][i] = !ok ? MMV8_NAN : bias ? acc[0][i] + bias[(long long)e * N + r0 + i] : acc[0][i];
            }
        __syncthreads();
        if (G < groups && sub == 0 && lane < MMV8_R && r0 + lane < N) {
            const float* wt = w + (long long)t * top;
            float s = 0.0f;
            for (int j = 0; j < top; ++j) s += wt[j] * pv[gl][j][lane];      // moe_combine's order
            x[(long long)t * xs + r0 + lane] += s;
        }
        __syncthreads();           // pv is written again next round
    }
}

// MMV8_KIND: 1 = mmv8_nb1 and mmv8_q8, 2 = ffn8_nb1 only, 3 = moe8_gate_up_nb1, moe8_gemv_nb1 and
// moe8_down_combine_nb1, unset = all (separate modules, as mmvf.cu's).
// xq: mmv8_q8's output, xqs bytes a row (grid.y rows).
#if !defined(MMV8_KIND) || MMV8_KIND == 1
extern "C" __global__ void __launch_bounds__(MMV8_WARPS * 32, MMV8_MINB) mmv8_nb1(
    const u8* W0, long long rb0, int n0, int qt0, const float* b0, float* y0, int ys0,
    const u8* W1, long long rb1, int n1, int qt1, const float* b1, float* y1, int ys1,
    const u8* W2, long long rb2, int n2, int qt2, const float* b2, float* y2, int ys2,
    int K, const u8* xq, long long xqs, int wpr, int accumulate, unsigned long long* amax) {
    const Mmv8Seg seg[3] = {{W0, rb0, n0, qt0, b0, y0, ys0}, {W1, rb1, n1, qt1, b1, y1, ys1},
                            {W2, rb2, n2, qt2, b2, y2, ys2}};
    mmv8_body(seg, K, xq, xqs, wpr, accumulate, amax);
}
#endif
#if !defined(MMV8_KIND) || MMV8_KIND == 2
extern "C" __global__ void __launch_bounds__(MMV8_WARPS * 32, MMV8_MINB) ffn8_nb1(
    const u8* Wg, const u8* Wu, long long rb, int N, int K, int qt, const u8* xq, long long xqs,
    int act, float* a, int as, int wpr) {
    ffn8_body(Wg, Wu, rb, N, K, qt, xq, xqs, act, a, as, wpr);
}
#endif
#if !defined(MMV8_KIND) || MMV8_KIND == 3
extern "C" __global__ void __launch_bounds__(MMV8_WARPS * 32, MMV8_MINB) moe8_gate_up_nb1(
    const u8* Wg, const u8* Wu, long long rb, long long eb, int E, int N, int K, int qt, const int* ids, int xdiv,
    const u8* xq, long long xqs, int act, const float* bg, const float* bu, float* y, int ys) {
    moe8_body<2>(Wg, Wu, rb, eb, E, N, K, qt, ids, xdiv, xq, xqs, act, bg, bu, y, ys);
}
extern "C" __global__ void __launch_bounds__(MMV8_WARPS * 32, MMV8_MINB) moe8_gemv_nb1(
    const u8* W, long long rb, long long eb, int E, int N, int K, int qt, const int* ids, int xdiv,
    const u8* xq, long long xqs, const float* b, float* y, int ys) {
    moe8_body<1>(W, nullptr, rb, eb, E, N, K, qt, ids, xdiv, xq, xqs, 0, b, nullptr, y, ys);
}
// x[t] += sum_j w[t, j] (W_e_j . xq[t top + j] + b_e_j), j in order (moe8_combine_body); grid.y: the
// tokens, top <= MMV8_MOE_MAX_K, wpr a power of two dividing MMV8_WARPS, top x mmv8_row_bytes(K) bytes
// of dynamic shared memory (checked on the host: ops.moe8_down_combine)
extern "C" __global__ void __launch_bounds__(MMV8_WARPS * 32, MMV8_MINB) moe8_down_combine_nb1(
    const u8* W, long long rb, long long eb, int E, int N, int K, int qt, const int* ids, int top, const u8* xq,
    long long xqs, const float* b, const float* w, float* x, int xs, int wpr) {
    moe8_combine_body(W, rb, eb, E, N, K, qt, ids, top, xq, xqs, b, w, x, xs, wpr);
}
#endif
