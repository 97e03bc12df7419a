// A small CUDA emulator for running kernel sources on the CPU (g++), for the parts of CUDA the flash
// attention kernels use: every thread of a block is a fiber (ucontext) on one OS thread, switched
// only at barriers, so __syncthreads, warp shuffles/ballots and the warp-wide tensor-core
// instructions (mma.sync m16n8k16, ldmatrix) are real rendezvous of all 32 lanes: a lane that
// skips one, or arrives at another (divergence), is reported, and so is a deadlock. Warps advance
// at random, different speeds (EMU_SEED), so a warp may run far ahead of another between block
// barriers. Blocks run one after another (atomics and fences are plain). A cp.async copy reads its
// source when issued and lands when the thread waits for its group (EMU_CP_EAGER=1: lands at
// issue): a tile read before its wait sees stale data, a source written after the issue is missed,
// and with eager copies a stage refilled while another warp still reads it corrupts that read.
// The fragment layouts are those of the PTX ISA (mma.m16n8k16 .f16 A/B/C, ldmatrix .x4 [.trans]).
#pragma once
#include "host_intrinsics.h"
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __align__(n) __attribute__((aligned(n)))


struct dim3 { unsigned x = 1, y = 1, z = 1; };
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int atomicAdd(int* p, int v) { int o = *p; *p += v; return o; }
static inline void __threadfence() {}
static inline void __threadfence_block() {}
// common.cuh's GEMV helpers compile on the host too (tests/host/mmvf_decode.cpp has the same shims)

namespace emu {

[[noreturn]] static inline void fail(const char* what) {
    std::fprintf(stderr, "cuda_emu: %s\n", what);
    std::fflush(stderr);
    std::abort();
}

struct Copy { void* dst; unsigned char data[16]; bool ok; };

struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    dim3 tid;
    int linear = 0;
    bool done = false;
    std::vector<std::vector<Copy>> groups;   // committed cp.async groups, oldest first
    std::vector<Copy> open;                  // issued, not yet committed
};

struct Barrier {
    int count = 0, arrived = 0;
    long gen = 0;
};

struct WarpSlot {
    const void* data[32];
    const char* tag[32];
};

struct State {
    dim3 block_idx, grid_dim, block_dim;
    std::vector<Fiber> fibers;
    Fiber* cur = nullptr;
    ucontext_t sched;
    Barrier block_bar;
    std::vector<Barrier> warp_bar;
    std::vector<WarpSlot> warp_slot;
    unsigned char* dyn = nullptr;    // dynamic shared memory, ending at an inaccessible page
    unsigned char* dyn_map = nullptr;
    size_t dyn_map_bytes = 0;
    long events = 0;             // barrier arrivals and completions (deadlock detection)
    bool eager = false;
    std::function<void()> body;
    unsigned long long rng = 88172645463325252ull;
};

static inline State& st() { static State s; return s; }
static inline unsigned char* dyn_smem() { return st().dyn; }

// A read or write past the dynamic shared memory lands on the page after it, which no access may
// touch: the fault stops the emulator with a message (on the GPU it reads another variable's bytes
// or faults later: compute-sanitizer's "Invalid __shared__ read").
static inline void on_fault(int, siginfo_t* si, void*) {
    const State& s = st();
    const unsigned char* a = (const unsigned char*)si->si_addr;
    const char* msg = (s.dyn_map && a >= s.dyn_map + s.dyn_map_bytes - 4096 && a < s.dyn_map + s.dyn_map_bytes)
                          ? "cuda_emu: a thread read or wrote past its block's dynamic shared memory\n"
                          : "cuda_emu: segmentation fault (a bad address)\n";
    ssize_t r = write(2, msg, std::strlen(msg));
    (void)r;
    _exit(134);
}

// dyn_bytes of stale shared memory (0xFF bytes: fp16 NaN), 16-byte aligned, its end within 15 bytes
// of an inaccessible page
static inline void map_dyn(State& s, size_t dyn_bytes) {
    static bool handler = false;
    if (!handler) {
        struct sigaction sa {};
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO;
        sigaction(SIGSEGV, &sa, nullptr);
        handler = true;
    }
    if (s.dyn_map) munmap(s.dyn_map, s.dyn_map_bytes);
    const size_t used = (dyn_bytes + 15) & ~(size_t)15, span = (used + 4095) & ~(size_t)4095;
    s.dyn_map_bytes = span + 4096;
    void* m = mmap(nullptr, s.dyn_map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) fail("mmap of the dynamic shared memory");
    s.dyn_map = (unsigned char*)m;
    if (mprotect(s.dyn_map + span, 4096, PROT_NONE) != 0) fail("mprotect of the shared memory's guard page");
    s.dyn = s.dyn_map + span - used;
    std::memset(s.dyn, 0xFF, used);
}

static inline void yield() { swapcontext(&st().cur->ctx, &st().sched); }

static inline void wait(Barrier& b) {
    long g = b.gen;
    ++st().events;
    if (++b.arrived == b.count) {
        b.arrived = 0;
        ++b.gen;
        return;
    }
    while (b.gen == g) yield();
}

static inline int lane() { return st().cur->linear & 31; }
static inline int warp() { return st().cur->linear >> 5; }

// every lane of the warp deposits `mine` (tagged by the call site) and gets all 32 values
template <class T> static inline void gather(const T& mine, T (&all)[32], const char* tag) {
    State& s = st();
    int w = warp(), ln = lane();
    s.warp_slot[w].data[ln] = &mine;
    s.warp_slot[w].tag[ln] = tag;
    wait(s.warp_bar[w]);
    for (int i = 0; i < 32; ++i) {
        if (std::strcmp(s.warp_slot[w].tag[i], tag) != 0) {
            std::fprintf(stderr, "cuda_emu: warp %d divergent: lane %d at %s, lane %d at %s\n", w, ln, tag, i,
                         s.warp_slot[w].tag[i]);
            std::abort();
        }
        all[i] = *(const T*)s.warp_slot[w].data[i];
    }
    wait(s.warp_bar[w]);
}

static inline void do_copy(const Copy& c) {
    if (c.ok) std::memcpy(c.dst, c.data, 16);
    else std::memset(c.dst, 0, 16);
}

static inline void cp_async16(void* dst, const void* src, bool ok) {
    if (((uintptr_t)dst & 15) || (ok && ((uintptr_t)src & 15))) fail("cp.async: address not 16-byte aligned");
    Copy c;
    c.dst = dst;
    c.ok = ok;
    if (ok) std::memcpy(c.data, src, 16);
    if (st().eager) do_copy(c);
    else st().cur->open.push_back(c);
}
static inline void cp_async_commit() {
    Fiber* f = st().cur;
    f->groups.push_back(f->open);
    f->open.clear();
}
static inline void cp_async_wait(int n) {
    Fiber* f = st().cur;
    while ((int)f->groups.size() > n) {
        for (const Copy& c : f->groups.front()) do_copy(c);
        f->groups.erase(f->groups.begin());
    }
}

static inline float h2f_(uint16_t h) { return realizar_host_h2f(h); }
static inline uint16_t lo16(uint32_t x) { return (uint16_t)(x & 0xFFFF); }
static inline uint16_t hi16(uint32_t x) { return (uint16_t)(x >> 16); }

struct MmaIn { uint32_t a[4], b[2]; };

// D = A (16x16, row) . B (16x8, col) + C, fp32 accumulation; lane holds C rows g, g+8, cols 2t, 2t+1
static inline void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    MmaIn mine{{a[0], a[1], a[2], a[3]}, {b0, b1}}, all[32];
    gather(mine, all, "mma");
    float A[16][16], B[16][8];
    for (int ln = 0; ln < 32; ++ln) {
        int g = ln >> 2, t = ln & 3;
        // a0,a1: (g, 2t..); a2,a3: (g+8, 2t..); a4,a5: (g, 2t+8..); a6,a7: (g+8, 2t+8..)
        for (int r = 0; r < 4; ++r) {
            int row = g + ((r & 1) ? 8 : 0), col = 2 * t + ((r & 2) ? 8 : 0);
            A[row][col] = h2f_(lo16(all[ln].a[r]));
            A[row][col + 1] = h2f_(hi16(all[ln].a[r]));
        }
        // b0,b1: rows 2t, 2t+1 of column g; b2,b3: rows 2t+8, 2t+9
        for (int r = 0; r < 2; ++r) {
            int row = 2 * t + 8 * r;
            B[row][g] = h2f_(lo16(all[ln].b[r]));
            B[row + 1][g] = h2f_(hi16(all[ln].b[r]));
        }
    }
    int g = lane() >> 2, t = lane() & 3;
    for (int i = 0; i < 4; ++i) {
        int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        float acc = c[i];
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
        c[i] = acc;
    }
}

// four 8x8 b16 matrices; lane l supplies row l % 8 of matrix l / 8; register i of lane l holds
// matrix i at (row l/4, cols 2 (l%4), +1), or transposed: (rows 2 (l%4), +1, col l/4)
static inline void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* p, bool trans) {
    if ((uintptr_t)p & 15) fail("ldmatrix: row address not 16-byte aligned");
    const uint16_t* all[32];
    gather(p, all, trans ? "ldmatrix.trans" : "ldmatrix");
    int ln = lane();
    for (int i = 0; i < 4; ++i) {
        uint16_t e0, e1;
        if (!trans) {
            const uint16_t* row = all[8 * i + (ln >> 2)];
            e0 = row[2 * (ln & 3)];
            e1 = row[2 * (ln & 3) + 1];
        } else {
            e0 = all[8 * i + 2 * (ln & 3)][ln >> 2];
            e1 = all[8 * i + 2 * (ln & 3) + 1][ln >> 2];
        }
        r[i] = (uint32_t)e0 | ((uint32_t)e1 << 16);
    }
}

static void trampoline() {
    st().body();
    st().cur->done = true;
    ++st().events;
    if (!st().cur->groups.empty() || !st().cur->open.empty()) {
        // copies a thread never waited for are a bug in the kernel (they could land after exit)
        bool any = !st().cur->open.empty();
        for (auto& gr : st().cur->groups) any |= !gr.empty();
        if (any) fail("thread exited with cp.async copies never waited for");
    }
    swapcontext(&st().cur->ctx, &st().sched);
}

static inline double uniform() {   // xorshift64
    unsigned long long& x = st().rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return (x >> 11) * (1.0 / 9007199254740992.0);
}

// run fn on every block of grid (x fastest), each block's threads as fibers
static inline void launch(dim3 grid, dim3 block, size_t dyn_bytes, std::function<void()> fn) {
    State& s = st();
    const char* e = std::getenv("EMU_CP_EAGER");
    s.eager = e && e[0] == '1';
    const char* sd = std::getenv("EMU_SEED");
    if (sd) s.rng = std::strtoull(sd, nullptr, 10) * 2654435761ull + 1;
    s.grid_dim = grid;
    s.block_dim = block;
    s.body = fn;
    int nt = block.x * block.y * block.z;
    if (nt % 32) fail("block size must be a multiple of 32");
    map_dyn(s, dyn_bytes);
    const size_t slack = ((dyn_bytes + 15) & ~(size_t)15) - dyn_bytes;   // before the guard page: checked below
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                s.block_idx = {bx, by, bz};
                s.fibers.assign(nt, Fiber());
                s.block_bar = Barrier{nt, 0, 0};
                s.warp_bar.assign(nt / 32, Barrier{32, 0, 0});
                s.warp_slot.assign(nt / 32, WarpSlot());
                for (int i = 0; i < nt; ++i) {
                    Fiber& f = s.fibers[i];
                    f.linear = i;
                    f.tid = {(unsigned)(i % block.x), (unsigned)((i / block.x) % block.y),
                             (unsigned)(i / (block.x * block.y))};
                    f.stack.resize(1 << 17);
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.data();
                    f.ctx.uc_stack.ss_size = f.stack.size();
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, trampoline, 0);
                }
                // each warp runs in a round with its own probability: warps drift apart
                std::vector<double> speed(nt / 32);
                for (auto& p : speed) p = 0.05 + 0.95 * uniform();
                long idle = 0;
                for (;;) {
                    bool all_done = true;
                    long before = s.events;
                    for (int w = 0; w < nt / 32; ++w) {
                        bool run = uniform() < speed[w];
                        for (int i = 32 * w; i < 32 * w + 32; ++i) {
                            Fiber& f = s.fibers[i];
                            if (f.done) continue;
                            all_done = false;
                            if (!run) continue;
                            s.cur = &f;
                            swapcontext(&s.sched, &f.ctx);
                        }
                    }
                    if (all_done) break;
                    idle = s.events == before ? idle + 1 : 0;
                    if (idle > 2000) fail("deadlock: every live thread waits at a barrier nobody else reaches");
                }
                s.cur = nullptr;
                for (size_t i = dyn_bytes; i < dyn_bytes + slack; ++i)
                    if (s.dyn[i] != 0xFF) fail("a block wrote past its dynamic shared memory");
            }
}

}  // namespace emu

#define threadIdx (emu::st().cur->tid)
#define blockIdx (emu::st().block_idx)
#define blockDim (emu::st().block_dim)
#define gridDim (emu::st().grid_dim)

static inline void __syncthreads() { emu::wait(emu::st().block_bar); }
static inline void __syncwarp(unsigned = 0xffffffffu) {
    int dummy = 0, all[32];
    emu::gather(dummy, all, "syncwarp");
}
static inline float __shfl_xor_sync(unsigned, float v, int m) {
    float all[32];
    emu::gather(v, all, "shfl_xor");
    return all[emu::lane() ^ m];
}
// (a lane below delta gets its own value back, as on the GPU)
static inline float __shfl_up_sync(unsigned, float v, unsigned delta) {
    float all[32];
    emu::gather(v, all, "shfl_up");
    const int from = emu::lane() - (int)delta;
    return all[from < 0 ? emu::lane() : from];
}
static inline float __shfl_sync(unsigned, float v, int src) {
    float all[32];
    emu::gather(v, all, "shfl");
    return all[src & 31];
}
static inline int __shfl_sync(unsigned, int v, int src) {
    int all[32];
    emu::gather(v, all, "shfl32");
    return all[src & 31];
}
static inline long long __shfl_sync(unsigned, long long v, int src) {
    long long all[32];
    emu::gather(v, all, "shfl64");
    return all[src & 31];
}
static inline unsigned __ballot_sync(unsigned, bool p) {
    int v = p, all[32];
    emu::gather(v, all, "ballot");
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= (unsigned)(all[i] != 0) << i;
    return r;
}

#define REALIZAR_HOST_TEST
