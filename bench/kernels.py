"""How fast are the compression kernels? Each op against a device-to-device copy.

For every op and backend (the torch reference on the same device, Triton
where it runs) and every size, the median time of the fused
error-feedback op, its effective bandwidth (the bytes it must read and
write, over its time) and that bandwidth as a fraction of a plain copy's,
measured in the same run. Triton runs on CUDA tensors only here (its CPU
interpreter is for testing, not timing).

    python bench/kernels.py                      # 1M..256M elements on a GPU, 1M..4M on CPU
    python bench/kernels.py --sizes 64M --ops quantize_int8_ef,copy

Writes ``bench/results/kernels-<machine>.{csv,json}``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
import torch

import gradcomp
from gradcomp import ops

GPU_SIZES = "1M,4M,16M,64M,256M"
CPU_SIZES = "1M,4M"

# H200 targets from the project's issues, checked at this size when a GPU runs.
TARGET_SIZE = 64 * 2**20
TARGETS = {
    "quantize_int8_ef": (0.8, 3.0),
    "quantize_int4_ef": (0.8, 3.0),
    "sign_ef": (0.8, 3.0),
    "dequantize_int8_accumulate": (0.8, None),
}


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
    """name -> (bytes read + written, setup() -> run(op_lookup) callable)."""
    x, residual = _case(n, device)
    k = max(1, n // 100)
    codes8, scales8 = ops.reference.quantize_blockwise(x, 8, 256)
    signs, sign_scales = ops.reference.sign_compress(x, 1024)
    out = torch.zeros(n, device=device)
    copy_target = torch.empty_like(x)
    cases = {
        "copy": (8 * n, lambda impl: copy_target.copy_(x)),
        "quantize_int8_ef": (
            4 * n + 8 * n + n + 4 * (n // 256),
            lambda impl: impl("quantize_blockwise")(x, 8, 256, False, 0, residual),
        ),
        "quantize_int4_ef": (
            4 * n + 8 * n + n // 2 + 4 * (n // 256),
            lambda impl: impl("quantize_blockwise")(x, 4, 256, False, 0, residual),
        ),
        "quantize_int8_stochastic_ef": (
            4 * n + 8 * n + n + 4 * (n // 256),
            lambda impl: impl("quantize_blockwise")(x, 8, 256, True, 1, residual),
        ),
        "sign_ef": (
            4 * n + 8 * n + n // 8 + 4 * (n // 1024),
            lambda impl: impl("sign_compress")(x, 1024, residual),
        ),
        "dequantize_int8_accumulate": (
            n + 4 * (n // 256) + 8 * n,
            lambda impl: impl("dequantize_blockwise")(codes8, scales8, 8, 256, n, out, True),
        ),
        "sign_decode_accumulate": (
            n // 8 + 4 * (n // 1024) + 8 * n,
            lambda impl: impl("sign_decompress")(signs, sign_scales, 1024, n, out, True),
        ),
        "randk_1pct_ef": (4 * n + 8 * n + 8 * k, lambda impl: impl("randk_select")(x, k, 5, residual)),
        "topk_1pct_ef": (4 * n + 8 * n + 8 * k, lambda impl: impl("topk_select")(x, k, residual, seed=5)),
    }
    return cases


def backends_for(device: torch.device) -> list[str]:
    names = ["torch"]
    if device.type == "cuda":
        try:
            ops.implementation("quantize_blockwise", device)  # loads optional backends
            from gradcomp.ops import _REGISTRY

            names += [name for name in ("triton", "cuda") if name in _REGISTRY]
        except RuntimeError:
            pass
    return names


def lookup(backend: str):
    from gradcomp.ops import _REGISTRY

    functions = _REGISTRY[backend][1]
    return lambda op: functions[op]


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
    copy_bytes, copy = cases.pop("copy")
    copy_seconds = timed(lambda: copy(None), device, args.warmup, args.iters)
    copy_bandwidth = copy_bytes / copy_seconds
    records = [_record("copy", "copy", n, copy_bytes, copy_seconds, copy_bandwidth, copy_seconds)]
    for name in wanted or list(cases):
        nbytes, fn = cases[name]
        reference_seconds = None
        for backend in backends:
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


def run(args) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    default = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    sizes = [common.parse_size(s) for s in common.split_list([args.sizes or default])]
    wanted = [op for op in common.split_list([args.ops]) if op != "copy"] if args.ops else None
    backends = backends_for(device)
    records = []
    progress = common.Progress(total=len(sizes), enabled=args.progress)
    for position, n in enumerate(sizes):
        progress.update(position, f"{elements(n)} elements")
        records += measure_size(n, device, backends, wanted, args)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    progress.close()
    return records


def check_targets(records: list[dict]) -> list[str]:
    lines = []
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
    result.add_argument("--warmup", type=int, default=3)
    result.add_argument("--iters", type=int, default=10)
    result.add_argument(
        "--out", default=common.RESULTS, help=f"folder for CSV/JSON (default {common.RESULTS})"
    )
    result.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rewrite a progress line on stderr (default: when stderr is a terminal)",
    )
    return result


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    results = common.Results("kernels", common.machine(1, "single-process"), vars(args), directory=args.out)
    records = run(args)
    print(f"# machine: {results.machine['machine']}")
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
    ]
    print(common.format_table(header, rows))
    for line in check_targets(records):
        print(line)
    for path in results.write(records, extra={"gradcomp": gradcomp.__version__}):
        print(f"# wrote {path}")


if __name__ == "__main__":
    main()
