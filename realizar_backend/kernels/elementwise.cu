// Small glue kernels: activation * up for the GEMVs of float matrices, a bias added to rows, a gated
// attention's query and gate apart and its output gate, row gather (each prompt's last hidden state),
// a continuation's decode inputs, and greedy argmax.
#include "common.cuh"

// a = act(g) * u, elementwise over n values (act 0 = SiLU, 1 = GELU-tanh; 2: the clamped SwiGLU of
// g and u, common.cuh gated_f)
extern "C" __global__ void act_mul(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ a,
                                   long long n, int act) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] = gated_f(g[i], u[i], act);
}

// x[b, :width] += bias, for n rows of stride xs (an output projection's bias, gpt-oss: added after its
// projection into the residual, whichever kernel family ran it)
extern "C" __global__ void add_rows(float* __restrict__ x, int xs, const float* __restrict__ bias, int n, int width) {
    int b = blockIdx.y;
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < n && c < width) x[(long long)b * xs + c] += bias[c];
}

// A gated attention's q projection (qwen35) gives each head [query | gate]: src [rows][heads][2][D]
// -> q [rows][heads][D] and gate [rows][heads][D]. Grid (ceil(heads * D / 256), rows).
extern "C" __global__ void split_pair(const float* __restrict__ src, float* __restrict__ q, float* __restrict__ gate,
                                     int rows, int heads, int D) {
    int r = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows || i >= heads * D) return;
    int h = i / D, d = i - h * D;
    const float* s = src + ((long long)r * heads + h) * 2 * D + d;
    q[(long long)r * heads * D + i] = s[0];
    gate[(long long)r * heads * D + i] = s[D];
}

// y *= sigmoid(gate), elementwise over n values (a gated attention's heads)
extern "C" __global__ void sigmoid_mul(float* __restrict__ y, const float* __restrict__ gate, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = y[i] / (1.0f + expf(-gate[i]));
}

// dst[b, :] = src[idx[b], :]
extern "C" __global__ void gather_rows(const float* __restrict__ src, const int* __restrict__ idx,
                                       float* __restrict__ dst, int n, int width) {
    int b = blockIdx.y;
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < n && c < width) dst[(long long)b * width + c] = src[(long long)idx[b] * width + c];
}

// out[r] = first index of the maximum of row r (NaN never wins); one block of 1024 per row.
// io != 0 (a decode step): the chosen token and the next position also go to the step's own input
// rows (io[b]: token, io[io_stride + b]: position), so the next step can run on the device's output
// without the host in between (a continuation: a decode Step without tokens, backends/runner.py)
__device__ __forceinline__ void feed_next(int* io, int io_stride, int b, int tok, int* ring, int ring_len) {
    if (io) {
        int pos = io[io_stride + b];
        io[b] = tok;
        io[io_stride + b] = pos + 1;
        // the host's copy: a ring of token rows in mapped host memory, so a step needs no copy of its
        // own after the graph. The step's ring row is io row 3 (the same for every row of a step: the
        // host numbers the steps), advanced here for the next step (token_ring.py)
        if (ring) {
            int rr = io[3 * io_stride + b];
            ring[rr * io_stride + b] = tok;
            io[3 * io_stride + b] = rr + 1 == ring_len ? 0 : rr + 1;
        }
    }
}

// A continuation over another batch (CUDABackend's prev_rows): the decode inputs io [4, io_stride]
// (tokens, positions, slots, ring row) of n rows, each either a row of the previous step, whose
// token and next position that step's last kernel left in io (stage[3][j] = that row), or a new
// row whose token, position and slot the host staged (stage[3][j] = -1); rows n..b-1 are padding
// on the scratch slot at position 0. One block: every row is read before any is written, so a row
// may move down or up. Dynamic shared memory: 3 * n ints.
extern "C" __global__ void decode_io_merge(int* __restrict__ io, int io_stride, const int* __restrict__ stage,
                                           int n, int b, int scratch_slot, int ring_row) {
    extern __shared__ int kept[];
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        int from = stage[3 * io_stride + j];
        for (int k = 0; k < 3; ++k) kept[k * n + j] = from >= 0 ? io[k * io_stride + from] : stage[k * io_stride + j];
    }
    __syncthreads();
    for (int j = threadIdx.x; j < b; j += blockDim.x) {
        bool live = j < n;
        io[j] = live ? kept[j] : 0;
        io[io_stride + j] = live ? kept[n + j] : 0;
        io[2 * io_stride + j] = live ? kept[2 * n + j] : scratch_slot;
        io[3 * io_stride + j] = ring_row;
    }
}

extern "C" __global__ void argmax_rows(const float* __restrict__ x, int xs, int cols, int* __restrict__ out, int rows,
                                       int* io, int io_stride, int* ring, int ring_len) {
    __shared__ float sv[32];
    __shared__ int si[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * xs;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = xr[i];
        if (v > best) { best = v; bi = i; }  // strided walk: first hit per thread is its lowest index
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) { sv[wid] = best; si[wid] = bi; }
    __syncthreads();
    if (wid == 0) {
        int nw = (blockDim.x + 31) >> 5;
        best = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) {
            out[r] = bi == 0x7fffffff ? 0 : bi;
            feed_next(io, io_stride, r, out[r], ring, ring_len);
        }
    }
}

// out[b] = the row packed into key[b] by a GEMV's fused argmax (common.cuh argmax_key), and key[b]
// reset to 0 for the next step's atomicMax. The row is the low word's complement.
extern "C" __global__ void argmax_unpack(unsigned long long* key, int* out, int n, int* io, int io_stride, int* ring,
                                         int ring_len) {
    pdl_wait();
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    int tok = (int)(0xFFFFFFFFu - (unsigned)(key[b] & 0xFFFFFFFFull));
    out[b] = tok;
    key[b] = 0ull;
    feed_next(io, io_stride, b, tok, ring, ring_len);
}

// Busy-wait about ns nanoseconds on one thread: the profiler queues a step's launches behind it
// so that event timings measure kernels, not Python launch gaps.
extern "C" __global__ void spin_ns(long long ns) {
    long long t0 = clock64();
    // clock64 counts SM cycles; ~2 GHz is close enough for a queueing barrier
    while (clock64() - t0 < 2 * ns) {
    }
}
