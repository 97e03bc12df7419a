// Prompt attention (prefill and chunked prefill) as flash attention on the tensor cores, over the
// paged KV pool. Row t (a token of a prompt, q already roped, fp32 [n][H][D]) sits at positions[t] of
// the sequence in slot slots[t] and sees that sequence's keys [start, positions[t]] (start = 0, or
// positions[t] - window + 1 with a sliding window): exactly causal masking, over the cached prefix of
// a chunk plus the chunk itself (rope_kv has written the chunk's K and V before this runs). sinks
// (null: none): head h's sink logit joins its rows' softmax denominators (flash.cuh fl_sink_sum).
//
// Block (tile, head h, split s): NW warps, WM m-tiles of 16 rows each (BQ = 16 NW WM consecutive rows
// of the launch), one q head; a warp's rows are the M dimension of its mma tiles, and with WM = 2
// each K or V fragment it reads from shared memory feeds two of them. K/V tiles of BK keys are shared
// by the block's warps, double-buffered (the next tile's copies fly while this one is used). Rows of one
// sequence at consecutive positions form a "run" (normally the whole tile); a tile holding rows of
// two sequences runs one run after the other, each over its own keys. Tiles run last-first: the
// longest rows of a prompt start first and the short ones fill the tail.
// Split-K (gridDim.z > 1, for few long rows: a chunk of a long prompt): a run's key tiles are divided
// among the splits; splits of a tile whose longest run has few keys are skipped (fewer than
// min_split_keys per split); the last block of a tile to finish combines (flash.cuh).
//
// Entry points flash_prefill_d<D>_w<NW>_m<WM>_q<QS>: QS = 1 splits q into hi + lo fp16 parts (q . k with
// fp32-like accuracy, 1.5x the mma work). Dynamic shared memory: backends/cuda/flash.py sizes it
// (prefill_smem), from the same formula as below.
#include "flash.cuh"

// first run start after row r of the tile, or nrow (runs: bit r = row r starts a run)
__device__ __forceinline__ int fl_next_run(const u32* runs, int r, int nrow) {
    for (int i = r + 1; i < nrow;) {
        u32 m = runs[i >> 5] >> (i & 31);
        if (m) return min(nrow, i + __ffs((int)m) - 1);
        i = (i | 31) + 1;
    }
    return nrow;
}

template <int D, int NW, int WM, bool QS>
__device__ __forceinline__ void fl_prefill(const float* __restrict__ q, float* out, u16* o16,
                                           const u16* __restrict__ kpool, const u16* __restrict__ vpool,
                                           const int* __restrict__ bt, int max_blocks, int bs_log2,
                                           const int* __restrict__ slots, const int* __restrict__ positions, int n,
                                           int H, int KVH, float scale, int window, float* part_o, float2* part_ml,
                                           int* counters, int min_split_keys, const float* sinks) {
    // BK keys per K/V tile: 64, or 32 where the accumulators of 256-dim heads or of two m-tiles of
    // 128 dims leave no registers for 64 (backends/cuda/flash.py prefill_bk says the same)
    constexpr int BQ = 16 * NW * WM, NT = 32 * NW, LDS = D + 8, BK = D > 128 || (WM == 2 && D > 64) ? 32 : 64;
    constexpr bool QREG = D <= 128 && !QS && WM == 1;   // q fragments live in registers; else re-read from shared
    constexpr int KD = D / 16, CPR = D / 8;
    static_assert(!QREG || BQ <= 2 * BK, "q staging aliases one K/V stage");
    static_assert((BK * CPR) % NT == 0, "a tile's copies divide evenly among the threads");
    FL_DYN_SMEM(smem);
    u16* kvs = (u16*)smem;                                   // [2 stages][K, V][BK][LDS]
    u16* qh = QREG ? kvs + 2 * BK * LDS : kvs + 4 * BK * LDS; // [BQ][LDS]: QREG stages q in stage 1
    u16* ql = qh + BQ * LDS;                                 // QS: the lo parts
    __shared__ int s_pos[BQ], s_slot[BQ], s_flag;
    __shared__ u32 s_runs[(BQ + 31) / 32];
    __shared__ float s_w[(FL_MAXC + 1) * BQ];

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int tile = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, s = blockIdx.z, kh = h / (H / KVH);
    const int t0 = tile * BQ, nrow = min(BQ, n - t0);
    pdl_wait();
    for (int i = tid; i < BQ; i += NT) {
        s_pos[i] = i < nrow ? positions[t0 + i] : 0;
        s_slot[i] = i < nrow ? slots[t0 + i] : -1;
    }
    __syncthreads();
    for (int r0 = 32 * w; r0 < BQ; r0 += NT) {            // warp-uniform
        const int r = r0 + lane;
        const bool first = r < nrow && (r == 0 || s_slot[r] != s_slot[r - 1] || s_pos[r] != s_pos[r - 1] + 1);
        const u32 b = __ballot_sync(0xffffffffu, first);
        if (lane == 0) s_runs[r0 >> 5] = b;
    }
    __syncthreads();
    int nsplit = 1;
    if (gridDim.z > 1) {
        int maxk = 1;
        for (int rb = 0; rb < nrow;) {
            const int re = fl_next_run(s_runs, rb, nrow), p0 = s_pos[rb];
            maxk = max(maxk, re - rb + p0 - (window > 0 ? max(0, p0 - window + 1) : 0));
            rb = re;
        }
        nsplit = min(min((int)gridDim.z, FL_MAXC), (maxk + min_split_keys - 1) / min_split_keys);
        nsplit = max(nsplit, 1);
    }
    if (s >= nsplit) return;                              // block-uniform

    // q rows -> fp16 (scaled into the log2 domain), rows past the launch zero
    const float qsc = scale * FL_LOG2E;
    for (int i = tid; i < BQ * (D / 4); i += NT) {
        const int r = i / (D / 4), c = 4 * (i - r * (D / 4));
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < nrow) v = *(const float4*)(q + ((long long)(t0 + r) * H + h) * D + c);
        const float x[4] = {v.x * qsc, v.y * qsc, v.z * qsc, v.w * qsc};
        u16 hi[4], lo[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            hi[e] = f2h(x[e]);
            lo[e] = f2h(x[e] - h2f(hi[e]));
        }
        *(uint2*)(qh + r * LDS + c) = make_uint2(hi[0] | ((u32)hi[1] << 16), hi[2] | ((u32)hi[3] << 16));
        if (QS) *(uint2*)(ql + r * LDS + c) = make_uint2(lo[0] | ((u32)lo[1] << 16), lo[2] | ((u32)lo[3] << 16));
    }
    __syncthreads();
    u32 qf[QREG ? KD : 1][4];
    if constexpr (QREG) {
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) fl_afrag(qf[kk], qh, LDS, 16 * w, kk, lane);
        __syncthreads();                                  // stage 1 (holding q) is free again
    }

    // m-tile i of the warp: rows wr[i] .. wr[i] + 15 of the tile (warps interleaved, so the rows of
    // a diagonal K/V tile are spread over every warp); this thread's rows wr[i] + g and + 8
    for (int rb = 0; rb < nrow;) {                        // block-uniform: every thread walks the same runs
        const int re = fl_next_run(s_runs, rb, nrow);
        const int slot = s_slot[rb], p0 = s_pos[rb];
        const int kb = window > 0 ? max(0, p0 - window + 1) : 0, ke = p0 + (re - rb) - 1;   // keys [kb, ke]
        const int ntile = (ke - kb + BK) / BK, per = (ntile + nsplit - 1) / nsplit;
        const int j0 = min(ntile, s * per), j1 = min(ntile, j0 + per);
        bool active[WM];                                  // warp-uniform: the m-tile holds rows of this run
        float o[WM][D / 8][4], m[WM][2], l[WM][2];
#pragma unroll
        for (int i = 0; i < WM; ++i) {
            const int wr = 16 * (w + NW * i);
            active[i] = wr < re && wr + 16 > rb;
            m[i][0] = m[i][1] = -INFINITY;
            l[i][0] = l[i][1] = 0.0f;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) o[i][dt][0] = o[i][dt][1] = o[i][dt][2] = o[i][dt][3] = 0.0f;
        }

        auto issue = [&](int j, int st) {
            const int k0 = kb + j * BK;
            u16* ks = kvs + st * 2 * BK * LDS;
            u16* vs = ks + BK * LDS;
#pragma unroll
            for (int it = 0; it < BK * CPR / NT; ++it) {
                const int x = tid + it * NT, key = x / CPR, c = x - key * CPR, kp = k0 + key;
                const bool ok = kp <= ke;
                const long long off = ok ? (kv_row(bt, max_blocks, bs_log2, slot, kp) * KVH + kh) * D + c * 8 : 0;
                cp16z(ks + key * LDS + c * 8, kpool + off, ok);
                cp16z(vs + key * LDS + c * 8, vpool + off, ok);
            }
            cp_commit();
        };
        if (j0 < j1) issue(j0, 0);
        for (int j = j0; j < j1; ++j) {
            const int st = (j - j0) & 1;
            if (j + 1 < j1) {
                issue(j + 1, st ^ 1);
                cp_wait<1>();
            } else {
                cp_wait<0>();
            }
            __syncthreads();                              // tile j is in shared memory for every warp
            const int k0 = kb + j * BK;
            const u16* ks = kvs + st * 2 * BK * LDS;
            const u16* vs = ks + BK * LDS;
            float sc[WM][BK / 8][4];
#pragma unroll
            for (int i = 0; i < WM; ++i)
#pragma unroll
                for (int nt = 0; nt < BK / 8; ++nt) sc[i][nt][0] = sc[i][nt][1] = sc[i][nt][2] = sc[i][nt][3] = 0.0f;
            // S = Q K^T: each K fragment serves every m-tile of the warp
#pragma unroll
            for (int kk = 0; kk < KD; ++kk) {
                u32 a[WM][4], al[WM][4];
#pragma unroll
                for (int i = 0; i < WM; ++i) {
                    if (!active[i]) continue;
                    if constexpr (QREG) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) a[i][e] = qf[kk][e];
                    } else {
                        fl_afrag(a[i], qh, LDS, 16 * (w + NW * i), kk, lane);
                    }
                    if constexpr (QS) fl_afrag(al[i], ql, LDS, 16 * (w + NW * i), kk, lane);
                }
#pragma unroll
                for (int np = 0; np < BK / 16; ++np) {
                    u32 b[4];
                    fl_kfrag(b, ks, LDS, 16 * np, kk, lane);
#pragma unroll
                    for (int i = 0; i < WM; ++i) {
                        if (!active[i]) continue;
                        fl_mma(sc[i][2 * np], a[i], b[0], b[1]);
                        fl_mma(sc[i][2 * np + 1], a[i], b[2], b[3]);
                        if constexpr (QS) {
                            fl_mma(sc[i][2 * np], al[i], b[0], b[1]);
                            fl_mma(sc[i][2 * np + 1], al[i], b[2], b[3]);
                        }
                    }
                }
            }
            u32 pf[WM][BK / 16][4];
#pragma unroll
            for (int i = 0; i < WM; ++i) {
                if (!active[i]) continue;
                // keys past a row, before its window or beyond the run's last key (zero-filled) are
                // masked, unless the whole tile is visible to all 16 rows (warp-uniform test)
                const int wr = 16 * (w + NW * i), ra = wr + g, rc = ra + 8, pw0 = p0 + (wr - rb);
                const bool ina = ra >= rb && ra < re, inc = rc >= rb && rc < re;
                const int pa = p0 + (ra - rb), pc = p0 + (rc - rb);
                const bool full = wr >= rb && wr + 16 <= re && k0 + BK - 1 <= pw0 &&
                                  (window <= 0 || k0 > pw0 + 15 - window);
                if (!full) {
#pragma unroll
                    for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = k0 + nt * 8 + 2 * tq + (e & 1);
                            const bool in = e < 2 ? ina : inc;
                            const int p = e < 2 ? pa : pc;
                            if (!in || key > p || (window > 0 && key <= p - window)) sc[i][nt][e] = -INFINITY;
                        }
                }
                fl_softmax_step<BK / 8, D / 8>(sc[i], m[i], l[i], o[i], pf[i]);
            }
            // O += P V: each V fragment serves every m-tile of the warp
#pragma unroll
            for (int kj = 0; kj < BK / 16; ++kj) {
                const u16* vb = vs + (kj * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8;
#pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {
                    u32 b[4];
                    bool any = false;
#pragma unroll
                    for (int i = 0; i < WM; ++i) any |= active[i];
                    if (!any) break;
                    fl_ldsm_t(b, vb + dp * 16);
#pragma unroll
                    for (int i = 0; i < WM; ++i) {
                        if (!active[i]) continue;
                        fl_mma(o[i][2 * dp], pf[i][kj], b[0], b[1]);
                        fl_mma(o[i][2 * dp + 1], pf[i][kj], b[2], b[3]);
                    }
                }
            }
            __syncthreads();                              // tile j consumed: its stage may be refilled
        }
#pragma unroll
        for (int i = 0; i < WM; ++i) {
            if (!active[i]) continue;
            const int wr = 16 * (w + NW * i), ra = wr + g, rc = ra + 8;
            const bool ina = ra >= rb && ra < re, inc = rc >= rb && rc < re;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                l[i][e] += __shfl_xor_sync(0xffffffffu, l[i][e], 1);
                l[i][e] += __shfl_xor_sync(0xffffffffu, l[i][e], 2);
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                if (!(e ? inc : ina)) continue;
                const long long row = t0 + (e ? rc : ra);
                if (nsplit == 1) {
                    const float inv = 1.0f / fl_sink_sum(l[i][e], m[i][e], sinks ? sinks + h : nullptr);
                    const long long ob = (row * H + h) * D;
#pragma unroll
                    for (int dt = 0; dt < D / 8; ++dt) {
                        const int d = dt * 8 + 2 * tq;
                        const float x0 = o[i][dt][2 * e] * inv, x1 = o[i][dt][2 * e + 1] * inv;
                        *(float2*)(out + ob + d) = make_float2(x0, x1);
                        if (o16) *(u32*)(o16 + ob + d) = fl_pack(x0, x1);
                    }
                } else {
                    const long long pr = ((long long)s * n + row) * H + h;
#pragma unroll
                    for (int dt = 0; dt < D / 8; ++dt)
                        *(float2*)(part_o + pr * D + dt * 8 + 2 * tq) =
                            make_float2(o[i][dt][2 * e], o[i][dt][2 * e + 1]);
                    if (tq == 0) part_ml[pr] = make_float2(m[i][e], l[i][e]);
                }
            }
        }
        rb = re;
    }
    if (nsplit > 1 && fl_arrive_last(counters + (long long)tile * H + h, nsplit, &s_flag)) {
        const long long r0 = (long long)t0 * H + h;
        fl_combine<D>(nrow, nsplit, part_o + r0 * D, (long long)n * H * D, (long long)H * D, part_ml + r0,
                      (long long)n * H, H, out + r0 * D, o16 ? o16 + r0 * D : nullptr, nullptr, nullptr,
                      (long long)H * D, nullptr, nullptr, s_w, sinks ? sinks + h : nullptr, 0);
    }
}

#define FL_PREFILL_ARGS                                                                                           \
    const float *q, float *out, u16 *o16, const u16 *kpool, const u16 *vpool, const int *bt, int max_blocks,   \
        int bs_log2, const int *slots, const int *positions, int n, int H, int KVH, float scale, int window,  \
        float *part_o, float2 *part_ml, int *counters, int min_split_keys, const float *sinks
// FL_MINB (optional): blocks per SM the registers must allow (the 128-dim kernel needs ~200 per
// thread: 2 blocks of 4 warps; 3 cap it at 168, a few bytes spilled)
#ifndef FL_MINB
#define FL_MINB 1
#endif
#define FL_PREFILL_(D, NW, WM, QS)                                                                                \
    extern "C" __global__ void __launch_bounds__(32 * NW, FL_MINB)                                              \
        flash_prefill_d##D##_w##NW##_m##WM##_q##QS(FL_PREFILL_ARGS) {                                           \
        fl_prefill<D, NW, WM, QS != 0>(q, out, o16, kpool, vpool, bt, max_blocks, bs_log2, slots, positions, n,  \
                                       H, KVH, scale, window, part_o, part_ml, counters, min_split_keys, sinks);  \
    }
#define FL_PREFILL(D, NW, WM, QS) FL_PREFILL_(D, NW, WM, QS)

// the loader compiles one variant per module (-DFL_D, -DFL_NW, -DFL_WM, -DFL_QS); without them, every one
#ifdef FL_D
FL_PREFILL(FL_D, FL_NW, FL_WM, FL_QS)
#else
FL_PREFILL(64, 4, 1, 0)
FL_PREFILL(128, 4, 1, 0)
FL_PREFILL(256, 4, 1, 0)
FL_PREFILL(64, 4, 1, 1)
FL_PREFILL(128, 4, 1, 1)
FL_PREFILL(256, 4, 1, 1)
FL_PREFILL(128, 8, 1, 0)
FL_PREFILL(64, 4, 2, 0)
FL_PREFILL(128, 4, 2, 0)
FL_PREFILL(64, 4, 2, 1)
FL_PREFILL(128, 4, 2, 1)
#endif
