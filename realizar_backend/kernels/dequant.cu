// Dequantize family: raw GGUF rows -> float32 rows, one thread per 32-weight unit.
// dequant_<type> expands a whole matrix for the prefill GEMM (cuBLAS) path only;
// embed_<type> gathers token-embedding rows (by token ids read from a device buffer, so a
// captured graph replays with new tokens) and applies the embedding scale.
#include "common.cuh"

template <int QT>
__device__ __forceinline__ void store_unit(const u8* __restrict__ row, int u, int K, float scale, float* __restrict__ out) {
    float w[32];
    load_unit<QT>(row, u, K, w);
    int nv = K - 32 * u;
    float* o = out + 32 * u;
#pragma unroll
    for (int i = 0; i < 32; ++i)
        if (i < nv) o[i] = w[i] * scale;
}

template <int QT>
__device__ __forceinline__ void dequant_body(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                             float* __restrict__ out, long long os) {
    long long nu = (K + 31) >> 5;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= nu * N) return;
    long long r = idx / nu;
    int u = (int)(idx - r * nu);
    store_unit<QT>(W + r * row_bytes, u, K, 1.0f, out + r * os);
}

template <int QT>
__device__ __forceinline__ void embed_body(const u8* __restrict__ W, long long row_bytes, int K,
                                           const int* __restrict__ tokens, int n, float scale,
                                           float* __restrict__ out, int os) {
    int nu = (K + 31) >> 5;
    int u = blockIdx.x * blockDim.x + threadIdx.x;
    int b = blockIdx.y;
    if (u >= nu || b >= n) return;
    store_unit<QT>(W + (long long)tokens[b] * row_bytes, u, K, scale, out + (long long)b * os);
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

// fp16 rows for the tensor-core prefill GEMM: 16-byte stores (a unit is 64 bytes of output)
template <int QT>
__device__ __forceinline__ void dequant16_body(const u8* __restrict__ W, long long row_bytes, int N, int K,
                                               u16* __restrict__ out, long long os, int bf) {
    long long nu = (K + 31) >> 5;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= nu * N) return;
    long long r = idx / nu;
    int u = (int)(idx - r * nu);
    float w[32];
    load_unit<QT>(W + r * row_bytes, u, K, w);
    u16* o = out + r * os + 32 * u;
    int nv = K - 32 * u;
    if (nv >= 32 && ((((u64)o) & 15) == 0)) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint4 p;
            p.x = f2x(w[8 * i], bf) | ((u32)f2x(w[8 * i + 1], bf) << 16);
            p.y = f2x(w[8 * i + 2], bf) | ((u32)f2x(w[8 * i + 3], bf) << 16);
            p.z = f2x(w[8 * i + 4], bf) | ((u32)f2x(w[8 * i + 5], bf) << 16);
            p.w = f2x(w[8 * i + 6], bf) | ((u32)f2x(w[8 * i + 7], bf) << 16);
            ((uint4*)o)[i] = p;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i)
            if (i < nv) o[i] = f2x(w[i], bf);
    }
}

#define DEFINE_DEQUANT16(name, QT)                                                                  \
    extern "C" __global__ void dequant16_##name(const u8* W, long long row_bytes, int N, int K,    \
                                                u16* out, long long os, int bf) {                  \
        dequant16_body<QT>(W, row_bytes, N, K, out, os, bf);                                            \
    }

DEFINE_DEQUANT16(f32, QT_F32)
DEFINE_DEQUANT16(f16, QT_F16)
DEFINE_DEQUANT16(bf16, QT_BF16)
DEFINE_DEQUANT16(q4_0, QT_Q4_0)
DEFINE_DEQUANT16(q4_1, QT_Q4_1)
DEFINE_DEQUANT16(q5_0, QT_Q5_0)
DEFINE_DEQUANT16(q5_1, QT_Q5_1)
DEFINE_DEQUANT16(q8_0, QT_Q8_0)
DEFINE_DEQUANT16(q4_k, QT_Q4_K)
DEFINE_DEQUANT16(q5_k, QT_Q5_K)
DEFINE_DEQUANT16(q6_k, QT_Q6_K)

DEFINE_DEQUANT(f32, QT_F32)
DEFINE_DEQUANT(f16, QT_F16)
DEFINE_DEQUANT(bf16, QT_BF16)
DEFINE_DEQUANT(q4_0, QT_Q4_0)
DEFINE_DEQUANT(q4_1, QT_Q4_1)
DEFINE_DEQUANT(q5_0, QT_Q5_0)
DEFINE_DEQUANT(q5_1, QT_Q5_1)
DEFINE_DEQUANT(q8_0, QT_Q8_0)
DEFINE_DEQUANT(q4_k, QT_Q4_K)
DEFINE_DEQUANT(q5_k, QT_Q5_K)
DEFINE_DEQUANT(q6_k, QT_Q6_K)
