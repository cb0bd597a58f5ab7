#!/usr/bin/env bash
# GPU check, one script for one GPU (about 5 minutes on an H200, 8 at most):
#   1. parity of every GPU implementation against the torch reference
#      (tests/test_triton.py on CUDA tensors: real kernels, no interpreter);
#   2. throughput of every op per backend against a device-to-device copy
#      (bench/kernels.py, 1M..256M elements).
# Usage: bash bench/gpu_check.sh [OUTPUT_DIR]   (default bench/results)
# Needs torch with CUDA, triton and pytest; installs nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

# gradcomp.kernels is kernels/ installed inside the package: lay that out
# in a scratch folder instead of installing.
tree="$(mktemp -d)"
cp -r gradcomp "$tree/gradcomp"
cp -r kernels "$tree/gradcomp/kernels"
export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name(0))"
} 2>&1 | tee "$out/gpu_check-device.txt"

# The slow-marked tests run CPU ranks through Triton's interpreter: not a GPU check.
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_triton.py 2>&1 \
  | tee "$out/gpu_check-parity.txt"
parity=${PIPESTATUS[0]}

timeout 240 python3 bench/kernels.py 2>&1 | tee "$out/gpu_check-kernels.txt"
bench=${PIPESTATUS[0]}
if [ "$out" != "bench/results" ]; then
  cp bench/results/kernels-*.csv bench/results/kernels-*.json "$out/" 2>/dev/null
fi
rm -rf "$tree"
echo "gpu_check: parity exit $parity, kernels bench exit $bench"
[ "$parity" -eq 0 ] && [ "$bench" -eq 0 ]
