// Thread-block clusters (sm_90): a launch with a cluster size (backends/cuda/pdl.py) runs the blocks
// of one cluster at once on one GPC, and they read each other's shared memory. Before sm_90 (and on
// the host) every block is a cluster of one and these are no-ops.
#pragma once

// this block's rank in its cluster (x) and the cluster's size in blocks (y)
__device__ __forceinline__ uint2 cluster_place() {
    uint2 p = {0u, 1u};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n\tmov.u32 %1, %%cluster_nctarank;" : "=r"(p.x), "=r"(p.y));
#endif
    return p;
}

// every thread of every block of the cluster; shared-memory writes before it are visible to the
// cluster's other blocks after it
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// cluster_sync in two halves: after arrive, this thread's earlier shared-memory reads and writes are
// done as far as the cluster is concerned; wait returns once every thread of the cluster arrived.
// Work between the two (global writes, a counter vote) overlaps the barrier's latency.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// the float at the same shared-memory address in block `rank` of this cluster
__device__ __forceinline__ float cluster_ld(const float* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned a;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
#else
    return *p;
#endif
}
