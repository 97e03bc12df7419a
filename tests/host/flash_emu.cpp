// Runs the flash attention kernels (kernels/flash_prefill.cu, flash_decode.cu) on the CPU through
// cuda_emu.h, for tests/kernels/test_flash_host.py: argv[1] is a directory holding params.txt (one
// "name value" per line: the kernel's name, launch shape and scalar arguments, as
// backends/cuda/flash.py plans them) and the input arrays as raw .bin files (q_norm and k_norm: a
// decode launch's head norms, absent: none); the outputs are
// written back there (out, o16, oq, od, kpool, vpool after the launch, counters), through emu_io.h.
#include "cuda_emu.h"

#include "flash_prefill.cu"
#include "flash_decode.cu"
#include "emu_io.h"

typedef void (*PrefillFn)(FL_PREFILL_ARGS);
typedef void (*DecodeFn)(FL_DECODE_ARGS);

int main(int argc, char** argv) {
    if (!open_dir(argc, argv, "flash_emu")) return 2;
    const std::string kernel = str("kernel");
    const int n = num("n"), H = num("H"), D = num("D");
    dim3 grid{(unsigned)num("gx"), (unsigned)num("gy"), (unsigned)num("gz")}, block{(unsigned)num("threads"), 1, 1};
    const size_t smem = (size_t)num("smem");
    auto q = load<float>("q");
    auto kpool = load<uint16_t>("kpool"), vpool = load<uint16_t>("vpool");
    auto bt = load<int>("bt"), slots = load<int>("slots"), positions = load<int>("positions");
    auto part_o = load_opt<float>("part_o", (size_t)num("part_floats"));
    auto part_ml = load_opt<float2>("part_ml", (size_t)num("ml_count"));
    auto counters = load_opt<int>("counters", (size_t)num("counters_count"));
    auto sinks = load_opt<float>("sinks");      // absent: no sinks (a null pointer)
    std::vector<float> out((size_t)n * H * D, NAN);
    std::vector<uint16_t> o16(num("use_o16") ? (size_t)n * H * D : 0, 0x7E00);
    std::vector<signed char> oq(num("use_oq") ? (size_t)n * H * D : 0, 0);
    std::vector<float2> od(num("use_oq") ? (size_t)n * H * D / 32 : 0, float2{NAN, NAN});

#define PRE(name) {#name, name}
    std::map<std::string, PrefillFn> pre = {
        PRE(flash_prefill_d64_w4_m1_q0), PRE(flash_prefill_d128_w4_m1_q0), PRE(flash_prefill_d256_w4_m1_q0),
        PRE(flash_prefill_d64_w4_m1_q1), PRE(flash_prefill_d128_w4_m1_q1), PRE(flash_prefill_d256_w4_m1_q1),
        PRE(flash_prefill_d128_w8_m1_q0), PRE(flash_prefill_d64_w4_m2_q0), PRE(flash_prefill_d128_w4_m2_q0),
        PRE(flash_prefill_d64_w4_m2_q1), PRE(flash_prefill_d128_w4_m2_q1)};
    std::map<std::string, DecodeFn> dec = {
        {"flash_decode_d64_q1", flash_decode_d64_q1},   {"flash_decode_d128_q1", flash_decode_d128_q1},
        {"flash_decode_d256_q1", flash_decode_d256_q1}, {"flash_decode_d64_q0", flash_decode_d64_q0},
        {"flash_decode_d128_q0", flash_decode_d128_q0}, {"flash_decode_d256_q0", flash_decode_d256_q0}};
    const int max_blocks = num("max_blocks"), bs_log2 = num("bs_log2"), KVH = num("KVH"), window = num("window");
    const float scale = num("scale");
    if (pre.count(kernel)) {
        PrefillFn fn = pre[kernel];
        const int msk = num("min_split_keys");
        emu::launch(grid, block, smem, [&] {
            fn(q.data(), out.data(), ptr(o16), kpool.data(), vpool.data(), bt.data(), max_blocks, bs_log2,
               slots.data(), positions.data(), n, H, KVH, scale, window, ptr(part_o), ptr(part_ml), ptr(counters), msk,
               ptr(sinks));
        });
    } else if (dec.count(kernel)) {
        DecodeFn fn = dec[kernel];
        auto kin = load_opt<float>("kin"), vin = load_opt<float>("vin");   // absent: unfused
        auto rt = load_opt<float2>("rt");
        auto qnw = load_opt<float>("q_norm"), knw = load_opt<float>("k_norm");   // absent: no head norm
        const float eps = str("eps").empty() ? 0.0f : (float)num("eps");
        const int rope_dim = num("rope_dim"), style = num("style"), fuse = num("fuse");
        const int single_max = num("single_max"), split_keys = num("split_keys");
        emu::launch(grid, block, smem, [&] {
            fn(q.data(), ptr(kin), ptr(vin), out.data(), ptr(o16), ptr(oq), ptr(od), kpool.data(), vpool.data(),
               bt.data(), max_blocks, bs_log2, slots.data(), positions.data(), n, H, KVH, scale, window, ptr(rt),
               rope_dim, style, fuse, ptr(part_o), ptr(part_ml), ptr(counters), single_max, split_keys,
               0,    // spin: the host's blocks are clusters of one, which never wait for each other
               ptr(sinks), ptr(qnw), ptr(knw), eps);
        });
    } else {
        fail("unknown kernel", kernel);
    }
    save("out", out);
    save("o16", o16);
    save("oq", oq);
    save("od", od);
    save("kpool", kpool);
    save("vpool", vpool);
    save("counters", counters);
    return 0;
}
