// Quantized matrix multiply for batched decode (backends/cuda/mmq.py): y[t, r] = W[r] . h[t] for M
// activation rows t at once, on fp16 tensor cores (mma.sync m16n8k16, fp32 accumulation, sm_80+),
// with fp32-class accuracy. Each CTA dequantizes a tile of 128 weight rows x 128 columns from the
// GGUF blocks (device layouts, formats/gpu_layout.py) into shared memory once and applies it to
// every token of its tile, so a weight block is read from memory once per token tile (once per step
// up to 64 tokens), not once per token or per few tokens as in the GEMVs.
//
// Numerics. A weight is (sub-block scale d) x (integer q) [+ sub-block min m]; q is exact in fp16.
// mmq_prep scales each activation row by a power of two s (max in [2^14, 2^15): exact, and fp16
// cannot overflow) and splits it, xh = fp16(s h), xl = fp16(s h - xh) (exact difference, rounded
// once: xh + xl = s h to ~2^-22), and sums s h over every 32-column unit in fp32. Per unit and
// weight row the tensor cores form T = q . xh + q . xl (exact products, fp32 sums over 32 terms: 16
// for Q6_K, whose scale covers 16 columns), and the fp32 accumulator takes acc = fma(T, d, acc)
// [then fma(m, sum(s h), acc)], so the long sum over K runs in fp32 FMAs, as the GEMVs' does. The
// epilogue multiplies by 1/s (exact) and adds the bias.
//
// Layouts. The k order inside a unit is free as long as the A (weights) and B (activations)
// fragments agree; it is chosen so that a thread's B fragments of both k16 steps of a unit are 8
// consecutive stored halves (one 16-byte shared load for xh, one for xl), and so that step s holds
// columns 16s..16s+15 (one Q6_K scale). Column c = 16s + 4t + 2e + h of a unit is
//   stored at activation position p = 8t + 4s + 2e + h  (prep record; thread tig = t reads p = 8t..8t+7),
//   stored at A-tile position   P = 16s + 8e + 2t + h   (the fragment k index of step s is P - 16s).
// Prep record per token and 128-column chunk (528 bytes): 4 units x [xh p 0..31 | xl p 0..31]
// (128 bytes), then the 4 unit sums (fp32). Rows of K not a multiple of 128 end in a zero-filled
// partial chunk.
//
// Tiles and grid. 256 threads (8 warps as WM x WN, each warp MT x NT tiles of 16 rows x 8 tokens);
// a CTA covers 128 rows (FFN: 64 gate rows and the same 64 up rows) and BN tokens (8, 16, 32 or
// 64: one kernel per BN, mmq_bnBN). The grid is tiles x splits x token blocks, the token block
// fastest (CTAs sharing weights run together and share them through L2). Few tiles (small N): K is
// split into `splits` ranges of `cps` chunks; every CTA of a split tile stores its raw partial
// sums in a scratch buffer, and the last to finish (a counter per tile, reset by it) adds them in
// split order and runs the epilogue: deterministic, one launch.
// Pipeline per chunk: the raw quant bytes of the next D chunks are in registers (global loads in
// flight) and their prep records in shared buffers (cp.async) while chunk c is computed; then the
// next chunk's registers are decoded into the (single) A tile between two barriers.
//
// 8-bit activations (-DMMQ_A8=1: a module of its own, kernels mmq8_prep and mmq8_bnBN; the same
// tiles, pipeline and epilogues). The q8_1 scheme of mmv8.cu at tile scale: mmq_prep quantizes each
// 32-column unit of s h (s as above) to int8 q = rint(s h / dx), dx = max|s h| / 127 (common.cuh
// quant_q8_lane), and keeps (dx, dx sum q); the A tile holds the weights' integers q (every type
// taken fits int8: Q4_K 0..15, Q6_K -32..31, Q8_0 -128..127, IQ4 levels -127..113, MXFP4 -12..12). Per unit and weight row one int8
// mma (m16n8k32 s8, exact int32 sums; two m16n8k16 for Q6_K's 16-column scales) gives T = q_w . q_x,
// and acc = fma(float(T) dx, d, acc) [then fma(m, dx sum q, acc)]: the GEMV numerics of mmv8.cu
// (results are those of W . (q dx), within fp32 roundings), with a quarter of the mma instructions
// and under a third of the activation bytes. The other types (Q2_K, Q3_K, the 2- and 3-bit I-quants)
// are not taken (mmq_takes): the host keeps them on the fp16 variant.
// Column c = 16s + 4t + i of a unit is stored at activation byte p = 8t + 4s + i of the unit (thread
// tig = t reads bytes 8t..8t+7: its B registers of both k16 halves) and at A-tile byte c (the int8
// fragment layout of ldmatrix: a row's bytes 4t..4t+3 and 16 + 4t..). Prep record per token and
// chunk (160 bytes): 4 units x q[32] (128 bytes), then 4 x (dx, dx sum q) (fp32).
//
// mmq_bnBN: up to three segments sharing one input (Q, K, V; each its own type, bias and output),
// accumulate != 0 adds into y (the residual), amax != 0 (one segment) folds the LM head's argmax
// in (common.cuh argmax_key, as mmvf). mode 1: the fused FFN, segment 0 gate and 1 up (same type
// and shape), y0[t, r] = act(g) * u.
#include "common.cuh"
#include "mma.cuh"

#ifndef MMQ_A8
#define MMQ_A8 0
#endif
// kernel names: the 8-bit variant's are mmq8_prep and mmq8_bnBN (a profile tells the two apart)
#if MMQ_A8
#define MMQ_NAME(x) mmq8_##x
#else
#define MMQ_NAME(x) mmq_##x
#endif
#define MMQ_THREADS 256
#define MMQ_PREP_THREADS 1024   // mmq_prep: a block per row
#define MMQ_PREP_NJ 20          // mmq_prep keeps rows of up to 20 x 1024 columns in registers: the most
                                // that fit a 1024-thread block's 64 registers a thread unspilled (both
                                // variants); a 7-8B model's FFN down input (up to 18,944) is read once
#define MMQ_BM 128          // weight rows per CTA tile
#define MMQ_KC 128          // columns per chunk: 4 units
#define MMQ_MROW 5          // float4 per meta row: the 4 units' scales, 1 pad (conflict-free stores)
#if MMQ_A8
#define MMQ_AU 32           // bytes per unit in an A-tile row: 32 int8
#define MMQ_XP 8            // 16-byte pieces of int8 values per (token, chunk) record: 4 units x 32
#define MMQ_SW 8            // floats per (token, chunk) after them: (dx, dx sum q) per unit
#else
#define MMQ_AU 64           // bytes per unit in an A-tile row: 32 fp16
#define MMQ_XP 32           // 16-byte pieces of fp16 halves per (token, chunk) record: 4 units x (xh, xl)
#define MMQ_SW 4            // floats per (token, chunk) after them: the unit sums
#endif
#define MMQ_XROW (16 * MMQ_XP)              // bytes per activation row of a chunk in shared memory (swizzled, no pad)
#define MMQ_REC (MMQ_XROW + 4 * MMQ_SW)     // bytes per (token, chunk) prep record: 528 (fp16), 160 (int8)
#define MMQ_AROW (4 * MMQ_AU + 16)          // bytes per A-tile row: the chunk + 16 (8 rows at one column hit 8 bank groups)

// Warp tiling per token-tile width (BM = 16 MT WM = 128 rows, BN = 8 NT WN tokens, WN = 8 / WM) and
// the chunks of weights in flight (D: in registers; the narrow tiles are bound by memory latency,
// the wide ones by registers)
template <int BN> struct MmqCfg;
template <> struct MmqCfg<8> { static constexpr int MT = 1, NT = 1, WM = 8, D = 2; };
template <> struct MmqCfg<16> { static constexpr int MT = 1, NT = 2, WM = 8, D = 2; };
#if MMQ_A8
// 8 warps over the rows (no A fragment loaded twice per CTA): MT = NT = 2 spills in the module of all
// 8 types
template <> struct MmqCfg<32> { static constexpr int MT = 1, NT = 4, WM = 8, D = 1; };
#else
template <> struct MmqCfg<32> { static constexpr int MT = 2, NT = 2, WM = 4, D = 1; };
#endif
template <> struct MmqCfg<64> { static constexpr int MT = 2, NT = 4, WM = 4, D = 1; };

// dynamic shared memory of mmq_bnBN: A tile | unit scales | D + 1 activation chunks | their unit sums
// (int8: and scales)
template <int BN> __host__ __device__ constexpr int mmq_smem_bytes() {
    return MMQ_BM * MMQ_AROW + MMQ_BM * 16 * MMQ_MROW + (MmqCfg<BN>::D + 1) * BN * MMQ_REC;
}

// the types the 8-bit variant takes: those of mmv8.cu (common.cuh QUnit and the 4-bit level types),
// whose integers fit int8
__host__ __device__ constexpr bool mmq_takes(int qt) {
    return !MMQ_A8 || qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q5_0 || qt == QT_Q5_1 || qt == QT_Q8_0 ||
           qt == QT_Q4_K || qt == QT_Q5_K || qt == QT_Q6_K || qt == QT_IQ4_NL || qt == QT_IQ4_XS || qt == QT_MXFP4;
}

// ------------------------------------------------------------------ instructions
#ifdef REALIZAR_HOST_TEST
// tests/host/mmq_emu.cpp provides the warp-collective ones (and emulates them per the PTX ISA)
void mmq_ldsm_x4(u32 (&r)[4], const u8* p);
inline float mmq_ldcg(const float* p) { return *p; }
inline void mmq_stcg(float* p, float v) { *p = v; }
inline void mmq_cp_commit() {}
template <int N> inline void mmq_cp_wait() {}
#else
// four 8x8 fp16 matrices from shared memory: lane l gives the address of row l % 8 of matrix l / 8
__device__ __forceinline__ void mmq_ldsm_x4(u32 (&r)[4], const u8* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((u32)__cvta_generic_to_shared(p)));
}

// split-K partial sums: through L2 only (another SM reads them)
__device__ __forceinline__ float mmq_ldcg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ void mmq_stcg(float* p, float v) {
    asm volatile("st.global.cg.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

__device__ __forceinline__ void mmq_cp_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// wait until at most N of this thread's committed cp.async groups are pending
template <int N> __device__ __forceinline__ void mmq_cp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}
#endif

// ------------------------------------------------------------------ prep
// (sum of a, max of b) over the block in one round of shared memory (sm: 64 floats); the sum in
// block_reduce's order
__device__ __forceinline__ float2 block_sum_max(float a, float b, float* sm) {
    a = warp_sum(a);
    b = warp_max(b);
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();  // sm may still be read from the previous reduction
    if (lane == 0) {
        sm[wid] = a;
        sm[32 + wid] = b;
    }
    __syncthreads();
    if (wid == 0) {
        const float x = warp_sum(lane < nw ? sm[lane] : 0.0f), y = warp_max(lane < nw ? sm[32 + lane] : 0.0f);
        if (lane == 0) {
            sm[0] = x;
            sm[32] = y;
        }
    }
    __syncthreads();
    return make_float2(sm[0], sm[32]);
}

// Row t of x (stride xs), RMSNorm'ed with weight nw (nw == 0: as it is), as prep records of out
// (row stride os bytes, ceil(K/128) records); inv[t] = 1/s. Block (t, p) of MMQ_PREP_THREADS: row t,
// and of its records the rounds j of 32 units (one a warp) with j % gridDim.y == p. Every block of a
// row reads all of it and finds the same norm and scale (same order, same bits), so splitting the
// records over gridDim.y blocks needs no communication: at small batches the records' warp sums
// were each block's longest part. Rows of up to MMQ_PREP_NJ x 1024 columns are read once into
// registers, longer ones twice (sum of squares and max, records). The norm's sum of squares and the
// max of |x w| share one block reduction: max |x rs w| is taken as rs max |x w| (the same to rounding,
// which can only move the scale by a factor of two, exact either way).
// Column c = 16s + 4t + i of a unit goes to position 8t + 4s + i (see the top of the file).
#if !defined(MMQ_BN) || MMQ_BN == 0
extern "C" __global__ void __launch_bounds__(MMQ_PREP_THREADS) MMQ_NAME(prep)(const float* __restrict__ x, int xs, int M, int K,
                                                                   const float* __restrict__ nw, float eps,
                                                                   u8* __restrict__ out, long long os,
                                                                   float* __restrict__ inv) {
    __shared__ float sm[64];
    const int t = blockIdx.x, S = gridDim.y, part = blockIdx.y;
    if (t >= M) return;
    pdl_wait();
    const float* xr = x + (long long)t * xs;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nu = K >> 5, nch = (K + MMQ_KC - 1) / MMQ_KC;
    const int pos = 8 * ((lane >> 2) & 3) + 4 * (lane >> 4) + (lane & 3);
    u8* o = out + (long long)t * os;
    float iv;
    // one unit (32 columns: its halves and its sum; int8: its values and (dx, dx sum q)) per warp
    auto put = [&](int u, float v) {
#if MMQ_A8
        u8* rec = o + (u >> 2) * MMQ_REC;
        // pos is 0 at lane 0 only: that lane writes the unit's (dx, dx sum q)
        quant_q8_lane(v, (i8*)(rec + MMQ_AU * (u & 3)), (float2*)(rec + MMQ_XROW) + (u & 3), pos);
#else
        u8* rec = o + (u >> 2) * MMQ_REC + (u & 3) * 128;
        const u16 h = f2h(v);
        ((u16*)rec)[pos] = h;
        ((u16*)(rec + 64))[pos] = f2h(v - h2f(h));
        const float sum = warp_sum(v);
        if (lane == 0) ((float*)(o + (u >> 2) * MMQ_REC + MMQ_XROW))[u & 3] = sum;
#endif
    };
    // the norm's 1 / rms(x) (rs; 1 without a norm) and the row's scale s, from each thread's sum of
    // squares and max |x w| (x w: x without a norm)
    auto scale_of = [&](float ss, float m, float& rs) {
        rs = 1.0f;
        if (nw) {
            const float2 r = block_sum_max(ss, m, sm);
            rs = rsqrtf(r.x / K + eps);
            m = r.y * rs;
        } else {
            m = block_reduce(m, 1, sm);
        }
        return row_scale(m, iv);
    };
    if (4 * nch <= 32 * MMQ_PREP_NJ) {
        // the row read once, into registers (column threadIdx.x + 1024 j is unit wid + 32 j, as the
        // record writes want): the norm, the max and the records then need no second trip to memory.
        // Sums and maxima run in the same order as the loop below, so both give the same bits.
        float xv[MMQ_PREP_NJ], wv[MMQ_PREP_NJ], ss = 0.0f, m = 0.0f;
#pragma unroll
        for (int j = 0; j < MMQ_PREP_NJ; ++j) {
            const int u = wid + 32 * j, c = 32 * u + lane;
            xv[j] = u < nu ? xr[c] : 0.0f;
            wv[j] = u < nu && nw ? nw[c] : 1.0f;
            if (u < nu) {
                ss += xv[j] * xv[j];
                m = fmaxf(m, fabsf(xv[j] * wv[j]));
            }
        }
        float rs;
        const float s = scale_of(ss, m, rs);
#pragma unroll
        for (int j = 0; j < MMQ_PREP_NJ; ++j) {
            const int u = wid + 32 * j;
            if (u >= 4 * nch) break;                                    // warp-uniform
            if (j % S != part) continue;                                // another block's round
            put(u, u < nu ? (nw ? xv[j] * rs * wv[j] : xv[j]) * s : 0.0f);   // past K: zeros
        }
    } else {
        float rs, ss = 0.0f, m = 0.0f;
        for (int i = threadIdx.x; i < K; i += blockDim.x) {
            ss += xr[i] * xr[i];
            m = fmaxf(m, fabsf(nw ? xr[i] * nw[i] : xr[i]));
        }
        const float s = scale_of(ss, m, rs);
        for (int u = wid; u < 4 * nch; u += blockDim.x >> 5) {
            if ((u / (blockDim.x >> 5)) % S != part) continue;           // another block's round
            float v = 0.0f;                                               // past K: zeros
            if (u < nu) {
                const int c = 32 * u + lane;
                v = (nw ? xr[c] * rs * nw[c] : xr[c]) * s;
            }
            put(u, v);
        }
    }
    if (threadIdx.x == 0 && part == 0) inv[t] = iv;
    pdl_trigger();
}
#endif

// ------------------------------------------------------------------ weights -> A tile
// One piece of a weight row per work item: 32 weights of one chunk as loaded from global memory
// (what each type keeps differs), then decoded into the A tile and its unit's scale, half-unit
// scale and min (meta[u] = {d0, d1, m, 0}; d0 for columns 0..15, d1 for 16..31). A field a type
// never sets holds no register in that type's instantiation (e: Q5_K's fifth bits only).
struct MmqRaw {
    uint4 a, b;
    u32 c, d;
    uint4 e;
};

#if MMQ_A8
// a type's offset (stored bytes are q + off) as the A-tile stores take it: four bytes of off
__device__ __forceinline__ constexpr u32 mmq_offw(u32 off) { return off * 0x01010101u; }

// four stored bytes b = q + off as int8 q: b - off in each byte (mod 256). The low 7 bits subtract
// with the top bits set (no borrow leaves a byte); the top bit is then b's ^ off's ^ that borrow.
__device__ __forceinline__ u32 mmq_q8(u32 w, u32 off4) {
    const u32 H = 0x80808080u;
    return off4 ? ((w | H) - (off4 & ~H)) ^ ((w ^ ~off4) & H) : w;
}

// 16 columns 16s + 4t + k (byte k of w[t]) into the A-tile unit at ua: bytes 16s + 4t + k
__device__ __forceinline__ void mmq_put16(u8* ua, int s, u32 w0, u32 w1, u32 w2, u32 w3, u32 off4) {
    *(uint4*)(ua + 16 * s) = make_uint4(mmq_q8(w0, off4), mmq_q8(w1, off4), mmq_q8(w2, off4), mmq_q8(w3, off4));
}
#else
__device__ __forceinline__ constexpr u32 mmq_offw(u32 off) { return mmq_off2(off); }

// 16 columns 16s + 4t + k (byte k of w[t]) into the A-tile unit at ua: positions 16s + 2t + k
// (k = 0, 1) and 16s + 8 + 2t + k - 2 (k = 2, 3)
__device__ __forceinline__ void mmq_put16(u8* ua, int s, u32 w0, u32 w1, u32 w2, u32 w3, u32 off2) {
    *(uint4*)(ua + 32 * s) = make_uint4(mmq_pair<0>(w0, off2), mmq_pair<0>(w1, off2), mmq_pair<0>(w2, off2),
                                        mmq_pair<0>(w3, off2));
    *(uint4*)(ua + 32 * s + 16) = make_uint4(mmq_pair<1>(w0, off2), mmq_pair<1>(w1, off2), mmq_pair<1>(w2, off2),
                                             mmq_pair<1>(w3, off2));
}
#endif

// a whole unit from v[8] (v[i]: columns 4i..4i+3, unsigned bytes q + offset)
__device__ __forceinline__ void mmq_put32(u8* ua, const u32 (&v)[8], u32 off2) {
    mmq_put16(ua, 0, v[0], v[1], v[2], v[3], off2);
    mmq_put16(ua, 1, v[4], v[5], v[6], v[7], off2);
}

// mmq_load<QT>(row, nu, c, p, r): piece p (0..3) of chunk c of a row (nu units); mmq_store<QT>:
// its values into A-tile row ar, its unit's scales into meta row mr. Units past the row's end
// (a partial last chunk) load nothing; what they store is never read.
template <int QT> __device__ __forceinline__ void mmq_load(const u8* __restrict__ row, int nu, int c, int p, MmqRaw& r);
template <int QT> __device__ __forceinline__ void mmq_store(const MmqRaw& r, int c, int p, u8* ar, float4* mr);

// Q4_K: {d, dmin, scales[12], qs[128]}; chunk c is half c & 1 of block c >> 1. Piece p: qs bytes
// 64h + 16p..+15, i.e. columns 16(p & 1)..+15 of unit 2(p >> 1) (low nibbles) and of unit
// 2(p >> 1) + 1 (high nibbles); the piece also carries the scale and min of unit p.
template <> __device__ __forceinline__ void mmq_load<QT_Q4_K>(const u8* __restrict__ row, int, int c, int p, MmqRaw& r) {
    const u8* b = row + (c >> 1) * 144;
    r.a = __ldg((const uint4*)(b + 16 + 64 * (c & 1) + 16 * p));
    r.b = __ldg((const uint4*)b);
}

template <> __device__ __forceinline__ void mmq_store<QT_Q4_K>(const MmqRaw& r, int c, int p, u8* ar, float4* mr) {
    const u32 M4 = 0x0F0F0F0Fu, off = mmq_offw(0);
    u8* ulo = ar + MMQ_AU * (2 * (p >> 1));
    mmq_put16(ulo, p & 1, r.a.x & M4, r.a.y & M4, r.a.z & M4, r.a.w & M4, off);
    mmq_put16(ulo + MMQ_AU, p & 1, (r.a.x >> 4) & M4, (r.a.y >> 4) & M4, (r.a.z >> 4) & M4, (r.a.w >> 4) & M4, off);
    int sc, m;
    scale_min_k4w(4 * (c & 1) + p, r.b.y, r.b.z, r.b.w, sc, m);
    const float d = h2f((u16)(r.b.x & 0xFFFF)) * sc;
    mr[p] = make_float4(d, d, -h2f((u16)(r.b.x >> 16)) * m, 0.0f);
}

// Q5_K: {d, dmin, scales[12], qh[32], qs[128]} (176 bytes); pieces as Q4_K's (qs bytes 64h + 16p..
// +15 of the chunk's half h), plus qh bytes 16(p & 1)..+15, whose bit j is the fifth bit of that
// column of block unit j.
template <> __device__ __forceinline__ void mmq_load<QT_Q5_K>(const u8* __restrict__ row, int, int c, int p, MmqRaw& r) {
    const u8* b = row + (c >> 1) * 176;
    r.a = __ldg((const uint4*)(b + 48 + 64 * (c & 1) + 16 * p));
    r.b = __ldg((const uint4*)b);
    r.e = __ldg((const uint4*)(b + 16 + 16 * (p & 1)));
}

template <> __device__ __forceinline__ void mmq_store<QT_Q5_K>(const MmqRaw& r, int c, int p, u8* ar, float4* mr) {
    const u32 M4 = 0x0F0F0F0Fu, B1 = 0x01010101u, off = mmq_offw(0);
    const int j = 4 * (c & 1) + 2 * (p >> 1);            // block unit of the low nibbles; j + 1: high
    const u32 q[4] = {r.a.x, r.a.y, r.a.z, r.a.w}, h[4] = {r.e.x, r.e.y, r.e.z, r.e.w};
    u32 lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        lo[i] = (q[i] & M4) | (((h[i] >> j) & B1) << 4);
        hi[i] = ((q[i] >> 4) & M4) | (((h[i] >> (j + 1)) & B1) << 4);
    }
    u8* ulo = ar + MMQ_AU * (2 * (p >> 1));
    mmq_put16(ulo, p & 1, lo[0], lo[1], lo[2], lo[3], off);
    mmq_put16(ulo + MMQ_AU, p & 1, hi[0], hi[1], hi[2], hi[3], off);
    int sc, m;
    scale_min_k4w(4 * (c & 1) + p, r.b.y, r.b.z, r.b.w, sc, m);
    const float d = h2f((u16)(r.b.x & 0xFFFF)) * sc;
    mr[p] = make_float4(d, d, -h2f((u16)(r.b.x >> 16)) * m, 0.0f);
}

// Q6_K (device layout, common.cuh q6k_unit): piece p = unit 4c + p; values q + 32 in 0..63
template <> __device__ __forceinline__ void mmq_load<QT_Q6_K>(const u8* __restrict__ row, int nu, int c, int p, MmqRaw& r) {
    const u8* b = row + (c >> 1) * 208;
    const int j = 4 * (c & 1) + p;
    r.a = __ldg((const uint4*)(b + 16 * j));
    const uint2 hi = __ldg((const uint2*)(b + 128 + 8 * j));
    r.b.x = hi.x;
    r.b.y = hi.y;
    r.c = ld16(b + 192 + 2 * j);                     // the two int8 scales
    r.d = ld16(row + 26 * nu + 2 * (c >> 1));        // the block's d
}

template <> __device__ __forceinline__ void mmq_store<QT_Q6_K>(const MmqRaw& r, int, int p, u8* ar, float4* mr) {
    u32 v[8];
    q6k_bits(r.a, make_uint2(r.b.x, r.b.y), v);
    mmq_put32(ar + MMQ_AU * p, v, mmq_offw(32));
    const float d = h2f((u16)r.d);
    mr[p] = make_float4(d * (float)(i8)(r.c & 255), d * (float)(i8)(r.c >> 8), 0.0f, 0.0f);
}

// Q8_0 (device layout: 32 int8 per unit, then the d values); signed bytes flipped to q + 128
template <> __device__ __forceinline__ void mmq_load<QT_Q8_0>(const u8* __restrict__ row, int nu, int c, int p, MmqRaw& r) {
    const int u = 4 * c + p;
    if (u >= nu) return;
    r.a = __ldg((const uint4*)(row + 32 * u));
    r.b = __ldg((const uint4*)(row + 32 * u + 16));
    r.c = ld16(row + 32 * nu + 2 * u);
}

template <> __device__ __forceinline__ void mmq_store<QT_Q8_0>(const MmqRaw& r, int, int p, u8* ar, float4* mr) {
    const u32 F = 0x80808080u;
    const u32 v[8] = {r.a.x ^ F, r.a.y ^ F, r.a.z ^ F, r.a.w ^ F, r.b.x ^ F, r.b.y ^ F, r.b.z ^ F, r.b.w ^ F};
    mmq_put32(ar + MMQ_AU * p, v, mmq_offw(128));
    const float d = h2f((u16)r.c);
    mr[p] = make_float4(d, d, 0.0f, 0.0f);
}

// Q5_0 (device layout, common.cuh q5_0_unit): values 0..31, offset 16
template <> __device__ __forceinline__ void mmq_load<QT_Q5_0>(const u8* __restrict__ row, int nu, int c, int p, MmqRaw& r) {
    const int u = 4 * c + p;
    if (u >= nu) return;
    r.a = __ldg((const uint4*)(row + 16 * u));
    r.c = __ldg((const u32*)(row + 16 * nu + 4 * u));
    r.d = ld16(row + 20 * nu + 2 * u);
}

template <> __device__ __forceinline__ void mmq_store<QT_Q5_0>(const MmqRaw& r, int, int p, u8* ar, float4* mr) {
    u32 v[8];
    q5_0_bits<0>(r.a, r.c, v);
    mmq_put32(ar + MMQ_AU * p, v, mmq_offw(16));
    const float d = h2f((u16)r.d);
    mr[p] = make_float4(d, d, 0.0f, 0.0f);
}

// Q4_0: GGUF's {d, qs[16]} (18 bytes, 2-byte aligned): values 0..15, offset 8
template <> __device__ __forceinline__ void mmq_load<QT_Q4_0>(const u8* __restrict__ row, int nu, int c, int p, MmqRaw& r) {
    const int u = 4 * c + p;
    if (u >= nu) return;
    const u8* b = row + 18 * u;
    r.c = ld16(b);
    r.a = make_uint4((u32)ld32_a2(b + 2), (u32)ld32_a2(b + 6), (u32)ld32_a2(b + 10), (u32)ld32_a2(b + 14));
}

// Q4_1: GGUF's {d, m, qs[16]} (20 bytes): w = d q + m
template <> __device__ __forceinline__ void mmq_load<QT_Q4_1>(const u8* __restrict__ row, int nu, int c, int p, MmqRaw& r) {
    const int u = 4 * c + p;
    if (u >= nu) return;
    const u8* b = row + 20 * u;
    r.c = __ldg((const u32*)b);
    const u32* q = (const u32*)(b + 4);
    r.a = make_uint4(__ldg(q), __ldg(q + 1), __ldg(q + 2), __ldg(q + 3));
}

// Q4_0 / Q4_1: byte j of the 16 holds column j (low nibble) and column 16 + j (high nibble)
template <int OFF>
__device__ __forceinline__ void mmq_put_q4(const MmqRaw& r, int p, u8* ar) {
    const u32 M4 = 0x0F0F0F0Fu;
    const u32 v[8] = {r.a.x & M4, r.a.y & M4, r.a.z & M4, r.a.w & M4,
                      (r.a.x >> 4) & M4, (r.a.y >> 4) & M4, (r.a.z >> 4) & M4, (r.a.w >> 4) & M4};
    mmq_put32(ar + MMQ_AU * p, v, mmq_offw(OFF));
}

template <> __device__ __forceinline__ void mmq_store<QT_Q4_0>(const MmqRaw& r, int, int p, u8* ar, float4* mr) {
    mmq_put_q4<8>(r, p, ar);
    const float d = h2f((u16)r.c);
    mr[p] = make_float4(d, d, 0.0f, 0.0f);
}

template <> __device__ __forceinline__ void mmq_store<QT_Q4_1>(const MmqRaw& r, int, int p, u8* ar, float4* mr) {
    mmq_put_q4<0>(r, p, ar);
    const float d = h2f((u16)(r.c & 0xFFFF));
    mr[p] = make_float4(d, d, h2f((u16)(r.c >> 16)), 0.0f);
}

// Q5_1: GGUF's {d, m, qh, qs[16]} (24 bytes, 8-byte aligned): w = d q + m, q = nibble | fifth bit
// (qh bit j: column j)
template <> __device__ __forceinline__ void mmq_load<QT_Q5_1>(const u8* __restrict__ row, int nu, int c, int p, MmqRaw& r) {
    const int u = 4 * c + p;
    if (u >= nu) return;
    const uint2* b = (const uint2*)(row + 24 * u);
    const uint2 dmh = __ldg(b), q0 = __ldg(b + 1), q1 = __ldg(b + 2);
    r.c = dmh.x;
    r.d = dmh.y;
    r.a = make_uint4(q0.x, q0.y, q1.x, q1.y);
}

template <> __device__ __forceinline__ void mmq_store<QT_Q5_1>(const MmqRaw& r, int, int p, u8* ar, float4* mr) {
    const u32 M4 = 0x0F0F0F0Fu;
    const u32 q[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
    u32 v[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] = (q[i] & M4) | (u32)bits_to_b4(r.d >> (4 * i));
        v[i + 4] = ((q[i] >> 4) & M4) | (u32)bits_to_b4(r.d >> (16 + 4 * i));
    }
    mmq_put32(ar + MMQ_AU * p, v, mmq_offw(0));
    const float d = h2f((u16)(r.c & 0xFFFF));
    mr[p] = make_float4(d, d, h2f((u16)(r.c >> 16)), 0.0f);
}

// The whole-unit types of lowbit.cuh (the I-quants, MXFP4): piece p = unit 4c + p, loaded as an LRaw
// (a, b, c, d -> MmqRaw a, c, d, b.x) and decoded to its bytes b = q + 128 and scales
template <int QT>
__device__ __forceinline__ void mmq_load_lb(const u8* __restrict__ row, int nu, int c, int p, MmqRaw& r) {
    const int u = 4 * c + p;
    if (u >= nu) return;
    LRaw l;
    lb_load<QT>(row, u, nu, l);
    r.a = l.a;
    r.c = l.b;
    r.d = l.c;
    r.b.x = l.d;
}

template <int QT>
__device__ __forceinline__ void mmq_store_lb(const MmqRaw& r, int c, int p, u8* ar, float4* mr) {
    LRaw l;
    l.a = r.a;
    l.b = r.c;
    l.c = r.d;
    l.d = r.b.x;
    LUnit w;
    lb_decode<QT>(l, 4 * c + p, w);
    mmq_put32(ar + MMQ_AU * p, w.v, mmq_offw(lowbit_off(QT)));
    mr[p] = make_float4(w.a0, w.a1, 0.0f, 0.0f);
}

#define MMQ_LOWBIT(Q)                                                                                         \
    template <> __device__ __forceinline__ void mmq_load<Q>(const u8* __restrict__ row, int nu, int c, int p,  \
                                                            MmqRaw& r) {                                      \
        mmq_load_lb<Q>(row, nu, c, p, r);                                                                     \
    }                                                                                                         \
    template <> __device__ __forceinline__ void mmq_store<Q>(const MmqRaw& r, int c, int p, u8* ar, float4* mr) { \
        mmq_store_lb<Q>(r, c, p, ar, mr);                                                                     \
    }
MMQ_LOWBIT(QT_IQ4_NL)
MMQ_LOWBIT(QT_IQ4_XS)
MMQ_LOWBIT(QT_MXFP4)
MMQ_LOWBIT(QT_IQ2_XXS)
MMQ_LOWBIT(QT_IQ2_XS)
MMQ_LOWBIT(QT_IQ2_S)
MMQ_LOWBIT(QT_IQ3_XXS)
MMQ_LOWBIT(QT_IQ3_S)
#undef MMQ_LOWBIT

// 8 columns 8p..8p+7 (bytes of w0: 8p..8p+3, of w1: 8p+4..) into the A-tile unit at ua: step p >> 1,
// t = 2(p & 1) and t + 1 of mmq_put16's positions
__device__ __forceinline__ void mmq_put8(u8* ua, int p, u32 w0, u32 w1, u32 off2) {
#if MMQ_A8
    *(uint2*)(ua + 8 * p) = make_uint2(mmq_q8(w0, off2), mmq_q8(w1, off2));
#else
    u8* q = ua + 32 * (p >> 1) + 8 * (p & 1);
    *(uint2*)q = make_uint2(mmq_pair<0>(w0, off2), mmq_pair<0>(w1, off2));
    *(uint2*)(q + 16) = make_uint2(mmq_pair<1>(w0, off2), mmq_pair<1>(w1, off2));
#endif
}

// Q3_K (lowbit.cuh q3k_unit): chunk c is half h = c & 1 of block c >> 1, whose 4 units j = 4h + s share
// qs bytes 32h..32h+31 (bits 2s) and the 32 hmask bytes (bit j). Piece p: columns 8p..8p+7 of all 4
// units (qs bytes 32h + 8p.., hmask bytes 8p..), and the scales of unit p; values q + 4 in 0..7.
template <> __device__ __forceinline__ void mmq_load<QT_Q3_K>(const u8* __restrict__ row, int, int c, int p, MmqRaw& r) {
    const u8* b = row + (c >> 1) * 110;
    const u8* q = b + 32 + 32 * (c & 1) + 8 * p;
    r.a = make_uint4((u32)ld32_a2(q), (u32)ld32_a2(q + 4), (u32)ld32_a2(b + 8 * p), (u32)ld32_a2(b + 8 * p + 4));
    r.c = ld16(b + 96 + 2 * p);
    r.d = ld16(b + 104 + 2 * (p & 1));
    r.b.x = ld16(b + 108);
}

template <> __device__ __forceinline__ void mmq_store<QT_Q3_K>(const MmqRaw& r, int c, int p, u8* ar, float4* mr) {
    const int h = c & 1;
    const u32 off = mmq_offw(4);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const int j = 4 * h + s;
        const u32 w0 = ((r.a.x >> (2 * s)) & 0x03030303u) | (((r.a.z >> j) & 0x01010101u) << 2);
        const u32 w1 = ((r.a.y >> (2 * s)) & 0x03030303u) | (((r.a.w >> j) & 0x01010101u) << 2);
        mmq_put8(ar + MMQ_AU * s, p, w0, w1, off);
    }
    float a0, a1;
    q3k_scale_pair(r.c, r.d, r.b.x, 4 * h + p, a0, a1);
    mr[p] = make_float4(a0, a1, 0.0f, 0.0f);
}

// ------------------------------------------------------------------ the tile product
// The numerics of a variant: a unit's A fragments of 16 rows (MmqA, mmq_lda), a token's B fragments
// of a unit with what its unit sums and scales hold (MmqB, mmq_ldb), and the tensor-core products of
// one 16-row x 8-token piece: the whole unit (mmq_dot) or its columns 16s..16s+15 (mmq_dot_half),
// as fp32 T ready for the weights' scale (int8: T dx, the token's scale applied).
// X: BN activation rows of MMQ_XP 16-byte pieces, piece q of row t at mmq_xpiece(q, t).
#if MMQ_A8
// the four tokens of a half-warp's 8-byte B loads read one unit at 4 different 32-byte bank groups
__device__ __forceinline__ int mmq_xpiece(int q, int t) { return q ^ ((t & 3) << 1); }

struct MmqA {
    u32 r[4];                                    // rows 0..7 / 8..15 of k 0..15, then of k 16..31
};
struct MmqB {
    uint2 q;                                     // k 4 tig.. and 16 + 4 tig.. of token gid
    float dx0, dx1, sx0, sx1;                    // (dx, dx sum q) of tokens 2 tig and 2 tig + 1
};

__device__ __forceinline__ void mmq_lda(MmqA& a, const u8* p) { mmq_ldsm_x4(a.r, p); }

__device__ __forceinline__ void mmq_ldb(MmqB& b, const u8* Xs, const float* Ss, int t0, int gid, int tig, int u) {
    const int tl = t0 + gid, tc = t0 + 2 * tig;
    b.q = *(const uint2*)(Xs + tl * MMQ_XROW + 32 * (u ^ (tl & 3)) + 8 * tig);
    const float2 e0 = *(const float2*)(Ss + MMQ_SW * tc + 2 * u), e1 = *(const float2*)(Ss + MMQ_SW * (tc + 1) + 2 * u);
    b.dx0 = e0.x;
    b.sx0 = e0.y;
    b.dx1 = e1.x;
    b.sx1 = e1.y;
}

__device__ __forceinline__ void mmq_scale_t(float (&t)[4], const int (&T)[4], const MmqB& b) {
    t[0] = (float)T[0] * b.dx0;                  // |T| <= 32 x 128 x 127 < 2^24: exact in fp32
    t[1] = (float)T[1] * b.dx1;
    t[2] = (float)T[2] * b.dx0;
    t[3] = (float)T[3] * b.dx1;
}

__device__ __forceinline__ void mmq_dot(float (&t)[4], const MmqA& a, const MmqB& b) {
    int T[4] = {0, 0, 0, 0};
    mmq_mma8(T, a.r, b.q.x, b.q.y);
    mmq_scale_t(t, T, b);
}

__device__ __forceinline__ void mmq_dot_half(float (&t)[4], const MmqA& a, const MmqB& b, int s) {
    int T[4] = {0, 0, 0, 0};
    mmq_mma8_k16(T, s ? a.r[2] : a.r[0], s ? a.r[3] : a.r[1], s ? b.q.y : b.q.x);
    mmq_scale_t(t, T, b);
}
#else
// the two rows a quarter-warp reads hit opposite bank halves
__device__ __forceinline__ int mmq_xpiece(int q, int t) { return q ^ ((t & 1) << 2); }

struct MmqA {
    u32 r[2][4];                                 // step s (k 16s..16s+15)
};
struct MmqB {
    uint4 h, l;                                  // xh, xl of both steps
    float sx0, sx1;                              // sums of the tokens of c0/c2 and c1/c3
};

__device__ __forceinline__ void mmq_lda(MmqA& a, const u8* p) {
#pragma unroll
    for (int s = 0; s < 2; ++s) mmq_ldsm_x4(a.r[s], p + 32 * s);
}

template <bool MIN>
__device__ __forceinline__ void mmq_ldb(MmqB& b, const u8* Xs, const float* Ss, int t0, int gid, int tig, int u) {
    const int tl = t0 + gid;
    const u8* xr = Xs + tl * MMQ_XROW;
    b.h = *(const uint4*)(xr + (mmq_xpiece(8 * u + tig, tl) << 4));
    b.l = *(const uint4*)(xr + (mmq_xpiece(8 * u + 4 + tig, tl) << 4));
    b.sx0 = b.sx1 = 0.0f;
    if (MIN) {
        const int tc = t0 + 2 * tig;
        b.sx0 = Ss[MMQ_SW * tc + u];
        b.sx1 = Ss[MMQ_SW * tc + MMQ_SW + u];
    }
}

__device__ __forceinline__ void mmq_dot(float (&t)[4], const MmqA& a, const MmqB& b) {
    mmq_mma(t, a.r[0], b.h.x, b.h.y);
    mmq_mma(t, a.r[0], b.l.x, b.l.y);
    mmq_mma(t, a.r[1], b.h.z, b.h.w);
    mmq_mma(t, a.r[1], b.l.z, b.l.w);
}

__device__ __forceinline__ void mmq_dot_half(float (&t)[4], const MmqA& a, const MmqB& b, int s) {
    mmq_mma(t, a.r[s], s ? b.h.z : b.h.x, s ? b.h.w : b.h.y);
    mmq_mma(t, a.r[s], s ? b.l.z : b.l.x, s ? b.l.w : b.l.y);
}
#endif

// acc += the chunk's nuc units: A tile (rows of 4 units), meta (per row, 4 x float4), X (BN activation
// rows, mmq_xpiece), S (BN x MMQ_SW unit sums, int8: and scales).
template <int QT, int BN>
__device__ __forceinline__ void mmq_chunk(const u8* As, const float4* Ms, const u8* Xs, const float* Ss, int nuc,
                                          int wm, int wn, int lane,
                                          float (&acc)[MmqCfg<BN>::MT][MmqCfg<BN>::NT][4]) {
    constexpr int MT = MmqCfg<BN>::MT, NT = MmqCfg<BN>::NT;
    // w = d q + m: the min needs the unit sums
    constexpr bool MIN = QT == QT_Q4_K || QT == QT_Q4_1 || QT == QT_Q5_K || QT == QT_Q5_1;
    // a scale per 16 columns
    constexpr bool HALF = QT == QT_Q6_K || QT == QT_Q3_K || QT == QT_IQ2_XS || QT == QT_IQ2_S;
    const int gid = lane >> 2, tig = lane & 3;
    const u8* arow = As + (wm * 16 * MT + (lane & 7) + 8 * ((lane >> 3) & 1)) * MMQ_AROW + 16 * (lane >> 4);
#pragma unroll 1
    for (int u = 0; u < nuc; ++u) {               // unrolled, ptxas spills at BN = 64
        MmqA a[MT];
        float d0[MT][2], d1[MT][2], mn[MT][2];      // [m][rows gid, gid + 8]
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            mmq_lda(a[m], arow + 16 * m * MMQ_AROW + MMQ_AU * u);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float4 t = Ms[(wm * 16 * MT + 16 * m + gid + 8 * h) * MMQ_MROW + u];
                d0[m][h] = t.x;
                d1[m][h] = t.y;
                mn[m][h] = t.z;
            }
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            MmqB b;                                              // tokens: gid (B), 2 tig and 2 tig + 1 (C)
#if MMQ_A8
            mmq_ldb(b, Xs, Ss, wn * 8 * NT + 8 * n, gid, tig, u);
#else
            mmq_ldb<MIN>(b, Xs, Ss, wn * 8 * NT + 8 * n, gid, tig, u);
#endif
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                float* c = acc[m][n];
                if (!HALF) {
                    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mmq_dot(t, a[m], b);
                    c[0] = fmaf(t[0], d0[m][0], c[0]);
                    c[1] = fmaf(t[1], d0[m][0], c[1]);
                    c[2] = fmaf(t[2], d0[m][1], c[2]);
                    c[3] = fmaf(t[3], d0[m][1], c[3]);
                    if (MIN) {
                        c[0] = fmaf(mn[m][0], b.sx0, c[0]);
                        c[1] = fmaf(mn[m][0], b.sx1, c[1]);
                        c[2] = fmaf(mn[m][1], b.sx0, c[2]);
                        c[3] = fmaf(mn[m][1], b.sx1, c[3]);
                    }
                } else {                                 // step s: columns 16s.., scale d_s
#pragma unroll
                    for (int s = 0; s < 2; ++s) {
                        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                        mmq_dot_half(t, a[m], b, s);
                        const float e0 = s ? d1[m][0] : d0[m][0], e1 = s ? d1[m][1] : d0[m][1];
                        c[0] = fmaf(t[0], e0, c[0]);
                        c[1] = fmaf(t[1], e0, c[1]);
                        c[2] = fmaf(t[2], e1, c[2]);
                        c[3] = fmaf(t[3], e1, c[3]);
                    }
                }
            }
        }
    }
}

// prep records of chunk c for tokens tok0 .. tok0 + BN - 1 (those < M) into X and S, by cp.async;
// gi (the grouped experts' gate/up): token j's record is row gi[j] / gdiv of xp (its pair's input row)
template <int BN>
__device__ __forceinline__ void mmq_stage_x(const u8* __restrict__ xp, long long xps, int c, int tok0, int M, u8* Xs,
                                            float* Ss, const int* __restrict__ gi, int gdiv) {
    constexpr int P = MMQ_REC / 16, PS = P - MMQ_XP;     // 16-byte pieces a record, of them after the values
    for (int i = threadIdx.x; i < BN * P; i += MMQ_THREADS) {
        const int t = i / P, q = i - P * t;
        if (tok0 + t < M) {
            const long long row = gi ? gi[tok0 + t] / gdiv : tok0 + t;
            const u8* src = xp + row * xps + (long long)c * MMQ_REC + 16 * q;
            void* dst = q < MMQ_XP ? (void*)(Xs + t * MMQ_XROW + (mmq_xpiece(q, t) << 4))
                                   : (void*)(Ss + MMQ_SW * t + (PS > 1 ? 4 * (q - MMQ_XP) : 0));
            cp_async16(dst, src);
        }
    }
    mmq_cp_commit();
}

// wait until this thread's copies of the prep records of the oldest staged chunk have landed, with
// `pending` younger chunks staged after it (one cp.async group per chunk)
__device__ __forceinline__ void mmq_wait_x(int pending) {
    if (pending >= 2) mmq_cp_wait<2>();
    else if (pending == 1) mmq_cp_wait<1>();
    else mmq_cp_wait<0>();
}

// The weight pieces a thread loads and decodes each chunk: item j (0, 1) is piece mmq_piece(tid) of
// A-tile row mmq_lrow(tid, j). Four lanes a row, so that a warp's load of an item reads 8 rows'
// pieces 0..3, adjacent bytes in every type's layout (a row's 64 quant bytes of a K-quant chunk in
// one run), where one lane a row read 32 rows' 16-byte pieces from 32 lines: the weight loads were
// most of the tiles' L1 wavefronts. Item 0 takes rows 0..63, item 1 rows 64..127 (a fused FFN
// tile: the gate's rows, then the up's).
__device__ __forceinline__ int mmq_lrow(int tid, int j) { return (tid >> 2) + (MMQ_BM / 2) * j; }
__device__ __forceinline__ int mmq_piece(int tid) { return tid & 3; }

// One chunk of the pipeline: compute chunk c, then (block-uniform) decode chunk c + 1 from register
// slot SLOT into the A tile and refill the slot with chunk c + 1 + D (D chunks of weights in flight
// in registers, their prep records in D + 1 shared buffers). Chunk j >= c0 + 1 lives in slot
// (j - c0 - 1) % D and in activation buffer (j - c0) % (D + 1).
template <int QT, int BN, int SLOT>
__device__ __forceinline__ void mmq_iter(int c, int c0, int c1, MmqRaw (&r)[MmqCfg<BN>::D][2], const u8* const (&wr)[2],
                                         int nu, const u8* __restrict__ xp, long long xps, int tok0, int M,
                                         u8* sm, int wm, int wn, float (&acc)[MmqCfg<BN>::MT][MmqCfg<BN>::NT][4],
                                         const int* __restrict__ gi, int gdiv) {
    constexpr int D = MmqCfg<BN>::D;
    const int tid = threadIdx.x, p = mmq_piece(tid), xb = (c - c0) % (D + 1);
    u8* X = sm + MMQ_BM * MMQ_AROW + MMQ_BM * 16 * MMQ_MROW + xb * BN * MMQ_XROW;
    float* S = (float*)(sm + MMQ_BM * MMQ_AROW + MMQ_BM * 16 * MMQ_MROW + (D + 1) * BN * MMQ_XROW) + xb * BN * MMQ_SW;
    mmq_chunk<QT, BN>(sm, (const float4*)(sm + MMQ_BM * MMQ_AROW), X, S, min(4, nu - 4 * c), wm, wn, tid & 31, acc);
    if (c + 1 < c1) {
        __syncthreads();                         // every warp is done with the A tile and X[xb]
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int lr = mmq_lrow(tid, j);
            mmq_store<QT>(r[SLOT][j], c + 1, p, sm + lr * MMQ_AROW, (float4*)(sm + MMQ_BM * MMQ_AROW) + MMQ_MROW * lr);
        }
        if (c + 1 + D < c1) {
            mmq_load<QT>(wr[0], nu, c + 1 + D, p, r[SLOT][0]);
            mmq_load<QT>(wr[1], nu, c + 1 + D, p, r[SLOT][1]);
            mmq_stage_x<BN>(xp, xps, c + 1 + D, tok0, M, X, S, gi, gdiv);
        }
        mmq_wait_x(min(D, c1 - c - 2));
        __syncthreads();
    }
}

// chunks c0 .. c1 - 1 of the CTA's rows into acc. wr: this thread's weight rows (of its items' tile
// rows mmq_lrow(tid, 0) and mmq_lrow(tid, 1)); it loads and decodes piece mmq_piece(tid) of both in
// every chunk. gi, gdiv: mmq_stage_x's gather (null: none).
template <int QT, int BN>
__device__ __forceinline__ void mmq_main(const u8* const (&wr)[2], int nu, int c0, int c1,
                                         const u8* __restrict__ xp, long long xps, int tok0, int M, u8* sm,
                                         int wm, int wn, float (&acc)[MmqCfg<BN>::MT][MmqCfg<BN>::NT][4],
                                         const int* __restrict__ gi = nullptr, int gdiv = 1) {
    constexpr int D = MmqCfg<BN>::D;
    const int tid = threadIdx.x, p = mmq_piece(tid);
    u8* X0 = sm + MMQ_BM * MMQ_AROW + MMQ_BM * 16 * MMQ_MROW;       // activation buffer b: X0 + b * BN * MMQ_XROW
    float* S0 = (float*)(X0 + (D + 1) * BN * MMQ_XROW);              // its unit sums: S0 + b * BN * MMQ_SW
    MmqRaw r[D][2] = {};
    mmq_load<QT>(wr[0], nu, c0, p, r[0][0]);     // weights only: may run before the kernel before ends
    mmq_load<QT>(wr[1], nu, c0, p, r[0][1]);
    pdl_wait();
    mmq_stage_x<BN>(xp, xps, c0, tok0, M, X0, S0, gi, gdiv);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int lr = mmq_lrow(tid, j);
        mmq_store<QT>(r[0][j], c0, p, sm + lr * MMQ_AROW, (float4*)(sm + MMQ_BM * MMQ_AROW) + MMQ_MROW * lr);
    }
#pragma unroll
    for (int j = 1; j <= D; ++j)
        if (c0 + j < c1) {
            mmq_load<QT>(wr[0], nu, c0 + j, p, r[j - 1][0]);
            mmq_load<QT>(wr[1], nu, c0 + j, p, r[j - 1][1]);
            mmq_stage_x<BN>(xp, xps, c0 + j, tok0, M, X0 + j * BN * MMQ_XROW, S0 + j * BN * MMQ_SW, gi, gdiv);
        }
    mmq_wait_x(min(D, c1 - 1 - c0));
    __syncthreads();
    for (int c = c0; c < c1; c += D) {
        mmq_iter<QT, BN, 0>(c, c0, c1, r, wr, nu, xp, xps, tok0, M, sm, wm, wn, acc, gi, gdiv);
        if (D > 1 && c + 1 < c1)
            mmq_iter<QT, BN, D - 1>(c + 1, c0, c1, r, wr, nu, xp, xps, tok0, M, sm, wm, wn, acc, gi, gdiv);
    }
}

// ------------------------------------------------------------------ the kernel
// mmq_main for the weight type qt (false: a type not compiled in or not taken, acc untouched)
template <int BN>
__device__ __forceinline__ bool mmq_run(int qt, const u8* const (&wr)[2], int nu, int c0, int c1,
                                        const u8* __restrict__ xp, long long xps, int tok0, int M, u8* sm, int wm,
                                        int wn, float (&acc)[MmqCfg<BN>::MT][MmqCfg<BN>::NT][4],
                                        const int* __restrict__ gi, int gdiv) {
#define MMQ_CASE(Q) case Q: if constexpr (QT_ON(Q) && mmq_takes(Q)) { mmq_main<Q, BN>(wr, nu, c0, c1, xp, xps, tok0, M, sm, wm, wn, acc, gi, gdiv); return true; } break;
    switch (qt) {
        MMQ_CASE(QT_Q4_0)
        MMQ_CASE(QT_Q4_1)
        MMQ_CASE(QT_Q5_0)
        MMQ_CASE(QT_Q8_0)
        MMQ_CASE(QT_Q4_K)
        MMQ_CASE(QT_Q6_K)
        MMQ_CASE(QT_Q5_K)
        MMQ_CASE(QT_Q5_1)
        MMQ_CASE(QT_Q3_K)
        MMQ_CASE(QT_IQ4_NL)
        MMQ_CASE(QT_IQ4_XS)
        MMQ_CASE(QT_MXFP4)
        MMQ_CASE(QT_IQ2_XXS)
        MMQ_CASE(QT_IQ2_XS)
        MMQ_CASE(QT_IQ2_S)
        MMQ_CASE(QT_IQ3_XXS)
        MMQ_CASE(QT_IQ3_S)
        default: break;
    }
#undef MMQ_CASE
    return false;
}

template <int BN>
__device__ __forceinline__ void mmq_body(const MmqSeg (&seg)[3], int K, const u8* __restrict__ xp, long long xps,
                                         const float* __restrict__ inv, int M, int mode, int act, int accumulate,
                                         int splits, int cps, float* part, u32* cnt, unsigned long long* amax) {
#ifdef MMQ_DYN_SMEM
    MMQ_DYN_SMEM(mmq_sm);
#else
    extern __shared__ uint4 mmq_sm[];
#endif
    constexpr int MT = MmqCfg<BN>::MT, NT = MmqCfg<BN>::NT, WM = MmqCfg<BN>::WM, E = MT * NT * 4;
    u8* sm = (u8*)mmq_sm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp % WM, wn = warp / WM;
    const int gid = lane >> 2, tig = lane & 3;
    // which tile, K range and tokens
    const int TB = (M + BN - 1) / BN;
    int L = blockIdx.x;
    const int tb = L % TB;
    L /= TB;
    const int split = L % splits, tile = L / splits;
    const int tile_rows = mode ? MMQ_BM / 2 : MMQ_BM;
    int lt = tile, si = 0;
    if (!mode) {
        const int t0 = (seg[0].n + MMQ_BM - 1) / MMQ_BM, t1 = (seg[1].n + MMQ_BM - 1) / MMQ_BM;
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
    const int r0 = lt * tile_rows, tok0 = tb * BN;
    const int nu = K >> 5, nch = (K + MMQ_KC - 1) / MMQ_KC;
    const int c0 = split * cps, c1 = min(nch, c0 + cps);
    // this thread's weight rows for the tile decode (rows past the end repeat the last one, never stored)
    const u8* wr[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int lr = mmq_lrow(tid, j);
        wr[j] = mode ? (lr < MMQ_BM / 2 ? seg[0].W : seg[1].W) + (long long)min(r0 + (lr & 63), S.n - 1) * S.rb
                     : S.W + (long long)min(r0 + lr, S.n - 1) * S.rb;
    }

    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.0f;
    const bool known = mmq_run<BN>(S.qt, wr, nu, c0, c1, xp, xps, tok0, M, sm, wm, wn, acc, nullptr, 1);
    if (!known) mmq_fill_nan(acc);
    pdl_trigger();

    // split K: raw sums to the scratch; the last CTA of the tile adds them in split order
    if (splits > 1) {
        __shared__ int last;
        const long long ti = (long long)tile * TB + tb;
        float* P = part + (ti * splits + split) * (MMQ_THREADS * E);
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) mmq_stcg(P + ((m * NT + n) * 4 + i) * MMQ_THREADS + tid, acc[m][n][i]);
        __threadfence();
        __syncthreads();
        if (tid == 0) last = atomicAdd(cnt + ti, 1u) == (u32)(splits - 1);
        __syncthreads();
        if (!last) return;                   // block-uniform
        __threadfence();
        const float* P0 = part + ti * splits * (MMQ_THREADS * E);
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float* q = P0 + ((m * NT + n) * 4 + i) * MMQ_THREADS + tid;
                    float v = mmq_ldcg(q);
#pragma unroll 4
                    for (int sp = 1; sp < splits; ++sp) v += mmq_ldcg(q + (long long)sp * (MMQ_THREADS * E));
                    acc[m][n][i] = v;
                }
        if (tid == 0) cnt[ti] = 0u;          // ready for the next launch
    }
    __syncthreads();                         // the A tile and meta are free: exchange buffers below

    if (mode) {
        // fused FFN: warps wm < WM/2 hold gate rows 0..63 of the tile, the others the same up rows;
        // the up values go through shared memory to the gate's threads
        float* xu = (float*)sm;              // [64][BN]
        const bool up = wm >= WM / 2;
        float* a = seg[0].y;
        const int as = seg[0].ys, F = seg[0].n;
        for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int lrow = wm * 16 * MT + 16 * m + gid + 8 * (i >> 1);
                        const int tl = wn * 8 * NT + 8 * n + 2 * tig + (i & 1), t = tok0 + tl;
                        const float v = t < M ? acc[m][n][i] * inv[t] : 0.0f;
                        if (pass == 0 && up) xu[(lrow - MMQ_BM / 2) * BN + tl] = v;
                        if (pass == 1 && !up && t < M && r0 + lrow < F)
                            a[(long long)t * as + r0 + lrow] = act_f(v, act) * xu[lrow * BN + tl];
                    }
            if (pass == 0) __syncthreads();
        }
        return;
    }

    unsigned long long best[NT][2];          // argmax keys of this thread's tokens (amax)
#pragma unroll
    for (int n = 0; n < NT; ++n) best[n][0] = best[n][1] = 0ull;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + wm * 16 * MT + 16 * m + gid + 8 * (i >> 1);
                const int t = tok0 + wn * 8 * NT + 8 * n + 2 * tig + (i & 1);
                if (r < S.n && t < M) {
                    const float v = acc[m][n][i] * inv[t] + (S.bias ? S.bias[r] : 0.0f);
                    float* out = S.y + (long long)t * S.ys + r;
                    *out = accumulate ? *out + v : v;
                    if (amax) {
                        const unsigned long long k = argmax_key(v, r);
                        best[n][i & 1] = k > best[n][i & 1] ? k : best[n][i & 1];
                    }
                }
            }
    if (amax) {
        // per token: the warp's best over its rows (lanes of one tig), the CTA's over its warps,
        // then one atomic per token and CTA
        unsigned long long* red = (unsigned long long*)(sm + MMQ_BM * MMQ_AROW);   // [WM][BN], in the meta area
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                unsigned long long b = best[n][j];
#pragma unroll
                for (int o = 4; o < 32; o <<= 1) {
                    const unsigned long long t = __shfl_xor_sync(0xffffffffu, b, o);
                    b = t > b ? t : b;
                }
                if (gid == 0) red[wm * BN + wn * 8 * NT + 8 * n + 2 * tig + j] = b;
            }
        __syncthreads();
        if (tid < BN && tok0 + tid < M) {
            unsigned long long b = 0ull;
#pragma unroll
            for (int w = 0; w < WM; ++w) b = red[w * BN + tid] > b ? red[w * BN + tid] : b;
            if (b) atomicMax(amax + tok0 + tid, b);
        }
    }
}

// ------------------------------------------------------------------ grouped experts
// The routed experts of a wide step (backends/cuda/experts.py GroupedExperts) on these tiles, one
// launch for all experts. moe.cu's bucketing lists each expert's (row, expert) pairs in row order in
// a slot range of its own padded to BN (list[slot] = pair p = t * k + j; -1: padding) and describes
// each BN-slot token tile: tiles[3 tb ..] = (expert e, first slot, end of e's slots that hold pairs;
// e = -1: no tile). A CTA runs mmq_bnBN's pipeline over expert e's matrix (W + e * eb):
//   mode 1 (gate W0 and up W1 of one type and shape): slot s reads row list[s] / k of the prep
//     records (h, one record a step row: gathered in mmq_stage_x) and writes
//     y[s] = gated_f(gate_e . h + b0_e, up_e . h + b1_e, act)  (rows in slot order, stride ys);
//   mode 0 (down W0): slot s reads prep row s (of the rows mode 1 wrote) and writes
//     y[list[s]] = W_e . a[s] + b0_e  (rows in pair order: moe_combine sums them per row, j in order).
// Biases: float [E, n]. Grid: row tiles x TB token tiles (the host's bound, token tile fastest); a CTA
// past the step's tiles returns at once, so the launch is fixed by the row count, not the routing.
// Every output is written by one CTA with no K split: bitwise the same run to run.
template <int BN>
__device__ __forceinline__ void mmq_moe_body(const u8* __restrict__ W0, const u8* __restrict__ W1, long long rb,
                                             long long eb, int n, int qt, const float* __restrict__ b0,
                                             const float* __restrict__ b1, float* __restrict__ y, int ys, int K,
                                             const u8* __restrict__ xp, long long xps, const float* __restrict__ inv,
                                             const int* __restrict__ tiles, const int* __restrict__ list, int k,
                                             int TB, int mode, int act) {
#ifdef MMQ_DYN_SMEM
    MMQ_DYN_SMEM(mmq_sm);
#else
    extern __shared__ uint4 mmq_sm[];
#endif
    constexpr int MT = MmqCfg<BN>::MT, NT = MmqCfg<BN>::NT, WM = MmqCfg<BN>::WM;
    u8* sm = (u8*)mmq_sm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp % WM, wn = warp / WM;
    const int gid = lane >> 2, tig = lane & 3;
    const int tb = blockIdx.x % TB, tile = blockIdx.x / TB;
    pdl_wait();                              // the tile table is the bucketing's output
    const int e = tiles[3 * tb], tok0 = tiles[3 * tb + 1], M = tiles[3 * tb + 2];
    if (e < 0) return;                       // block-uniform: no tile here this step
    const int tile_rows = mode ? MMQ_BM / 2 : MMQ_BM, r0 = tile * tile_rows;
    const int nu = K >> 5, nch = (K + MMQ_KC - 1) / MMQ_KC;
    const long long eo = (long long)e * eb;
    const u8* wr[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int lr = mmq_lrow(tid, j);
        wr[j] = mode ? (lr < MMQ_BM / 2 ? W0 : W1) + eo + (long long)min(r0 + (lr & 63), n - 1) * rb
                     : W0 + eo + (long long)min(r0 + lr, n - 1) * rb;
    }
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][j][i] = 0.0f;
    if (!mmq_run<BN>(qt, wr, nu, 0, nch, xp, xps, tok0, M, sm, wm, wn, acc, mode ? list : nullptr, k))
        mmq_fill_nan(acc);
    pdl_trigger();
    __syncthreads();                         // the A tile is free: the up values' exchange below
    const float* be0 = b0 ? b0 + (long long)e * n : nullptr;
    const float* be1 = b1 ? b1 + (long long)e * n : nullptr;
    if (mode) {
        // as mmq_body's fused FFN: warps wm < WM/2 hold gate rows r0..r0+63, the others the same up rows
        float* xu = (float*)sm;              // [64][BN]
        const bool up = wm >= WM / 2;
        for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int lrow = wm * 16 * MT + 16 * m + gid + 8 * (i >> 1);
                        const int tl = wn * 8 * NT + 8 * j + 2 * tig + (i & 1), t = tok0 + tl;
                        const float v = t < M ? acc[m][j][i] * inv[list[t] / k] : 0.0f;
                        if (pass == 0 && up) {
                            const int r = r0 + lrow - MMQ_BM / 2;
                            xu[(lrow - MMQ_BM / 2) * BN + tl] = be1 && r < n ? v + be1[r] : v;
                        }
                        if (pass == 1 && !up && t < M && r0 + lrow < n)
                            y[(long long)t * ys + r0 + lrow] =
                                gated_f(be0 ? v + be0[r0 + lrow] : v, xu[lrow * BN + tl], act);
                    }
            if (pass == 0) __syncthreads();
        }
        return;
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + wm * 16 * MT + 16 * m + gid + 8 * (i >> 1);
                const int t = tok0 + wn * 8 * NT + 8 * j + 2 * tig + (i & 1);
                if (r < n && t < M) y[(long long)list[t] * ys + r] = acc[m][j][i] * inv[t] + (be0 ? be0[r] : 0.0f);
            }
}

// MMQ_BN: one token-tile width per compilation (the loader compiles them as separate modules, on
// first use); 0: mmq_prep only; unset: everything. The grouped experts' kernels come in both variants
// (mmq_moe_bnBN, mmq8_moe_bnBN: the prep records say which).
#define DEFINE_MMQ(BN)                                                                                    \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS, 2) MMQ_NAME(bn##BN)(                        \
        const u8* W0, long long rb0, int n0, int qt0, const float* b0, float* y0, int ys0,                \
        const u8* W1, long long rb1, int n1, int qt1, const float* b1, float* y1, int ys1,                \
        const u8* W2, long long rb2, int n2, int qt2, const float* b2, float* y2, int ys2,                \
        int K, const u8* xp, long long xps, const float* inv, int M, int mode, int act, int accumulate,   \
        int splits, int cps, float* part, unsigned* cnt, unsigned long long* amax) {                      \
        const MmqSeg seg[3] = {{W0, rb0, n0, qt0, b0, y0, ys0}, {W1, rb1, n1, qt1, b1, y1, ys1},          \
                               {W2, rb2, n2, qt2, b2, y2, ys2}};                                          \
        mmq_body<BN>(seg, K, xp, xps, inv, M, mode, act, accumulate, splits, cps, part, cnt, amax);       \
    }                                                                                                     \
    MMQ_MOE(BN)
#define MMQ_MOE(BN)                                                                                       \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS, 2) MMQ_NAME(moe_bn##BN)(                    \
        const u8* W0, const u8* W1, long long rb, long long eb, int n, int qt, const float* b0,           \
        const float* b1, float* y, int ys, int K, const u8* xp, long long xps, const float* inv,          \
        const int* tiles, const int* list, int k, int TB, int mode, int act) {                            \
        mmq_moe_body<BN>(W0, W1, rb, eb, n, qt, b0, b1, y, ys, K, xp, xps, inv, tiles, list, k, TB, mode, act); \
    }
#if !defined(MMQ_BN) || MMQ_BN == 8
DEFINE_MMQ(8)
#endif
#if !defined(MMQ_BN) || MMQ_BN == 16
DEFINE_MMQ(16)
#endif
#if !defined(MMQ_BN) || MMQ_BN == 32
DEFINE_MMQ(32)
#endif
#if !defined(MMQ_BN) || MMQ_BN == 64
DEFINE_MMQ(64)
#endif
