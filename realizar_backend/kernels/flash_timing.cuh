// A timeline of flash_decode.cu's blocks, compiled in only with -DFLD_TIMING (tools/decode_timeline.py
// builds that variant with NVRTC; the shipped kernels never have it). Thread 0 of each block stamps
// %globaltimer (ns, one clock for the whole GPU) at the points FLD_T(i) marks, and a block of the
// cluster path appends its stamps, its (split, KV head, row), SM and cluster count to fld_tl when it
// ends. The points, FLD_T(i):
//   0 entry   1 past pdl_wait   2 q ready   3 every key read   4 warps merged   5 copies pushed
//   6 own slices combined   7 exit   8 won the last level's vote   9 the partials' (M, L) loaded
//   10 output stored   11 the first tile's K/V landed   12 its scores   13 its P.V
// (0 where a block never got there: 8-10 in blocks that did not win a vote)
#pragma once

#ifdef FLD_TIMING
#define FLD_TCAP 65536        // records: blocks of one or a few launches
#define FLD_TPTS 14
__device__ unsigned long long fld_tl[FLD_TCAP][FLD_TPTS + 3];   // stamps, (s | kh << 12 | t << 24), SM, ncl
__device__ unsigned int fld_tn;                        // records written (zeroed by the tool)
__shared__ unsigned long long fld_stl[FLD_TPTS];
#define FLD_T(i)                                                                     \
    do {                                                                             \
        if (threadIdx.x == 0) {                                                      \
            unsigned long long t_;                                                   \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                   \
            fld_stl[i] = t_;                                                         \
        }                                                                            \
    } while (0)
#define FLD_T_RESET()                                                                \
    do {                                                                             \
        if (threadIdx.x == 0)                                                        \
            for (int k_ = 0; k_ < FLD_TPTS; ++k_) fld_stl[k_] = 0;                   \
    } while (0)
__device__ __forceinline__ void fld_flush(int ncl) {
    if (threadIdx.x == 0) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        const unsigned i = atomicAdd(&fld_tn, 1u);
        if (i < FLD_TCAP) {
            for (int k = 0; k < FLD_TPTS; ++k) fld_tl[i][k] = fld_stl[k];
            fld_tl[i][FLD_TPTS] = blockIdx.x | (blockIdx.y << 12) | ((unsigned long long)blockIdx.z << 24);
            fld_tl[i][FLD_TPTS + 1] = sm;
            fld_tl[i][FLD_TPTS + 2] = ncl;
        }
    }
}
#define FLD_FLUSH(ncl) fld_flush(ncl)
#else
#define FLD_T(i)
#define FLD_T_RESET()
#define FLD_FLUSH(ncl)
#endif
