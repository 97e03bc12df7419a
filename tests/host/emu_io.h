// The file harness of the emulators that run one launch from a directory (attention_emu, deltanet_emu,
// flash_emu, moe_emu, moe_grouped_emu; their Python side is tests/support/host_emu.py): argv[1] is the directory, its
// params.txt holds one "name value" per line (`kernel` and the launch's scalars), each input array is
// a raw NAME.bin there, and each output is written back as NAME_after.bin.
//
// Include it after the kernel sources. What differs between the emulators is chosen per call:
//   num(k) a parameter as a double (std::stod), inum(k) as a long long (std::stoll); both exit 2
//     where k is missing;
//   load(name) an input that must be there (exit 2 without it), load_opt(name, min_count) one that
//     may be absent (empty, or min_count zeroed values), passed to the kernel through ptr() (a null
//     pointer where empty).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace emu_io {

static std::map<std::string, std::string> params;
static std::string dir, prog;

[[noreturn]] static void fail(const char* what, const std::string& k) {
    std::fprintf(stderr, "%s: %s %s\n", prog.c_str(), what, k.c_str());
    std::exit(2);
}

// prog names the emulator in messages; false where the command line is not `prog DIR`
static bool open_dir(int argc, char** argv, const char* name) {
    prog = name;
    if (argc != 2) return false;
    dir = argv[1];
    std::ifstream pf(dir + "/params.txt");
    std::string k, v;
    while (pf >> k >> v) params[k] = v;
    return true;
}

// a parameter as written ("" where absent)
static std::string str(const char* k) {
    auto it = params.find(k);
    return it == params.end() ? std::string() : it->second;
}

static const std::string& need(const char* k) {
    auto it = params.find(k);
    if (it == params.end()) fail("missing parameter", k);
    return it->second;
}

static double num(const char* k) { return std::stod(need(k)); }
static long long inum(const char* k) { return std::stoll(need(k)); }

template <class T> static bool read_bin(const char* name, std::vector<T>& v) {
    std::ifstream f(dir + "/" + name + ".bin", std::ios::binary);
    if (!f) return false;
    f.seekg(0, std::ios::end);
    const size_t bytes = f.tellg();
    f.seekg(0);
    v.resize(bytes / sizeof(T));
    f.read((char*)v.data(), v.size() * sizeof(T));
    return true;
}

template <class T> static std::vector<T> load(const char* name) {
    std::vector<T> v;
    if (!read_bin(name, v)) fail("no", std::string(name) + ".bin");
    return v;
}

template <class T> static std::vector<T> load_opt(const char* name, size_t min_count = 0) {
    std::vector<T> v;
    read_bin(name, v);
    if (v.size() < min_count) v.resize(min_count);
    return v;
}

template <class T> static T* ptr(std::vector<T>& v) { return v.empty() ? nullptr : v.data(); }

template <class T> static void save(const char* name, const std::vector<T>& v) {
    std::ofstream f(dir + "/" + name + "_after.bin", std::ios::binary);
    f.write((const char*)v.data(), v.size() * sizeof(T));
}

}  // namespace emu_io

using namespace emu_io;
