#!/usr/bin/env bash
# The GPU check: the most one run on one GPU can tell, within 6 minutes.
#
# A GPU machine is lent rarely and briefly, and only the files of one output
# folder come back (at most 8). So the sections run in the order of their
# value, each under its own time limit inside the run's budget, and each
# writes its results as soon as it ends: a run killed at its limit still
# returns what finished. Every Python section runs on CPU first, in the same
# code (--dry-run, in the test suite: tests/bench/test_gpu_check.py), so that on
# the GPU nothing but the device itself can fail.
#
#   versions   torch, CUDA, NCCL, Triton, CuPy, the driver, the GPU
#   kernels    every op per backend at 64M and 256M elements (past the 60 MB
#              L2) against a device-to-device copy, the block-scaled formats
#              (mxfp8, mxfp4, nvfp4) among them; Top-K at 1% against
#              torch.topk (bench/kernel_speed.py)
#   worker     one rank over NCCL: a collective issued from gradcomp's worker
#              thread on its stream; all_reduce results (sync, Work.wait(),
#              get_future().wait()) and CompressedAdam's read on the caller's
#              stream at once and after a synchronize; FSDP2 with gradcomp's
#              comms inline on FSDP's streams, the hook's input kept while its
#              stream is held back; no host sync in any path's steady state;
#              Work.is_completed() false while the GPU still runs the reduction
#              (bench/gpu_worker.py)
#   identity   4 processes sharing the GPU over Gloo on CUDA tensors, each
#              backend forced in turn: every rank's all_reduce result bit for
#              bit the same, for Top-K (approximate, exact), random-K and int8
#              on the algorithms whose decode sums several ranks' rows
#              (bench/gpu_identity.py)
#   ranks      2 and 4 processes sharing the GPU over Gloo on CUDA tensors: the
#              DDP hook, FSDP2's paths, CompressedAdam and DiLoCo, replicas
#              agreeing, the default backends against the torch backend (at 2),
#              within bounds of dense; a collective Gloo cannot run there is
#              reported as not covered (bench/gpu_ranks.py)
#   overlap    the DDP hook's work against a backward pass of 10 ms or more,
#              25 MB buckets, from a profile: its streams and the fraction of
#              its time overlapping backward kernels (bench/gpu_ddp.py)
#   compare    the hook and CompressedAdam on the GPU backends against the
#              torch backend: one rank over NCCL, two over Gloo on CUDA tensors
#   parity     the GPU tests: every GPU op against the torch reference (the
#              block-scaled formats' in tests/ops/test_parity_microscaling.py),
#              the backends' own tests, auto's CUDA-event timing (pytest -n 8)
#   memcheck   if time is left and compute-sanitizer runs: every op of the cuda
#              and triton backends at 1, 1023 and 4097 elements under memcheck
#              (bench/gpu_memcheck.py)
#   host cost  in the time left: the DDP hook's host time per bucket against
#              DDP's own all-reduce, 64 one-parameter buckets of 1K elements on
#              2 Gloo ranks: the models and codecs on the GPU (the codec ops
#              cost their launches), then on CPU tensors with a core for every
#              thread (bench/host_cost.py; optional, reported only)
#
# What comes back (OUTPUT_DIR): gpu_check.txt (versions and one line per
# section), gpu_check.log (every section's output), gpu_check.json (worker,
# identity, overlap, compare, ranks; the sections on several ranks save each
# path or backend as it ends), kernel_speed-*.{csv,json}, parity.xml (JUnit), and
# gpu_check-files.tar.gz (the overlap profile's Chrome trace, the host cost's
# files).
#
# Usage: bash bench/gpu_check.sh [OUTPUT_DIR]            on the GPU machine ($OUT there)
#        bash bench/gpu_check.sh --dry-run [OUTPUT_DIR]  on a CPU machine: CPU tensors, Gloo,
#                                                        tiny sizes, under 3 minutes
#        bash bench/gpu_check.sh --help                  this text
# Needs torch with CUDA, triton, cupy and pytest; installs nothing. pytest-xdist and
# pytest-timeout, where present, run the parity section on 8 processes and end a hung
# test; the dry run needs neither (the README's set-up installs neither).
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
case "${1:-}" in
  -*) if [ "$1" != "--dry-run" ]; then
    echo "gpu_check.sh: unknown option $1 (--help tells the usage)" >&2
    exit 2
  fi ;;
esac

dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
  dry_run=1
  shift
fi
if [ "$dry_run" -eq 1 ]; then
  out="${1:-${TMPDIR:-/tmp}/gpu_check-dry-run}"
  budget=170 # seconds for the whole run, packing included
  # The sections pick the CPU themselves; kernel_speed.py and pytest by what they see.
  export CUDA_VISIBLE_DEVICES=""
  dry=(--dry-run)
else
  out="${1:-${OUT:-bench/results/gpu_check}}"
  budget=345
  dry=()
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
summary="$out/gpu_check.txt"
log="$out/gpu_check.log"
: >"$summary"
: >"$log"
export PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN
deadline=$((SECONDS + budget - 10)) # 10 s kept for the last packing
status=0

# The package goes to a scratch folder instead of being installed. csrc/ goes beside it, where the
# cuda backend finds the sources to compile when there is no fatbin (none is
# copied: the check runs what NVRTC makes of the sources as they are). tests/
# and pyproject.toml go too, and every section runs there: under `python -m`,
# the current folder comes first on sys.path, and the repository's own
# gradcomp/ (with its fatbins) would shadow the layout. The bench scripts run
# from the repository by path (their folder first on sys.path, then the layout).
tree="$(mktemp -d)"
extras="$(mktemp -d)" # files beyond the 8 that come back: packed into one archive
trap 'rm -rf "$tree" "$extras"' EXIT
cp -r gradcomp "$tree/gradcomp"
rm -f "$tree"/gradcomp/*.fatbin
cp -r kernels "$tree/gradcomp/kernels" # where pyproject.toml's package-dir installs the Triton kernels
cp -r csrc tests pyproject.toml "$tree/"
export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}"
cd "$tree"

pack() {
  if [ -n "$(ls -A "$extras")" ]; then
    tar -czf "$out/gpu_check-files.tar.gz.partial" -C "$extras" . &&
      mv "$out/gpu_check-files.tar.gz.partial" "$out/gpu_check-files.tar.gz"
  fi
}

# section NAME CAP REQUIRED COMMAND...: run COMMAND for at most CAP seconds (less
# where the run's budget ends sooner), its output to the log; one line to the
# summary. A REQUIRED (1) section that fails, times out or finds no time fails
# the run; an optional one (0) is reported only.
section() {
  local name=$1 cap=$2 required=$3
  shift 3
  local left=$((deadline - SECONDS))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 15 ]; then
    echo "$name: SKIPPED, ${left} s left of the run's ${budget} s" | tee -a "$summary" "$log"
    [ "$required" -eq 0 ] || status=1
    return
  fi
  echo "=== $name (limit ${limit} s): $*" | tee -a "$log"
  local began=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  local code=${PIPESTATUS[0]} verdict
  case $code in
    0) verdict=ok ;;
    124 | 137) verdict="TIMED OUT at ${limit} s" ;;
    *) verdict="FAILED (exit $code)" ;;
  esac
  echo "$name: $verdict, $((SECONDS - began)) s" | tee -a "$summary" "$log"
  if [ "$code" -ne 0 ] && [ "$required" -eq 1 ]; then
    status=1
  fi
  pack
  return "$code"
}

echo "gradcomp revision: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo "unknown (no git here)")" |
  tee -a "$summary" "$log"
sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
section versions 30 1 python3 - "$summary" "$dry_run" "${sanitizer:-compute-sanitizer}" <<'EOF'
"""Versions of everything the check runs on, into the summary and the log."""
import os
import subprocess
import sys
from importlib import metadata

lines = [f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, dry run: {sys.argv[2] == '1'}"]


def version(what, read):
    try:
        lines.append(f"{what}: {read()}")
    except Exception as error:  # noqa: BLE001 - absent or broken: said, not fatal
        lines.append(f"{what}: unavailable ({type(error).__name__}: {error})")


def gpu():
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible to torch"


def last_line(*command):
    return subprocess.run(command, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[-1]


version("torch", lambda: __import__("torch").__version__)
version("CUDA (torch built with)", lambda: __import__("torch").version.cuda)
version("NCCL", lambda: __import__("torch").cuda.nccl.version())
version("GPU", gpu)
version("Triton", lambda: __import__("triton").__version__)
version("CuPy", lambda: __import__("cupy").__version__)
version("gradcomp", lambda: __import__("gradcomp").__version__)
version(
    "driver (nvidia-smi)",
    lambda: last_line("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
)
version("compute-sanitizer", lambda: f"{last_line(sys.argv[3], '--version')} ({sys.argv[3]})")
for package in ("pytest", "pytest-xdist", "pytest-timeout"):
    version(package, lambda: metadata.version(package))
print("\n".join(lines))
with open(sys.argv[1], "a") as summary:
    summary.write("\n".join(lines) + "\n")
EOF

if [ "$dry_run" -eq 1 ]; then
  kernels=(--sizes 4K,16K --topk-sizes 16K --topk-ratios 0.01 --iters 2 --warmup 1)
else
  kernels=(--sizes 64M,256M --topk-sizes 64M,256M --topk-ratios 0.01)
fi
section kernels 75 1 python3 "$repo/bench/kernel_speed.py" "${kernels[@]}" --out "$out" --no-progress
section worker 45 1 python3 "$repo/bench/gpu_worker.py" ${dry[@]+"${dry[@]}"} --out "$out"
section identity 45 1 python3 "$repo/bench/gpu_identity.py" ${dry[@]+"${dry[@]}"} --out "$out"
section overlap 45 1 python3 "$repo/bench/gpu_ddp.py" --section overlap ${dry[@]+"${dry[@]}"} --out "$out" \
  --trace "$extras/gpu_ddp-trace.json"
section compare 60 1 python3 "$repo/bench/gpu_ddp.py" --section compare ${dry[@]+"${dry[@]}"} --out "$out"
section ranks 100 1 python3 "$repo/bench/gpu_ranks.py" ${dry[@]+"${dry[@]}"} --out "$out"

# The GPU tests: the parity suite's triton and cuda cases, the backends' own
# tests, the gpu-marked ones (auto's CUDA events), and the check that the model of
# torch's NCCL options the subgroup test uses has the real ones' attributes (it
# needs a torch built with NCCL). Slow-marked tests run CPU
# ranks through Triton's interpreter or compile with nvcc: not a GPU check. The
# dry run collects the same selection from the layout (the suite runs the tests
# on CPU itself, most of them skipped for want of a GPU).
# -v: xdist logs each test's outcome as it ends, so a run cut at its limit still tells
# which passed; --session-timeout (pytest-timeout 2.3 and later) ends the session a little
# before the section's limit, so that pytest writes its summary and XML itself.
# pytest-xdist and pytest-timeout are used where present, and only then.
plugins="$(python3 -m pytest --help 2>/dev/null)"
parity=(-v)
if grep -q -- "--numprocesses" <<<"$plugins"; then
  parity+=(-n 8)
fi
left=$((deadline - SECONDS))
parity_limit=$((left < 120 ? left : 120))
if grep -q -- "--session-timeout" <<<"$plugins"; then
  parity+=(--session-timeout $((parity_limit > 40 ? parity_limit - 20 : parity_limit)))
fi
if grep -q -- "--timeout=" <<<"$plugins"; then
  parity+=(--timeout 60)
fi
[ "$dry_run" -eq 0 ] || parity=(--collect-only -q)
section parity 120 1 python3 -m pytest "${parity[@]}" -rfE --tb=short -p no:cacheprovider \
  --junitxml "$out/parity.xml" -m "gpu or not slow" -k "triton or cuda or gpu or nccl" \
  tests/ops/test_parity.py tests/ops/test_parity_microscaling.py tests/kernels/test_triton.py \
  tests/kernels/test_cuda.py \
  tests/collectives/test_streams.py tests/collectives/test_subgroups.py

# If time is left: memcheck over every op of the GPU backends. PyTorch's caching
# allocator is off, so every tensor is an allocation of its own and a read past
# a tensor's end is one past an allocation's. Errors found fail the run (exit 3);
# a sanitizer that cannot run here (some virtual machines refuse it) is reported.
if [ "$dry_run" -eq 1 ]; then
  # The driver's logic on CPU tensors, Triton's backend through its interpreter.
  TRITON_INTERPRET=1 section "memcheck driver (no sanitizer on CPU)" 40 1 \
    python3 "$repo/bench/gpu_memcheck.py" --dry-run --backend cpu --backend triton
elif [ -z "$sanitizer" ]; then
  echo "memcheck: skipped, compute-sanitizer absent" | tee -a "$summary" "$log"
else
  for backend in cuda triton; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 section "memcheck $backend" 150 0 \
      "$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 50 \
      python3 "$repo/bench/gpu_memcheck.py" --backend "$backend"
    [ $? -ne 3 ] || status=1
  done
fi

# The host cost per bucket where kernel time vanishes: the hook's Python path, its
# worker and the codecs' launches against DDP's C++ path. On the GPU first (the figure
# the host-cost goal is about), then on CPU tensors, which on this machine get a core
# for each of a rank's threads. Optional, and last: a figure, not a check, in the time
# memcheck leaves. The dry run takes the same code on CPU tensors.
if [ "$dry_run" -eq 1 ]; then
  host=(--buckets 8 --rounds 1 --steps 3 --profile-steps 0)
  host_devices=(cpu)
else
  host=(--rounds 3 --steps 20 --profile-steps 0)
  host_devices=(cuda cpu)
fi
for device in "${host_devices[@]}"; do
  section "host cost $device" 90 0 python3 "$repo/bench/host_cost.py" --device "$device" "${host[@]}" \
    --out "$extras" --no-progress
done

pack
echo "gpu_check: $([ "$status" -eq 0 ] && echo "every section passed" || echo "a section FAILED"), $SECONDS s" |
  tee -a "$summary"
exit "$status"
