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

// Pushes into another block's shared memory, counted on its barrier (sm_90 st.async). dst and bar are
// this block's addresses of the same variables; the copies written are those of block `rank`. The
// receiver learns of the bytes through its barrier: mbar_expect(bar, bytes), then mbar_wait.
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned rank) {
    unsigned a = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
#endif
    return a;
}

__device__ __forceinline__ void cluster_push(float* dst, unsigned rank, float v, unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 ::"r"(cluster_map(dst, rank)), "r"(__float_as_uint(v)), "r"(cluster_map(bar, rank)) : "memory");
#else
    *dst = v;
#endif
}

// two floats (8-byte aligned)
__device__ __forceinline__ void cluster_push2(float* dst, unsigned rank, float a, float b, unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];"
                 ::"r"(cluster_map(dst, rank)), "r"(__float_as_uint(a)), "r"(__float_as_uint(b)),
                 "r"(cluster_map(bar, rank)) : "memory");
#else
    dst[0] = a;
    dst[1] = b;
#endif
}

// a barrier of one arrival (the receiver's own mbar_expect) plus the bytes it expects; the init is
// visible to the cluster's other blocks after the next cluster barrier
__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n\tfence.mbarrier_init.release.cluster;"
                 ::"r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
#endif
}

// the receiver's arrival: `bytes` more are to come (pushes may land before or after it)
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}"
                 ::"r"((unsigned)__cvta_generic_to_shared(bar)), "r"(bytes) : "memory");
#endif
}

// spin until the barrier's phase `parity` completes; the pushed bytes are then visible (test_wait
// polls: a remote complete_tx need not wake a thread parked in try_wait)
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned done = 0;
    const unsigned a = (unsigned)__cvta_generic_to_shared(bar);
    do {
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.test_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(a), "r"(parity) : "memory");
    } while (!done);
#endif
}
