// Runs kernels/sampling.cu on the CPU: every CUDA thread of a block is a std::thread,
// __syncthreads and the warp exchanges (shuffles, ballots) are barriers, blocks run one after
// another (the kernels never wait on another block), atomics are the compiler's. Built with g++
// by tests/kernels/test_sampling_emu.py, which compares the result with the NumPy twin.
//
// usage: sampling_emu IN OUT
//   IN:  int32 header {V, n, slots, G, slice, cap, block_hist, block_final, mask_rows, bias_words},
//        float32 logits [n, V], int32 params [n, 16], int32 counts [slots, V],
//        int32 masks [mask_rows, ceil(V / 32)], int32 biases [bias_words]
//   OUT: int32 out [n, 4], int32 counts [slots, V]
#include "host_intrinsics.h"
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __align__(n) alignas(n)

struct dim3e { unsigned x = 1, y = 1, z = 1; };
thread_local dim3e threadIdx;
dim3e blockIdx, blockDim, gridDim;

namespace emu {
std::unique_ptr<std::barrier<>> block_bar;
std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
unsigned long long warp_buf[32][32];
std::vector<unsigned long long> dyn;
}

using std::max;
using std::min;


static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
static inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }

static inline void __syncthreads() { emu::block_bar->arrive_and_wait(); }

template <class T> static inline unsigned long long to_bits(T v) {
    unsigned long long b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> static inline T from_bits(unsigned long long b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

// every lane publishes v, then reads lane src(lane)
template <class T, class Src> static inline T warp_exchange(T v, Src src) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    emu::warp_buf[w][lane] = to_bits(v);
    emu::warp_bar[w]->arrive_and_wait();
    int s = src(lane);
    T r = (s >= 0 && s < 32) ? from_bits<T>(emu::warp_buf[w][s]) : v;
    emu::warp_bar[w]->arrive_and_wait();
    return r;
}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int o) {
    return warp_exchange(v, [o](int l) { return l ^ o; });
}
template <class T> static inline T __shfl_up_sync(unsigned, T v, unsigned d) {
    return warp_exchange(v, [d](int l) { return l - (int)d; });
}
static inline unsigned __ballot_sync(unsigned, int pred) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    emu::warp_buf[w][lane] = pred ? 1 : 0;
    emu::warp_bar[w]->arrive_and_wait();
    unsigned m = 0;
    for (int i = 0; i < 32; ++i) m |= (unsigned)(emu::warp_buf[w][i] & 1) << i;
    emu::warp_bar[w]->arrive_and_wait();
    return m;
}
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    unsigned long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}

#define REALIZAR_HOST_TEST
#define SAMPLE_DYN_SMEM(name) u64* name = (u64*)emu::dyn.data()
#include "sampling.cu"

static void launch(dim3e grid, unsigned threads, size_t smem_bytes, const std::function<void()>& body) {
    emu::dyn.assign(smem_bytes / 8 + 1, 0xDEADBEEFDEADBEEFull);   // garbage, as on the device
    gridDim = grid;
    blockDim = dim3e{threads, 1, 1};
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            blockIdx = dim3e{bx, by, 1};
            emu::block_bar = std::make_unique<std::barrier<>>(threads);
            emu::warp_bar.clear();
            for (unsigned w = 0; w < threads / 32; ++w) emu::warp_bar.push_back(std::make_unique<std::barrier<>>(32));
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < threads; ++t)
                ts.emplace_back([t, &body] {
                    threadIdx = dim3e{t, 0, 0};
                    body();
                });
            for (auto& t : ts) t.join();
        }
}

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    FILE* f = std::fopen(argv[1], "rb");
    if (!f) return 2;
    int h[10];
    if (std::fread(h, 4, 10, f) != 10) return 2;
    int V = h[0], n = h[1], slots = h[2], G = h[3], slice = h[4], cap = h[5], bh = h[6], bf = h[7];
    int mwords = (V + 31) / 32, mask_rows = h[8], bias_words = h[9];
    std::vector<float> logits((size_t)n * V);
    std::vector<int> params((size_t)n * SAMPLE_PW), counts((size_t)slots * V);
    std::vector<u32> masks((size_t)std::max(mask_rows, 1) * mwords, 0xA5A5A5A5u);
    std::vector<int> bias(std::max(bias_words, 1), 0x7fc00000);
    if (std::fread(logits.data(), 4, logits.size(), f) != logits.size()) return 2;
    if (std::fread(params.data(), 4, params.size(), f) != params.size()) return 2;
    if (std::fread(counts.data(), 4, counts.size(), f) != counts.size()) return 2;
    if (std::fread(masks.data(), 4, (size_t)mask_rows * mwords, f) != (size_t)mask_rows * mwords) return 2;
    if (std::fread(bias.data(), 4, bias_words, f) != (size_t)bias_words) return 2;
    std::fclose(f);

    // the forward pass's argmax_rows: first index of the max, NaN never wins
    std::vector<int> argmax(n, 0);
    for (int r = 0; r < n; ++r) {
        float best = -INFINITY;
        int bi = -1;
        for (int i = 0; i < V; ++i) {
            float v = logits[(size_t)r * V + i];
            if (v > best) { best = v; bi = i; }
        }
        argmax[r] = bi < 0 ? 0 : bi;
    }
    std::vector<float> zbuf((size_t)n * V, NAN);
    std::vector<u64> rowmax(n, 0), hw((size_t)n * SAMPLE_NB, 0), zmass(n, 0);
    std::vector<u32> hcnt((size_t)n * SAMPLE_NB, 0);
    std::vector<float2> lsep((size_t)n * G, float2{NAN, NAN});
    std::vector<int> out((size_t)n * 4, 0x7fc00000);
    std::vector<int> io(n, -7);     // the next decode step's input tokens (pipelined sampled steps)

    launch(dim3e{(unsigned)G, (unsigned)n, 1}, bh, 0, [&] {
        sample_prep(logits.data(), V, V, params.data(), counts.data(), masks.data(), mwords, bias.data(), zbuf.data(),
                    rowmax.data(), slice);
    });
    launch(dim3e{(unsigned)G, (unsigned)n, 1}, bh, SAMPLE_NB * 12, [&] {
        sample_hist(logits.data(), V, V, params.data(), zbuf.data(), rowmax.data(), hcnt.data(),
                    hw.data(), zmass.data(), lsep.data(), slice);
    });
    size_t smem = SAMPLE_NB * 12 + (size_t)cap * 16;
    launch(dim3e{(unsigned)n, 1, 1}, bf, smem, [&] {
        sample_final(logits.data(), V, V, params.data(), argmax.data(), zbuf.data(), rowmax.data(), hcnt.data(),
                     hw.data(), zmass.data(), lsep.data(), G, out.data(), cap, io.data());
    });
    // the scratch must be left zeroed for the next step
    bool clean = std::all_of(hw.begin(), hw.end(), [](u64 v) { return v == 0; }) &&
                 std::all_of(hcnt.begin(), hcnt.end(), [](u32 v) { return v == 0; }) &&
                 std::all_of(zmass.begin(), zmass.end(), [](u64 v) { return v == 0; }) &&
                 std::all_of(rowmax.begin(), rowmax.end(), [](u64 v) { return v == 0; });
    if (!clean) {
        std::fprintf(stderr, "scratch not reset\n");
        return 3;
    }
    for (int r = 0; r < n; ++r) {
        if (io[r] != out[(size_t)r * 4]) {
            std::fprintf(stderr, "row %d: decode input %d, sampled token %d\n", r, io[r], out[(size_t)r * 4]);
            return 3;
        }
    }
    FILE* o = std::fopen(argv[2], "wb");
    if (!o) return 2;
    std::fwrite(out.data(), 4, out.size(), o);
    std::fwrite(counts.data(), 4, counts.size(), o);
    std::fclose(o);
    return 0;
}
