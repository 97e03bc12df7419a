// Asynchronous 16-byte copies from global to shared memory in commit groups (sm_80+): loops that keep
// several stages of loads in flight hold them in shared memory, not in registers (flash attention's
// K/V tiles, mmv8.cu's Q4_K trips). A thread waits for its own groups only: a stage other lanes or
// warps copied is read after that wait and a barrier (__syncwarp for a warp's own ring). On the host
// emulator (tests/host/cuda_emu.h) a copy lands when its group is waited for.
#pragma once
#include "common.cuh"

// 16 bytes global -> shared through L2 only (.cg: read once, not kept in L1); !ok: the 16 bytes are
// zeroed and nothing is read (an address past the data may be passed)
__device__ __forceinline__ void cp16z(void* smem, const void* gmem, bool ok) {
#ifdef REALIZAR_HOST_TEST
    emu::cp_async16(smem, gmem, ok);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((u32)__cvta_generic_to_shared(smem)),
                 "l"(gmem), "r"(ok ? 16 : 0)
                 : "memory");
#endif
}

// closes this thread's copies issued since the last commit into one group (possibly empty: loops
// commit every trip so that the count of groups in flight is the same on every lane)
__device__ __forceinline__ void cp_commit() {
#ifdef REALIZAR_HOST_TEST
    emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// wait until at most N of this thread's committed groups are still in flight
template <int N> __device__ __forceinline__ void cp_wait() {
#ifdef REALIZAR_HOST_TEST
    emu::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}
