// CPU check of common.cuh's fp32-activation decoders (load_funit / funit_dot, used by mmvf.cu)
// against the plain decoders (load_unit, the ones the dequantize kernels use and the GPU tests
// check against gguf's dequantize). Built with g++ by tests/test_mmvf_host.py through shims of
// the few CUDA intrinsics involved; prints one line per type: max relative error of the decoded
// weights and of the unit dot products.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <random>

#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__
static inline float realizar_host_h2f(unsigned short h) { _Float16 x; std::memcpy(&x, &h, 2); return (float)x; }
static inline unsigned short realizar_host_f2h(float f) { _Float16 x = (_Float16)f; unsigned short h; std::memcpy(&h, &x, 2); return h; }
struct uint4 { unsigned int x, y, z, w; };
struct int4 { int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
static inline float2 make_float2(float a, float b) { return {a, b}; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
static inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
    unsigned char by[8];
    for (int i = 0; i < 4; ++i) { by[i] = (a >> (8 * i)) & 255; by[4 + i] = (b >> (8 * i)) & 255; }
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)by[(s >> (4 * i)) & 7] << (8 * i);
    return r;
}
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
    unsigned long long v = ((unsigned long long)hi << 32) | lo;
    return (unsigned)(v >> (sh & 31));
}
template <class T> static inline T __ldg(const T* p) { return *p; }
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
#define REALIZAR_HOST_TEST
#include "common.cuh"

struct TypeInfo { int qt; const char* name; int block, bytes; std::vector<int> scale_offs; };

template <int QT>
static void check(const TypeInfo& t, std::mt19937& rng) {
    const int units_per_block = t.block / 32;
    const int nblk = 24;                         // odd-sized blocks land at every 2-byte alignment
    std::vector<unsigned char> buf(nblk * t.bytes + 2 + 64);
    unsigned char* row = buf.data() + 2;         // start misaligned on purpose (2 mod 4)
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> sc(0.005f, 0.025f);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int i = 0; i < nblk * t.bytes; ++i) row[i] = (unsigned char)byte(rng);
    for (int b = 0; b < nblk; ++b)
        for (int o : t.scale_offs) {
            unsigned short h = realizar_host_f2h(sc(rng));
            std::memcpy(row + b * t.bytes + o, &h, 2);
        }
    double werr = 0, wmax = 0, derr = 0;
    for (int u = 0; u < nblk * units_per_block; ++u) {
        float ref[32];
        load_unit<QT>(row, u, 32 * (u + 1), ref);
        FUnit fw;
        load_funit<QT>(row, u, fw);
        float xv[32];
        for (int k = 0; k < 32; ++k) xv[k] = nd(rng);
        double dref = 0, sabs = 0;
        for (int k = 0; k < 32; ++k) {
            unsigned v = fw.v[k / 4];
            float f = k % 4 == 0 ? funit_f<QT, 0>(v) : k % 4 == 1 ? funit_f<QT, 1>(v)
                    : k % 4 == 2 ? funit_f<QT, 2>(v) : funit_f<QT, 3>(v);
            double w = (QT == QT_Q8_0) ? (double)fw.a0 * f
                                       : (k < 16 ? (double)fw.a0 * f + fw.c0 : (double)fw.a1 * f + fw.c1);
            werr = std::fmax(werr, std::fabs(w - ref[k]));
            wmax = std::fmax(wmax, std::fabs((double)ref[k]));
            dref += (double)ref[k] * xv[k];
            sabs += std::fabs((double)ref[k] * xv[k]);
        }
        float sl = 0, sh = 0;
        for (int k = 0; k < 16; ++k) { sl += xv[k]; sh += xv[16 + k]; }
        float d = funit_dot<QT>(fw, xv, sl, sh);
        derr = std::fmax(derr, std::fabs(d - dref) / std::fmax(sabs, 1e-30));
    }
    std::printf("%s %.3e %.3e\n", t.name, werr / std::fmax(wmax, 1e-30), derr);
}

int main() {
    std::mt19937 rng(1234);
    check<QT_Q4_0>({QT_Q4_0, "Q4_0", 32, 18, {0}}, rng);
    check<QT_Q4_1>({QT_Q4_1, "Q4_1", 32, 20, {0, 2}}, rng);
    check<QT_Q5_0>({QT_Q5_0, "Q5_0", 32, 22, {0}}, rng);
    check<QT_Q5_1>({QT_Q5_1, "Q5_1", 32, 24, {0, 2}}, rng);
    check<QT_Q8_0>({QT_Q8_0, "Q8_0", 32, 34, {0}}, rng);
    check<QT_Q4_K>({QT_Q4_K, "Q4_K", 256, 144, {0, 2}}, rng);
    check<QT_Q5_K>({QT_Q5_K, "Q5_K", 256, 176, {0, 2}}, rng);
    check<QT_Q6_K>({QT_Q6_K, "Q6_K", 256, 210, {208}}, rng);
    return 0;
}
