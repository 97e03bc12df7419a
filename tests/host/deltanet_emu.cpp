// Runs one launch of a kernels/deltanet.cu kernel on the CPU through cuda_emu.h, for
// tests/kernels/test_deltanet_host.py: argv[1] is a directory holding params.txt (one "name value" per
// line: `kernel` is conv or delta, the rest its scalar arguments; for delta, `entry` names the kernel:
// dn_delta or one of its dn_delta_k<dk> instances, `chunk_min` the chunked rule's argument, and
// `chunk`, where given, the chunked kernel (dn_chunk_k<dk>) launched before it, as the prompt step
// launches them) and the input arrays as raw .bin files. The arrays a launch writes are read as the
// test poisoned them and written back as <name>_after.bin. Grids and blocks are the launchers' (backends/cuda/ops.py dn_conv, dn_delta).
#include "cuda_emu.h"

#include "deltanet.cu"
#include "emu_io.h"

int main(int argc, char** argv) {
    if (!open_dir(argc, argv, "deltanet_emu")) return 2;
    const std::string kernel = str("kernel");
    auto slots = load<int>("slots");
    auto pos = load<int>("pos");
    const int n = num("n"), scratch = num("scratch");
    if (kernel == "conv") {
        auto x = load<float>("x");
        auto w = load<float>("w");
        auto st = load<float>("conv_state");
        auto out = load<float>("out");
        const int C = num("C"), taps = num("taps"), xs = num("xs"), os = num("os");
        dim3 grid{(unsigned)((C + DN_CONV_THREADS - 1) / DN_CONV_THREADS), (unsigned)n, 1}, block{DN_CONV_THREADS, 1, 1};
        emu::launch(grid, block, 0, [&] {
            dn_conv(x.data(), xs, w.data(), taps, st.data(), slots.data(), pos.data(), scratch, n, C, out.data(), os);
        });
        save("conv_state", st);
        save("out", out);
    } else if (kernel == "delta") {
        auto cv = load<float>("cv");
        auto alpha = load<float>("alpha");
        auto beta = load<float>("beta");
        auto z = load<float>("z");
        auto a_coef = load<float>("a_coef");
        auto dt_bias = load<float>("dt_bias");
        auto out_norm = load<float>("out_norm");
        auto st = load<float>("state");
        auto out = load<float>("out");
        const int nk = num("nk"), dk = num("dk"), nv = num("nv"), dv = num("dv");
        const int threads = num("threads");
        const std::string entry = str("entry");
        const std::string chunk = str("chunk");
        using Delta = decltype(&dn_delta);
        Delta fn = entry == "dn_delta" ? &dn_delta : nullptr, chunk_fn = nullptr;
#define DN_DELTA_K_ENTRY(K)                                        \
        if (entry == "dn_delta_k" #K) fn = &dn_delta_k##K;          \
        if (chunk == "dn_chunk_k" #K) chunk_fn = &dn_chunk_k##K;
        DN_DELTA_K_LIST(DN_DELTA_K_ENTRY)
        if (fn == nullptr) fail("unknown delta kernel", entry);
        if (!chunk.empty() && chunk_fn == nullptr) fail("unknown chunk kernel", chunk);
        dim3 grid{(unsigned)nv, (unsigned)n, 1}, block{(unsigned)threads, 1, 1};
        dim3 chunk_grid{(unsigned)nv, (unsigned)((n + DN_CHUNK - 1) / DN_CHUNK), 1};
        dim3 chunk_block{(unsigned)((dv + 15) / 16 * 32), 1, 1};
        for (Delta f : {chunk_fn, fn}) {
            if (f == nullptr) continue;
            emu::launch(f == chunk_fn ? chunk_grid : grid, f == chunk_fn ? chunk_block : block, 0, [&] {
                f(cv.data(), num("cvs"), alpha.data(), beta.data(), num("abs"), z.data(), num("zs"), a_coef.data(),
                  dt_bias.data(), out_norm.data(), st.data(), slots.data(), pos.data(), scratch, n, nk, dk, nv, dv,
                  (float)num("eps"), out.data(), num("os"), num("chunk_min"));
            });
        }
        save("state", st);
        save("out", out);
    } else {
        fail("unknown kernel", kernel);
    }
    return 0;
}
