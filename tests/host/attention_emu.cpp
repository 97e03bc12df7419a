// Runs attention.cu's kernels (attn_decode: decode rows with RoPE and the KV write folded in;
// attn_tile, attn_tile_v2: prompt rows) on the CPU through cuda_emu.h, for
// tests/kernels/test_attention_host.py: argv[1] is a directory holding params.txt (one "name value"
// per line: the kernel's name, launch shape and scalar arguments, as backends/cuda/ops.py attention
// launches it) and the input arrays as raw .bin files; the outputs are written back there (out,
// kpool, vpool after the launch).
#include "cuda_emu.h"

#include <fstream>
#include <map>
#include <string>

#include "attention.cu"

static std::map<std::string, std::string> params;
static std::string dir;

static double num(const char* k) {
    auto it = params.find(k);
    if (it == params.end()) {
        std::fprintf(stderr, "attention_emu: missing parameter %s\n", k);
        std::exit(2);
    }
    return std::stod(it->second);
}

template <class T> static std::vector<T> load(const char* name) {
    std::ifstream f(dir + "/" + name + ".bin", std::ios::binary);
    std::vector<T> v;
    if (f) {
        f.seekg(0, std::ios::end);
        size_t bytes = f.tellg();
        f.seekg(0);
        v.resize(bytes / sizeof(T));
        f.read((char*)v.data(), bytes);
    }
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
    const int n = num("n"), H = num("H"), KVH = num("KVH"), D = num("D"), window = num("window");
    const int max_blocks = num("max_blocks"), bs_log2 = num("bs_log2");
    const float scale = num("scale");
    dim3 grid{(unsigned)num("gx"), (unsigned)num("gy"), 1}, block{(unsigned)num("threads"), 1, 1};
    auto q = load<float>("q");
    auto kpool = load<uint16_t>("kpool"), vpool = load<uint16_t>("vpool");
    auto bt = load<int>("bt"), slots = load<int>("slots"), positions = load<int>("positions");
    auto sinks = load<float>("sinks");      // absent: no sinks (a null pointer)
    std::vector<float> out((size_t)n * H * D, NAN);
    if (kernel == "attn_decode") {
        auto kin = load<float>("kin"), vin = load<float>("vin");
        auto rt = load<float2>("rt");
        const int rope_dim = num("rope_dim"), style = num("style");
        emu::launch(grid, block, 0, [&] {
            attn_decode(q.data(), out.data(), kpool.data(), vpool.data(), slots.data(), positions.data(), bt.data(),
                        max_blocks, bs_log2, H, KVH, D, scale, window, n, nullptr, nullptr, nullptr, kin.data(),
                        vin.data(), rope_dim, style, 1, rt.data(), ptr(sinks));
        });
    } else if (kernel == "attn_tile" || kernel == "attn_tile_v2") {
        auto fn = kernel == "attn_tile" ? attn_tile : attn_tile_v2;
        emu::launch(grid, block, (size_t)num("smem"), [&] {
            fn(q.data(), out.data(), kpool.data(), vpool.data(), slots.data(), positions.data(), bt.data(), max_blocks,
               bs_log2, H, KVH, D, scale, window, n, nullptr, ptr(sinks));
        });
    } else {
        std::fprintf(stderr, "attention_emu: unknown kernel %s\n", kernel.c_str());
        return 2;
    }
    save("out", out);
    save("kpool_out", kpool);
    save("vpool_out", vpool);
    return 0;
}
