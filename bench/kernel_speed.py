"""How fast are the compression kernels? Each op against a device-to-device copy.

For every op and backend (the torch reference on the same device, the cpu
backend on CPU tensors, Triton and the CUDA kernels of csrc/ where they run,
each for the ops it has) and every size, the median time of the fused
error-feedback op, its effective bandwidth (the bytes it must read and
write, over its time) and that bandwidth as a fraction of a plain copy's,
measured in the same run. Triton and CUDA run on CUDA tensors only here
(Triton's CPU interpreter is for testing, not timing).

A second section times Top-K on every backend that has it (on a GPU
Triton's one-pass sampling path, which dispatch picks, and the CUDA radix
select; on CPU the cpu backend): the fused op (selection, values, indices,
residual update) against ``torch.topk(x.abs(), k)`` at 0.1%, 1% and 10% of
16M..256M fp32 elements on a GPU (1M on CPU), and both against one
device-to-device copy of the input.

Backends are called directly, without the op boundary's checks, so that the
timings are the kernels'; the first call of each op is checked to pass the
arguments the boundary would complete (``levels``, ``index_dtype``): a
backend completes nothing (the CUDA one fails on ``index_dtype=None``), and a
run on CPU finds a call that forgets one before a GPU does.

    python bench/kernel_speed.py                 # 1M..256M elements on a GPU, 1M..4M on CPU
    python bench/kernel_speed.py --sizes 64M --ops quantize_int8_ef,copy --topk-sizes 64M

Writes ``bench/results/kernels-<machine>.{csv,json}``, again after every
size: a run stopped midway keeps the sizes it finished.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import statistics
import time
from collections.abc import Iterator

import torch
from lib.machine import machine
from lib.options import add_output_options
from lib.progress import Progress
from lib.results import Results

import gradcomp
from gradcomp import ops
from gradcomp.ops import checks, reference
from gradcomp.tables import format_table
from gradcomp.units import parse_size, split_list

GPU_SIZES = "1M,4M,16M,64M,256M"
CPU_SIZES = "1M,4M"
TOPK_SIZES = "16M,64M,256M"
CPU_TOPK_SIZES = "1M"
TOPK_RATIOS = "0.001,0.01,0.1"

# H200 targets from the project's issues, checked at this size when a GPU runs.
TARGET_SIZE = 64 * 2**20
TARGETS = {
    "quantize_int8_ef": (0.8, 3.0),
    "quantize_int4_ef": (0.8, 3.0),
    "sign_ef": (0.8, 3.0),
    "dequantize_int8_accumulate": (0.8, None),
    "quantize_mxfp8_ef": (0.8, None),
    "quantize_mxfp4_ef": (0.8, None),
    "quantize_nvfp4_ef": (0.8, None),
    "dequantize_mxfp8_accumulate": (0.8, None),
    "dequantize_mxfp4_accumulate": (0.8, None),
    "dequantize_nvfp4_accumulate": (0.8, None),
}
# The fused Top-K at 1% on the backend dispatch picks, at 64M and 256M elements: at least
# this fraction of a copy's bandwidth (the op section) and this many times faster than
# torch.topk(x.abs(), k) (the Top-K section).
TOPK_TARGET = {"ratio": 0.01, "fraction_of_copy": 0.4, "speedup": 3.0, "sizes": (64 * 2**20, 256 * 2**20)}


def elements(n: int) -> str:
    """``1M``, ``64M``, ``1023``: element counts as the --sizes option takes them."""
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _case(n: int, device: torch.device, seed: int = 0):
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, device=device, generator=generator)
    residual = torch.zeros(n, device=device)
    return x, residual


def build_cases(n: int, device: torch.device):
    """name -> (op it runs, bytes read + written, run(op_lookup) callable)."""
    x, residual = _case(n, device)
    k = max(1, n // 100)
    codes8, scales8 = ops.backend("torch").quantize_blockwise(x, 8, 256)
    signs, sign_scales = ops.backend("torch").sign_compress(x, 1024)
    mxfp8, mxfp4 = (ops.backend("torch").mx_quantize(x, element) for element in ("e4m3", "e2m1"))
    nvfp4 = ops.backend("torch").nvfp4_quantize(x)
    # Backends are called directly, with complete arguments (what the op
    # boundary's checks would complete): the timings are the kernels'.
    int8, int4, index_dtype = {"levels": 127}, {"levels": 7}, reference.index_dtype_for(n)
    out = torch.zeros(n, device=device)
    copy_target = torch.empty_like(x)
    # Every fused error-feedback op reads x and the residual and writes the
    # residual (12 bytes an element), plus its payload; a decode-accumulate
    # reads and writes the output (8 bytes an element), plus the payload.
    feedback, accumulate = 12 * n, 8 * n
    int8_payload, int4_payload = n + 4 * (n // 256), n // 2 + 4 * (n // 256)
    sign_payload, sparse_payload = n // 8 + 4 * (n // 1024), 8 * k
    mxfp8_payload, mxfp4_payload, nvfp4_payload = n + n // 32, n // 2 + n // 32, n // 2 + n // 16 + 4
    # NVFP4's tensor scale is the absmax of x + residual, known only once the whole
    # tensor is read: its encoder reads x and the residual twice (8 bytes an element more).
    nvfp4_feedback = feedback + 8 * n
    seeds = itertools.count(5)
    cases = {
        "copy": (None, 8 * n, lambda impl: copy_target.copy_(x)),
        "quantize_int8_ef": (
            "quantize_blockwise",
            feedback + int8_payload,
            lambda impl: impl("quantize_blockwise")(x, 8, 256, False, 0, residual, **int8),
        ),
        "quantize_int4_ef": (
            "quantize_blockwise",
            feedback + int4_payload,
            lambda impl: impl("quantize_blockwise")(x, 4, 256, False, 0, residual, **int4),
        ),
        "quantize_int8_stochastic_ef": (
            "quantize_blockwise",
            feedback + int8_payload,
            lambda impl: impl("quantize_blockwise")(x, 8, 256, True, 1, residual, **int8),
        ),
        "sign_ef": (
            "sign_compress",
            feedback + sign_payload,
            lambda impl: impl("sign_compress")(x, 1024, residual),
        ),
        "dequantize_int8_accumulate": (
            "dequantize_blockwise",
            accumulate + int8_payload,
            lambda impl: impl("dequantize_blockwise")(codes8, scales8, 8, 256, n, out, True, **int8),
        ),
        "quantize_mxfp8_ef": (
            "mx_quantize",
            feedback + mxfp8_payload,
            lambda impl: impl("mx_quantize")(x, "e4m3", 32, residual),
        ),
        "quantize_mxfp4_ef": (
            "mx_quantize",
            feedback + mxfp4_payload,
            lambda impl: impl("mx_quantize")(x, "e2m1", 32, residual),
        ),
        "quantize_nvfp4_ef": (
            "nvfp4_quantize",
            nvfp4_feedback + nvfp4_payload,
            lambda impl: impl("nvfp4_quantize")(x, 16, residual),
        ),
        "dequantize_mxfp8_accumulate": (
            "mx_dequantize",
            accumulate + mxfp8_payload,
            lambda impl: impl("mx_dequantize")(*mxfp8, "e4m3", 32, n, out, True),
        ),
        "dequantize_mxfp4_accumulate": (
            "mx_dequantize",
            accumulate + mxfp4_payload,
            lambda impl: impl("mx_dequantize")(*mxfp4, "e2m1", 32, n, out, True),
        ),
        "dequantize_nvfp4_accumulate": (
            "nvfp4_dequantize",
            accumulate + nvfp4_payload,
            lambda impl: impl("nvfp4_dequantize")(*nvfp4, 16, n, out, True),
        ),
        "sign_decode_accumulate": (
            "sign_decompress",
            accumulate + sign_payload,
            lambda impl: impl("sign_decompress")(signs, sign_scales, 1024, n, out, True),
        ),
        "randk_1pct_ef": (
            "randk_select",
            feedback + sparse_payload,
            # A new seed every call, as every step has: recent indices are reused.
            lambda impl: impl("randk_select")(x, k, next(seeds), residual),
        ),
        "topk_1pct_ef": (
            "topk_select",
            feedback + sparse_payload,
            lambda impl: impl("topk_select")(x, k, residual, seed=5, index_dtype=index_dtype),
        ),
    }
    return cases


def backends_for(device: torch.device) -> list[str]:
    """``torch`` and every optional backend that is installed and runs on ``device``."""
    names = ["torch"]
    if device.type == "cpu":
        names.append("cpu")
    if device.type == "cuda":
        names += [name for name in ("triton", "cuda") if ops.runs_on(name, device)]
    return names


def provides(backend: str, op: str) -> bool:
    return op in ops.functions(backend)


def incomplete_arguments(op: str, args: tuple, kwargs: dict) -> list[str]:
    """The arguments of a call of ``op`` left None that the op boundary would complete
    (:mod:`gradcomp.ops.checks`): a backend called directly gets them as they are."""
    given = inspect.signature(getattr(reference, op)).bind(*args, **kwargs)
    given.apply_defaults()
    completed = checks.checked(op, args, kwargs).arguments
    return [name for name, value in completed.items() if given.arguments[name] is None and value is not None]


def lookup(backend: str):
    """``op -> function`` of ``backend``, called directly (no checks in a timed loop).
    The first call of each op is checked for arguments the op boundary would have
    completed (``TypeError``): backends complete nothing."""
    functions, checked = ops.functions(backend), set()

    def find(op: str):
        function = functions[op]

        def call(*args, **kwargs):
            if op not in checked:
                missing = incomplete_arguments(op, args, kwargs)
                if missing:
                    raise TypeError(
                        f"{backend} {op} called directly with {', '.join(missing)} left None: the op "
                        "boundary completes them (gradcomp.ops.checks), a backend does not; pass them"
                    )
                checked.add(op)
            return function(*args, **kwargs)

        return call

    return find


def timed(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of ``fn()``; CUDA timings with events, no host sync inside the loop."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    times = []
    for _ in range(iters):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure_size(
    n: int, device: torch.device, backends: list[str], wanted: list[str] | None, args
) -> list[dict]:
    """Records of every op and backend at ``n`` elements, the copy measured first."""
    cases = build_cases(n, device)
    _, copy_bytes, copy = cases.pop("copy")
    copy_seconds = timed(lambda: copy(None), device, args.warmup, args.iters)
    copy_bandwidth = copy_bytes / copy_seconds
    records = [_record("copy", "copy", n, copy_bytes, copy_seconds, copy_bandwidth, copy_seconds)]
    for name in wanted or list(cases):
        op, nbytes, fn = cases[name]
        reference_seconds = None
        for backend in [backend for backend in backends if provides(backend, op)]:
            impl = lookup(backend)
            seconds = timed(lambda fn=fn, impl=impl: fn(impl), device, args.warmup, args.iters)
            reference_seconds = reference_seconds or seconds
            records.append(_record(name, backend, n, nbytes, seconds, copy_bandwidth, reference_seconds))
    return records


def _record(op, backend, n, nbytes, seconds, copy_bandwidth, reference_seconds) -> dict:
    return {
        "op": op,
        "backend": backend,
        "elements": n,
        "bytes_moved": nbytes,
        "median_ms": seconds * 1e3,
        "gb_per_s": nbytes / seconds / 1e9,
        "fraction_of_copy": nbytes / seconds / copy_bandwidth,
        "speedup_vs_torch": reference_seconds / seconds,
    }


def topk_label(ratio: float) -> str:
    """``0.01`` -> ``"topk_1pct"``."""
    return f"topk_{ratio * 100:g}pct"


def topk_backends(backends: list[str]) -> list[str]:
    """The backends the Top-K section times, dispatch's choice first: every one here that
    has ``topk_select``, but the torch reference where another has it."""
    having = [
        name for name in ops.preference("topk_select") if name in backends and provides(name, "topk_select")
    ]
    return [name for name in having if name != "torch"] or having


def measure_topk(n: int, device: torch.device, backends: list[str], ratios: list[float], args) -> list[dict]:
    """Each backend's fused Top-K (with a residual) and ``torch.topk(x.abs(), k)`` at
    ``n`` fp32 elements, each against one device-to-device copy of the input."""
    x = torch.randn(n, device=device, generator=torch.Generator(device=device).manual_seed(0))
    residual = torch.zeros(n, device=device)
    copy_target = torch.empty_like(x)
    copy_seconds = timed(lambda: copy_target.copy_(x), device, args.warmup, args.iters)
    index_dtype = reference.index_dtype_for(n)
    records = []
    for ratio in ratios:
        k = max(1, round(ratio * n))
        baseline = timed(lambda k=k: torch.topk(x.abs(), k, sorted=False), device, args.warmup, args.iters)
        timings = [("torch.topk", baseline)]
        for backend in backends:
            select = lookup(backend)("topk_select")
            seconds = timed(
                lambda k=k, select=select: select(x, k, residual, False, seed=5, index_dtype=index_dtype),
                device,
                args.warmup,
                args.iters,
            )
            timings.append((backend, seconds))
        for name, seconds in timings:
            records.append(
                {
                    "op": topk_label(ratio),
                    "backend": name,
                    "elements": n,
                    "k": k,
                    "median_ms": seconds * 1e3,
                    "copy_ms": copy_seconds * 1e3,
                    "times_copy": seconds / copy_seconds,
                    "speedup_vs_torch_topk": baseline / seconds,
                }
            )
    return records


def run(args) -> Iterator[list[dict]]:
    """The records of each size, then of each Top-K size, as each is measured."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    sizes = [parse_size(s) for s in split_list([args.sizes or (GPU_SIZES if on_gpu else CPU_SIZES)])]
    wanted = [op for op in split_list([args.ops]) if op != "copy"] if args.ops else None
    backends = backends_for(device)
    topk = (TOPK_SIZES if on_gpu else CPU_TOPK_SIZES) if args.topk_sizes is None else args.topk_sizes
    topk_sizes = [parse_size(s) for s in split_list([topk])]
    ratios = [float(r) for r in split_list([args.topk_ratios])]
    progress = Progress(total=len(sizes) + len(topk_sizes), enabled=args.progress)
    for position, n in enumerate(sizes):
        progress.update(position, f"{elements(n)} elements")
        yield measure_size(n, device, backends, wanted, args)
        if on_gpu:
            torch.cuda.empty_cache()
    for position, n in enumerate(topk_sizes, start=len(sizes)):
        progress.update(position, f"Top-K at {elements(n)} elements")
        yield measure_topk(n, device, topk_backends(backends), ratios, args)
        if on_gpu:
            torch.cuda.empty_cache()
    progress.close()


def check_targets(records: list[dict]) -> list[str]:
    lines = []
    label = topk_label(TOPK_TARGET["ratio"])
    for n in TOPK_TARGET["sizes"]:
        fused = [r for r in records if r["op"] == "topk_1pct_ef" and r["elements"] == n and "gb_per_s" in r]
        alone = [
            r for r in records if r["op"] == label and r["elements"] == n and r["backend"] != "torch.topk"
        ]
        if not fused or not alone:
            continue
        chosen = alone[0]["backend"]  # dispatch's choice comes first
        fraction = next((r["fraction_of_copy"] for r in fused if r["backend"] == chosen), None)
        speedup = alone[0]["speedup_vs_torch_topk"]
        met = fraction is not None and fraction >= TOPK_TARGET["fraction_of_copy"]
        met = met and speedup >= TOPK_TARGET["speedup"]
        shown = "n/a" if fraction is None else f"{fraction:.0%}"
        lines.append(
            f"{chosen} fused Top-K at 1% of {elements(n)}: {shown} of copy "
            f"(target {TOPK_TARGET['fraction_of_copy']:.0%}), {speedup:.1f}x torch.topk "
            f"(target {TOPK_TARGET['speedup']:g}x)" + (" -- met" if met else " -- MISSED")
        )
    for op, (fraction, speedup) in TARGETS.items():
        for record in records:
            if record["op"] == op and record["backend"] == "triton" and record["elements"] == TARGET_SIZE:
                ok_fraction = record["fraction_of_copy"] >= fraction
                ok_speedup = speedup is None or record["speedup_vs_torch"] >= speedup
                lines.append(
                    f"{op} at 64M: {record['fraction_of_copy']:.0%} of copy (target {fraction:.0%})"
                    + (
                        f", {record['speedup_vs_torch']:.1f}x torch (target {speedup:.0f}x)"
                        if speedup
                        else ""
                    )
                    + (" -- met" if ok_fraction and ok_speedup else " -- MISSED")
                )
    return lines


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    result.add_argument(
        "--sizes", help=f"elements, e.g. 1M,64M (default {GPU_SIZES} on GPU, {CPU_SIZES} on CPU)"
    )
    result.add_argument("--ops", help="comma list of ops (default all)")
    result.add_argument(
        "--topk-sizes",
        help=(
            f"elements of the Top-K section (default {TOPK_SIZES} on GPU, {CPU_TOPK_SIZES} on CPU; "
            "'' for none)"
        ),
    )
    result.add_argument(
        "--topk-ratios",
        default=TOPK_RATIOS,
        help=f"k / elements in the Top-K section (default {TOPK_RATIOS})",
    )
    result.add_argument("--warmup", type=int, default=3)
    result.add_argument("--iters", type=int, default=10)
    add_output_options(result)
    return result


def print_tables(records: list[dict]) -> None:
    """The op table and the Top-K table of ``records`` (either may be empty)."""
    header = ["op", "backend", "elements", "median ms", "GB/s", "of copy", "vs torch"]
    rows = [
        [
            r["op"],
            r["backend"],
            elements(r["elements"]),
            f"{r['median_ms']:.3f}",
            f"{r['gb_per_s']:.1f}",
            f"{r['fraction_of_copy']:.0%}",
            f"{r['speedup_vs_torch']:.2f}x",
        ]
        for r in records
        if "gb_per_s" in r
    ]
    if rows:
        print(format_table(header, rows), flush=True)
    topk = [r for r in records if "speedup_vs_torch_topk" in r]
    if topk:
        print("# Top-K: each backend's fused op (with a residual) vs torch.topk(x.abs(), k), fp32")
        header = ["k / n", "backend", "elements", "k", "median ms", "copy ms", "x copy", "vs torch.topk"]
        rows = [
            [
                r["op"],
                r["backend"],
                elements(r["elements"]),
                str(r["k"]),
                f"{r['median_ms']:.3f}",
                f"{r['copy_ms']:.3f}",
                f"{r['times_copy']:.2f}x",
                f"{r['speedup_vs_torch_topk']:.2f}x",
            ]
            for r in topk
        ]
        print(format_table(header, rows), flush=True)


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    results = Results("kernel_speed", machine(1, "single-process"), vars(args), directory=args.out)
    print(f"# machine: {results.machine['machine']}", flush=True)
    records: list[dict] = []
    paths: list[str] = []
    for measured in run(args):  # written after every size: a run stopped midway keeps them
        records += measured
        print_tables(measured)
        paths = results.write(records, extra={"gradcomp": gradcomp.__version__})
    for line in check_targets(records):
        print(line)
    for path in paths:
        print(f"# wrote {path}")


if __name__ == "__main__":
    main()
