// Dequantize family: raw GGUF rows -> float32 rows (the start-up self-check of every type's
// decoder), and embed_<type>, which gathers token-embedding rows (by token ids read from a device buffer, so
// a captured graph replays with new tokens) and applies the embedding scale.
//
// One thread decodes one 32-weight unit into registers, as everywhere else. A thread storing its
// own unit would make every store instruction of the warp touch 32 lines 128 (fp32) or 64 bytes
// apart; instead the warp's 32 units (consecutive in the flattened row-major unit order, so
// normally one contiguous run of output) go through shared memory, and lane l then stores chunk
// l, l + 32, ... : each store instruction writes 512 contiguous bytes in 16-byte pieces.
#include "common.cuh"

#define DQ_WARPS 8   // shared memory per block is sized for 8 warps: launch with <= 256 threads

// Warp-cooperative store of 32 units. Lane l holds its unit as CH 16-byte chunks v (CH = 8: 32
// floats; CH = 4: 32 16-bit values packed in pairs) bound for dst[0 .. nv); nv = 0 for a lane
// without a unit. sm: this warp's 32 * CH slots. All 32 lanes must call.
// Chunk j of lane l sits in slot CH*l + ((j + (l >> SH)) % CH): the staging writes (8 lanes, one
// chunk each, per 128-byte shared-memory wavefront) and the reads (lanes 8p .. 8p+7 read chunks
// of one or two units) both fall on 8 distinct 16-byte bank groups.
template <int CH, typename T>
__device__ __forceinline__ void warp_store_units(const u32 (&v)[4 * CH], T* dst, int nv, uint4* sm) {
    constexpr int E = 16 / (int)sizeof(T);   // elements per chunk
    constexpr int SH = CH == 8 ? 0 : 1;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < CH; ++j)
        sm[CH * lane + ((j + (lane >> SH)) & (CH - 1))] = make_uint4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < CH; ++r) {
        const int c = 32 * r + lane, o = c / CH, j = c % CH;
        T* d = (T*)__shfl_sync(0xffffffffu, (u64)dst, o);
        const int n = __shfl_sync(0xffffffffu, nv, o);
        const uint4 q = sm[CH * o + ((j + (o >> SH)) & (CH - 1))];
        const int e0 = E * j;
        T* p = d + e0;
        if (e0 + E <= n && ((u64)p & 15) == 0) {
            *(uint4*)p = q;
        } else if (e0 < n) {  // a row's ragged end (float types) or an unaligned row stride
            const u32 w4[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int i = 0; i < E; ++i) {
                if (e0 + i < n) {
                    if constexpr (sizeof(T) == 4) p[i] = __uint_as_float(w4[i]);
                    else p[i] = (u16)(w4[i >> 1] >> (16 * (i & 1)));
                }
            }
        }
    }
    __syncwarp();   // the slots are free again when this returns
}

__device__ __forceinline__ void pack_f32(const float (&w)[32], u32 (&v)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = __float_as_uint(w[i]);
}

// flattened unit idx of an N x K matrix -> decoded unit in w, its destination and valid count
template <int QT, typename T>
__device__ __forceinline__ int load_flat_unit(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                              T* out, long long os, float (&w)[32], T*& dst) {
    const long long nu = (K + 31) >> 5;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= nu * N) {
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = 0.0f;
        dst = out;
        return 0;
    }
    const long long r = idx / nu;
    const int u = (int)(idx - r * nu);
    load_unit<QT>(W + r * row_bytes, u, K, w);
    dst = out + r * os + 32 * u;
    return min(32, K - 32 * u);
}

template <int QT>
__device__ __forceinline__ void dequant_body(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                             float* __restrict__ out, long long os) {
    __shared__ uint4 sm[DQ_WARPS * 32 * 8];
    float w[32];
    float* dst;
    const int nv = load_flat_unit<QT>(W, row_bytes, N, K, out, os, w, dst);
    u32 v[32];
    pack_f32(w, v);
    warp_store_units<8>(v, dst, nv, sm + (threadIdx.x >> 5) * 32 * 8);
}

template <int QT>
__device__ __forceinline__ void embed_body(const u8* __restrict__ W, long long row_bytes, int K,
                                           const int* __restrict__ tokens, int n, float scale,
                                           float* __restrict__ out, int os) {
    __shared__ uint4 sm[DQ_WARPS * 32 * 8];
    pdl_trigger();            // a decode step's first kernel: the next one may start prefetching now
    const int nu = (K + 31) >> 5;
    const int u = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    float w[32];
    float* dst = out;
    int nv = 0;
    if (u < nu && b < n) {
        load_unit<QT>(W + (long long)tokens[b] * row_bytes, u, K, w);
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] *= scale;
        dst = out + (long long)b * os + 32 * u;
        nv = min(32, K - 32 * u);
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = 0.0f;
    }
    u32 v[32];
    pack_f32(w, v);
    warp_store_units<8>(v, dst, nv, sm + (threadIdx.x >> 5) * 32 * 8);
}

#define DEFINE_DEQUANT(name, QT)                                                                    \
    extern "C" __global__ void dequant_##name(const u8* W, long long row_bytes, int N, int K,      \
                                              float* out, long long os) {                          \
        dequant_body<QT>(W, row_bytes, N, K, out, os);                                              \
    }                                                                                               \
    extern "C" __global__ void embed_##name(const u8* W, long long row_bytes, int K,               \
                                            const int* tokens, int n, float scale, float* out,     \
                                            int os) {                                               \
        embed_body<QT>(W, row_bytes, K, tokens, n, scale, out, os);                                 \
    }


#if QT_ON(QT_F32)
DEFINE_DEQUANT(f32, QT_F32)
#endif
#if QT_ON(QT_F16)
DEFINE_DEQUANT(f16, QT_F16)
#endif
#if QT_ON(QT_BF16)
DEFINE_DEQUANT(bf16, QT_BF16)
#endif
#if QT_ON(QT_Q4_0)
DEFINE_DEQUANT(q4_0, QT_Q4_0)
#endif
#if QT_ON(QT_Q4_1)
DEFINE_DEQUANT(q4_1, QT_Q4_1)
#endif
#if QT_ON(QT_Q5_0)
DEFINE_DEQUANT(q5_0, QT_Q5_0)
#endif
#if QT_ON(QT_Q5_1)
DEFINE_DEQUANT(q5_1, QT_Q5_1)
#endif
#if QT_ON(QT_Q8_0)
DEFINE_DEQUANT(q8_0, QT_Q8_0)
#endif
#if QT_ON(QT_Q4_K)
DEFINE_DEQUANT(q4_k, QT_Q4_K)
#endif
#if QT_ON(QT_Q5_K)
DEFINE_DEQUANT(q5_k, QT_Q5_K)
#endif
#if QT_ON(QT_Q6_K)
DEFINE_DEQUANT(q6_k, QT_Q6_K)
#endif
#if QT_ON(QT_Q2_K)
DEFINE_DEQUANT(q2_k, QT_Q2_K)
#endif
#if QT_ON(QT_Q3_K)
DEFINE_DEQUANT(q3_k, QT_Q3_K)
#endif
#if QT_ON(QT_IQ4_NL)
DEFINE_DEQUANT(iq4_nl, QT_IQ4_NL)
#endif
#if QT_ON(QT_IQ4_XS)
DEFINE_DEQUANT(iq4_xs, QT_IQ4_XS)
#endif
#if QT_ON(QT_MXFP4)
DEFINE_DEQUANT(mxfp4, QT_MXFP4)
#endif
#if QT_ON(QT_IQ2_XXS)
DEFINE_DEQUANT(iq2_xxs, QT_IQ2_XXS)
#endif
#if QT_ON(QT_IQ2_XS)
DEFINE_DEQUANT(iq2_xs, QT_IQ2_XS)
#endif
#if QT_ON(QT_IQ2_S)
DEFINE_DEQUANT(iq2_s, QT_IQ2_S)
#endif
#if QT_ON(QT_IQ3_XXS)
DEFINE_DEQUANT(iq3_xxs, QT_IQ3_XXS)
#endif
#if QT_ON(QT_IQ3_S)
DEFINE_DEQUANT(iq3_s, QT_IQ3_S)
#endif
