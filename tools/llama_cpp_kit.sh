#!/usr/bin/env bash
# Builds .llamacpp/ (git-ignored): a pruned llama.cpp source tree, packed small enough to travel with a
# device call, for the side-by-side figures (llama-bench, llama-batched-bench, llama-server on the shape
# twins). The source is the llama.cpp that the llama-cpp-python sdist on PyPI vendors; only what the CUDA
# build of those three programs needs is kept (no tests, docs, models, web UI sources, other backends).
#   bash tools/llama_cpp_kit.sh            fetch the sdist (cached in $LLAMACPP_CACHE) and pack
#   LLAMACPP_PY_VERSION=0.3.36 bash tools/llama_cpp_kit.sh
# Output: .llamacpp/llama.cpp.tar.xz and .llamacpp/VERSION; tools/llama_cpp_bench.sh builds and runs it.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VER=${LLAMACPP_PY_VERSION:-0.3.36}
CACHE=${LLAMACPP_CACHE:-/tmp/llamacpp-sdist}
DEST=$REPO/.llamacpp
SDIST=$CACHE/llama_cpp_python-$VER.tar.gz

mkdir -p "$CACHE"
if [ ! -f "$SDIST" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$CACHE"
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
tar -xzf "$SDIST" -C "$WORK"
SRC=$WORK/llama_cpp_python-$VER/vendor/llama.cpp
[ -f "$SRC/CMakeLists.txt" ] || { echo "no vendor/llama.cpp in $SDIST"; exit 1; }
# the vendored commit, for the report (the sdist carries the submodule's git metadata)
COMMIT=$(git -C "$SRC" rev-parse --short=10 HEAD 2>/dev/null || echo unknown)
SUBJECT=$(git -C "$SRC" log -1 --format='%cs %s' 2>/dev/null || echo "")

T=$WORK/llama.cpp
mkdir -p "$T/tools" "$T/ggml/src" "$T/scripts"
cp -a "$SRC"/{CMakeLists.txt,LICENSE,cmake,include,src,common,vendor,licenses} "$T/"
cp -a "$SRC/scripts/ui-assets.cmake" "$T/scripts/"
cp -a "$SRC"/ggml/{CMakeLists.txt,cmake,include} "$T/ggml/"
# ggml core files plus the CPU and CUDA backends; every other backend directory stays behind
# (ggml only enters a backend's directory when its GGML_<NAME> option is on)
find "$SRC/ggml/src" -maxdepth 1 -type f -exec cp -a {} "$T/ggml/src/" \;
cp -a "$SRC/ggml/src/ggml-cpu" "$SRC/ggml/src/ggml-cuda" "$T/ggml/src/"
# the CPU backend's code for other processors
find "$T/ggml/src/ggml-cpu/arch" -mindepth 1 -maxdepth 1 ! -name x86 ! -name arm -exec rm -rf {} +
rm -rf "$T/ggml/src/ggml-cpu/spacemit"
cp -a "$SRC/tools/llama-bench" "$SRC/tools/batched-bench" "$SRC/tools/server" "$SRC/tools/mtmd" "$T/tools/"
rm -rf "$T/tools/server/tests" "$T/tools/server/bench" "$T/tools/server/"*.md
rm -rf "$T/tools/mtmd/tests" "$T/tools/mtmd/"test-* "$T/tools/mtmd/"*.md
# the server embeds its web UI from prebuilt assets; without them (no network there) it embeds an empty
# table and still serves the HTTP API, so only the UI's CMake files travel
mkdir -p "$T/tools/ui"
cp -a "$SRC"/tools/ui/{CMakeLists.txt,ui.cpp.in,ui.h.in,sources.cmake} "$T/tools/ui/"
rm -rf "$T/vendor/miniaudio/"*.md
cat > "$T/tools/CMakeLists.txt" <<'EOF'
# pruned by realizar-backend's tools/llama_cpp_kit.sh: only the benchmark programs and the server
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(batched-bench)
add_subdirectory(llama-bench)
add_subdirectory(mtmd)
if (LLAMA_BUILD_SERVER)
    add_subdirectory(ui)
    add_subdirectory(server)
endif()
EOF
printf 'llama-cpp-python %s\nllama.cpp %s %s\n' "$VER" "$COMMIT" "$SUBJECT" > "$T/REALIZAR_KIT_VERSION"

mkdir -p "$DEST"
rm -f "$DEST/llama.cpp.tar.xz"
tar -C "$WORK" --sort=name --owner=0 --group=0 --mtime='2020-01-01' -cf - llama.cpp | xz -T2 -6 > "$DEST/llama.cpp.tar.xz"
cp "$T/REALIZAR_KIT_VERSION" "$DEST/VERSION"
echo "$(du -h "$DEST/llama.cpp.tar.xz" | cut -f1) $DEST/llama.cpp.tar.xz ($(du -sh "$T" | cut -f1) unpacked): $(tr '\n' ' ' < "$DEST/VERSION")"
