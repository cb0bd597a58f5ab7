"""The DDP hook on one GPU: its overlap with the backward pass, and its results against the torch backend.

Run by ``bench/gpu_check.sh`` (``--dry-run``: CPU tensors, Gloo, a tiny model),
one section per call:

* ``--section overlap``: one rank over NCCL, a deep stack of Linear layers
  whose backward pass takes at least 10 ms (the batch doubles until it
  does), DDP with 25 MB buckets and gradcomp's int8 hook; one backward pass
  profiled with ``torch.profiler``. From the trace: the streams of the work
  gradcomp's worker thread launched (they must not be the backward pass's),
  and how much of its time overlapped the backward pass's kernels. A
  bucket's work is queued when DDP hands the bucket over, so everything but
  the last buckets' can overlap the layers still to be differentiated.
* ``--section compare``: a small MLP trains a few steps with the hook (int8,
  Top-K, sign) and with ``CompressedAdam`` (int8), once on the default
  backends and once with ``GRADCOMP_BACKEND=torch``: the parameters must
  agree bit for bit (a few ulp for sign). On one rank over NCCL, then on
  two ranks over Gloo on CUDA tensors of the same GPU.

Writes the checks under "ddp overlap" / "ddp compare" in
``<out>/gpu_check.json`` (``--trace``: the profile's Chrome trace); exits 1
if a check fails.

    python bench/gpu_ddp.py --section overlap --trace bench/results/gpu_ddp-trace.json
    python bench/gpu_ddp.py --section compare --dry-run --out /tmp/gc
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys
import threading
import time

import torch
from lib import gpu_setup

import gradcomp
from gradcomp.spawn import run_ranks

STEPS = 4
COMPARE_BUCKET_MB = 0.25
GPU_MLP_WIDTH = 1024
DRY_RUN_MLP_WIDTH = 64
OVERLAP_BUCKET_MB = 25
# The overlap model on a GPU: 16 layers of 2048x2048 fp32 weights, 16 MB each: DDP's
# 25 MB cap puts two in a bucket. The batch doubles from 4096 until the backward
# pass takes at least MIN_BACKWARD_MS.
GPU_MODEL = {"width": 2048, "layers": 16, "batch": 4096}
DRY_RUN_MODEL = {"width": 64, "layers": 4, "batch": 32}
MIN_BACKWARD_MS = 10.0
MAX_DOUBLINGS = 4
ROOT = pathlib.Path(__file__).resolve().parents[1]


def kernel_names() -> tuple[set[str], tuple[str, ...]]:
    """The names of gradcomp's kernels, read from its sources: the Triton ones (the
    ``_..._kernel`` functions of ``gradcomp.kernels``, wherever it is installed from) exactly,
    and the CUDA ones (csrc/) exactly or, where a macro stamps one per type
    (``sign_compress_##X_NAME``), by their prefix. A substring would also match torch's own
    (``sign`` in ``unsigned``)."""
    exact = set()
    (triton_sources,) = importlib.util.find_spec("gradcomp.kernels").submodule_search_locations
    for path in pathlib.Path(triton_sources).glob("*.py"):
        exact |= set(re.findall(r"^def (_\w+_kernel)\(", path.read_text(), re.MULTILINE))
    found = set()
    for path in (ROOT / "csrc").glob("*.cu"):
        found |= set(
            re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)", path.read_text())
        )
    exact |= {name for name in found if not name.endswith("_")}
    return exact, tuple(sorted(name for name in found if name.endswith("_")))


KERNELS, KERNEL_PREFIXES = kernel_names()
# Device work in a trace: kernels, copies and fills on a GPU; operators on a CPU,
# where a thread stands for a stream.
DEVICE_CATEGORIES = {"cuda": ("kernel", "gpu_memcpy", "gpu_memset"), "cpu": ("cpu_op",)}
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


# ----------------------------------------------------------------------------- overlap


def linear_stack(width: int, layers: int) -> torch.nn.Sequential:
    """``layers`` Linear(width, width) + ReLU, seeded without touching the global RNG."""
    return gpu_setup.seeded(
        torch.nn.Sequential(
            *[module for _ in range(layers) for module in (torch.nn.Linear(width, width), torch.nn.ReLU())]
        )
    )


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length two unions of intervals share."""
    shared, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        shared += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return shared


def by_name(event: dict) -> bool:
    """Whether ``event`` is one of gradcomp's kernels, by its name."""
    name = event["name"]
    return name in KERNELS or name.startswith(KERNEL_PREFIXES)


def overlap_from_trace(events: list[dict], worker_threads: set[int], device_type: str) -> dict:
    """gradcomp's device work (launched by its worker thread) against the rest (the
    backward pass) in a Chrome trace's ``events``: their streams, busy microseconds
    (nested or concurrent work counted once), and the part of gradcomp's time during
    which the rest was busy too.

    On a GPU a kernel's launching thread is found through its launch's correlation
    id; where no launch in the trace came from a worker thread, gradcomp's streams are
    those its kernels ran on (found by their names, :func:`kernel_names`), and all the
    work on them is gradcomp's. On a CPU (a dry run) the operators are the device work
    and their thread is their stream."""
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES[device_type] and "dur" in e]
    if device_type == "cuda":
        launcher = {
            e["args"]["correlation"]: e["tid"]
            for e in events
            if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
        }
        found_by = "launching thread" if worker_threads & set(launcher.values()) else "kernel name"

        def stream(e):
            return e["args"].get("stream")

        named = {stream(e) for e in device if by_name(e)}

        def ours(e):
            if found_by == "kernel name":
                return stream(e) in named
            return launcher.get(e["args"].get("correlation")) in worker_threads
    else:
        found_by = "thread"

        def stream(e):
            return e["tid"]

        def ours(e):
            return e["tid"] in worker_threads

    mine = [e for e in device if ours(e)]
    rest = [e for e in device if not ours(e)]
    mine_busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in mine])
    rest_busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in rest])
    overlapped = _intersection(mine_busy, rest_busy)
    gradcomp_streams = sorted({stream(e) for e in mine}, key=str)
    backward_streams = sorted({stream(e) for e in rest}, key=str)
    return {
        "gradcomp found by": found_by,
        "gradcomp events": len(mine),
        "gradcomp kernels by name": sum(map(by_name, mine)),
        "gradcomp streams": gradcomp_streams,
        "backward events": len(rest),
        "backward streams": backward_streams,
        "shared streams": sorted(set(gradcomp_streams) & set(backward_streams), key=str),
        "gradcomp busy us": _length(mine_busy),
        "backward busy us": _length(rest_busy),
        "overlapped us": overlapped,
        "overlapped fraction": overlapped / _length(mine_busy) if mine_busy else None,
    }


def backward_ms(model, inputs, device: torch.device, repeats: int = 3) -> float:
    """Median milliseconds of a backward pass of ``model(inputs)`` (its forward outside)."""
    times = []
    for _ in range(repeats):
        loss = model(inputs).square().mean()
        gpu_setup.synchronize(device)
        began = time.perf_counter()
        loss.backward()
        gpu_setup.synchronize(device)
        times.append(1e3 * (time.perf_counter() - began))
    return sorted(times)[len(times) // 2]


def sized_batch(model, width: int, batch: int, device: torch.device, minimum_ms: float):
    """Inputs of ``batch`` rows, doubled until a backward pass takes ``minimum_ms``; (inputs, ms)."""
    generator = torch.Generator(device=device).manual_seed(1)
    for doubling in range(MAX_DOUBLINGS + 1):
        inputs = torch.randn(batch << doubling, width, device=device, generator=generator)
        took = backward_ms(model, inputs, device)
        if took >= minimum_ms:
            break
    return inputs, took


def overlap(device: torch.device, shape: dict, minimum_ms: float, trace_path: str | None, entry: dict):
    """One profiled backward pass of the hooked model (bucket rebuild and agreement before)."""
    from torch.profiler import profile

    model = torch.nn.parallel.DistributedDataParallel(
        linear_stack(shape["width"], shape["layers"]).to(device), bucket_cap_mb=OVERLAP_BUCKET_MB
    )
    inputs, without_hook = sized_batch(model, shape["width"], shape["batch"], device, minimum_ms)
    gradcomp.ddp.register(model, "int8", min_numel=0)
    with_hook = backward_ms(model, inputs, device)  # and the agreement check, the bucket rebuild
    workers = {t.native_id for t in threading.enumerate() if t.name == "gradcomp-collectives"}
    loss = model(inputs).square().mean()
    gpu_setup.synchronize(device)
    with profile(activities=gpu_setup.profiler_activities(device)) as trace:
        loss.backward()
        gpu_setup.synchronize(device)
    found = overlap_from_trace(gpu_setup.trace_events(trace, trace_path), workers, device.type)
    entry.update(
        batch=inputs.shape[0],
        bucket_sizes=model._get_ddp_logging_data().get("bucket_sizes"),
        backward_ms_without_hook=without_hook,
        backward_long_enough=without_hook >= minimum_ms,
        backward_ms_with_hook=with_hook,
        **found,
    )
    if device.type == "cuda":  # streams exist only there
        entry["ok"] = found["gradcomp events"] > 0 and not found["shared streams"]


# ----------------------------------------------------------------------------- compare


def mlp(width: int) -> torch.nn.Module:
    """256 inputs, 7 hidden layers of ``width``, 10 outputs; seeded without touching the global RNG."""
    layers = [torch.nn.Linear(256, width), torch.nn.ReLU()]
    for _ in range(6):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return gpu_setup.seeded(torch.nn.Sequential(*layers, torch.nn.Linear(width, 10)))


def train(rank: int, compressor: str, backend: str | None, device: torch.device, width: int):
    """Parameters after ``STEPS`` of SGD with the hook on ``backend`` (None: the default);
    compressor ``adam:NAME``: CompressedAdam exchanging momentum through NAME, no hook."""
    with gpu_setup.forced_backend(backend):
        if compressor.startswith("adam:"):
            model = mlp(width).to(device)
            optimizer = gradcomp.optim.CompressedAdam(
                model.parameters(), lr=1e-3, compressor=compressor[5:], warmup_steps=3
            )
        else:
            model = torch.nn.parallel.DistributedDataParallel(
                mlp(width).to(device), bucket_cap_mb=COMPARE_BUCKET_MB
            )
            gradcomp.ddp.register(model, compressor, min_numel=0)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            inputs = torch.randn(64, 256, generator=generator).to(device)
            labels = torch.randint(0, 10, (64,), generator=generator).to(device)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
        gpu_setup.synchronize(device)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


COMPARED = (("int8", 0.0), ("topk", 0.0), ("sign", 1e-5), ("adam:int8", 0.0))


def compare(rank: int, device: torch.device, width: int) -> dict:
    """The hook on the default backends against the torch backend: compressor -> result."""
    results = {}
    for compressor, tolerance in COMPARED:
        default = train(rank, compressor, None, device, width)
        reference = train(rank, compressor, "torch", device, width)
        difference = (default - reference).abs().max().item()
        same = difference <= tolerance * max(1.0, reference.abs().max().item())
        results[compressor] = {"max |difference|": difference, "same": same}
    return results


def _compare_on_rank(rank: int, world_size: int, device_type: str, width: int) -> dict:
    return compare(rank, gpu_setup.rank_device(device_type), width)


def record_comparison(results: dict, entry: dict) -> None:
    entry.update(results)
    entry["ok"] = all(result["same"] for result in results.values())


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = gpu_setup.parser(__doc__)
    parser.add_argument("--section", choices=("overlap", "compare"), required=True)
    parser.add_argument("--trace", help="keep the overlap profile's Chrome trace here")
    args = parser.parse_args(argv)
    device = gpu_setup.device_for(args.dry_run)
    shape = DRY_RUN_MODEL if args.dry_run else GPU_MODEL
    minimum_ms = 0.0 if args.dry_run else MIN_BACKWARD_MS
    if args.section == "overlap":
        settings = {**shape, "bucket_cap_mb": OVERLAP_BUCKET_MB, "min_backward_ms": minimum_ms}
        report = gpu_setup.Report(args.out, "ddp overlap", device, settings)
        with gpu_setup.one_rank_group(device), report.check("overlap with the backward pass") as entry:
            overlap(device, shape, minimum_ms, args.trace, entry)
        return report.finish()
    width = DRY_RUN_MLP_WIDTH if args.dry_run else GPU_MLP_WIDTH
    settings = {
        "steps": STEPS,
        "width": width,
        "bucket_cap_mb": COMPARE_BUCKET_MB,
        "compared": dict(COMPARED),
    }
    report = gpu_setup.Report(args.out, "ddp compare", device, settings)
    with report.check(f"one rank, {'NCCL' if device.type == 'cuda' else 'Gloo'}") as entry:
        with gpu_setup.one_rank_group(device):
            record_comparison(compare(0, device, width), entry)
    with report.check(f"two ranks, Gloo on {device.type.upper()} tensors") as entry:
        ranks = run_ranks(_compare_on_rank, 2, device.type, width, timeout=240, group_timeout=120)
        record_comparison(ranks, entry)
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
