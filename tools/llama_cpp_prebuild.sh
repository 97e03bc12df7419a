#!/usr/bin/env bash
# Builds .llamacpp/bin.tar.xz (git-ignored): llama-bench, llama-batched-bench and llama-server of the kit
# (.llamacpp/llama.cpp.tar.xz, made by tools/llama_cpp_kit.sh) compiled for sm_90 on a machine without a
# GPU, so that tools/llama_cpp_bench.sh on the GPU machine unpacks them instead of spending ~270 s of the
# lease on the build. The pack records the kit's sha256; the bench script uses it only while that matches
# the kit it is given (otherwise it builds there as before): run this again after a new kit.
#   nohup nice -n 10 bash tools/llama_cpp_prebuild.sh > /tmp/llamacpp_prebuild.log 2>&1 &
# It takes long on few cores (27 min with -j2 on a 2-core machine; the CUDA template instances are
# throughput-bound: ~4,400 CPU-seconds on the H100 machine's CPU) and resumes where it stopped when called again.
# The programs need glibc >= 2.34 and libstdc++ with GLIBCXX_3.4.30 (gcc 12) on the GPU machine; where they do
# not start there, the bench script builds as before.
# Needs nvcc (CUDA 13), cmake, gcc, ninja or make, xz, strip; pip when the toolkit has no cuBLAS.
# The cmake options are tools/llama_cpp_bench.sh's, with these differences, none of which changes a kernel:
#  - BUILD_SHARED_LIBS=ON: the programs share libggml*/libllama/libmtmd .so files beside them (RPATH $ORIGIN,
#    stripped); three static programs would each carry the CUDA kernels
#  - the CUDA runtime linked statically (ggml-cuda's CMakeLists, patched in the unpacked copy: CUDA::cudart ->
#    CUDA::cudart_static), so the GPU machine supplies only libcublas.so.13/libcublasLt.so.13 (its Python
#    nvidia wheels, found through $LLAMACPP_WORK/ldpath) and the driver's libcuda.so.1 (driver for CUDA 13)
#  - GGML_NATIVE=OFF with x86-64-v3 (AVX2, FMA, F16C, BMI2): the GPU machine's CPU is not this one, and the
#    CPU code does not enter the GPU figures
#  - GGML_CUDA_NCCL=OFF (one GPU; the GPU machine's build finds no NCCL either)
#  - CMAKE_CUDA_ARCHITECTURES=90-real instead of 90, GGML_CUDA_COMPRESSION_MODE=none instead of size: the same
#    sm_90 code, without the compute_90 PTX (only a GPU newer than sm_90 would JIT it) and with the cubins
#    left raw for xz, which packs them far tighter than nvcc's compression (the pack: 41 MB -> 16 MB)
#  - cuBLAS: the toolkit's, else the nvidia-cublas wheel for CUDA 13 (pip download, unpacked in the work
#    dir); libcuda for the link: the toolkit's stub, else one generated here from the driver calls ggml-cuda
#    makes (SONAME libcuda.so.1, not packed), so the virtual-memory pool stays on as on the GPU machine
# Settings (environment): LLAMACPP_PREBUILD_WORK (/tmp/llamacpp_prebuild), LLAMACPP_JOBS (2),
#   LLAMACPP_CUBLAS_SPEC (pip requirement, "nvidia-cublas>=13,<14")
# Output: .llamacpp/bin.tar.xz (the programs and their .so files, flat) and .llamacpp/bin.VERSION (kit
#   sha256, nvcc, compilers, glibc, options, build time)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
KIT=$REPO/.llamacpp/llama.cpp.tar.xz
W=${LLAMACPP_PREBUILD_WORK:-/tmp/llamacpp_prebuild}
JOBS=${LLAMACPP_JOBS:-2}
CUBLAS_SPEC=${LLAMACPP_CUBLAS_SPEC:-nvidia-cublas>=13,<14}
TARGETS="llama-bench llama-batched-bench llama-server"
[ -f "$KIT" ] || { echo "no $KIT: run tools/llama_cpp_kit.sh first"; exit 1; }
nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null) || { echo "no nvcc"; exit 1; }
# the toolkit's root (nvcc may be a wrapper outside it)
cuda=
for c in "$(dirname "$(dirname "$(readlink -f "$nvcc")")")" "${CUDA_HOME:-}" /usr/local/cuda; do
  [ -f "$c/include/cuda.h" ] && { cuda=$c; break; }
done
[ -n "$cuda" ] || { echo "no CUDA toolkit (include/cuda.h) beside $nvcc, in \$CUDA_HOME or /usr/local/cuda"; exit 1; }
nvver=$("$nvcc" --version | grep -o 'release [0-9.]*, V[0-9.]*' | sed 's/.*V//')
sha=$(sha256sum "$KIT" | cut -c1-16)
mkdir -p "$W"

if [ "$(cat "$W/kit.sha" 2>/dev/null)" != "$sha" ]; then   # a new kit: start over
  rm -rf "$W/src" "$W/build" "$W/build_s"
  mkdir -p "$W/src" && tar -xJf "$KIT" -C "$W/src"
  # the CUDA runtime into libggml-cuda.so itself (the GPU machine's wheels may bring another libcudart)
  f=$W/src/llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt
  sed -i 's/target_link_libraries(ggml-cuda PRIVATE CUDA::cudart CUDA::cublas)/target_link_libraries(ggml-cuda PRIVATE CUDA::cudart_static CUDA::cublas)/' "$f"
  grep -q 'PRIVATE CUDA::cudart_static CUDA::cublas)$' "$f" || { echo "cannot patch $f for the static CUDA runtime"; exit 1; }
  echo "$sha" > "$W/kit.sha"
fi

if [ ! -f "$W/build/CMakeCache.txt" ]; then
  extra=() rpl=""
  # cuBLAS: the toolkit's, else the CUDA 13 wheel's (only cuBLAS's own headers on the include path)
  if ! ls "$cuda"/{include,targets/*/include}/cublas_v2.h >/dev/null 2>&1; then
    if ! ls "$W"/cublas/nvidia/*/lib/libcublas.so.13 >/dev/null 2>&1; then
      rm -rf "$W/cublas" "$W/whl" && mkdir -p "$W/whl" "$W/cublas"
      python3 -m pip download -q --no-deps "$CUBLAS_SPEC" -d "$W/whl"
      python3 -m zipfile -e "$W"/whl/nvidia_cublas-*.whl "$W/cublas"
      rm -rf "$W/whl"
    fi
    cb=$(dirname "$(dirname "$(ls "$W"/cublas/nvidia/*/lib/libcublas.so.13 | head -1)")")
    mkdir -p "$W/cublas_include"
    ln -sf "$cb"/include/cublas*.h "$cb"/include/nvblas.h "$W/cublas_include/" 2>/dev/null || true
    extra+=(-DCUDA_cublas_LIBRARY="$cb/lib/libcublas.so.13" -DCUDA_cublasLt_LIBRARY="$cb/lib/libcublasLt.so.13"
            -DCMAKE_CUDA_FLAGS="-I$W/cublas_include" -DCMAKE_CXX_FLAGS="-I$W/cublas_include")
    rpl+=" -Wl,-rpath-link,$cb/lib"
    echo "cuBLAS from $cb ($(ls -d "$W"/cublas/*.dist-info 2>/dev/null | head -1 | xargs -r basename))"
  fi
  # libcuda for the link only: the toolkit's stub, else a stub of the driver calls ggml-cuda makes
  if ! ls "$cuda"/{lib64,lib,targets/*/lib}/{,stubs/}libcuda.so >/dev/null 2>&1; then
    mkdir -p "$W/stub"
    grep -rhoE '\bcu[A-Z][A-Za-z0-9_]*\s*\(' "$W/src/llama.cpp/ggml/src/ggml-cuda" | sed 's/\s*(//' | sort -u \
      | grep -v '^cuBLAS$' > "$W/stub/calls"
    # cuda.h renames some calls (cuFoo -> cuFoo_v2): the stub exports the names the objects will ask for
    { echo '#include <cuda.h>'; sed 's/^/STUBSYM /' "$W/stub/calls"; } > "$W/stub/names.c"
    gcc -E -I"$cuda/include" "$W/stub/names.c" | sed -n 's/^STUBSYM \([A-Za-z0-9_]*\)$/\1/p' \
      | sed 's/.*/int &(void) { return 999; }/' > "$W/stub/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$W/stub/libcuda.so" "$W/stub/stub.c"
    ln -sf libcuda.so "$W/stub/libcuda.so.1"     # the name the programs' link looks for (-rpath-link)
    extra+=(-DCUDA_cuda_driver_LIBRARY="$W/stub/libcuda.so")
    rpl+=" -Wl,-rpath-link,$W/stub"
    echo "libcuda: a stub of $(wc -l < "$W/stub/stub.c") driver calls (link only)"
  fi
  # the programs link against libggml-cuda.so, whose libcublas/libcuda the linker must find too (the
  # install RPATH $ORIGIN names neither)
  [ -z "$rpl" ] || extra+=(-DCMAKE_EXE_LINKER_FLAGS="$rpl" -DCMAKE_SHARED_LINKER_FLAGS="$rpl")
  extra+=(-DLLAMA_BUILD_COMMIT="$(awk '$1 == "llama.cpp" {print $2}' "$REPO/.llamacpp/VERSION" 2>/dev/null)")
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  opts=(-DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real
        -DGGML_CUDA_COMPRESSION_MODE=none -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON
        -DGGML_CUDA_NCCL=OFF -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
        -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
        -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON "-DCMAKE_INSTALL_RPATH=\$ORIGIN")
  echo "${opts[*]} (static CUDA runtime)" > "$W/options"
  cmake -S "$W/src/llama.cpp" -B "$W/build" "${gen[@]}" -DCMAKE_CUDA_COMPILER="$nvcc" "${opts[@]}" "${extra[@]}" \
    > "$W/configure.log" 2>&1 || { tail -30 "$W/configure.log"; rm -f "$W/build/CMakeCache.txt"; exit 1; }
fi

t0=$(date +%s)
rc=0
# shellcheck disable=SC2086
cmake --build "$W/build" -j "$JOBS" --target $TARGETS > "$W/build.log" 2>&1 || rc=$?
echo $(( $(cat "$W/build_s" 2>/dev/null || echo 0) + $(date +%s) - t0 )) > "$W/build_s"
[ $rc = 0 ] || { grep -B2 -A12 -m3 "error" "$W/build.log" | head -60; exit 1; }

# the programs and the .so files they load (by soname: no links in the pack), stripped
P=$W/pack
rm -rf "$P" && mkdir -p "$P"
for t in $TARGETS; do cp "$W/build/bin/$t" "$P/"; done
for l in $(readelf -d "$W"/build/bin/{llama-*,lib*.so*} 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u); do
  [ -e "$W/build/bin/$l" ] && cp -L "$W/build/bin/$l" "$P/"
done
strip --strip-unneeded "$P"/*
echo "== ldd $P/llama-server (only libcublas*, libcuda.so.1 and the system's libc/libstdc++/libgomp come from the GPU machine)"
LD_LIBRARY_PATH='' ldd "$P/llama-server" "$P/libggml-cuda.so"* || true
mkdir -p "$REPO/.llamacpp"
tar -C "$P" --sort=name --owner=0 --group=0 --mtime='2020-01-01' -cf - . | xz -T1 -9 > "$REPO/.llamacpp/bin.tar.xz"
{
  echo "kit $sha"
  echo "kit_version $(tr '\n' ' ' < "$REPO/.llamacpp/VERSION" 2>/dev/null)"
  echo "nvcc $nvver"
  echo "compilers $(gcc --version | head -1), $(cmake --version | head -1)"
  echo "glibc $(ldd --version | head -1 | grep -o '[0-9.]*$') here; the programs need" \
       "$(objdump -T "$P"/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)" \
       "$(objdump -T "$P"/* 2>/dev/null | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)"
  echo "built $(date -u +%Y-%m-%dT%H:%MZ) in $(cat "$W/build_s") s with -j$JOBS"
  echo "targets $TARGETS"
  echo "options $(cat "$W/options")"
} > "$REPO/.llamacpp/bin.VERSION"
echo "$(du -h "$REPO/.llamacpp/bin.tar.xz" | cut -f1) $REPO/.llamacpp/bin.tar.xz ($(du -sh "$P" | cut -f1) unpacked)"
cat "$REPO/.llamacpp/bin.VERSION"
