// CPU check of common.cuh's fp32-activation decoders (load_funit / funit_dot, used by mmvf.cu)
// against the plain decoders (load_unit, the ones the dequantize kernels use and the GPU tests
// check against gguf's dequantize). Built with g++ by tests/kernels/test_mmvf_host.py through shims of
// the few CUDA intrinsics involved; prints one line per type: max relative error of the decoded
// weights and of the unit dot products.
// With arguments FILE K TYPE RB (any type of the GPU's table): FILE holds rows of K weights in the
// type's device layout (formats/gpu_layout.py), RB bytes a row; prints every weight as each decoder
// gives it (see dump), for tests/kernels/test_mmvf_host.py to hold against gguf's dequantize.
#include "host_intrinsics.h"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <random>

static inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
struct HostDim3 { unsigned x = 0, y = 0, z = 0; };   // common.cuh's block helpers name them (unused here)
static HostDim3 threadIdx, blockDim;
static inline void __syncthreads() {}
#define REALIZAR_HOST_TEST
#include "common.cuh"

// types the device stores regrouped (formats/gpu_layout.py): quants first, the fp16 d values at the row end
static bool regrouped(int qt) { return qt == QT_Q5_0 || qt == QT_Q8_0 || qt == QT_Q6_K; }

struct TypeInfo { int qt; const char* name; int block, bytes; std::vector<int> scale_offs; };

template <int QT>
static void check(const TypeInfo& t, std::mt19937& rng) {
    const int units_per_block = t.block / 32;
    const int nblk = 24;                         // odd-sized blocks land at every 2-byte alignment
    std::vector<unsigned char> buf(nblk * t.bytes + 16 + 64);
    // start misaligned on purpose (2 mod 4); the regrouped types' device layouts have 16-byte aligned rows
    unsigned char* row = buf.data() + (regrouped(QT) ? 16 - ((unsigned long long)buf.data() & 15) : 2);
    const int K = nblk * t.block;
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> sc(0.005f, 0.025f);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int i = 0; i < nblk * t.bytes; ++i) row[i] = (unsigned char)byte(rng);
    for (int b = 0; b < nblk; ++b)
        for (int o : t.scale_offs) {
            unsigned short h = realizar_host_f2h(sc(rng));
            // regrouped types (device layout): the blocks' d values follow the row's quants
            std::memcpy(row + (regrouped(QT) ? (t.bytes - 2) * nblk + 2 * b : b * t.bytes + o), &h, 2);
        }
    double werr = 0, wmax = 0, derr = 0;
    for (int u = 0; u < nblk * units_per_block; ++u) {
        float ref[32];
        load_unit<QT>(row, u, K, ref);
        FUnit fw;
        load_funit<QT>(row, u, K >> 5, fw);
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

// the QUnit decoders exist for the types of the int8-activation path; the others print "-"
template <int QT> struct HasQUnit { static constexpr bool value = QT == QT_Q4_0 || QT == QT_Q4_1 || QT == QT_Q5_0 ||
    QT == QT_Q5_1 || QT == QT_Q8_0 || QT == QT_Q4_K || QT == QT_Q5_K || QT == QT_Q6_K; };

// funit's weight k of a decoded unit: a f + c (the funit_s8 types: a q, c = 0)
template <int QT>
static double funit_weight(const FUnit& fw, int k) {
    unsigned v = fw.v[k / 4];
    float f = k % 4 == 0 ? funit_f<QT, 0>(v) : k % 4 == 1 ? funit_f<QT, 1>(v) : k % 4 == 2 ? funit_f<QT, 2>(v)
                                                                                            : funit_f<QT, 3>(v);
    if (QT == QT_Q8_0) return (double)fw.a0 * f;
    return k < 16 ? (double)fw.a0 * f + fw.c0 : (double)fw.a1 * f + fw.c1;
}

// FILE holds rows of K weights in the type's device layout, RB bytes a row, laid out from a 256-byte
// aligned start as in the device's arena (so rows keep the alignment they have there). Prints each
// weight as decoded by load_unit, load_funit and load_qunit ("-" where the type has none), then
// "DOT e": the largest error of funit_dot against float64 over load_unit's weights, relative to
// sum |w x| of the unit, on pseudo-random activations.
template <int QT>
static int dump(const char* path, int K, long long rb) {
    FILE* f = std::fopen(path, "rb");
    if (!f) return 1;
    std::vector<unsigned char> all;
    unsigned char tmp[4096];
    for (size_t n; (n = std::fread(tmp, 1, sizeof tmp, f)) > 0;) all.insert(all.end(), tmp, tmp + n);
    std::fclose(f);
    std::vector<unsigned char> buf(all.size() + 256 + 64, 0xEE);
    unsigned char* base = buf.data() + (256 - ((unsigned long long)buf.data() & 255));
    std::memcpy(base, all.data(), all.size());
    std::mt19937 rng(77);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    double derr = 0;
    for (size_t r = 0; r * rb < all.size(); ++r) {
        const unsigned char* row = base + r * rb;
        for (int u = 0; u < K / 32; ++u) {
            float w[32], xv[32];
            load_unit<QT>(row, u, K, w);
            FUnit fw;
            load_funit<QT>(row, u, K >> 5, fw);
            for (int k = 0; k < 32; ++k) {
                if constexpr (HasQUnit<QT>::value) {
                    QUnit q;
                    load_qunit<QT>(row, u, K >> 5, q);
                    double qv = (double)(signed char)(q.v[k / 4] >> (8 * (k % 4)));
                    if (QT == QT_Q5_0) qv = (double)((q.v[k / 4] >> (8 * (k % 4))) & 255);   // 0..31, C holds -16 d
                    double qw = (double)q.A * (k < 16 ? q.s0 : q.s1) * qv + q.C;
                    std::printf("%.17g %.17g %.17g\n", (double)w[k], funit_weight<QT>(fw, k), qw);
                } else {
                    std::printf("%.17g %.17g -\n", (double)w[k], funit_weight<QT>(fw, k));
                }
            }
            double ref = 0, sabs = 0;
            float sl = 0, sh = 0;
            for (int k = 0; k < 32; ++k) {
                xv[k] = nd(rng);
                ref += (double)w[k] * xv[k];
                sabs += std::fabs((double)w[k] * xv[k]);
            }
            for (int k = 0; k < 16; ++k) { sl += xv[k]; sh += xv[16 + k]; }
            float d = funit_dot<QT>(fw, xv, sl, sh);
            derr = std::fmax(derr, std::fabs(d - ref) / std::fmax(sabs, 1e-30));
        }
    }
    std::printf("DOT %.3e\n", derr);
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 5) {
        const int K = std::atoi(argv[2]);
        const long long rb = std::atoll(argv[4]);
        const char* t = argv[3];
#define DUMP(NAME) if (!std::strcmp(t, #NAME)) return dump<QT_##NAME>(argv[1], K, rb);
        DUMP(Q4_0) DUMP(Q4_1) DUMP(Q5_0) DUMP(Q5_1) DUMP(Q8_0) DUMP(Q4_K) DUMP(Q5_K) DUMP(Q6_K)
        DUMP(Q2_K) DUMP(Q3_K) DUMP(IQ4_NL) DUMP(IQ4_XS) DUMP(MXFP4) DUMP(IQ2_XXS) DUMP(IQ2_XS) DUMP(IQ2_S)
        DUMP(IQ3_XXS) DUMP(IQ3_S)
#undef DUMP
        return 2;
    }
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
