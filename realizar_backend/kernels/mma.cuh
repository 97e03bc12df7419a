// What mmq.cu and mmqs.cu share: the tensor-core instructions, the weight-to-fp16 conversion, a
// launch's segments and the NaN fill for a type not compiled in.
// Host tests (tests/host/mmq_emu.cpp) define REALIZAR_HOST_TEST and emulate the instructions.
#pragma once
#include "common.cuh"

#ifdef REALIZAR_HOST_TEST
void mmq_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);
void mmq_mma8(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);
void mmq_mma8_k16(int (&d)[4], u32 a0, u32 a1, u32 b);
u32 mmq_hsub2(u32 a, u32 b);
#else
// d += A (16x16 fp16, row) . B (16x8 fp16, col), fp32
__device__ __forceinline__ void mmq_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += A (16x32 int8, row) . B (32x8 int8, col), exact int32 sums (mmq.cu's 8-bit variant)
__device__ __forceinline__ void mmq_mma8(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += A (16x16 int8, row) . B (16x8 int8, col), exact int32 sums
__device__ __forceinline__ void mmq_mma8_k16(int (&d)[4], u32 a0, u32 a1, u32 b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%0, %1, %2, %3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b));
}

__device__ __forceinline__ u32 mmq_hsub2(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
#endif

// bytes (0, 1) or (2, 3) of w (unsigned) as fp16 pair minus off2 (fp16 pair of 1024 + offset):
// 0x64XX is the fp16 1024 + XX, so the difference is the integer XX - offset, exactly
template <int HI> __device__ __forceinline__ u32 mmq_pair(u32 w, u32 off2) {
    return mmq_hsub2(prmt_imm<HI ? 0x4342u : 0x4140u>(w, 0x64646464u), off2);
}

__device__ __forceinline__ constexpr u32 mmq_off2(u32 off) { return (0x6400u + off) * 0x00010001u; }

// One matrix of a launch (Q, K, V: up to three sharing the input) and where its outputs go
struct MmqSeg {
    const u8* W;
    long long rb;
    int n, qt;
    const float* bias;
    float* y;
    int ys;
};

// sums of a type not compiled in (the host checks types): NaN rather than numbers
template <int A, int B>
__device__ __forceinline__ void mmq_fill_nan(float (&acc)[A][B][4]) {
#pragma unroll
    for (int m = 0; m < A; ++m)
#pragma unroll
        for (int n = 0; n < B; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][n][i] = __int_as_float(0x7fffffff);
}
