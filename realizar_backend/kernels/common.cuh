// Shared by every kernel family: integer types (NVRTC has no <cstdint>), fp16 conversion
// without <cuda_fp16.h> (so NVRTC needs no toolkit headers), warp reductions, and the
// GGUF block decoders.
//
// Decoding unit: 32 consecutive weights of one row ("unit" u covers columns 32u .. 32u+31).
// Every GGUF block type is a whole number of units (32-element blocks: one unit; 256-element
// K-quant super-blocks: eight), so GEMV, dequantize and embedding kernels are one template over
// the type, and any row length the format allows works (hidden 896 = 28 units).
#pragma once

#ifndef INFINITY  // NVRTC has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// ggml type numbers (gguf.GGMLQuantizationType)
#define QT_F32 0
#define QT_F16 1
#define QT_Q4_0 2
#define QT_Q4_1 3
#define QT_Q5_0 6
#define QT_Q5_1 7
#define QT_Q8_0 8
#define QT_Q2_K 10
#define QT_Q3_K 11
#define QT_Q4_K 12
#define QT_Q5_K 13
#define QT_Q6_K 14
#define QT_IQ2_XXS 16
#define QT_IQ2_XS 17
#define QT_IQ3_XXS 18
#define QT_IQ4_NL 20
#define QT_IQ3_S 21
#define QT_IQ2_S 22
#define QT_IQ4_XS 23
#define QT_BF16 30
#define QT_MXFP4 39

// Quant types compiled in (bit = ggml type number): a model's loader compiles only the types it
// holds, which cuts the first-start NVRTC time of the type-templated families several times.
#ifndef REALIZAR_QMASK
#define REALIZAR_QMASK 0xFFFFFFFFFFFFFFFFull
#endif
#define QT_ON(qt) (((REALIZAR_QMASK) >> (qt)) & 1ull)

#ifdef REALIZAR_HOST_TEST  // tests/test_mmvf_host.py runs the decoders on the CPU (g++, shims)
__device__ __forceinline__ float h2f(u16 h) { return realizar_host_h2f(h); }
__device__ __forceinline__ u16 f2h(float f) { return realizar_host_f2h(f); }
#else
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }

// fp32 -> bf16, round to nearest even (finite inputs)
__device__ __forceinline__ u16 f2bf(float f) {
    u32 b = __float_as_uint(f);
    return (u16)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// 16-bit float of either kind: bf != 0 -> bf16 (fp32 range: the FFN activations of the prefill
// GEMM can pass fp16's 65504), else fp16 (more mantissa)
__device__ __forceinline__ u16 f2x(float f, int bf) { return bf ? f2bf(f) : f2h(f); }

// Q4_0's 18-byte blocks are only 2-byte aligned: read them 16 bits at a time.
__device__ __forceinline__ u32 ld16(const u8* p) { return *(const u16*)p; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// L2 prefetch hint for [p, p + bytes): one sm_90 bulk prefetch (a no-op before sm_90), widened to
// 16-byte bounds (allocations are 256-byte aligned and padded, so the widened range stays in them).
// The size field holds 16-byte units in 16 bits: longer ranges are cut to their first 1 MB (a hint).
__device__ __forceinline__ void l2_prefetch(const void* p, long long bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (bytes <= 0) return;
    bytes = min(bytes, (1ll << 20) - 32);
    u64 a = (u64)p & ~(u64)15, e = ((u64)p + (u64)bytes + 15) & ~(u64)15;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"((u32)(e - a)) : "memory");
#endif
}


// 16-byte asynchronous copy global -> shared through L1 (sm_80+; a plain copy before): many in
// flight per thread with no registers held; cp_async_wait_all() waits for this thread's own copies.
// .ca, not .cg: the blocks of an SM that stage the same activation row then share it in L1
// (bypassing L1, each block would fetch the row from L2 again).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(smem)), "l"(gmem)
                 : "memory");
#else
    *(float4*)smem = *(const float4*)gmem;
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Programmatic dependent launch (sm_90; no-ops before, and in kernels launched without the host's
// programmatic-serialization attribute). A kernel launched with it may start while the kernel
// before it is still running: pdl_wait() blocks until that kernel has finished and its writes are
// visible. Every thread of such a kernel calls it before it reads or writes any activation; only
// read-only data (weights, cached K/V) may be touched before, which is what lets weight prefetches
// overlap the previous kernel's tail. pdl_trigger() lets the next kernel's blocks be scheduled:
// kernels call it once their last loads are issued, not at their start (the next kernel's blocks,
// parked early, hold SM slots that this kernel's blocks still to be placed need).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }

__device__ __forceinline__ float gelu_tanh_f(float g) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

__device__ __forceinline__ float act_f(float g, int act) { return act ? gelu_tanh_f(g) : silu_f(g); }

// gpt-oss's clamped SwiGLU (model/math.py swiglu_oai, the experts' activation code 2): the gate
// clamped from above and up both ways at the limit, then g * sigmoid(alpha g) * (up + 1). The
// comparisons keep a NaN a NaN, as NumPy's clip does.
#define ACT_SWIGLU_OAI 2
#define SWIGLU_OAI_ALPHA 1.702f
#define SWIGLU_OAI_LIMIT 7.0f

// act(g) * u for the activation codes 0 and 1 (act_f), the clamped SwiGLU of g and u for code 2
__device__ __forceinline__ float gated_f(float g, float u, int act) {
    if (act != ACT_SWIGLU_OAI) return act_f(g, act) * u;
    g = g > SWIGLU_OAI_LIMIT ? SWIGLU_OAI_LIMIT : g;
    u = u > SWIGLU_OAI_LIMIT ? SWIGLU_OAI_LIMIT : (u < -SWIGLU_OAI_LIMIT ? -SWIGLU_OAI_LIMIT : u);
    return g / (1.0f + expf(-SWIGLU_OAI_ALPHA * g)) * (u + 1.0f);
}

// Sum (is_max = 0) or max of v over the block, returned to every thread; sm: 32 floats of shared
// memory. Block-uniform barriers.
__device__ __forceinline__ float block_reduce(float v, int is_max, float* sm) {
    v = is_max ? warp_max(v) : warp_sum(v);
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();  // sm may still be read from the previous reduction
    if (lane == 0) sm[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nw ? sm[lane] : 0.0f;
        t = is_max ? warp_max(t) : warp_sum(t);
        if (lane == 0) sm[0] = t;
    }
    __syncthreads();
    return sm[0];
}

// the power of two s putting m (a row's max |value|) in [2^14, 2^15); inv = 1/s. Scaling an
// activation row by s before it is rounded to fp16 halves is exact both ways, and fp16 cannot
// overflow (prefill.cu's splits, mmq.cu's prep).
__device__ __forceinline__ float row_scale(float m, float& inv) {
    int e = 0;
    if (m > 0.0f && m <= 3.402823466e38f) frexpf(m, &e);   // finite m = f * 2^e, f in [0.5, 1)
    e = e < -100 ? -100 : e;                                 // all-tiny rows: keep s a finite float
    inv = ldexpf(1.0f, e - 15);
    return ldexpf(1.0f, 15 - e);
}

// A fused argmax's key of output v at row r: an order-keeping 64-bit packing, so that one atomicMax
// per block and row keeps the largest (order-independent: deterministic); the first row wins ties
// as argmax_rows does, NaN never wins. argmax_unpack (elementwise.cu) reads and resets it.
__device__ __forceinline__ unsigned long long argmax_key(float v, int r) {
    u32 u = __float_as_uint(v);
    u ^= (u >> 31) ? 0xFFFFFFFFu : 0x80000000u;          // order-keeping: larger float, larger key
    if (v != v) u = 0u;                                   // NaN never wins (as argmax_rows)
    return ((unsigned long long)u << 32) | (u32)(0xFFFFFFFFu - (u32)r);   // ties: lowest row wins
}

// ------------------------------------------------------------------ block decoders
// load_unit<QT>(row, u, K, w): w[0..31] = columns 32u..32u+31 of `row` (raw GGUF bytes).
// K only matters for the float types, whose rows may end inside a unit (tail reads as 0).

template <int QT> __device__ __forceinline__ void load_unit(const u8* __restrict__ row, int u, int K, float (&w)[32]);

template <> __device__ __forceinline__ void load_unit<QT_F32>(const u8* __restrict__ row, int u, int K, float (&w)[32]) {
    const float* r = (const float*)row + 32 * u;
    int nv = K - 32 * u;
#pragma unroll
    for (int i = 0; i < 32; ++i) w[i] = i < nv ? r[i] : 0.0f;
}

template <> __device__ __forceinline__ void load_unit<QT_F16>(const u8* __restrict__ row, int u, int K, float (&w)[32]) {
    const u16* r = (const u16*)row + 32 * u;
    int nv = K - 32 * u;
#pragma unroll
    for (int i = 0; i < 32; ++i) w[i] = i < nv ? h2f(r[i]) : 0.0f;
}

template <> __device__ __forceinline__ void load_unit<QT_BF16>(const u8* __restrict__ row, int u, int K, float (&w)[32]) {
    const u16* r = (const u16*)row + 32 * u;
    int nv = K - 32 * u;
#pragma unroll
    for (int i = 0; i < 32; ++i) w[i] = i < nv ? bf2f(r[i]) : 0.0f;
}

// Q4_0: {f16 d; u8 qs[16]} ; w = (q - 8) * d, low nibbles first then high nibbles
template <> __device__ __forceinline__ void load_unit<QT_Q4_0>(const u8* __restrict__ row, int u, int, float (&w)[32]) {
    const u8* b = row + u * 18;
    float d = h2f(ld16(b));
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
        u32 q2 = ld16(b + 2 + j);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            u32 q = (q2 >> (8 * k)) & 0xFF;
            w[j + k] = ((int)(q & 15) - 8) * d;
            w[j + k + 16] = ((int)(q >> 4) - 8) * d;
        }
    }
}

// Q4_1: {f16 d, m; u8 qs[16]} ; w = q * d + m
template <> __device__ __forceinline__ void load_unit<QT_Q4_1>(const u8* __restrict__ row, int u, int, float (&w)[32]) {
    const u8* b = row + u * 20;
    float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
    const u32* qs = (const u32*)(b + 4);  // 20-byte blocks keep 4-byte alignment
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 q4 = qs[i];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            u32 q = (q4 >> (8 * k)) & 0xFF;
            w[4 * i + k] = (q & 15) * d + m;
            w[4 * i + k + 16] = (q >> 4) * d + m;
        }
    }
}

// Q5_0 and Q8_0 in their device layouts (formats/gpu_layout.py, made by repack.cu): GGUF's 22- and
// 34-byte blocks are 2-byte aligned (4-byte loads and a funnel shift per word); on the device a row
// holds its units' quants 16-byte aligned, then the d values. Q5_0's fifth bits are regrouped so that
// bit i of byte k belongs to v[i] (column 4i + k) and bit 4 + i to v[i + 4] (column 16 + 4i + k).
// v[i] = columns 4i..4i+3, v[i + 4] = columns 16 + 4i..: bytes holding q << SH (q = 0..31).
__device__ __forceinline__ u32 shl_or_shr(u32 x, int n) { return n >= 0 ? x << n : x >> -n; }

// q5_0_bits: the bit work of q5_0_unit on a unit's 16 quant bytes x and its regrouped fifth bits qh
template <int SH>
__device__ __forceinline__ void q5_0_bits(uint4 x, u32 qh, u32 (&v)[8]) {
    u32 X[4] = {x.x, x.y, x.z, x.w};
    const u32 lo = 0x0F0F0F0Fu << SH, hi = 0x10101010u << SH;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] = (shl_or_shr(X[i], SH) & lo) | (shl_or_shr(qh, 4 + SH - i) & hi);
        v[i + 4] = (shl_or_shr(X[i], SH - 4) & lo) | (shl_or_shr(qh, SH - i) & hi);
    }
}

template <int SH>
__device__ __forceinline__ void q5_0_unit(const u8* __restrict__ row, int u, int nu, u32 (&v)[8], float& d) {
    uint4 x = __ldg((const uint4*)(row + 16 * u));
    u32 qh = __ldg((const u32*)(row + 16 * nu + 4 * u));
    d = h2f(ld16(row + 20 * nu + 2 * u));
    q5_0_bits<SH>(x, qh, v);
}

// Q8_0 (device layout): the unit's 32 int8 values as 8 words
__device__ __forceinline__ void q8_0_unit(const u8* __restrict__ row, int u, int nu, u32 (&v)[8], float& d) {
    const uint4* q = (const uint4*)(row + 32 * u);
    uint4 a = __ldg(q), c = __ldg(q + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = c.x; v[5] = c.y; v[6] = c.z; v[7] = c.w;
    d = h2f(ld16(row + 32 * nu + 2 * u));
}

template <> __device__ __forceinline__ void load_unit<QT_Q5_0>(const u8* __restrict__ row, int u, int K, float (&w)[32]) {
    u32 v[8];
    float d;
    q5_0_unit<0>(row, u, K >> 5, v, d);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) w[4 * i + k] = d * (float)((int)((v[i] >> (8 * k)) & 31) - 16);
}

// Q5_1: {f16 d, m; u8 qh[4]; u8 qs[16]}
template <> __device__ __forceinline__ void load_unit<QT_Q5_1>(const u8* __restrict__ row, int u, int, float (&w)[32]) {
    const u8* b = row + u * 24;
    float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
    u32 qh = *(const u32*)(b + 4);
    const u32* qs = (const u32*)(b + 8);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 q4 = qs[i];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            int jj = 4 * i + k;
            u32 q = (q4 >> (8 * k)) & 0xFF;
            u32 h0 = ((qh >> jj) << 4) & 0x10, h1 = (qh >> (jj + 12)) & 0x10;
            w[jj] = ((q & 15) | h0) * d + m;
            w[jj + 16] = ((q >> 4) | h1) * d + m;
        }
    }
}

template <> __device__ __forceinline__ void load_unit<QT_Q8_0>(const u8* __restrict__ row, int u, int K, float (&w)[32]) {
    u32 v[8];
    float d;
    q8_0_unit(row, u, K >> 5, v, d);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) w[4 * i + k] = (float)(i8)(v[i] >> (8 * k)) * d;
}

// K-quant 6-bit scale/min pair j of 8, packed in 12 bytes (llama.cpp get_scale_min_k4)
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q4_K: {f16 d, dmin; u8 scales[12]; u8 qs[128]} (144 bytes, 16-byte aligned blocks).
// Sub-block j uses qs[32*(j/2) ..] low nibbles (j even) or high nibbles (j odd).
template <> __device__ __forceinline__ void load_unit<QT_Q4_K>(const u8* __restrict__ row, int u, int, float (&w)[32]) {
    const u8* b = row + (u >> 3) * 144;
    int j = u & 7;
    float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
    int sc, m;
    scale_min_k4(j, b + 4, sc, m);
    float d1 = d * sc, m1 = dmin * m;
    const uint4* q = (const uint4*)(b + 16 + 32 * (j >> 1));
    uint4 a = q[0], c = q[1];
    u32 words[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
    int sh = (j & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) w[4 * i + k] = ((words[i] >> (8 * k + sh)) & 15) * d1 - m1;
}

// Q5_K: {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]} (176 bytes); fifth bit j of qh[l]
template <> __device__ __forceinline__ void load_unit<QT_Q5_K>(const u8* __restrict__ row, int u, int, float (&w)[32]) {
    const u8* b = row + (u >> 3) * 176;
    int j = u & 7;
    float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
    int sc, m;
    scale_min_k4(j, b + 4, sc, m);
    float d1 = d * sc, m1 = dmin * m;
    const uint4* q = (const uint4*)(b + 48 + 32 * (j >> 1));
    const uint4* h = (const uint4*)(b + 16);
    uint4 a = q[0], c = q[1], ha = h[0], hc = h[1];
    u32 words[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
    u32 hw[8] = {ha.x, ha.y, ha.z, ha.w, hc.x, hc.y, hc.z, hc.w};
    int sh = (j & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            u32 ql = (words[i] >> (8 * k + sh)) & 15;
            u32 qh = (hw[i] >> (8 * k + j)) & 1;
            w[4 * i + k] = (ql | (qh << 4)) * d1 - m1;
        }
}

// Q6_K in its device layout (formats/gpu_layout.py, made by repack.cu): per 256-weight block
// lo[8][16] (low nibbles of columns b and b + 16), hi[8][8] (2-bit high parts of columns 16w + 4s + k
// at bits 2s of byte 4w + k), sc[8][2] (int8 scales of columns 0..15, 16..31): 208 bytes; the row's
// fp16 d values follow its blocks. One unit is one 16-byte, one 8-byte and two 2-byte loads (GGUF's
// 210-byte blocks are 2-byte aligned: twice the load instructions and a funnel shift per word).
// v[i] = columns 4i..4i+3, v[i + 4] = columns 16 + 4i.. as bytes holding the unsigned value 0..63.
// q6k_bits: the bit work of q6k_unit on a unit's 16 low-nibble bytes and 8 high-part bytes
__device__ __forceinline__ void q6k_bits(uint4 lo, uint2 hi, u32 (&v)[8]) {
    u32 L[4] = {lo.x, lo.y, lo.z, lo.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {        // the high parts of v[i] sit at bits 2i of hi.x's bytes
        u32 hx = i < 2 ? hi.x << (4 - 2 * i) : hi.x >> (2 * i - 4);
        u32 hy = i < 2 ? hi.y << (4 - 2 * i) : hi.y >> (2 * i - 4);
        v[i] = (L[i] & 0x0F0F0F0Fu) | (hx & 0x30303030u);
        v[i + 4] = ((L[i] >> 4) & 0x0F0F0F0Fu) | (hy & 0x30303030u);
    }
}

__device__ __forceinline__ void q6k_unit(const u8* __restrict__ row, int u, int nu, u32 (&v)[8], u32& sc, float& d) {
    const u8* b = row + (u >> 3) * 208;
    int j = u & 7;
    uint4 lo = __ldg((const uint4*)(b + 16 * j));
    uint2 hi = __ldg((const uint2*)(b + 128 + 8 * j));
    sc = ld16(b + 192 + 2 * j);
    d = h2f(ld16(row + 26 * nu + 2 * (u >> 3)));      // after the nu / 8 blocks of 208 bytes
    q6k_bits(lo, hi, v);
}

template <> __device__ __forceinline__ void load_unit<QT_Q6_K>(const u8* __restrict__ row, int u, int K, float (&w)[32]) {
    u32 v[8], sc;
    float d;
    q6k_unit(row, u, K >> 5, v, sc, d);
    float d0 = d * (float)(i8)(sc & 255), d1 = d * (float)(i8)(sc >> 8);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) w[4 * i + k] = (i < 4 ? d0 : d1) * (float)((int)((v[i] >> (8 * k)) & 63) - 32);
}

// ------------------------------------------------------------------ 8-bit activations (Q8_1-like)
// An activation row of K values (K a multiple of 32) is stored as int8 q[K] plus one float2 per
// 32 values: (d, d * sum(q)), value ~= q * d. The sum lets offset/min terms of the weight formats
// fold into one multiply (sum_k (a q_k + c) x_k = a dx sum(q_k xq_k) + c sx).

// 4 bytes at a 2-byte aligned address (Q4_0's 18-byte blocks)
__device__ __forceinline__ int ld32_a2(const u8* p) {
    return (int)(ld16(p) | (ld16(p + 2) << 16));
}

// bits 0..3 of x -> bit 4 of bytes 0..3 (the fifth bit of Q5_0/Q5_1 values)
__device__ __forceinline__ int bits_to_b4(u32 x) {
    return (int)(((x & 1u) << 4) | ((x & 2u) << 11) | ((x & 4u) << 18) | ((x & 8u) << 25));
}

// Quantize 32 values held one per lane (all 32 lanes call): lane's int8 goes to q[lane],
// lane 0 writes (d, d*sum). Round half to even, as np.rint in the NumPy twin.
__device__ __forceinline__ void quant_q8_lane(float v, i8* q, float2* ds, int lane) {
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = d > 0.0f ? 1.0f / d : 0.0f;
    int qi = (int)rintf(v * id);
    q[lane] = (i8)qi;
    float s = warp_sum((float)qi);  // |sum| <= 32*127: exact in float
    if (lane == 0) *ds = make_float2(d, d * s);
}

// One 32-weight unit decoded for integer dot products: v[i] holds the weights of columns
// 4i..4i+3 (int8 lanes); the unit's dot with an 8-bit activation unit (xq, (dx, sx)) is
// A * dx * (s0 * sum_{i<4} dp4a(v[i], x[i]) + s1 * sum_{i>=4} ...) + C * sx.
struct QUnit {
    int v[8];
    float A, C;
    int s0, s1;
};

template <int QT> __device__ __forceinline__ void load_qunit(const u8* __restrict__ row, int u, int nu, QUnit& w);

template <> __device__ __forceinline__ void load_qunit<QT_Q4_0>(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    const u8* b = row + u * 18;
    float d = h2f(ld16(b));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int q = ld32_a2(b + 2 + 4 * i);
        w.v[i] = q & 0x0F0F0F0F;
        w.v[i + 4] = (q >> 4) & 0x0F0F0F0F;
    }
    w.A = d; w.C = -8.0f * d; w.s0 = w.s1 = 1;
}

template <> __device__ __forceinline__ void load_qunit<QT_Q4_1>(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    const u8* b = row + u * 20;
    u32 dm = *(const u32*)b;
    const int* qs = (const int*)(b + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int q = qs[i];
        w.v[i] = q & 0x0F0F0F0F;
        w.v[i + 4] = (q >> 4) & 0x0F0F0F0F;
    }
    w.A = h2f((u16)(dm & 0xFFFF)); w.C = h2f((u16)(dm >> 16)); w.s0 = w.s1 = 1;
}

template <> __device__ __forceinline__ void load_qunit<QT_Q5_0>(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    u32 v[8];
    float d;
    q5_0_unit<0>(row, u, nu, v, d);
#pragma unroll
    for (int i = 0; i < 8; ++i) w.v[i] = (int)v[i];
    w.A = d; w.C = -16.0f * d; w.s0 = w.s1 = 1;
}

template <> __device__ __forceinline__ void load_qunit<QT_Q5_1>(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    const u8* b = row + u * 24;
    u32 dm = *(const u32*)b;
    u32 qh = *(const u32*)(b + 4);
    const int* qs = (const int*)(b + 8);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int q = qs[i];
        w.v[i] = (q & 0x0F0F0F0F) | bits_to_b4(qh >> (4 * i));
        w.v[i + 4] = ((q >> 4) & 0x0F0F0F0F) | bits_to_b4(qh >> (16 + 4 * i));
    }
    w.A = h2f((u16)(dm & 0xFFFF)); w.C = h2f((u16)(dm >> 16)); w.s0 = w.s1 = 1;
}

template <> __device__ __forceinline__ void load_qunit<QT_Q8_0>(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    u32 v[8];
    q8_0_unit(row, u, nu, v, w.A);
#pragma unroll
    for (int i = 0; i < 8; ++i) w.v[i] = (int)v[i];
    w.C = 0.0f; w.s0 = w.s1 = 1;
}

// K-quant scale/min pair j (run-time j) from the 12 scale bytes held as three words s0 s1 s2
__device__ __forceinline__ void scale_min_k4w(int j, u32 s0, u32 s1, u32 s2, int& sc, int& m) {
    int sh = 8 * (j & 3);
    u32 a = (s0 >> sh) & 255, b = (s1 >> sh) & 255;   // q[j&3], q[4 + (j&3)]
    if (j < 4) {
        sc = a & 63;
        m = b & 63;
    } else {
        u32 c = (s2 >> sh) & 255;                    // q[j + 4]
        sc = (c & 0xF) | ((a >> 6) << 4);
        m = (c >> 4) | ((b >> 6) << 4);
    }
}

template <> __device__ __forceinline__ void load_qunit<QT_Q4_K>(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    const u8* b = row + (u >> 3) * 144;   // 144-byte blocks in 256-aligned rows: 16-byte loads
    int j = u & 7;
    uint4 hd = *(const uint4*)b;          // d, dmin, scales[12]
    int sc, m;
    scale_min_k4w(j, hd.y, hd.z, hd.w, sc, m);
    const uint4* q = (const uint4*)(b + 16 + 32 * (j >> 1));
    uint4 x0 = q[0], x1 = q[1];
    int sh = (j & 1) * 4;
    u32 words[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) w.v[i] = (int)((words[i] >> sh) & 0x0F0F0F0Fu);
    w.A = h2f((u16)(hd.x & 0xFFFF)) * sc;
    w.C = -h2f((u16)(hd.x >> 16)) * m;
    w.s0 = w.s1 = 1;
}

template <> __device__ __forceinline__ void load_qunit<QT_Q5_K>(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    const u8* b = row + (u >> 3) * 176;
    int j = u & 7;
    uint4 hd = *(const uint4*)b;
    int sc, m;
    scale_min_k4w(j, hd.y, hd.z, hd.w, sc, m);
    const uint4* q = (const uint4*)(b + 48 + 32 * (j >> 1));
    const uint4* h = (const uint4*)(b + 16);
    uint4 x0 = q[0], x1 = q[1], h0 = h[0], h1 = h[1];
    int sh = (j & 1) * 4;
    u32 words[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    u32 hw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i)
        w.v[i] = (int)(((words[i] >> sh) & 0x0F0F0F0Fu) | (((hw[i] >> j) & 0x01010101u) << 4));
    w.A = h2f((u16)(hd.x & 0xFFFF)) * sc;
    w.C = -h2f((u16)(hd.x >> 16)) * m;
    w.s0 = w.s1 = 1;
}

// Q6_K (device layout): values 0..63 minus 32 with a per-byte saturating subtract (no saturation
// occurs), two int8 scales per unit (columns 0..15 and 16..31)
template <> __device__ __forceinline__ void load_qunit<QT_Q6_K>(const u8* __restrict__ row, int u, int nu, QUnit& w) {
    u32 v[8], sc;
    q6k_unit(row, u, nu, v, sc, w.A);
#pragma unroll
    for (int i = 0; i < 8; ++i) w.v[i] = (int)__vsubss4(v[i], 0x20202020u);
    w.s0 = (int)(i8)(sc & 255);
    w.s1 = (int)(i8)(sc >> 8);
    w.C = 0.0f;
}

// partial dot of a decoded unit with one 8-bit activation unit (x: 8 ints, 16-byte aligned)
__device__ __forceinline__ float qunit_dot(const QUnit& w, const int* __restrict__ x, float2 xds) {
    int4 a = *(const int4*)x, c = *(const int4*)(x + 4);
    int lo = __dp4a(w.v[0], a.x, __dp4a(w.v[1], a.y, __dp4a(w.v[2], a.z, __dp4a(w.v[3], a.w, 0))));
    int hi = __dp4a(w.v[4], c.x, __dp4a(w.v[5], c.y, __dp4a(w.v[6], c.z, __dp4a(w.v[7], c.w, 0))));
    return w.A * xds.x * (float)(w.s0 * lo + w.s1 * hi) + w.C * xds.y;
}

// ------------------------------------------------------------------ RoPE
// One rotary pair (a, b) by (cos c, sin s), each product and the sum rounded as float32 on its own
// (no fused multiply-add), as the NumPy twin computes it: the rotated k goes to the fp16 cache,
// where a contraction could flip the rounding of a value and part the GPU's cache from the CPU's.
__device__ __forceinline__ float2 rope_rot(float a, float b, float c, float s) {
    return make_float2(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)), __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c)));
}

// ------------------------------------------------------------------ fp32 activations (mmvf.cu)
// A 32-weight unit decoded for fp32 dot products with no integer->float conversion instruction:
// byte k of v[i] holds the value q of column 4i+k as q << (7 - bits) (q unsigned, bits <= 6; Q6_K
// keeps q as it is, the bits = 7 case), and one PRMT puts that byte under the exponent of 0.5:
// f = 0.5 + q / 2^(bits+1), exactly. The weight
// A q + C is then a f + c with a = 2^(bits+1) A and c = C - 2^bits A, so the unit's dot with x is
//   a0 * sum_{k<16} f_k x_k + a1 * sum_{k>=16} f_k x_k + c0 * sum_{k<16} x_k + c1 * sum_{k>=16} x_k,
// where the two sums of x are computed once per unit and shared by every row. Q8_0 (8-bit signed)
// has no spare bit: its bytes (sign flipped) become 2^23 + q + 128, and one subtraction gives q; the
// I-quants and MXFP4 (lowbit.cuh) decode to such bytes too (funit_s8), with a scale per half unit.
struct FUnit {
    u32 v[8];
    float a0, a1, c0, c1;
};

// n 32-bit words from a 2-byte aligned address: aligned 4-byte loads and a funnel shift (half the
// load instructions of 16-bit loads); the extra word is read only when the address is misaligned.
template <int n>
__device__ __forceinline__ void ldw_a2(const u8* p, u32 (&w)[n]) {
    const u32* a = (const u32*)((u64)p & ~(u64)3);
    u32 sh = ((u32)(u64)p & 2u) * 8u;
    u32 t[n + 1];
#pragma unroll
    for (int i = 0; i < n; ++i) t[i] = __ldg(a + i);
    t[n] = sh ? __ldg(a + n) : 0u;
#pragma unroll
    for (int i = 0; i < n; ++i) w[i] = __funnelshift_r(t[i], t[i + 1], sh);
}

__device__ __forceinline__ void funit_coef(FUnit& w, int bits, float A, float C) {
    w.a0 = w.a1 = A * (float)(2 << bits);          // power-of-two scalings: exact
    w.c0 = w.c1 = C - A * (float)(1 << bits);
}

template <int QT> __device__ __forceinline__ void load_funit(const u8* __restrict__ row, int u, int nu, FUnit& w);

template <> __device__ __forceinline__ void load_funit<QT_Q4_0>(const u8* __restrict__ row, int u, int nu, FUnit& w) {
    const u8* b = row + u * 18;
    u32 q[4];
    ldw_a2<4>(b + 2, q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w.v[i] = (q[i] << 3) & 0x78787878u;
        w.v[i + 4] = (q[i] >> 1) & 0x78787878u;
    }
    float d = h2f(ld16(b));
    funit_coef(w, 4, d, -8.0f * d);
}

template <> __device__ __forceinline__ void load_funit<QT_Q4_1>(const u8* __restrict__ row, int u, int nu, FUnit& w) {
    const u8* b = row + u * 20;
    u32 dm = __ldg((const u32*)b);
    const u32* qs = (const u32*)(b + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 q = __ldg(qs + i);
        w.v[i] = (q << 3) & 0x78787878u;
        w.v[i + 4] = (q >> 1) & 0x78787878u;
    }
    funit_coef(w, 4, h2f((u16)(dm & 0xFFFF)), h2f((u16)(dm >> 16)));
}

template <> __device__ __forceinline__ void load_funit<QT_Q5_0>(const u8* __restrict__ row, int u, int nu, FUnit& w) {
    float d;
    q5_0_unit<2>(row, u, nu, w.v, d);
    funit_coef(w, 5, d, -16.0f * d);
}

template <> __device__ __forceinline__ void load_funit<QT_Q5_1>(const u8* __restrict__ row, int u, int nu, FUnit& w) {
    const u8* b = row + u * 24;
    u32 dm = __ldg((const u32*)b);
    u32 qh = __ldg((const u32*)(b + 4));
    const u32* qs = (const u32*)(b + 8);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 x = __ldg(qs + i);
        w.v[i] = (((x & 0x0F0F0F0Fu) | (u32)bits_to_b4(qh >> (4 * i))) << 2);
        w.v[i + 4] = ((((x >> 4) & 0x0F0F0F0Fu) | (u32)bits_to_b4(qh >> (16 + 4 * i))) << 2);
    }
    funit_coef(w, 5, h2f((u16)(dm & 0xFFFF)), h2f((u16)(dm >> 16)));
}

template <> __device__ __forceinline__ void load_funit<QT_Q8_0>(const u8* __restrict__ row, int u, int nu, FUnit& w) {
    float d;
    q8_0_unit(row, u, nu, w.v, d);
#pragma unroll
    for (int i = 0; i < 8; ++i) w.v[i] ^= 0x80808080u;   // q + 128, unsigned
    w.a0 = w.a1 = d;
    w.c0 = w.c1 = 0.0f;
}

template <> __device__ __forceinline__ void load_funit<QT_Q4_K>(const u8* __restrict__ row, int u, int nu, FUnit& w) {
    const u8* b = row + (u >> 3) * 144;
    int j = u & 7;
    uint4 hd = __ldg((const uint4*)b);
    int sc, m;
    scale_min_k4w(j, hd.y, hd.z, hd.w, sc, m);
    const uint4* q = (const uint4*)(b + 16 + 32 * (j >> 1));
    uint4 x0 = __ldg(q), x1 = __ldg(q + 1);
    u32 words[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    int sh = (j & 1) * 4;                  // lanes alternate: no branch on j
#pragma unroll
    for (int i = 0; i < 8; ++i) w.v[i] = ((words[i] >> sh) & 0x0F0F0F0Fu) << 3;
    float A = h2f((u16)(hd.x & 0xFFFF)) * sc;
    funit_coef(w, 4, A, -h2f((u16)(hd.x >> 16)) * m);
}

template <> __device__ __forceinline__ void load_funit<QT_Q5_K>(const u8* __restrict__ row, int u, int nu, FUnit& w) {
    const u8* b = row + (u >> 3) * 176;
    int j = u & 7;
    uint4 hd = __ldg((const uint4*)b);
    int sc, m;
    scale_min_k4w(j, hd.y, hd.z, hd.w, sc, m);
    const uint4* q = (const uint4*)(b + 48 + 32 * (j >> 1));
    const uint4* h = (const uint4*)(b + 16);
    uint4 x0 = __ldg(q), x1 = __ldg(q + 1), h0 = __ldg(h), h1 = __ldg(h + 1);
    int sh = (j & 1) * 4;
    u32 words[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    u32 hw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i)
        w.v[i] = (((words[i] >> sh) & 0x0F0F0F0Fu) | (((hw[i] >> j) & 0x01010101u) << 4)) << 2;
    float A = h2f((u16)(hd.x & 0xFFFF)) * sc;
    funit_coef(w, 5, A, -h2f((u16)(hd.x >> 16)) * m);
}

// Q6_K (device layout): the 6-bit value q sits in bits 0..5, so f = 0.5 + q / 256 (the Q-bits = 7
// case of funit_coef); the -32 goes into c; a scale per half unit
template <> __device__ __forceinline__ void load_funit<QT_Q6_K>(const u8* __restrict__ row, int u, int nu, FUnit& w) {
    u32 sc;
    float d;
    q6k_unit(row, u, nu, w.v, sc, d);
    float A0 = d * (float)(i8)(sc & 255), A1 = d * (float)(i8)(sc >> 8);
    w.a0 = 256.0f * A0;    // a = 2^8 A, c = -32 A - 2^7 A
    w.a1 = 256.0f * A1;
    w.c0 = -160.0f * A0;
    w.c1 = -160.0f * A1;
}

// byte permute with the selector as an immediate: ptxas, left to choose, puts the constant word
// in the immediate slot and moves every selector into a register, one extra instruction per weight
template <u32 SEL>
__device__ __forceinline__ u32 prmt_imm(u32 a, u32 b) {
#ifdef __CUDA_ARCH__
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "n"(SEL));
    return r;
#else
    return __byte_perm(a, b, SEL);
#endif
}

// The types whose FUnit bytes hold a signed q + 128 (Q8_0's form): Q8_0, and the I-quants and MXFP4
// (lowbit.cuh), which have a scale per half unit (a0, a1) and no offset (c0 = c1 = 0)
__host__ __device__ constexpr bool funit_s8(int qt) {
    return qt == QT_Q8_0 || qt == QT_IQ4_NL || qt == QT_IQ4_XS || qt == QT_MXFP4 || qt == QT_IQ2_XXS ||
           qt == QT_IQ2_XS || qt == QT_IQ2_S || qt == QT_IQ3_XXS || qt == QT_IQ3_S;
}

// value of byte K of v as a float: 0.5 + q / 2^(bits+1) (funit_s8 types: q itself)
template <int QT, int K>
__device__ __forceinline__ float funit_f(u32 v) {
    if (funit_s8(QT)) return __int_as_float((int)prmt_imm<0x7440u | K>(v, 0x4B000000u)) - 8388736.0f;
    return __int_as_float((int)prmt_imm<0x7044u | (K << 8)>(v, 0x3F000000u));
}

// acc + the four weights of word v times x[0..3], in order
template <int QT>
__device__ __forceinline__ float funit_dot4(u32 v, const float* x, float acc) {
    acc = fmaf(funit_f<QT, 0>(v), x[0], acc);
    acc = fmaf(funit_f<QT, 1>(v), x[1], acc);
    acc = fmaf(funit_f<QT, 2>(v), x[2], acc);
    return fmaf(funit_f<QT, 3>(v), x[3], acc);
}

// dot of a decoded unit with 32 fp32 activations xv; sl, sh: sums of xv[0..15], xv[16..31]
template <int QT>
__device__ __forceinline__ float funit_dot(const FUnit& w, const float (&xv)[32], float sl, float sh) {
    float lo0 = 0.0f, lo1 = 0.0f, hi0 = 0.0f, hi1 = 0.0f;   // four independent chains
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
        lo0 = funit_dot4<QT>(w.v[i], xv + 4 * i, lo0);
        lo1 = funit_dot4<QT>(w.v[i + 1], xv + 4 * i + 4, lo1);
        hi0 = funit_dot4<QT>(w.v[i + 4], xv + 16 + 4 * i, hi0);
        hi1 = funit_dot4<QT>(w.v[i + 5], xv + 20 + 4 * i, hi1);
    }
    if (QT == QT_Q8_0) return w.a0 * ((lo0 + lo1) + (hi0 + hi1));
    if (funit_s8(QT)) return fmaf(w.a0, lo0 + lo1, w.a1 * (hi0 + hi1));
    return fmaf(w.a0, lo0 + lo1, fmaf(w.a1, hi0 + hi1, fmaf(w.c0, sl, w.c1 * sh)));
}

// the decoders of the low-bit and codebook types (Q2_K, Q3_K, the I-quants, MXFP4)
#include "lowbit.cuh"
