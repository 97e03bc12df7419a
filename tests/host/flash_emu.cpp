// Runs the flash attention kernels (kernels/flash_prefill.cu, flash_decode.cu) on the CPU through
// cuda_emu.h, for tests/kernels/test_flash_host.py: argv[1] is a directory holding params.txt (one
// "name value" per line: the kernel's name, launch shape and scalar arguments, as
// backends/cuda/flash.py plans them) and the input arrays as raw .bin files; the outputs are
// written back there (out, o16, oq, od, kpool, vpool after the launch, counters).
#include "cuda_emu.h"

#include <fstream>
#include <map>
#include <string>

#include "flash_prefill.cu"
#include "flash_decode.cu"

typedef void (*PrefillFn)(FL_PREFILL_ARGS);
typedef void (*DecodeFn)(FL_DECODE_ARGS);

static std::map<std::string, std::string> params;
static std::string dir;

static double num(const char* k) {
    auto it = params.find(k);
    if (it == params.end()) {
        std::fprintf(stderr, "flash_emu: missing parameter %s\n", k);
        std::exit(2);
    }
    return std::stod(it->second);
}

template <class T> static std::vector<T> load(const char* name, size_t min_count = 0) {
    std::ifstream f(dir + "/" + name + ".bin", std::ios::binary);
    std::vector<T> v;
    if (f) {
        f.seekg(0, std::ios::end);
        size_t bytes = f.tellg();
        f.seekg(0);
        v.resize(bytes / sizeof(T));
        f.read((char*)v.data(), bytes);
    }
    if (v.size() < min_count) v.resize(min_count);
    return v;
}

template <class T> static void save(const char* name, const std::vector<T>& v) {
    std::ofstream f(dir + "/" + name + ".bin", std::ios::binary);
    f.write((const char*)v.data(), v.size() * sizeof(T));
}

template <class T> static T* ptr(std::vector<T>& v) { return v.empty() ? nullptr : v.data(); }

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    dir = argv[1];
    std::ifstream pf(dir + "/params.txt");
    std::string k, v;
    while (pf >> k >> v) params[k] = v;
    const std::string kernel = params["kernel"];
    const int n = num("n"), H = num("H"), D = num("D");
    dim3 grid{(unsigned)num("gx"), (unsigned)num("gy"), (unsigned)num("gz")}, block{(unsigned)num("threads"), 1, 1};
    const size_t smem = (size_t)num("smem");
    auto q = load<float>("q");
    auto kpool = load<uint16_t>("kpool"), vpool = load<uint16_t>("vpool");
    auto bt = load<int>("bt"), slots = load<int>("slots"), positions = load<int>("positions");
    auto part_o = load<float>("part_o", (size_t)num("part_floats"));
    auto part_ml = load<float2>("part_ml", (size_t)num("ml_count"));
    auto counters = load<int>("counters", (size_t)num("counters_count"));
    auto sinks = load<float>("sinks");      // absent: no sinks (a null pointer)
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
        auto kin = load<float>("kin"), vin = load<float>("vin");
        auto rt = load<float2>("rt");
        const int rope_dim = num("rope_dim"), style = num("style"), fuse = num("fuse");
        const int single_max = num("single_max"), split_keys = num("split_keys");
        emu::launch(grid, block, smem, [&] {
            fn(q.data(), ptr(kin), ptr(vin), out.data(), ptr(o16), ptr(oq), ptr(od), kpool.data(), vpool.data(),
               bt.data(), max_blocks, bs_log2, slots.data(), positions.data(), n, H, KVH, scale, window, ptr(rt),
               rope_dim, style, fuse, ptr(part_o), ptr(part_ml), ptr(counters), single_max, split_keys,
               0,    // spin: the host's blocks are clusters of one, which never wait for each other
               ptr(sinks));
        });
    } else {
        std::fprintf(stderr, "flash_emu: unknown kernel %s\n", kernel.c_str());
        return 2;
    }
    save("out", out);
    save("o16", o16);
    save("oq", oq);
    save("od", od);
    save("kpool_out", kpool);
    save("vpool_out", vpool);
    save("counters_out", counters);
    return 0;
}
