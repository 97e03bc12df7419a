// Paged KV cache: the addressing every attention and KV-write kernel shares.
// Per layer, K and V are each one pool of fp16 rows [num_blocks + 1][block_size][KVH][D] (the last
// block is scratch: padded rows of a bucketed decode batch write and read it, never a live block).
// A sequence in slot s owns the blocks bt[s * max_blocks + i], i = 0, 1, ...: block i holds its
// positions [i * block_size, (i + 1) * block_size). block_size is a power of two (bs_log2).
#pragma once

// row index (of KVH * D values) of position pos of the sequence in slot `slot`
__device__ __forceinline__ long long kv_row(const int* __restrict__ bt, int max_blocks, int bs_log2, int slot,
                                            int pos) {
    return ((long long)__ldg(bt + (long long)slot * max_blocks + (pos >> bs_log2)) << bs_log2) +
           (pos & ((1 << bs_log2) - 1));
}
