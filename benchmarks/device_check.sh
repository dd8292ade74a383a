#!/usr/bin/env bash
# The GPU checks of shoal's CUDA path in one run, for a machine with an NVIDIA GPU, PyTorch,
# Triton and transformers already installed (it installs nothing). From the repository root:
#
#     OUT=/some/folder bash benchmarks/device_check.sh
#
# 1. kernels: the Triton paged-attention kernel against float64 and against the SDPA path, the
#    decode CUDA graphs against the eager step, float32 greedy decoding against transformers
#    on the same GPU with graphs on and off;
# 2. greedy: every greedy-vs-transformers case (float64) on CUDA, graphs on and off;
# 3. gpu_w1: benchmarks/gpu_w1.py (W1 against transformers' continuous batching, the decode
#    step's GPU busy share and HBM roofline) -> $OUT/gpu_w1.json.
#
# Each stage has its own time limit (about 8 minutes in all at worst; far less expected) and
# its own log; $OUT/summary.txt has one line per stage with its exit status and seconds. Six
# files in all. The server's test fixtures are not loaded (FastAPI and friends may be absent).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# This tree's shoal; Triton compiles its kernels (never its CPU interpreter) on this machine.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

{
    nvidia-smi
    $PY -c 'import sys, torch, triton, transformers
print(sys.version)
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("triton", triton.__version__, "transformers", transformers.__version__)'
} >"$OUT/env.txt" 2>&1

stage() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $(($(date +%s) - start)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

PYTEST=($PY -m pytest -q -rs -p no:cacheprovider -p no:server_fixtures)
stage kernels 150 "${PYTEST[@]}" tests/layers/test_triton_attention.py \
    tests/engine/test_cuda_graphs.py tests/engine/test_gpu_vs_transformers.py
stage greedy 180 env SHOAL_TEST_DEVICE=cuda "${PYTEST[@]}" \
    tests/engine/test_greedy_vs_transformers.py tests/engine/test_speculation_vs_transformers.py
stage gpu_w1 300 $PY benchmarks/gpu_w1.py --out "$OUT"
