// Runs one launch of a kernels/moe.cu kernel on the CPU through cuda_emu.h, for tests/kernels/test_moe_host.py:
// argv[1] is a directory holding params.txt (one "name value" per line: `kernel` is topk, combine, shared_add,
// gate_up_<type> or gemv_<type>, the rest its scalar arguments) and the input arrays as raw .bin
// files. The output arrays are read from their .bin files as the test poisoned them and written
// back as <name>_after.bin. Grids and blocks are the launchers' (backends/cuda/ops.py moe_*).
#include "cuda_emu.h"

#include "moe.cu"
#include "emu_io.h"

typedef void (*GateUpFn)(const u8*, const u8*, long long, long long, int, int, int, const int*, int, const float*,
                         int, float*, int, int, const float*, const float*);
typedef void (*GemvFn)(const u8*, long long, long long, int, int, int, const int*, const float*, int, int, float*,
                       int, const float*);

#define TYPES(X) X(f32) X(f16) X(bf16) X(q4_0) X(q4_1) X(q5_0) X(q5_1) X(q8_0) X(q4_k) X(q5_k) X(q6_k) \
    X(q2_k) X(q3_k) X(iq4_nl) X(iq4_xs) X(mxfp4) X(iq2_xxs) X(iq2_xs) X(iq2_s) X(iq3_xxs) X(iq3_s)

int main(int argc, char** argv) {
    if (!open_dir(argc, argv, "moe_emu")) return 2;
    const std::string kernel = str("kernel");
#define GATE_UP(t) {"gate_up_" #t, moe_gate_up_##t},
#define GEMV(t) {"gemv_" #t, moe_gemv_##t},
    std::map<std::string, GateUpFn> gate_up = {TYPES(GATE_UP)};
    std::map<std::string, GemvFn> gemv = {TYPES(GEMV)};
    if (kernel == "topk") {
        auto logits = load<float>("logits");
        auto ids = load<int>("ids");
        auto w = load<float>("w");
        const int T = inum("T"), E = inum("E"), top = inum("k"), ls = inum("ls"), renorm = inum("renorm");
        dim3 grid{(unsigned)((T + MOE_TOPK_ROWS - 1) / MOE_TOPK_ROWS), 1, 1}, block{MOE_TOPK_ROWS * 32, 1, 1};
        emu::launch(grid, block, 0, [&] { moe_topk(logits.data(), ls, T, E, top, renorm, ids.data(), w.data()); });
        save("ids", ids);
        save("w", w);
    } else if (kernel == "combine") {
        auto x = load<float>("x");
        auto y = load<float>("y");
        auto w = load<float>("w");
        const int T = inum("T"), top = inum("k"), H = inum("H"), xs = inum("xs"), ys = inum("ys");
        dim3 grid{(unsigned)T, (unsigned)((H + MOE_COMBINE_THREADS - 1) / MOE_COMBINE_THREADS), 1};
        dim3 block{MOE_COMBINE_THREADS, 1, 1};
        emu::launch(grid, block, 0, [&] { moe_combine(x.data(), xs, y.data(), ys, w.data(), top, H); });
        save("x", x);
    } else if (kernel == "shared_add") {
        auto x = load<float>("x");
        auto y = load<float>("y");
        auto sg = load<float>("s");
        const int T = inum("T"), H = inum("H"), xs = inum("xs"), ys = inum("ys");
        dim3 grid{(unsigned)T, (unsigned)((H + MOE_COMBINE_THREADS - 1) / MOE_COMBINE_THREADS), 1};
        dim3 block{MOE_COMBINE_THREADS, 1, 1};
        emu::launch(grid, block, 0, [&] { moe_shared_add(x.data(), xs, y.data(), ys, sg.data(), H); });
        save("x", x);
    } else if (gate_up.count(kernel) || gemv.count(kernel)) {
        auto ids = load<int>("ids");
        auto x = load<float>("x");
        auto out = load<float>("out");
        const long long rb = inum("row_bytes"), eb = inum("expert_bytes");
        const int E = inum("E"), N = inum("N"), K = inum("K"), pairs = inum("pairs"), xs = inum("xs"), os = inum("os");
        dim3 grid{(unsigned)pairs, (unsigned)((N + MOE_WARPS - 1) / MOE_WARPS), 1}, block{MOE_WARPS * 32, 1, 1};
        if (gate_up.count(kernel)) {
            auto wg = load<u8>("wg");
            auto wu = load<u8>("wu");
            auto bg = load_opt<float>("bg"), bu = load_opt<float>("bu");     // the experts' biases, if any
            const int top = inum("k"), act = inum("act");
            GateUpFn fn = gate_up[kernel];
            emu::launch(grid, block, 0, [&] {
                fn(wg.data(), wu.data(), rb, eb, E, N, K, ids.data(), top, x.data(), xs, out.data(), os, act,
                   ptr(bg), ptr(bu));
            });
        } else {
            auto w = load<u8>("w");
            auto b = load_opt<float>("b");
            const int xdiv = inum("xdiv");
            GemvFn fn = gemv[kernel];
            emu::launch(grid, block, 0, [&] {
                fn(w.data(), rb, eb, E, N, K, ids.data(), x.data(), xs, xdiv, out.data(), os, ptr(b));
            });
        }
        save("out", out);
    } else {
        fail("unknown kernel", kernel);
    }
    return 0;
}
