"""Every op of one backend, once each at 1, 1023 and 4097 elements: a driver for compute-sanitizer.

``bench/gpu_check.sh`` runs it under ``compute-sanitizer --tool memcheck``
once per GPU backend (cuda, then triton), with PyTorch's caching allocator
off so that every tensor is an allocation of its own and a read or write
past a tensor's end is one past an allocation's. The sizes are the odd
ones: a single element, one short of a power of two, one past a block.
Payload rows (``*_rows``, ``*_sum``) are called too, with a trailing row no
chunk uses. The block-scaled formats (MXFP8 and MXFP4 in blocks of 32,
NVFP4 in blocks of 16) meet the same sizes as a tail shorter than a block,
an odd number of E2M1 codes (two a byte) and a single element; their row
sums take three rows, the last ending where its allocation ends. Each call
goes through the op boundary (its checks complete the arguments) and is
followed by a synchronize, so that an error is reported at the call that
made it.

``--dry-run`` calls the cpu and torch backends' ops on CPU tensors: the
driver's own logic, without a GPU.

    compute-sanitizer --tool memcheck python bench/gpu_memcheck.py --backend cuda
    python bench/gpu_memcheck.py --dry-run
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator

import torch

from gradcomp import ops

SIZES = (1, 1023, 4097)
BLOCK = 256
SIGN_BLOCK = 1024
MX_BLOCK = 32  # OCP MX's block; MXFP8's elements are E4M3, MXFP4's E2M1
NVFP4_BLOCK = 16
# Inputs made by the reference, through the op boundary (it completes the arguments).
REFERENCE = ops.backend("torch")


def row_width(numel: int, bits: int, block: int) -> int:
    """Bytes of a payload row of ``numel`` elements (scales, codes, padding to 8), and 16 more."""
    return math.ceil((4 * math.ceil(numel / block) + math.ceil(numel * bits / 8)) / 8) * 8 + 16


def rows(count: int, numel: int, bits: int, block: int, device: torch.device) -> torch.Tensor:
    return torch.full((count, row_width(numel, bits, block)), 0xA5, dtype=torch.uint8, device=device)


def tight_rows(payloads: list[torch.Tensor]) -> torch.Tensor:
    """The payloads (uint8, one length) as rows 8 bytes apart, the last one ending where its
    allocation ends: a read past a payload's end in the last row is one past the allocation."""
    size = payloads[0].numel()
    stride = math.ceil(size / 8) * 8
    storage = torch.empty((len(payloads) - 1) * stride + size, dtype=torch.uint8, device=payloads[0].device)
    rows = storage.as_strided((len(payloads), size), (stride, 1))
    for row, payload in zip(rows, payloads, strict=True):
        row.copy_(payload)
    return rows


def block_scaled_cases(n: int, randn, device: torch.device) -> Iterator[tuple[str, str, tuple, dict]]:
    """The block-scaled formats' encoders, decoders and row sums at ``n`` elements."""
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for element in ("e4m3", "e2m1"):
            yield f"{element} {name}", "mx_quantize", (randn(n, dtype), element, MX_BLOCK, randn(n)), {}
        yield name, "nvfp4_quantize", (randn(n, dtype), NVFP4_BLOCK, randn(n)), {}

    def bfloat16() -> torch.Tensor:  # the narrowest output
        return torch.zeros(n, dtype=torch.bfloat16, device=device)

    for element in ("e4m3", "e2m1"):
        codes, scales = REFERENCE.mx_quantize(randn(n), element, MX_BLOCK)
        payload = (codes, scales, element, MX_BLOCK, n)
        yield f"{element} into bfloat16", "mx_dequantize", (*payload, bfloat16(), True), {}
        yield f"{element} allocated", "mx_dequantize", payload, {}
        rows = []
        for _ in range(3):  # a row per rank: the scales, then the codes
            codes, scales = REFERENCE.mx_quantize(randn(n), element, MX_BLOCK)
            rows.append(torch.cat([scales, codes]))
        sum_args = (tight_rows(rows), element, MX_BLOCK, n, bfloat16())
        yield element, "mx_dequantize_sum", sum_args, {"divisor": 3}
    codes, scales, tensor_scale = REFERENCE.nvfp4_quantize(randn(n), NVFP4_BLOCK)
    payload = (codes, scales, tensor_scale, NVFP4_BLOCK, n)
    yield "into bfloat16", "nvfp4_dequantize", (*payload, bfloat16(), True), {}
    yield "allocated", "nvfp4_dequantize", payload, {}
    rows = []
    for _ in range(3):  # the tensor scale's 4 bytes, the block scales, then the codes
        codes, scales, tensor_scale = REFERENCE.nvfp4_quantize(randn(n), NVFP4_BLOCK)
        rows.append(torch.cat([tensor_scale.view(torch.uint8), scales, codes]))
    yield "", "nvfp4_dequantize_sum", (tight_rows(rows), NVFP4_BLOCK, n, bfloat16()), {"divisor": 3}


def cases(n: int, device: torch.device) -> Iterator[tuple[str, str, tuple, dict]]:
    """``(label, op, args, kwargs)`` calling every op at ``n`` elements, rows variants included."""
    generator = torch.Generator(device=device).manual_seed(n)

    def randn(numel: int, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(numel, device=device, generator=generator).to(dtype)

    def zeros(numel: int) -> torch.Tensor:
        return torch.zeros(numel, device=device)

    k = max(1, n // 100)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        yield f"int8 {name}", "quantize_blockwise", (randn(n, dtype), 8, BLOCK, False, 0, randn(n)), {}
        yield f"sign {name}", "sign_compress", (randn(n, dtype), SIGN_BLOCK, randn(n)), {}
        yield f"approximate {name}", "topk_select", (randn(n, dtype), k, randn(n)), {}
    yield "int4 stochastic", "quantize_blockwise", (randn(n), 4, BLOCK, True, 3, randn(n)), {}
    codes, scales = REFERENCE.quantize_blockwise(randn(n), 8, BLOCK)
    yield "int8", "dequantize_blockwise", (codes, scales, 8, BLOCK, n, zeros(n), True), {}
    signs, sign_scales = REFERENCE.sign_compress(randn(n), SIGN_BLOCK)
    yield "sign", "sign_decompress", (signs, sign_scales, SIGN_BLOCK, n, zeros(n), True), {}

    chunk = 2 * BLOCK
    count = math.ceil(n / chunk) + 1  # a trailing row no chunk uses
    single = math.ceil(n / BLOCK) * BLOCK  # one chunk, whole blocks: a row per rank for the sums
    for bits in (8, 4):
        written = rows(count, chunk, bits, BLOCK, device)
        yield f"int{bits}", "quantize_rows", (randn(n), bits, BLOCK, chunk, written, False, 0, randn(n)), {}
        yield f"int{bits}", "dequantize_rows", (written, bits, BLOCK, n, chunk, zeros(n)), {}
        whole = rows(3, n, bits, BLOCK, device)
        for r in range(3):
            REFERENCE.quantize_rows(randn(n), bits, BLOCK, single, whole[r : r + 1])
        yield f"int{bits}", "dequantize_sum", (whole, bits, BLOCK, n, zeros(n)), {"divisor": 3}
    written = rows(count, chunk, 1, BLOCK, device)
    yield "sign", "sign_compress_rows", (randn(n), BLOCK, chunk, written, randn(n)), {}
    yield "sign", "sign_decompress_rows", (written, BLOCK, n, chunk, zeros(n)), {}
    whole = rows(3, n, 1, BLOCK, device)
    for r in range(3):
        REFERENCE.sign_compress_rows(randn(n), BLOCK, single, whole[r : r + 1])
    yield "sign", "sign_decompress_sum", (whole, BLOCK, n, zeros(n)), {"divisor": 3}
    yield from block_scaled_cases(n, randn, device)

    yield "exact", "topk_select", (randn(n), k, randn(n), True), {}
    yield "int64 indices", "topk_select", (randn(n), k, None, True), {"index_dtype": torch.int64}
    yield "", "randk_select", (randn(n), k, 7, randn(n)), {}
    yield "", "randk_indices", (n, k, 7, device), {}
    values, indices = REFERENCE.topk_select(randn(n), k, exact=True)
    yield "", "scatter_add", (indices, values, zeros(n)), {}
    for bits in (1, 2, 4):
        codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, device=device, generator=generator)
        yield f"{bits} bits", "pack_bits", (codes, bits), {}
        yield f"{bits} bits", "unpack_bits", (REFERENCE.pack_bits(codes, bits), bits, n), {}


def provides(backend: str, op: str, device: torch.device) -> bool:
    """Whether ``backend`` is installed, runs on ``device`` and has ``op``."""
    return ops.runs_on(backend, device) and op in ops.functions(backend)


def run(backend: str, device: torch.device) -> tuple[int, int]:
    """Call every op ``backend`` has at every size; (calls, calls that raised). A call
    that raises is reported and the next one runs."""
    calls = raised = 0
    for n in SIZES:
        for label, op, args, kwargs in cases(n, device):
            if not provides(backend, op, device):
                continue
            calls += 1
            try:
                getattr(ops.backend(backend), op)(*args, **kwargs)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except Exception as error:  # noqa: BLE001 - reported; the other ops still run
                raised += 1
                print(f"{backend} {op} {label} at {n}: RAISED {type(error).__name__}: {error}", flush=True)
            else:
                print(f"{backend} {op} {label} at {n}: ran", flush=True)
    return calls, raised


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", help="cuda or triton (repeatable; default both)")
    parser.add_argument("--dry-run", action="store_true", help="the cpu and torch backends on CPU tensors")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, backends = torch.device("cpu"), args.backend or ["cpu", "torch"]
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_memcheck: needs a CUDA GPU (--dry-run runs it on CPU)")
    else:
        device, backends = torch.device("cuda", 0), args.backend or ["cuda", "triton"]
    failed = False
    for backend in backends:
        calls, raised = run(backend, device)
        print(f"# {backend}: {calls} calls on {device}, {raised} raised", flush=True)
        if calls == 0:  # a backend asked for that cannot run checks nothing: a failure, not a pass
            print(f"# {backend}: not installed or not available here (the reason is logged)", flush=True)
        failed |= raised > 0 or calls == 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
