// Decode attention (one new token per row) as flash-decoding on the tensor cores, over the paged
// KV pool. Row t sits at positions[t] of the sequence in slot slots[t] and sees its keys
// [start, positions[t]] (start as in flash_prefill.cu).
//
// Block (split s, KV head kh, row t): the G = H / KVH q heads of the KV group are the M dimension of
// the mma tiles (G <= 16; rows G..15 are zero), so each K/V byte is read once for the whole group.
// The block's keys are cut into 16-key warp tiles dealt round-robin to its 4 warps; each warp streams
// its tiles through its own shared-memory stages (cp.async, no block barrier in the loop) and
// keeps its own online softmax; the warps merge through shared memory at the end.
// Splits: gridDim.x is the most splits a row may take (fixed per captured batch bucket); a row's own
// count comes from its length: rows of at most single_max keys run one pass (no partials, no
// combine), longer rows split into chunks of max(split_keys, ceil(keys / gridDim.x) rounded up to 64)
// keys; blocks past a row's count exit at once. Partials combine in the last block of each group of
// FL_MAXC splits, then (more than one group) in the last group's block (flash.cuh).
// Launched in thread-block clusters of C splits (sm_90, pdl.py; gridDim.x a multiple of C), the
// splits of a cluster combine through distributed shared memory instead: each block owns every
// C-th 32-dim slice of the group's heads, and the cluster's blocks push their copies of a slice
// into its owner's shared memory (st.async, counted on the owner's barrier: no cluster barrier
// after the keys). A row of more than C splits leaves one partial per cluster as flagged words
// (flash.cuh), which cluster 0 (where the launch leaves room for it to wait) or the last cluster
// to arrive combines, per slice. The per-level fences and serial combines of the global path were
// most of this kernel's time at a few thousand keys.
// fuse != 0: RoPE of q and of the new k from the cos/sin table rt (float2 [positions][rope_dim / 2],
// ops.rope_table), and the KV write: the block holding the row's last key writes the new k and v
// (fp16) to the pool and uses them from shared memory for that key. No block of the launch reads a
// row another block writes. The K/V copies and the cos/sin reads start before pdl_wait (cached rows
// and a constant table, which the kernel before does not write), then every q load at once; fuse ==
// 0 (q roped and the cache written by rope_kv): the copies after it.
// sinks (null: none): each q head's sink logit joins its row's softmax denominator wherever the row's
// output is normalised: single pass, combine, or cluster combine (flash.cuh fl_sink_sum).
// qnw, knw (fuse only; null: none): the per-head q and k norms (head_norm.cuh), applied to the q heads
// and the new k before they rotate: warp w finds the RMS of the group's q heads w, w + NW, ... and (the
// block holding the row's last key) of k, while the q loads are in flight; one barrier.
//
// Entry points flash_decode_d<D>_q<QS>; QS = 1 (the default) splits q into hi + lo fp16 parts: the
// scores then carry fp32-like accuracy, at no cost in a kernel that waits on memory.
#include "flash.cuh"
#include "cluster.cuh"
#include "head_norm.cuh"

#define FLD_NW 4      // warps per block
#define FLD_KW 16     // keys per warp tile
#define FLD_PREG 16   // cluster partials the last level holds in registers (128 splits in clusters of 8)
static_assert(FLD_PREG <= 32, "the last level keeps partial i's (m, l) in lane i");

// The end of a split of a cluster launch: ow[w][g][d] holds each warp's unnormalised output of head g
// and s_m / s_l[w][g] its (m, l). Level 1: slice x (32 dims of one head: head x / (D / 32)) belongs
// to block x % C of the cluster. Every block merges its warps per slice and pushes the slice's copy
// (32 values, then M and L) into the owner's recv[rank][x / C] with st.async, which counts the bytes
// on the owner's barrier `bar` (cluster.cuh); an owner waits for its C copies of each of its slices
// and combines them, in rank order, from its own shared memory. The one cluster barrier (every
// owner's barrier initialised, its q tile read: recv lies over it) is passed right after the q
// fragments reach registers, long before the first push, so no block waits at it.
// One cluster (ncl == 1): that is the output. Else the slice's cluster partial goes out as flagged
// words (flash.cuh) to ll [row, kh][cluster][slice][34] (its 32 values, then M and L), and one warp
// per slice waits for the ncl partials' flags, combines them in cluster order in one round of loads,
// and zeroes the words. With spin (flash.py: only where every block that can wait here fits on the
// GPU beside the blocks it waits for) that is cluster 0's owner of the slice, which starts as soon
// as its own partial is out. Otherwise the warps vote at the slice's counter (counters [row, kh]
// [slice]) and the last to arrive combines; the vote is relaxed (the words carry their own
// readiness, so no writer waits for its stores to land before it counts), and every other warp
// wrote before it voted, so the flags are set or in flight. No block barrier: per warp.
template <int D>
__device__ __forceinline__ void fl_decode_cluster(const float* ow, const float (*s_m)[16], const float (*s_l)[16],
                                               float* recv, unsigned long long* bar, int w, int lane, int C,
                                               int rank, int cl, int maxcl, int ncl, int G, long long rowp,
                                               float* out, u16* o16, i8* oq, float2* od, long long head0,
                                               u64* ll, int* counters, int spin, const float* sk) {
    constexpr int SL = D / 32, REC = 34;                          // slices per head; floats per slice copy
    const int nsl = G * SL, nmax = (nsl + C - 1) / C;
    const int nown = rank < nsl ? (nsl - rank + C - 1) / C : 0;   // slices this block owns
    if (threadIdx.x == 0) mbar_expect(bar, (unsigned)(C * nown * REC * 4));
    cluster_wait();                                               // every owner's barrier is ready
    for (int x = w; x < nsl; x += FLD_NW) {                       // merge the warps, push to the owner
        const int gg = x / SL, d = 32 * (x - gg * SL) + lane;
        float M = -INFINITY, L = 0.0f, v = 0.0f;                  // every lane weighs the warps itself
#pragma unroll
        for (int ww = 0; ww < FLD_NW; ++ww) M = fmaxf(M, s_m[ww][gg]);
#pragma unroll
        for (int ww = 0; ww < FLD_NW; ++ww) {
            const float f = s_l[ww][gg] > 0.0f ? exp2f(s_m[ww][gg] - M) : 0.0f;   // a warp with no keys: 0
            L += f * s_l[ww][gg];
            v += f * ow[(ww * 16 + gg) * D + d];
        }
        const unsigned owner = (unsigned)(x % C);
        float* dst = recv + (rank * nmax + x / C) * REC;
        cluster_push(dst + lane, owner, v, bar);
        if (lane == 0) cluster_push2(dst + 32, owner, M, L, bar);
    }
    if (nown > 0) mbar_wait(bar, 0);
    const long long cs = (long long)nsl * REC;                    // words between two clusters' copies of a slice
    for (int x = rank + C * w; x < nsl; x += C * FLD_NW) {        // warp-uniform
        const int gg = x / SL, c = x - gg * SL;
        const float* src = recv + (x / C) * REC;
        float pm[8], pl[8], pv[8];
#pragma unroll
        for (int p = 0; p < 8; ++p) {
            pm[p] = -INFINITY;
            pl[p] = pv[p] = 0.0f;
            if (p < C) {
                pm[p] = src[p * nmax * REC + 32];
                pl[p] = src[p * nmax * REC + 33];
                pv[p] = src[p * nmax * REC + lane];
            }
        }
        float M = -INFINITY;
#pragma unroll
        for (int p = 0; p < 8; ++p) M = fmaxf(M, pm[p]);
        float L = 0.0f, v = 0.0f;
#pragma unroll
        for (int p = 0; p < 8; ++p) {
            if (p < C) {
                const float f = pl[p] > 0.0f ? exp2f(pm[p] - M) : 0.0f;
                L += f * pl[p];
                v += f * pv[p];
            }
        }
        if (ncl == 1) {
            const long long ob = (head0 + gg) * D;
            fl_store32(v / fl_sink_sum(L, M, sk ? sk + gg : nullptr), c, lane, out ? out + ob : nullptr, o16 ? o16 + ob : nullptr, oq ? oq + ob : nullptr,
                       od ? od + (ob >> 5) : nullptr);
        } else {
            u64* mine = ll + (rowp * maxcl + cl) * cs + (long long)x * REC;
            fl_flag_put(mine + lane, v);
            if (lane < 2) fl_flag_put(mine + 32 + lane, lane ? L : M);
        }
    }
    if (ncl > 1) {
        for (int x = rank + C * w; x < nsl; x += C * FLD_NW) {
            int win = cl == 0;                                    // spin: cluster 0 combines
            if (!spin) {
                __syncwarp();
                win = 0;
                if (lane == 0) {
                    int* ctr = counters + rowp * nsl + x;
                    int old;
                    asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(ctr) : "memory");
                    win = old == ncl - 1;
                    if (win) *ctr = 0;
                }
                win = __shfl_sync(0xffffffffu, win, 0);
            }
            if (!win) continue;
            const int gg = x / SL, c = x - gg * SL;
            u64* src = ll + rowp * maxcl * cs + (long long)x * REC;    // cluster i's copy at src + i * cs
            float M = -INFINITY, L = 0.0f, v = 0.0f;
            if (ncl <= FLD_PREG) {
                // every partial's words in flight at once: each lane its value of every partial, lane
                // i partial i's (m, l), shared by shuffles (96 registers if every lane held them all)
                float pv[FLD_PREG], pm = -INFINITY, pl = 0.0f;
                bool ok;
                do {
                    ok = true;
#pragma unroll
                    for (int i = 0; i < FLD_PREG; ++i) {
                        pv[i] = 0.0f;
                        if (i < ncl) {
                            const u64 a = fl_flag_get(src + i * cs + lane);
                            ok = ok & fl_flagged(a);
                            pv[i] = fl_flag_val(a);
                        }
                    }
                    if (lane < ncl) {
                        const u64 b = fl_flag_get(src + lane * cs + 32), e = fl_flag_get(src + lane * cs + 33);
                        ok = ok & fl_flagged(b) & fl_flagged(e);
                        pm = fl_flag_val(b);
                        pl = fl_flag_val(e);
                    }
                } while (__ballot_sync(0xffffffffu, !ok) != 0u);
                M = pm;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
                const float f = exp2f(pm - M);                    // lane i's partial (a cluster partial has keys)
#pragma unroll
                for (int i = 0; i < FLD_PREG; ++i) {
                    const float fi = __shfl_sync(0xffffffffu, f, i), li = __shfl_sync(0xffffffffu, pl, i);
                    if (i < ncl) {
                        L += fi * li;
                        v += fi * pv[i];
                    }
                }
            } else {                                              // the same sums, a partial at a time
                for (int i = 0; i < ncl; ++i) {
                    const u64* p = src + i * cs;
                    u64 b;
                    for (;;) {
                        const u64 a = fl_flag_get(p + lane);
                        b = fl_flag_get(p + 32);
                        const u64 e = fl_flag_get(p + 33);
                        if (__ballot_sync(0xffffffffu, !(fl_flagged(a) & fl_flagged(b) & fl_flagged(e))) == 0u) break;
                    }
                    M = fmaxf(M, fl_flag_val(b));
                }
                for (int i = 0; i < ncl; ++i) {
                    const u64* p = src + i * cs;
                    const float f = exp2f(fl_flag_val(fl_flag_get(p + 32)) - M);
                    L += f * fl_flag_val(fl_flag_get(p + 33));
                    v += f * fl_flag_val(fl_flag_get(p + lane));
                }
            }
            const long long ob = (head0 + gg) * D;
            fl_store32(v / fl_sink_sum(L, M, sk ? sk + gg : nullptr), c, lane, out ? out + ob : nullptr,
                       o16 ? o16 + ob : nullptr, oq ? oq + ob : nullptr, od ? od + (ob >> 5) : nullptr);
            for (int i = 0; i < ncl; ++i) {                       // consumed: the next launch finds zeros
                src[i * cs + lane] = 0ull;
                if (lane < 2) src[i * cs + 32 + lane] = 0ull;
            }
        }
    }
}

template <int D, bool QS>
__device__ __forceinline__ void fl_decode(const float* __restrict__ q, const float* __restrict__ kin,
                                          const float* __restrict__ vin, float* out, u16* o16, i8* oq, float2* od,
                                          u16* kpool, u16* vpool, const int* __restrict__ bt, int max_blocks,
                                          int bs_log2, const int* __restrict__ slots,
                                          const int* __restrict__ positions, int n, int H, int KVH, float scale,
                                          int window, const float2* __restrict__ rt, int rope_dim, int style,
                                          int fuse, float* part_o, float2* part_ml, int* counters, int single_max,
                                          int split_keys, int spin, const float* sinks,
                                          const float* __restrict__ qnw, const float* __restrict__ knw, float eps) {
    // NST shared-memory stages per warp: 3 (a block has 192 keys in flight from its prologue on, so
    // a row of up to 192 keys costs one memory latency), 2 for 256-dim heads (shared memory)
    constexpr int LDS = D + 8, NT = 32 * FLD_NW, KD = D / 16, CPR = D / 8, NST = D <= 128 ? 3 : 2;
    constexpr int STAGE = 2 * FLD_KW * LDS;                       // halves of one stage (K then V)
    static_assert(FLD_NW * 16 * D * 4 <= FLD_NW * NST * STAGE * 2, "the warp merge reuses the stages");
    FL_DYN_SMEM(smem);
    u16* kvs = (u16*)smem;                                        // [NW][NST][K, V][KW][LDS]
    u16* qh = kvs + FLD_NW * NST * STAGE;                         // [16][LDS] q heads of the group
    u16* ql = qh + 16 * LDS;                                      // QS: their lo parts
    // clusters: the copies of the slices this block owns, pushed by the cluster's blocks (fl_decode_cluster);
    // over the q tile where its fragments live in registers, else after it
    float* recv = (float*)(D <= 128 ? qh : ql + 16 * LDS);
    static_assert(D > 128 || 2 * 16 * LDS * 2 >= (16 * D / 32) * 34 * 4, "recv must fit over the q tile");
    __shared__ __align__(16) u16 s_knew[D], s_vnew[D];
    __shared__ float s_m[FLD_NW][16], s_l[FLD_NW][16], s_f[FLD_NW][16], s_M[16], s_L[16];
    __shared__ float s_w[(FL_MAXC + 1) * 16];
    __shared__ float s_hn[17];                                    // head norms: 1 / rms of q heads 0..G-1, then k
    __shared__ int s_flag;

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int s = blockIdx.x, kh = blockIdx.y, t = blockIdx.z, G = H / KVH, S = gridDim.x;
    if (t >= n) return;
    const float* sk = sinks ? sinks + kh * G : nullptr;           // the group's heads' sink logits
    const int pos = positions[t], slot = slots[t];
    const int start = window > 0 ? max(0, pos - window + 1) : 0, nk = pos - start + 1;
    int chunk = nk, nsplit = 1;
    if (nk > single_max && S > 1) {
        chunk = max(split_keys, (((nk + S - 1) / S) + 63) & ~63);
        nsplit = (nk + chunk - 1) / chunk;
    }
    // in a cluster the blocks past the row's count stay (empty partials) while the cluster holds
    // any split: its blocks meet at cluster barriers; whole clusters past the count exit
    const uint2 place = cluster_place();
    const int C = (int)place.y, rank = (int)place.x, ncl = (nsplit + C - 1) / C;
    const bool clu = C > 1 && nsplit > 1;
    if (clu ? s / C >= ncl : s >= nsplit) return;                 // block-uniform (cluster-uniform)
    __shared__ __align__(8) unsigned long long s_bar;             // clusters: counts the copies pushed here
    if (clu && tid == 0) mbar_init(&s_bar);
    const int kb = start + s * chunk, ke = min(kb + chunk, pos + 1);   // keys [kb, ke)
    const int ntw = (ke - kb + FLD_KW - 1) / FLD_KW;
    const int cnt = w < ntw ? (ntw - w + FLD_NW - 1) / FLD_NW : 0;     // this warp's tiles: w, w + NW, ...
    const bool last = s == nsplit - 1;                            // holds key pos
    u16* mine = kvs + w * NST * STAGE;

    // this warp's i-th tile into stage i % NST; one commit group per call, empty or not, so that the
    // group count stays uniform for cp_wait
    auto issue = [&](int i) {
        if (i < cnt) {
            const int k0 = kb + (w + i * FLD_NW) * FLD_KW;
            u16* ks = mine + (i % NST) * STAGE;
            u16* vs = ks + FLD_KW * LDS;
            // lane j < KW reads key k0 + j's row from the block table, all at once; each copy below
            // takes its key's row by a shuffle (a table read per copy would wait on each other: the
            // copies' memory clobbers keep the compiler from reusing one)
            long long rb = 0;
            if (lane < FLD_KW && k0 + lane < ke)
                rb = (kv_row(bt, max_blocks, bs_log2, slot, k0 + lane) * KVH + kh) * D;
#pragma unroll
            for (int it = 0; it < FLD_KW * CPR / 32; ++it) {
                const int x = lane + 32 * it, key = x / CPR, c = x - key * CPR, kp = k0 + key;
                const bool ok = kp < ke;
                const long long off = __shfl_sync(0xffffffffu, rb, key) + c * 8;
                cp16z(ks + key * LDS + c * 8, kpool + off, ok);
                cp16z(vs + key * LDS + c * 8, vpool + off, ok);
            }
        }
        cp_commit();
    };
    if (!fuse) pdl_wait();
#pragma unroll
    for (int i = 0; i < NST; ++i) issue(i);
    // every q pair this thread rotates: the cos/sin first (a constant table: before pdl_wait), then
    // after it every q load at once (one memory latency, not one per pass)
    constexpr int QIT = 16 * (D / 2) / NT;
    const int half = rope_dim / 2;
    const float qsc = scale * FL_LOG2E;
    float2 qcs[QIT];
#pragma unroll
    for (int k = 0; k < QIT; ++k) {
        const int i = tid + k * NT, gg = i / (D / 2), p = i - gg * (D / 2);
        qcs[k] = make_float2(1.0f, 0.0f);
        if (fuse && p < half && gg < G) qcs[k] = rt[(long long)pos * half + p];
    }
    pdl_wait();
    float qva[QIT], qvb[QIT];
#pragma unroll
    for (int k = 0; k < QIT; ++k) {
        const int i = tid + k * NT, gg = i / (D / 2), p = i - gg * (D / 2);
        const int ia = p < half ? (style ? p : 2 * p) : rope_dim + 2 * (p - half);
        const int ib = p < half ? (style ? p + half : 2 * p + 1) : ia + 1;
        qva[k] = qvb[k] = 0.0f;
        if (gg < G) {
            const float* qr = q + ((long long)t * H + kh * G + gg) * D;
            qva[k] = qr[ia];
            qvb[k] = qr[ib];
        }
    }
    const bool knorm = knw && fuse && last;
    if (fuse && (qnw || knorm)) {                                 // block-uniform
        for (int x = w; x <= G; x += FLD_NW) {                    // warp-uniform
            if (x < G ? qnw != nullptr : knorm) {
                const float* row = x < G ? q + ((long long)t * H + kh * G + x) * D : kin + ((long long)t * KVH + kh) * D;
                const float r = head_rms_inv(row, D, eps);
                if (lane == 0) s_hn[x] = r;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int k = 0; k < QIT; ++k) {
        const int i = tid + k * NT, gg = i / (D / 2), p = i - gg * (D / 2);
        const int ia = p < half ? (style ? p : 2 * p) : rope_dim + 2 * (p - half);
        const int ib = p < half ? (style ? p + half : 2 * p + 1) : ia + 1;
        if (fuse && qnw && gg < G) {
            qva[k] = qva[k] * s_hn[gg] * qnw[ia];
            qvb[k] = qvb[k] * s_hn[gg] * qnw[ib];
        }
        const float2 r2 = rope_rot(qva[k], qvb[k], qcs[k].x, qcs[k].y);
        const float xa = r2.x * qsc, xb = r2.y * qsc;
        const u16 ha = f2h(xa), hb = f2h(xb);
        qh[gg * LDS + ia] = ha;
        qh[gg * LDS + ib] = hb;
        if (QS) {
            ql[gg * LDS + ia] = f2h(xa - h2f(ha));
            ql[gg * LDS + ib] = f2h(xb - h2f(hb));
        }
    }
    if (fuse && last) {
        // the new k (roped) and v as the cache holds them, to the pool and to shared memory
        const long long row = (kv_row(bt, max_blocks, bs_log2, slot, pos) * KVH + kh) * D;
        const float* kr = kin + ((long long)t * KVH + kh) * D;
        const float* vr = vin + ((long long)t * KVH + kh) * D;
        for (int p = tid; p < D / 2; p += NT) {
            int ia, ib;
            float c = 1.0f, sn = 0.0f;
            if (p < half) {
                ia = style ? p : 2 * p;
                ib = style ? p + half : 2 * p + 1;
                const float2 cs = rt[(long long)pos * half + p];
                c = cs.x;
                sn = cs.y;
            } else {
                ia = rope_dim + 2 * (p - half);
                ib = ia + 1;
            }
            const float ik = knorm ? s_hn[G] : 1.0f;
            const float a = head_normed(kr, ia, ik, knorm ? knw : nullptr), b = head_normed(kr, ib, ik, knorm ? knw : nullptr);
            const float2 r2 = rope_rot(a, b, c, sn);
            const u16 ka = f2h(r2.x), kb2 = f2h(r2.y), va = f2h(vr[ia]), vb = f2h(vr[ib]);
            s_knew[ia] = ka;
            s_knew[ib] = kb2;
            s_vnew[ia] = va;
            s_vnew[ib] = vb;
            kpool[row + ia] = ka;
            kpool[row + ib] = kb2;
            vpool[row + ia] = va;
            vpool[row + ib] = vb;
        }
    }
    __syncthreads();

    // the group's q fragments, in registers for the whole loop (256-dim heads: too many registers)
    constexpr bool HQ = D <= 128;
    u32 qa[HQ ? KD : 1][4], qla[HQ && QS ? KD : 1][4];
    if constexpr (HQ) {
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            fl_afrag(qa[kk], qh, LDS, 0, kk, lane);
            if constexpr (QS) fl_afrag(qla[kk], ql, LDS, 0, kk, lane);
        }
    }
    // clusters: this block's barrier is initialised and (D <= 128) the q tile read; the blocks wait
    // for each other only before their first push
    if (clu) cluster_arrive();
    float o[D / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    for (int i = 0; i < cnt; ++i) {                               // warp-uniform
        cp_wait<NST - 1>();
        __syncwarp();
        u16* ks = mine + (i % NST) * STAGE;
        u16* vs = ks + FLD_KW * LDS;
        const int k0 = kb + (w + i * FLD_NW) * FLD_KW;
        if (fuse && last && pos >= k0 && pos < k0 + FLD_KW) {     // the new key replaces the stale copy
            const int r = pos - k0;
            for (int x = lane; x < 2 * CPR; x += 32) {
                const bool isv = x >= CPR;
                const int c = isv ? x - CPR : x;
                *(uint4*)((isv ? vs : ks) + r * LDS + c * 8) = *(const uint4*)((isv ? s_vnew : s_knew) + c * 8);
            }
            __syncwarp();
        }
        // two accumulators per column tile (by the parity of the k-step; with QS the lo parts go
        // to the other one): half as long a chain of dependent mma, which is this loop's latency
        float sc[2][4], sx[2][4];
#pragma unroll
        for (int e = 0; e < 8; ++e) sc[e >> 2][e & 3] = sx[e >> 2][e & 3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            u32 a[4], b[4];
            float(&s0)[2][4] = kk & 1 ? sx : sc;
            float(&s1)[2][4] = kk & 1 ? sc : sx;
            fl_kfrag(b, ks, LDS, 0, kk, lane);
            if constexpr (HQ) {
                fl_mma(s0[0], qa[kk], b[0], b[1]);
                fl_mma(s0[1], qa[kk], b[2], b[3]);
                if constexpr (QS) {
                    fl_mma(s1[0], qla[kk], b[0], b[1]);
                    fl_mma(s1[1], qla[kk], b[2], b[3]);
                }
            } else {
                fl_afrag(a, qh, LDS, 0, kk, lane);
                fl_mma(s0[0], a, b[0], b[1]);
                fl_mma(s0[1], a, b[2], b[3]);
                if constexpr (QS) {
                    fl_afrag(a, ql, LDS, 0, kk, lane);
                    fl_mma(s1[0], a, b[0], b[1]);
                    fl_mma(s1[1], a, b[2], b[3]);
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) sc[e >> 2][e & 3] += sx[e >> 2][e & 3];
        if (k0 + FLD_KW > ke) {                                   // zero-filled keys past the range
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (k0 + nt * 8 + 2 * tq + (e & 1) >= ke) sc[nt][e] = -INFINITY;
        }
        u32 pf[1][4];
        fl_softmax_step<2, D / 8>(sc, m, l, o, pf);
        fl_pv16<D>(o, pf[0], vs, LDS, lane);
        __syncwarp();                                             // the stage is consumed: refill it
        issue(i + NST);
    }
    cp_wait<0>();
    pdl_trigger();                                                // every key read

    // merge the warps: each writes its rows' (m, l) and O to shared memory (over the stages)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    __syncthreads();                                              // every warp is done with its stages
    float* ow = (float*)smem;                                     // [NW][16][D]
    if (tq == 0) {
        s_m[w][g] = m[0];
        s_m[w][g + 8] = m[1];
        s_l[w][g] = l[0];
        s_l[w][g + 8] = l[1];
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        const int d = dt * 8 + 2 * tq;
        *(float2*)(ow + (w * 16 + g) * D + d) = make_float2(o[dt][0], o[dt][1]);
        *(float2*)(ow + (w * 16 + g + 8) * D + d) = make_float2(o[dt][2], o[dt][3]);
    }
    __syncthreads();
    if (clu) {                                                    // block-uniform
        // the flagged words after the counters (an even count: 8-byte aligned; flash.py plan_decode)
        u64* ll = (u64*)(counters + (long long)n * KVH * G * (D / 32));
        fl_decode_cluster<D>(ow, s_m, s_l, recv, &s_bar, w, lane, C, rank, s / C, S / C, ncl, G,
                             (long long)t * KVH + kh, out, o16, oq, od, t * H + kh * G, ll, counters, spin, sk);
        return;
    }
    if (tid < 16) {
        float M = -INFINITY, L = 0.0f;
#pragma unroll
        for (int ww = 0; ww < FLD_NW; ++ww) M = fmaxf(M, s_m[ww][tid]);
#pragma unroll
        for (int ww = 0; ww < FLD_NW; ++ww) {
            const float f = s_l[ww][tid] > 0.0f ? exp2f(s_m[ww][tid] - M) : 0.0f;   // a warp with no keys: 0
            s_f[ww][tid] = f;
            L += f * s_l[ww][tid];
        }
        s_M[tid] = M;
        s_L[tid] = L;
    }
    __syncthreads();
    const long long rowp = (long long)t * KVH + kh;               // (row, KV head): partials and counters
    const long long pG = (long long)G * D;
    for (int x = w; x < G * (D / 32); x += FLD_NW) {              // warp-uniform: head gg, dims 32 c..
        const int gg = x / (D / 32), c = x - gg * (D / 32), d = 32 * c + lane;
        float v = 0.0f;
#pragma unroll
        for (int ww = 0; ww < FLD_NW; ++ww) v += s_f[ww][gg] * ow[(ww * 16 + gg) * D + d];
        if (nsplit == 1) {
            const long long ob = ((long long)t * H + kh * G + gg) * D;
            fl_store32(v / fl_sink_sum(s_L[gg], s_M[gg], sk ? sk + gg : nullptr), c, lane, out ? out + ob : nullptr, o16 ? o16 + ob : nullptr,
                       oq ? oq + ob : nullptr, od ? od + (ob >> 5) : nullptr);
        } else {
            part_o[(rowp * S + s) * pG + (long long)gg * D + d] = v;
        }
    }
    if (nsplit == 1) return;
    if (tid < G) part_ml[(rowp * S + s) * G + tid] = make_float2(s_M[tid], s_L[tid]);

    // level 1: the last of each group of FL_MAXC splits combines the group; one group: the output
    const int ng = (nsplit + FL_MAXC - 1) / FL_MAXC, grp = s / FL_MAXC, maxg = (S + FL_MAXC - 1) / FL_MAXC;
    const int members = min(FL_MAXC, nsplit - grp * FL_MAXC);
    int* cnt_row = counters + rowp * (1 + maxg);                  // [0]: groups done, [1 + grp]: splits done
    if (!fl_arrive_last(cnt_row + 1 + grp, members, &s_flag)) return;
    const long long ob = ((long long)t * H + kh * G) * D;
    float* fo = out ? out + ob : nullptr;
    u16* f16 = o16 ? o16 + ob : nullptr;
    i8* fq = oq ? oq + ob : nullptr;
    float2* fd = od ? od + (ob >> 5) : nullptr;
    const long long src = rowp * S + (long long)grp * FL_MAXC;
    if (ng == 1) {
        fl_combine<D>(G, members, part_o + src * pG, pG, D, part_ml + src * G, G, 1, fo, f16, fq, fd, D, nullptr,
                      nullptr, s_w, sk, 1);
        return;
    }
    // level 2: group partials after the split partials: [n][KVH][maxg][G][D] and [n][KVH][maxg][G]
    float* g_o = part_o + (long long)n * KVH * S * pG + rowp * maxg * pG;
    float2* g_ml = part_ml + (long long)n * KVH * S * G + rowp * maxg * G;
    fl_combine<D>(G, members, part_o + src * pG, pG, D, part_ml + src * G, G, 1, nullptr, nullptr, nullptr, nullptr,
                  0, g_o + grp * pG, g_ml + grp * G, s_w);
    if (!fl_arrive_last(cnt_row, ng, &s_flag)) return;
    fl_combine<D>(G, ng, g_o, pG, D, g_ml, G, 1, fo, f16, fq, fd, D, nullptr, nullptr, s_w, sk, 1);
}

#define FL_DECODE_ARGS                                                                                            \
    const float *q, const float *kin, const float *vin, float *out, u16 *o16, i8 *oq, float2 *od, u16 *kpool,  \
        u16 *vpool, const int *bt, int max_blocks, int bs_log2, const int *slots, const int *positions, int n,  \
        int H, int KVH, float scale, int window, const float2 *rt, int rope_dim, int style, int fuse,          \
        float *part_o, float2 *part_ml, int *counters, int single_max, int split_keys, int spin,               \
        const float *sinks, const float *qnw, const float *knw, float eps
#define FL_DECODE_(D, QS)                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * FLD_NW) flash_decode_d##D##_q##QS(FL_DECODE_ARGS) {       \
        fl_decode<D, QS != 0>(q, kin, vin, out, o16, oq, od, kpool, vpool, bt, max_blocks, bs_log2, slots,       \
                              positions, n, H, KVH, scale, window, rt, rope_dim, style, fuse, part_o, part_ml,   \
                              counters, single_max, split_keys, spin, sinks, qnw, knw, eps);             \
    }
#define FL_DECODE(D, QS) FL_DECODE_(D, QS)

#ifdef FL_D
FL_DECODE(FL_D, FL_QS)
#else
FL_DECODE(64, 1)
FL_DECODE(128, 1)
FL_DECODE(256, 1)
FL_DECODE(64, 0)
FL_DECODE(128, 0)
FL_DECODE(256, 0)
#endif
