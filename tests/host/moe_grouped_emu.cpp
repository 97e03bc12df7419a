// Runs the grouped experts' chain on the CPU, as backends/cuda/experts.py GroupedExperts launches it,
// for tests/kernels/test_moe_grouped_host.py: moe.cu's moe_bucket_count and moe_bucket_fill, mmq.cu's
// mmq_prep of the rows, mmq_moe_bnBN mode 1 (gate and up), mmq_prep of its output, mmq_moe_bnBN mode 0
// (down, into the pairs' rows), and moe.cu's moe_combine into the residual. The fibers, barriers and
// tensor-core instructions are mmq_emu.cpp's (the exact-sum accumulation model). argv[1]: a
// directory (tests/host/emu_io.h) with params T k E H F bn TB qt_gu qt_d act rb_gu rb_d and the arrays
// h, x, ids, w, wg, wu, wd (bg, bu, bd: optional biases); written back: cnt, list, tiles, a, y, x.
// Built with -DMMQ_A8=1: the 8-bit variant's prep and tiles (mmq8_prep, mmq8_moe_bnBN).
#define MMQ_EMU_NO_MAIN
#include "mmq_emu.cpp"

// moe.cu's routing kernel shuffles by source lane (not run here, compiled with the rest)
template <class T> static inline T __shfl_sync(unsigned, T v, int src) {
    unsigned long long w = 0;
    std::memcpy(&w, &v, sizeof(T));
    auto buf = emu::publish(&w, 1);
    T r;
    std::memcpy(&r, &buf[src & 31][0], sizeof(T));
    return r;
}

#include "moe.cu"
#include "emu_io.h"

template <int BN> static void grouped(const u8* W0, const u8* W1, long long rb, long long eb, int n, int qt,
                                      const float* b0, const float* b1, float* y, int ys, int K, const u8* xp,
                                      long long xps, const float* inv, const int* tiles, const int* list, int k,
                                      int TB, int mode, int act) {
    const int rows = mode ? MMQ_BM / 2 : MMQ_BM;
    launch((unsigned)(((n + rows - 1) / rows) * TB), MMQ_THREADS, mmq_smem_bytes<BN>(), [&] {
        if constexpr (BN == 8) MMQ_NAME(moe_bn8)(W0, W1, rb, eb, n, qt, b0, b1, y, ys, K, xp, xps, inv, tiles, list, k, TB, mode, act);
        if constexpr (BN == 16) MMQ_NAME(moe_bn16)(W0, W1, rb, eb, n, qt, b0, b1, y, ys, K, xp, xps, inv, tiles, list, k, TB, mode, act);
        if constexpr (BN == 32) MMQ_NAME(moe_bn32)(W0, W1, rb, eb, n, qt, b0, b1, y, ys, K, xp, xps, inv, tiles, list, k, TB, mode, act);
        if constexpr (BN == 64) MMQ_NAME(moe_bn64)(W0, W1, rb, eb, n, qt, b0, b1, y, ys, K, xp, xps, inv, tiles, list, k, TB, mode, act);
    });
}

int main(int argc, char** argv) {
    if (!open_dir(argc, argv, "moe_grouped_emu")) return 2;
    const int T = inum("T"), k = inum("k"), E = inum("E"), H = inum("H"), F = inum("F"), bn = inum("bn"), TB = inum("TB");
    const int qt_gu = inum("qt_gu"), qt_d = inum("qt_d"), act = inum("act");
    const long long rb_gu = inum("rb_gu"), rb_d = inum("rb_d");
    const int P = T * k, S = TB * bn;
    auto h = load<float>("h");
    auto x = load<float>("x");
    auto ids = load<int>("ids");
    auto w = load<float>("w");
    auto wg = load<u8>("wg");
    auto wu = load<u8>("wu");
    auto wd = load<u8>("wd");
    auto bg = load_opt<float>("bg"), bu = load_opt<float>("bu"), bd = load_opt<float>("bd");
    for (auto* v : {&wg, &wu, &wd}) v->resize(v->size() + 64, 0xFF);   // nothing past the stack may be read

    // the lists, poisoned: what the bucketing leaves unwritten stays so
    std::vector<int> cnt(E, -7), list(S, -7), tiles(3 * TB, -7);
    launch(E, MOE_BUCKET_THREADS, 0, [&] { moe_bucket_count(ids.data(), P, cnt.data()); });
    launch(E, MOE_BUCKET_THREADS, 0, [&] {
        moe_bucket_fill(ids.data(), P, E, bn, cnt.data(), list.data(), tiles.data(), TB);
    });

    // gate and up: the rows' prep records, gathered per slot
    const long long xps_h = (long long)((H + MMQ_KC - 1) / MMQ_KC) * MMQ_REC, xps_a = (long long)((F + MMQ_KC - 1) / MMQ_KC) * MMQ_REC;
    std::vector<u8> rec_h((size_t)T * xps_h, 0xFF), rec_a((size_t)S * xps_a, 0xFF);
    std::vector<float> inv_h(T, NAN), inv_a(S, NAN), a((size_t)S * F, NAN), y((size_t)P * H, NAN);
    launch(T, MMQ_PREP_THREADS, 0, [&] { MMQ_NAME(prep)(h.data(), H, T, H, nullptr, 0.0f, rec_h.data(), xps_h, inv_h.data()); });
    auto run = [&](const u8* W0, const u8* W1, long long rb, int n, int qt, const float* b0, const float* b1, float* out,
                   int ys, int K, const u8* xp, long long xps, const float* inv, int mode) {
        const long long eb = (long long)n * rb;
        switch (bn) {
            case 8: grouped<8>(W0, W1, rb, eb, n, qt, b0, b1, out, ys, K, xp, xps, inv, tiles.data(), list.data(), k, TB, mode, act); break;
            case 16: grouped<16>(W0, W1, rb, eb, n, qt, b0, b1, out, ys, K, xp, xps, inv, tiles.data(), list.data(), k, TB, mode, act); break;
            case 32: grouped<32>(W0, W1, rb, eb, n, qt, b0, b1, out, ys, K, xp, xps, inv, tiles.data(), list.data(), k, TB, mode, act); break;
            case 64: grouped<64>(W0, W1, rb, eb, n, qt, b0, b1, out, ys, K, xp, xps, inv, tiles.data(), list.data(), k, TB, mode, act); break;
            default: fail("tile height", std::to_string(bn));
        }
    };
    run(wg.data(), wu.data(), rb_gu, F, qt_gu, ptr(bg), ptr(bu), a.data(), F, H, rec_h.data(), xps_h, inv_h.data(), 1);
    // down: the slots' gated rows (padding and unused slots hold the poison: their records are never read)
    launch(S, MMQ_PREP_THREADS, 0, [&] { MMQ_NAME(prep)(a.data(), F, S, F, nullptr, 0.0f, rec_a.data(), xps_a, inv_a.data()); });
    run(wd.data(), nullptr, rb_d, H, qt_d, ptr(bd), nullptr, y.data(), H, F, rec_a.data(), xps_a, inv_a.data(), 0);
    launch(T, MOE_COMBINE_THREADS, 0, [&] { moe_combine(x.data(), H, y.data(), H, w.data(), k, H); },
           (unsigned)((H + MOE_COMBINE_THREADS - 1) / MOE_COMBINE_THREADS));
    save("cnt", cnt);
    save("list", list);
    save("tiles", tiles);
    save("a", a);
    save("y", y);
    save("x", x);
    return 0;
}
