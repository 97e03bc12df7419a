// Weights into their device layout at upload (formats/gpu_layout.py describes it; its to_device is
// this file's NumPy twin). GGUF's Q5_0, Q8_0 and Q6_K blocks are 2-byte aligned, MXFP4's 1-byte; the
// device layouts give every 32-weight unit 16-byte aligned quants (common.cuh q5_0_unit, q8_0_unit,
// q6k_unit; lowbit.cuh's MXFP4 decoders).
//
// repack_<type>(src, rows, cols, dst, rb): src holds rows x cols weights in GGUF bytes, contiguous;
// dst rows of rb bytes (the GGUF row size rounded up to 16). One thread per 32-weight unit; a row's
// first thread also zeroes the row's padding.
#include "common.cuh"

__device__ __forceinline__ bool repack_unit(int rows, int cols, long long& r, int& u) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int nu = cols >> 5;
    if (t >= (long long)rows * nu) return false;
    r = t / nu;
    u = (int)(t - r * nu);
    return true;
}

__device__ __forceinline__ void repack_pad(u8* row, long long used, long long rb) {
    for (long long p = used; p < rb; ++p) row[p] = 0;
}

extern "C" __global__ void repack_q8_0(const u8* __restrict__ src, int rows, int cols, u8* __restrict__ dst,
                                       long long rb) {
    long long r;
    int u;
    if (!repack_unit(rows, cols, r, u)) return;
    int nu = cols >> 5;
    const u8* b = src + (r * nu + u) * 34;            // {f16 d; i8 qs[32]}
    u8* row = dst + r * rb;
#pragma unroll
    for (int i = 0; i < 32; ++i) row[32 * u + i] = b[2 + i];
    row[32 * nu + 2 * u] = b[0];
    row[32 * nu + 2 * u + 1] = b[1];
    if (u == 0) repack_pad(row, 34LL * nu, rb);
}

extern "C" __global__ void repack_mxfp4(const u8* __restrict__ src, int rows, int cols, u8* __restrict__ dst,
                                        long long rb) {
    long long r;
    int u;
    if (!repack_unit(rows, cols, r, u)) return;
    int nu = cols >> 5;
    const u8* b = src + (r * nu + u) * 17;            // {u8 e (E8M0); u8 qs[16]}
    u8* row = dst + r * rb;
#pragma unroll
    for (int i = 0; i < 16; ++i) row[16 * u + i] = b[1 + i];
    row[16 * nu + u] = b[0];
    if (u == 0) repack_pad(row, 17LL * nu, rb);
}

extern "C" __global__ void repack_q5_0(const u8* __restrict__ src, int rows, int cols, u8* __restrict__ dst,
                                       long long rb) {
    long long r;
    int u;
    if (!repack_unit(rows, cols, r, u)) return;
    int nu = cols >> 5;
    const u8* b = src + (r * nu + u) * 22;            // {f16 d; u8 qh[4] (bit j: column j); u8 qs[16]}
    u8* row = dst + r * rb;
#pragma unroll
    for (int i = 0; i < 16; ++i) row[16 * u + i] = b[6 + i];
    u32 qh = (u32)b[2] | ((u32)b[3] << 8) | ((u32)b[4] << 16) | ((u32)b[5] << 24);
#pragma unroll
    for (int k = 0; k < 4; ++k) {                     // byte k, bit 4h + i: column 16h + 4i + k
        u32 by = 0;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) by |= ((qh >> (16 * h + 4 * i + k)) & 1u) << (4 * h + i);
        row[16 * nu + 4 * u + k] = (u8)by;
    }
    row[20 * nu + 2 * u] = b[0];
    row[20 * nu + 2 * u + 1] = b[1];
    if (u == 0) repack_pad(row, 22LL * nu, rb);
}

extern "C" __global__ void repack_q6_k(const u8* __restrict__ src, int rows, int cols, u8* __restrict__ dst,
                                       long long rb) {
    long long r;
    int u;
    if (!repack_unit(rows, cols, r, u)) return;
    int nbk = cols >> 8, bi = u >> 3, j = u & 7, h = j >> 2, k = j & 3;
    const u8* b = src + (r * nbk + bi) * 210;         // {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}
    u8* row = dst + r * rb;
    u8* o = row + bi * 208;
    u8 q[32];      // the unit's unsigned 6-bit values, columns 128h + 32k + l (llama.cpp's order)
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        u32 lo = (b[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 15u;
        u32 hi = (b[128 + 32 * h + l] >> (2 * k)) & 3u;
        q[l] = (u8)(lo | (hi << 4));
    }
#pragma unroll
    for (int c = 0; c < 16; ++c) o[16 * j + c] = (u8)((q[c] & 15) | ((q[c + 16] & 15) << 4));
#pragma unroll
    for (int w = 0; w < 2; ++w)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            u32 by = 0;
#pragma unroll
            for (int s = 0; s < 4; ++s) by |= (u32)(q[16 * w + 4 * s + c] >> 4) << (2 * s);
            o[128 + 8 * j + 4 * w + c] = (u8)by;
        }
    o[192 + 2 * j] = b[192 + 2 * j];          // unit j's scales are GGUF's scales 2j, 2j + 1
    o[193 + 2 * j] = b[193 + 2 * j];
    if (j == 0) {
        row[208 * nbk + 2 * bi] = b[208];
        row[208 * nbk + 2 * bi + 1] = b[209];
    }
    if (u == 0) repack_pad(row, 210LL * nbk, rb);
}
