// CUDA's qualifiers, vector types and the per-thread intrinsics that kernel sources (common.cuh's
// decoders, the sampling and mma kernels) use, for compiling them with g++ in the host tests
// (tests/host/*.cpp, cuda_emu.h). Pure functions only: each program brings its own threads.
#pragma once
#include <cmath>
#include <cstring>

// every function a host one; a __shared__ array one static copy (blocks run one after another)
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static

struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
struct int4 { int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
static inline float2 make_float2(float a, float b) { return {a, b}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }

// one IEEE rounding per operation, as CUDA's _rn intrinsics (volatile keeps g++ from contracting)
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }

static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

static inline float realizar_host_h2f(unsigned short h) { _Float16 x; std::memcpy(&x, &h, 2); return (float)x; }
static inline unsigned short realizar_host_f2h(float f) {
    _Float16 x = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &x, 2);
    return h;
}

static inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
    unsigned char by[8];
    for (int i = 0; i < 4; ++i) { by[i] = (a >> (8 * i)) & 255; by[4 + i] = (b >> (8 * i)) & 255; }
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)by[(s >> (4 * i)) & 7] << (8 * i);
    return r;
}
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (sh & 31));
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
static inline unsigned __vsubss4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        int v = (int)(signed char)(a >> (8 * i)) - (int)(signed char)(b >> (8 * i));
        v = v < -128 ? -128 : (v > 127 ? 127 : v);
        r |= (unsigned)(v & 255) << (8 * i);
    }
    return r;
}
