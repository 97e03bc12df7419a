// Runs attention.cu's kernels (attn_decode: decode rows with RoPE, the KV write and, given
// q_norm and k_norm, the per-head q/k norms folded in;
// attn_tile, attn_tile_v2: prompt rows) on the CPU through cuda_emu.h, for
// tests/kernels/test_attention_host.py: argv[1] is a directory holding params.txt (one "name value"
// per line: the kernel's name, launch shape and scalar arguments, as backends/cuda/ops.py attention
// launches it) and the input arrays as raw .bin files; the outputs are written back there (out,
// kpool, vpool after the launch), through emu_io.h.
#include "cuda_emu.h"

#include "attention.cu"
#include "emu_io.h"

int main(int argc, char** argv) {
    if (!open_dir(argc, argv, "attention_emu")) return 2;
    const std::string kernel = str("kernel");
    const int n = num("n"), H = num("H"), KVH = num("KVH"), D = num("D"), window = num("window");
    const int max_blocks = num("max_blocks"), bs_log2 = num("bs_log2");
    const float scale = num("scale");
    dim3 grid{(unsigned)num("gx"), (unsigned)num("gy"), 1}, block{(unsigned)num("threads"), 1, 1};
    auto q = load<float>("q");
    auto kpool = load<uint16_t>("kpool"), vpool = load<uint16_t>("vpool");
    auto bt = load<int>("bt"), slots = load<int>("slots"), positions = load<int>("positions");
    auto sinks = load_opt<float>("sinks");      // absent: no sinks (a null pointer)
    std::vector<float> out((size_t)n * H * D, NAN);
    if (kernel == "attn_decode") {
        auto kin = load<float>("kin"), vin = load<float>("vin");
        auto rt = load<float2>("rt");
        auto qnw = load_opt<float>("q_norm"), knw = load_opt<float>("k_norm");   // absent: no head norm
        const int rope_dim = num("rope_dim"), style = num("style");
        const float eps = str("eps").empty() ? 0.0f : (float)num("eps");
        emu::launch(grid, block, 0, [&] {
            attn_decode(q.data(), out.data(), kpool.data(), vpool.data(), slots.data(), positions.data(), bt.data(),
                        max_blocks, bs_log2, H, KVH, D, scale, window, n, nullptr, nullptr, nullptr, kin.data(),
                        vin.data(), rope_dim, style, 1, rt.data(), ptr(sinks), ptr(qnw), ptr(knw), eps);
        });
    } else if (kernel == "attn_tile" || kernel == "attn_tile_v2") {
        auto fn = kernel == "attn_tile" ? attn_tile : attn_tile_v2;
        emu::launch(grid, block, (size_t)num("smem"), [&] {
            fn(q.data(), out.data(), kpool.data(), vpool.data(), slots.data(), positions.data(), bt.data(), max_blocks,
               bs_log2, H, KVH, D, scale, window, n, nullptr, ptr(sinks));
        });
    } else {
        fail("unknown kernel", kernel);
    }
    save("out", out);
    save("kpool", kpool);
    save("vpool", vpool);
    return 0;
}
