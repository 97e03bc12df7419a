// Runs kernels/mmq.cu (mmq_prep, then mmq_bnBN) or kernels/mmqs.cu (bn < 0: mmqs_t(-bn), with
// `splits` warps per block) on the CPU. Every CUDA thread of a block is a fiber
// (ucontext) on one OS thread, switched at barriers: __syncthreads is a block barrier, and each
// warp-collective instruction (ldmatrix, mma.sync, shuffles) is a warp barrier around an exchange
// buffer. ldmatrix.x4 and mma.m16n8k16 are emulated from their fragment layouts in the PTX ISA, so
// this checks the kernels' own indexing (the k permutation shared by the A tile and the prep
// records, the swizzles, the split-K reduction and its counters, the FFN and argmax epilogues)
// against float64 in tests/kernels/test_mmq_emu.py. Blocks run one after another.
// Built with -DMMQ_A8=1: mmq.cu's 8-bit variant (its prep and mmq_bnBN; no mmqs.cu), with the int8
// mma.m16n8k32 and m16n8k16 emulated from their fragment layouts (exact integer sums).
//
// usage: mmq_emu IN OUT  (formats: tests/kernels/test_mmq_emu.py)
// Tensor-core accumulation model (header field): 0 = the exact sum rounded once to fp32, 1 = the
// truncating model of tests/support/split16_twin.py (terms cut to 24 bits of the largest, result
// truncated toward zero).
#include "host_intrinsics.h"
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

struct dim3e { unsigned x = 0, y = 0, z = 0; };
dim3e threadIdx, blockIdx, blockDim, gridDim;

using std::max;
using std::min;

// ------------------------------------------------------------------ fibers
namespace emu {
enum { RUNNABLE, WAITING, DONE, COUNTED };
struct Fiber {
    ucontext_t ctx;
    int state;
};
struct Barrier {
    int n = 0, count = 0;
    std::vector<int> waiting;
};
std::vector<Fiber> fib;
std::vector<std::vector<char>> stacks;
ucontext_t sched;
int cur = -1;
Barrier block_bar;
std::vector<Barrier> warp_bar;
std::function<void()> body;
std::vector<uint4> dyn;                       // dynamic shared memory
// warp exchange: two buffers used alternately, so one barrier per collective suffices
unsigned long long xbuf[32][2][32][6];
int phase[1024];

void wait(Barrier& b) {
    if (++b.count == b.n) {               // the last arrival releases the others and goes on
        b.count = 0;
        for (int w : b.waiting) fib[w].state = RUNNABLE;
        b.waiting.clear();
        return;
    }
    b.waiting.push_back(cur);
    fib[cur].state = WAITING;
    swapcontext(&fib[cur].ctx, &sched);
}

void entry() {
    body();
    fib[cur].state = DONE;
}

void run_block(unsigned threads) {
    const size_t stack = 64 * 1024;
    fib.assign(threads, Fiber{});
    stacks.resize(threads);
    block_bar = Barrier{(int)threads, 0, {}};
    warp_bar.assign(threads / 32, Barrier{32, 0, {}});
    for (unsigned t = 0; t < threads; ++t) {
        stacks[t].resize(stack);
        getcontext(&fib[t].ctx);
        fib[t].ctx.uc_stack.ss_sp = stacks[t].data();
        fib[t].ctx.uc_stack.ss_size = stack;
        fib[t].ctx.uc_link = &sched;
        makecontext(&fib[t].ctx, entry, 0);
        fib[t].state = RUNNABLE;
        phase[t] = 0;
    }
    unsigned done = 0;
    while (done < threads) {
        bool progress = false;
        for (unsigned t = 0; t < threads; ++t) {
            if (fib[t].state != RUNNABLE) continue;
            cur = (int)t;
            threadIdx = dim3e{t, 0, 0};
            swapcontext(&sched, &fib[t].ctx);
            progress = true;
            if (fib[t].state == DONE) {
                fib[t].state = COUNTED;
                ++done;
            }
        }
        if (!progress) {
            std::fprintf(stderr, "deadlock: block (%u) has threads waiting at a barrier the others never reach\n",
                         blockIdx.x);
            std::exit(3);
        }
    }
    if (block_bar.count != 0) {
        std::fprintf(stderr, "block (%u) ended with threads inside a barrier\n", blockIdx.x);
        std::exit(3);
    }
}

// lane publishes words w[0..nw), waits for its warp, and returns the buffer everyone wrote
unsigned long long (*publish(const unsigned long long* w, int nw))[6] {
    const int t = (int)threadIdx.x, lane = t & 31, warp = t >> 5;
    auto buf = xbuf[warp][phase[t]];
    for (int i = 0; i < nw; ++i) buf[lane][i] = w[i];
    phase[t] ^= 1;
    wait(warp_bar[warp]);
    return buf;
}

int tc_model = 0;
}  // namespace emu

static inline void __syncthreads() { emu::wait(emu::block_bar); }
static inline void __threadfence() {}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int o) {
    unsigned long long w = 0;
    std::memcpy(&w, &v, sizeof(T));
    auto buf = emu::publish(&w, 1);
    T r;
    std::memcpy(&r, &buf[(threadIdx.x & 31) ^ o][0], sizeof(T));
    return r;
}
static inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    unsigned long long o = *p;
    if (v > o) *p = v;
    return o;
}

#define REALIZAR_HOST_TEST
#define MMQ_DYN_SMEM(name) uint4* name = emu::dyn.data()
#include "mmq.cu"
#if !MMQ_A8
#include "mmqs.cu"
#endif

static inline float h16(unsigned w, int hi) { return realizar_host_h2f((unsigned short)(hi ? w >> 16 : w & 0xFFFF)); }

u32 mmq_hsub2(u32 a, u32 b) {
    u32 lo = realizar_host_f2h(h16(a, 0) - h16(b, 0)), hi = realizar_host_f2h(h16(a, 1) - h16(b, 1));
    return lo | (hi << 16);
}

// ldmatrix.x4: lane l gives the address of row l % 8 of matrix l / 8; lane 4g + t receives from
// matrix i the 32 bits at columns 2t, 2t + 1 of its row g
void mmq_ldsm_x4(u32 (&r)[4], const u8* p) {
    unsigned long long w = (unsigned long long)(uintptr_t)p;
    auto buf = emu::publish(&w, 1);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const u8* row = (const u8*)(uintptr_t)buf[8 * i + g][0];
        std::memcpy(&r[i], row + 4 * t, 4);
    }
}

// exact products; the accumulation model of the header
static float tc_sum(const double* terms, int n) {
    if (emu::tc_model == 0) {
        long double s = 0;
        for (int i = 0; i < n; ++i) s += terms[i];
        return (float)s;
    }
    int emax = -100000;
    for (int i = 0; i < n; ++i)
        if (terms[i] != 0) emax = std::max(emax, std::ilogb(terms[i]) + 1);
    if (emax == -100000) return 0.0f;
    const double q = std::ldexp(1.0, emax - 24);
    double s = 0;
    for (int i = 0; i < n; ++i) s += std::trunc(terms[i] / q) * q;
    float r = (float)s;
    if (std::fabs((double)r) > std::fabs(s)) r = std::nextafter(r, 0.0f);
    return r;
}

// mma.m16n8k16 row.col f32.f16.f16.f32: A row g: a0 (k 2t, 2t+1), a2 (k 2t+8, 2t+9); row g+8: a1, a3;
// B column g: b0 (k 2t, 2t+1), b1 (k 2t+8, 2t+9); D: d0, d1 (row g, columns 2t, 2t+1), d2, d3 (row g+8)
void mmq_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    unsigned long long w[6] = {a[0], a[1], a[2], a[3], b0, b1};
    auto buf = emu::publish(w, 6);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    auto A = [&](int row, int k) {          // row 0..15, k 0..15
        const int owner = 4 * (row & 7) + ((k & 7) >> 1);
        const int reg = (row >> 3) + 2 * (k >> 3);
        return h16((unsigned)buf[owner][reg], k & 1);
    };
    auto B = [&](int k, int col) {
        const int owner = 4 * col + ((k & 7) >> 1);
        return h16((unsigned)buf[owner][4 + (k >> 3)], k & 1);
    };
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        double terms[17];
        terms[0] = d[i];
        for (int k = 0; k < 16; ++k) terms[1 + k] = (double)A(row, k) * (double)B(k, col);
        out[i] = tc_sum(terms, 17);
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// byte b of word w as int8
static int s8(unsigned long long w, int b) { return (int)(signed char)((w >> (8 * b)) & 255); }

// d[i] += sum over k < K of A(row, k) B(k, col) for the rows and columns of lane's D fragment (as
// mmq_mma's), in exact integer arithmetic
template <class FA, class FB> static void mma8_sum(int (&d)[4], int K, FA A, FB B) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        long long s = d[i];
        for (int k = 0; k < K; ++k) s += (long long)A(row, k) * B(k, col);
        out[i] = (int)s;
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// mma.m16n8k32 row.col s32.s8.s8.s32: A row g: a0 (k 4t..4t+3), a2 (k 16+4t..); row g+8: a1, a3;
// B column g: b0 (k 4t..4t+3), b1 (k 16+4t..)
void mmq_mma8(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    unsigned long long w[6] = {a[0], a[1], a[2], a[3], b0, b1};
    auto buf = emu::publish(w, 6);
    mma8_sum(d, 32, [&](int row, int k) { return s8(buf[4 * (row & 7) + ((k & 15) >> 2)][(row >> 3) + 2 * (k >> 4)], k & 3); },
             [&](int k, int col) { return s8(buf[4 * col + ((k & 15) >> 2)][4 + (k >> 4)], k & 3); });
}

// mma.m16n8k16 row.col s32.s8.s8.s32: A row g: a0 (k 4t..4t+3); row g+8: a1; B column g: b (k 4t..)
void mmq_mma8_k16(int (&d)[4], u32 a0, u32 a1, u32 b) {
    unsigned long long w[3] = {a0, a1, b};
    auto buf = emu::publish(w, 3);
    mma8_sum(d, 16, [&](int row, int k) { return s8(buf[4 * (row & 7) + (k >> 2)][row >> 3], k & 3); },
             [&](int k, int col) { return s8(buf[4 * col + (k >> 2)][2], k & 3); });
}

// ------------------------------------------------------------------ the launches
static void launch(unsigned grid, unsigned threads, size_t smem, const std::function<void()>& body,
                   unsigned grid_y = 1) {
    gridDim = dim3e{grid, grid_y, 1};
    blockDim = dim3e{threads, 1, 1};
    for (unsigned by = 0; by < grid_y; ++by)
        for (unsigned b = 0; b < grid; ++b) {
            emu::dyn.assign(smem / 16 + 1, uint4{0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu});   // NaN everywhere
            blockIdx = dim3e{b, by, 0};
            emu::body = body;
            emu::run_block(threads);
        }
}

#ifndef MMQ_EMU_NO_MAIN   // moe_grouped_emu.cpp: the harness above, its own main
template <class T> static bool rd(FILE* f, T* p, size_t n) { return std::fread(p, sizeof(T), n, f) == n; }

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    FILE* f = std::fopen(argv[1], "rb");
    if (!f) return 2;
    // header: mode K M nseg bn splits cps act accumulate use_norm use_amax xs tc_model twice prep_splits
    int h[15];
    if (!rd(f, h, 15)) return 2;
    const int mode = h[0], K = h[1], M = h[2], nseg = h[3], bn = h[4], splits = h[5], cps = h[6], act = h[7];
    const int accumulate = h[8], use_norm = h[9], use_amax = h[10], xs = h[11], twice = h[13];
    emu::tc_model = h[12];
    float eps;
    if (!rd(f, &eps, 1)) return 2;
    struct Seg { int qt, n, ys, has_bias; long long rb; std::vector<u8> w; std::vector<float> bias, y; };
    std::vector<Seg> segs(3);
    for (int s = 0; s < nseg; ++s) {
        Seg& g = segs[s];
        int hs[4];
        if (!rd(f, hs, 4) || !rd(f, &g.rb, 1)) return 2;
        g.qt = hs[0]; g.n = hs[1]; g.ys = hs[2]; g.has_bias = hs[3];
        g.w.resize((size_t)g.n * g.rb + 64);           // + slack: nothing past the rows may be read
        if (!rd(f, g.w.data(), (size_t)g.n * g.rb)) return 2;
        std::fill(g.w.begin() + (size_t)g.n * g.rb, g.w.end(), 0xFF);
        if (g.has_bias) {
            g.bias.resize(g.n);
            if (!rd(f, g.bias.data(), g.n)) return 2;
        }
        g.y.resize((size_t)M * g.ys);
        if (!rd(f, g.y.data(), g.y.size())) return 2;
    }
    std::vector<float> x((size_t)M * xs), nw(K);
    if (!rd(f, x.data(), x.size())) return 2;
    if (use_norm && !rd(f, nw.data(), K)) return 2;
    std::fclose(f);

    // prep records, poisoned: the prep must write all of them
    const int nch = (K + MMQ_KC - 1) / MMQ_KC;
    const long long xps = (long long)nch * MMQ_REC;
    std::vector<u8> rec((size_t)M * xps, 0xFF);
    std::vector<float> inv(M, NAN);
    launch(M, MMQ_PREP_THREADS, 0, [&] { MMQ_NAME(prep)(x.data(), xs, M, K, use_norm ? nw.data() : nullptr, eps, rec.data(), xps, inv.data()); },
           (unsigned)h[14]);
    for (size_t r = 0; r < rec.size(); r += MMQ_REC) {     // halves 0xFFFF and sums 0xFFFFFFFF: unwritten
        u16 hv[MMQ_XROW / 2];
        u32 sv[MMQ_SW];
        std::memcpy(hv, &rec[r], MMQ_XROW);
        std::memcpy(sv, &rec[r + MMQ_XROW], 4 * MMQ_SW);
        // int8 values may be 0xFF (-1): there the unit's (dx, dx sum q), written with them, tell
        if ((!MMQ_A8 && std::count(hv, hv + MMQ_XROW / 2, (u16)0xFFFF)) || std::count(sv, sv + MMQ_SW, 0xFFFFFFFFu)) {
            std::fprintf(stderr, "prep left part of record %zu unwritten\n", r / MMQ_REC);
            return 4;
        }
    }

    const bool small = bn < 0;           // mmqs.cu: tiles of 16 rows, one block each, `splits` warps
    const int tile_rows = small ? 16 : (mode ? MMQ_BM / 2 : MMQ_BM);
    int tiles = 0;
    if (mode) tiles = (segs[0].n + tile_rows - 1) / tile_rows;
    else
        for (int s = 0; s < nseg; ++s) tiles += (segs[s].n + tile_rows - 1) / tile_rows;
    const int TB = small ? 1 : (M + bn - 1) / bn;
    const int E = bn == 8 ? 4 : bn == 16 ? 8 : bn == 32 ? 16 : 32;
    std::vector<float> part((size_t)tiles * TB * splits * MMQ_THREADS * E, NAN);
    std::vector<unsigned> cnt((size_t)tiles * TB, 0);
    std::vector<unsigned long long> amax(M, 0);
    const int groups = small ? (M + -bn - 1) / -bn : 1;     // mmqs: token groups of -bn
    const unsigned grid = small ? (unsigned)(tiles * groups) : (unsigned)(tiles * splits * TB);
    auto run = [&] {
        auto ptr = [&](int s, int which) -> void* {
            if (s >= nseg) return nullptr;
            if (which == 0) return segs[s].w.data();
            if (which == 1) return segs[s].has_bias ? segs[s].bias.data() : nullptr;
            return segs[s].y.data();
        };
        auto n_ = [&](int s) { return s < nseg ? segs[s].n : 0; };
        auto qt_ = [&](int s) { return s < nseg ? segs[s].qt : 0; };
        auto ys_ = [&](int s) { return s < nseg ? segs[s].ys : 0; };
        auto rb_ = [&](int s) { return s < nseg ? segs[s].rb : 0ll; };
        auto body = [&] {
#define MMQ_ARGS                                                                                                  \
    (const u8*)ptr(0, 0), rb_(0), n_(0), qt_(0), (const float*)ptr(0, 1), (float*)ptr(0, 2), ys_(0),           \
        (const u8*)ptr(1, 0), rb_(1), n_(1), qt_(1), (const float*)ptr(1, 1), (float*)ptr(1, 2), ys_(1),       \
        (const u8*)ptr(2, 0), rb_(2), n_(2), qt_(2), (const float*)ptr(2, 1), (float*)ptr(2, 2), ys_(2), K,    \
        rec.data(), xps, inv.data(), M, mode, act, accumulate, splits, cps, part.data(), cnt.data(),           \
        use_amax ? amax.data() : nullptr
#define MMQS_ARGS                                                                                                 \
    (const u8*)ptr(0, 0), rb_(0), n_(0), qt_(0), (const float*)ptr(0, 1), (float*)ptr(0, 2), ys_(0),           \
        (const u8*)ptr(1, 0), rb_(1), n_(1), qt_(1), (const float*)ptr(1, 1), (float*)ptr(1, 2), ys_(1),       \
        (const u8*)ptr(2, 0), rb_(2), n_(2), qt_(2), (const float*)ptr(2, 1), (float*)ptr(2, 2), ys_(2), K,    \
        rec.data(), xps, inv.data(), M, mode, act, accumulate, use_amax ? amax.data() : nullptr, groups
            switch (bn) {
#if !MMQ_A8
                case -8: mmqs_t8(MMQS_ARGS); break;
                case -16: mmqs_t16(MMQS_ARGS); break;
#endif
                case 8: MMQ_NAME(bn8)(MMQ_ARGS); break;
                case 16: MMQ_NAME(bn16)(MMQ_ARGS); break;
                case 32: MMQ_NAME(bn32)(MMQ_ARGS); break;
                default: MMQ_NAME(bn64)(MMQ_ARGS); break;
            }
#undef MMQ_ARGS
#undef MMQS_ARGS
        };
        const int smem = bn == 8 ? mmq_smem_bytes<8>() : bn == 16 ? mmq_smem_bytes<16>() : bn == 32 ? mmq_smem_bytes<32>()
                                                                                               : mmq_smem_bytes<64>();
        launch(grid, small ? 32 * splits : MMQ_THREADS, small ? 0 : smem, body);
    };
    run();
    std::vector<std::vector<float>> first;
    for (int s = 0; s < nseg; ++s) first.push_back(segs[s].y);
    int same = 1;
    if (twice) {            // a second launch on the same inputs: counters reset, results bit-identical
        run();
        for (int s = 0; s < nseg; ++s)
            if (std::memcmp(first[s].data(), segs[s].y.data(), first[s].size() * 4)) same = 0;
    }
    int clean = std::all_of(cnt.begin(), cnt.end(), [](unsigned v) { return v == 0; });

    FILE* o = std::fopen(argv[2], "wb");
    if (!o) return 2;
    const int status[2] = {clean, same};
    std::fwrite(status, 4, 2, o);
    for (int s = 0; s < nseg; ++s) std::fwrite(first[s].data(), 4, first[s].size(), o);
    std::fwrite(amax.data(), 8, M, o);
    std::fwrite(inv.data(), 4, M, o);
    std::fclose(o);
    return 0;
}
#endif
