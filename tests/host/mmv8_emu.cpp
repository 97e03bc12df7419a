// Runs one launch of kernels/mmv8.cu (mmv8_nb1, ffn8_nb1 or an experts' moe8 kernel, after mmv8_q8
// quantized its input) on the CPU through cuda_emu.h, for tests/kernels/test_mmv8_host.py: argv[1] is
// a directory (emu_io.h) whose params.txt names the kernel (`mmv8`, `ffn8`, `moe8_gate_up`,
// `moe8_gemv` or `moe8_down_combine`), the launch's scalars and its grid (grid_x,
// nb: grid.y), and whose .bin files hold the weights in their device layouts, the input, the norm
// weight (nw, absent: no norm) and the outputs as the test poisoned them. Built once per kind with
// the loader's defines (catalog.mmv8_options), which fix the block size.
#include "cuda_emu.h"

static inline unsigned long long __shfl_xor_sync(unsigned, unsigned long long v, int m) {
    unsigned long long all[32];
    emu::gather(v, all, "shfl_xor64");
    return all[emu::lane() ^ m];
}
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    unsigned long long o = *p;
    if (v > o) *p = v;
    return o;
}

#include "mmv8.cu"
#include "emu_io.h"

int main(int argc, char** argv) {
    if (!open_dir(argc, argv, "mmv8_emu")) return 2;
    const std::string kernel = str("kernel");
    auto x = load<float>("x");
    auto nw = load_opt<float>("nw");
    const int K = inum("K"), xs = inum("xs"), nb = inum("nb"), wpr = inum("wpr");
    const float eps = (float)num("eps");
    const size_t smem = (size_t)mmv8_kpad(K) + (8 * (size_t)(K / 32) + 15) / 16 * 16;   // catalog.mmv8_smem
    const long long xqs = (long long)smem;                                            // ops._mmv8_quantize
    std::vector<u8> xq((size_t)nb * xqs, 0xA5);      // poisoned: what the GEMV reads must be written
    emu::launch(dim3{(unsigned)((K / 4 + 255) / 256), (unsigned)nb, 1}, dim3{256, 1, 1}, 0,
                [&] { mmv8_q8(x.data(), xs, K, ptr(nw), eps, xq.data(), xqs); });
    dim3 grid{(unsigned)inum("grid_x"), (unsigned)nb, 1}, block{MMV8_WARPS * 32, 1, 1};
    // mmv8 and ffn8: the warps' Q4_K rings after the staged row (catalog.mmv8_ring_smem)
    const size_t ring = (size_t)MMV8_WARPS * (kernel == "ffn8" ? mmv8_ring_bytes<2>() : mmv8_ring_bytes<1>());
#if !defined(MMV8_KIND) || MMV8_KIND == 1
    if (kernel == "mmv8") {
        const int S = inum("segments"), acc = inum("accumulate");
        std::vector<u8> w[3];
        std::vector<float> b[3], y[3];
        long long rb[3] = {0, 0, 0};
        int n[3] = {0, 0, 0}, qt[3] = {0, 0, 0}, ys[3] = {0, 0, 0};
        for (int s = 0; s < S; ++s) {
            std::string i = std::to_string(s);
            w[s] = load<u8>(("w" + i).c_str());
            b[s] = load_opt<float>(("b" + i).c_str());
            y[s] = load<float>(("y" + i).c_str());
            rb[s] = inum(("rb" + i).c_str());
            n[s] = inum(("n" + i).c_str());
            qt[s] = inum(("qt" + i).c_str());
            ys[s] = inum(("ys" + i).c_str());
        }
        auto amax = load_opt<unsigned long long>("amax");
        emu::launch(grid, block, smem + ring, [&] {
            mmv8_nb1(ptr(w[0]), rb[0], n[0], qt[0], ptr(b[0]), ptr(y[0]), ys[0],
                     ptr(w[1]), rb[1], n[1], qt[1], ptr(b[1]), ptr(y[1]), ys[1],
                     ptr(w[2]), rb[2], n[2], qt[2], ptr(b[2]), ptr(y[2]), ys[2],
                     K, xq.data(), xqs, wpr, acc, ptr(amax));
        });
        for (int s = 0; s < S; ++s) save(("y" + std::to_string(s)).c_str(), y[s]);
        if (!amax.empty()) save("amax", amax);
        return 0;
    }
#endif
#if !defined(MMV8_KIND) || MMV8_KIND == 2
    if (kernel == "ffn8") {
        auto wg = load<u8>("wg");
        auto wu = load<u8>("wu");
        auto a = load<float>("a");
        const long long rb = inum("rb");
        const int N = inum("N"), qt = inum("qt"), act = inum("act"), as = inum("as");
        emu::launch(grid, block, smem + ring, [&] {
            ffn8_nb1(wg.data(), wu.data(), rb, N, K, qt, xq.data(), xqs, act, a.data(), as, wpr);
        });
        save("a", a);
        return 0;
    }
#endif
#if !defined(MMV8_KIND) || MMV8_KIND == 3
    if (kernel == "moe8_gate_up" || kernel == "moe8_gemv") {     // nb: the input rows; grid.y: the pairs
        auto wg = load<u8>("wg");
        auto wu = load_opt<u8>("wu");
        auto ids = load<int>("ids");
        auto bg = load_opt<float>("bg");
        auto bu = load_opt<float>("bu");
        auto y = load<float>("y");
        const long long rb = inum("rb"), eb = inum("eb");
        const int E = inum("E"), N = inum("N"), qt = inum("qt"), xdiv = inum("xdiv"), act = inum("act"),
                  ys = inum("ys"), pairs = inum("pairs");
        emu::launch(dim3{(unsigned)inum("grid_x"), (unsigned)pairs, 1}, block, smem, [&] {
            if (kernel == "moe8_gate_up")
                moe8_gate_up_nb1(wg.data(), ptr(wu), rb, eb, E, N, K, qt, ids.data(), xdiv, xq.data(), xqs, act,
                                 ptr(bg), ptr(bu), y.data(), ys);
            else
                moe8_gemv_nb1(wg.data(), rb, eb, E, N, K, qt, ids.data(), xdiv, xq.data(), xqs, ptr(bg), y.data(),
                              ys);
        });
        save("y", y);
        return 0;
    }
    if (kernel == "moe8_down_combine") {     // nb: the pairs' rows (tokens x top); grid.y: the tokens
        auto wd = load<u8>("wd");
        auto ids = load<int>("ids");
        auto bd = load_opt<float>("bd");
        auto w = load<float>("w");
        auto xr = load<float>("xr");
        const long long rb = inum("rb"), eb = inum("eb");
        const int E = inum("E"), N = inum("N"), qt = inum("qt"), top = inum("top"), xrs = inum("xrs"),
                  T = inum("T");
        emu::launch(dim3{(unsigned)inum("grid_x"), (unsigned)T, 1}, block, (size_t)top * smem, [&] {
            moe8_down_combine_nb1(wd.data(), rb, eb, E, N, K, qt, ids.data(), top, xq.data(), xqs, ptr(bd), w.data(),
                                  xr.data(), xrs, wpr);
        });
        save("xr", xr);
        return 0;
    }
#endif
    fail("unknown kernel", kernel);
}
