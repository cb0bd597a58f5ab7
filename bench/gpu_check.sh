#!/usr/bin/env bash
# GPU check, one script for one GPU (every step has a timeout; 8.5 minutes at most):
#   1. parity of every GPU implementation against the torch reference:
#      tests/test_parity.py for the triton backend (real Triton kernels, no
#      interpreter) and the cuda backend (the CUDA kernels of csrc/, compiled
#      with NVRTC), then the backend-specific tests/test_triton.py and
#      tests/test_cuda.py, and auto's CUDA-event timing (tests/test_streams.py -m gpu);
#   2. the DDP hook end to end (bench/gpu_ddp.py): one rank over NCCL and two
#      ranks over Gloo on CUDA tensors, against the torch backend, and one step
#      profiled: which streams gradcomp's kernels ran on, how much they
#      overlapped the backward pass's kernels;
#   3. throughput of every op per backend against a device-to-device copy,
#      and CUDA Top-K against torch.topk (bench/kernels.py, 1M..64M elements).
# Usage: bash bench/gpu_check.sh [OUTPUT_DIR]   (default bench/results)
# Needs torch with CUDA, triton, cupy and pytest; installs nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
out="${1:-bench/results}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export PYTHONUNBUFFERED=1

# gradcomp.kernels is kernels/ installed inside the package: lay that out in a
# scratch folder instead of installing. csrc/ goes beside the package, where the
# cuda backend finds the sources to compile when there is no fatbin (none is
# copied: the check runs what NVRTC makes of the sources as they are). tests/
# and pyproject.toml go too, and pytest runs there: under `python -m`, the
# current folder comes first on sys.path, and the repository's own gradcomp/
# (without kernels/) would shadow the layout.
tree="$(mktemp -d)"
cp -r gradcomp "$tree/gradcomp"
cp -r kernels "$tree/gradcomp/kernels"
rm -f "$tree"/gradcomp/*.fatbin
cp -r csrc tests pyproject.toml "$tree/"
export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name(0))"
  python3 -c "import cupy; print('cupy', cupy.__version__)" || echo "cupy does not import: tests/test_cuda.py skips"
} 2>&1 | tee "$out/gpu_check-device.txt"

cd "$tree"
# The slow-marked tests run CPU ranks through Triton's interpreter or compile
# with nvcc: not a GPU check.
timeout 110 python3 -m pytest -q -p no:cacheprovider -m "not slow" -k "triton or cuda" tests/test_parity.py 2>&1 \
  | tee "$out/gpu_check-parity.txt"
parity=${PIPESTATUS[0]}
timeout 80 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_triton.py tests/test_cuda.py 2>&1 \
  | tee "$out/gpu_check-backends.txt"
backends=${PIPESTATUS[0]}
# auto on a GPU: buckets timed by CUDA events (one rank, Gloo on CUDA tensors), ready
# offsets from real events, two ranks on the one GPU agreeing on the plan.
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_streams.py 2>&1 \
  | tee -a "$out/gpu_check-backends.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || backends=1
timeout 150 python3 "$repo/bench/gpu_ddp.py" --out "$out" 2>&1 | tee "$out/gpu_check-ddp.txt"
ddp=${PIPESTATUS[0]}
cd "$repo"

timeout 110 python3 bench/kernels.py --sizes 1M,16M,64M 2>&1 | tee "$out/gpu_check-kernels.txt"
bench=${PIPESTATUS[0]}
if [ "$out" != "$repo/bench/results" ]; then
  cp bench/results/kernels-*.csv bench/results/kernels-*.json "$out/" 2>/dev/null
fi
rm -rf "$tree"
echo "gpu_check: parity exit $parity, backend tests exit $backends, ddp exit $ddp, kernels bench exit $bench"
[ "$parity" -eq 0 ] && [ "$backends" -eq 0 ] && [ "$ddp" -eq 0 ] && [ "$bench" -eq 0 ]
