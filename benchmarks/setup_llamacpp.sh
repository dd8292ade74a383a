#!/usr/bin/env bash
# Build llama.cpp (the W1 benchmark's second peer) and float GGUFs of the bundled SmolLM2-135M.
#
# llama.cpp's sources come from the `llama-cpp-python` source package on PyPI, which vendors
# them; `llama-server`, `llama-batched-bench` and `llama-quantize` are built with cmake
# (Release, -march=native, CPU only, no web UI, no network features) under `nice`. The bundled
# model ships as a Q4_1 GGUF; `llama-quantize --allow-requantize --pure` from the same build
# dequantizes it into F32, BF16 and F16 GGUFs, the same weights shoal loads from the Q4_1 file.
# Everything lands in ~/.cache/shoal/llamacpp/<version> (or $SHOAL_CACHE_DIR/llamacpp/...) and
# is built once; the script prints that folder. Nothing here is needed by `make test`.
#
#     benchmarks/setup_llamacpp.sh [VERSION]      # default: the newest on PyPI
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
cache=${SHOAL_CACHE_DIR:-$HOME/.cache/shoal}/llamacpp
spec=llama-cpp-python${1:+==$1}
mkdir -p "$cache/downloads"

sdist=$(find "$cache/downloads" -name "llama_cpp_python-${1:-*}.tar.gz" | sort -V | tail -1)
if [[ -z $sdist || -z ${1:-} ]]; then
  # Ask PyPI for the newest (or the named) version; a cached sdist of it is not fetched again.
  "$py" -m pip download -q --no-binary :all: --no-deps "$spec" -d "$cache/downloads" >&2
  sdist=$(find "$cache/downloads" -name "llama_cpp_python-${1:-*}.tar.gz" | sort -V | tail -1)
fi
version=$(basename "$sdist" .tar.gz)
version=${version#llama_cpp_python-}
root=$cache/$version
bin=$root/build/bin

if [[ ! -x $bin/llama-server || ! -x $bin/llama-batched-bench || ! -x $bin/llama-quantize ]]; then
  echo "building llama.cpp from llama-cpp-python $version (a few minutes on 2 cores)" >&2
  mkdir -p "$root"
  [[ -d $root/src ]] || {
    tar xzf "$sdist" -C "$root"
    mv "$root/llama_cpp_python-$version/vendor/llama.cpp" "$root/src"
    rm -rf "$root/llama_cpp_python-$version"
  }
  nice -n 19 cmake -S "$root/src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >&2
  nice -n 19 cmake --build "$root/build" -j2 \
    --target llama-server llama-batched-bench llama-quantize >&2
fi

model=$("$py" -c 'from shoal.models.files import bundled_model_path; print(bundled_model_path())')
for type in F32 BF16 F16; do
  out=$root/smollm2-135m-$type.gguf
  if [[ ! -s $out ]]; then
    nice -n 19 "$bin/llama-quantize" --allow-requantize --pure "$model" "$out.tmp" "$type" >&2
    mv "$out.tmp" "$out"
  fi
done
echo "$root"
