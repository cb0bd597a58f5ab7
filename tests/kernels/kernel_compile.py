"""Compile every Triton kernel of gradcomp for a GPU, on a machine without one.

Run as a script (``python tests/kernels/kernel_compile.py --arch 80 90``), never in
a process where ``TRITON_INTERPRET=1`` defined the kernels: it prints one JSON
line per compiled specialization and exits non-zero if any failed.

How: Triton's active driver is replaced by one that reports a fixed
``GPUTarget`` and launching is replaced by compiling (``warmup``). The
launchers then run as they do on a GPU, on CPU tensors whose memory is never
read, so every specialization they produce (pointer dtypes, constexpr
flags, integers equal to 1 or divisible by 16) goes through Triton's real
compiler and ptxas. Each specialization is compiled a second time with its
sizes (``numel``, ``nbytes``, ``k``, ``count``, ``row_stride``) above 2**31,
as 64-bit integers, the way a tensor of more than 2**31 elements reaches the
kernel. A row stride that fits 32 bits still addresses a gathered buffer of
2 GiB or more once a row index multiplies it: each record counts the
products of ``row_stride`` the kernel's Triton IR forms in 32 bits.

The cases call the launchers with every input dtype, residual dtype, output
dtype, bit width, ``levels`` (1 included), rounding mode, block (packed and
straddling bytes), block-scaled element format, ``numel`` 1 and odd, and
index dtype they accept.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator

# Sizes that reach 2**31 on large tensors: compiled again as 64-bit integers.
SIZE_PARAMETERS = ("numel", "nbytes", "k", "count", "total_blocks", "row_stride")
WIDE = 2**31 + 3
# Strides a row index multiplies: the product passes 2**31 (row 2 of a buffer
# of 1 GiB rows) while the stride itself reaches the kernel as a 32-bit integer.
ROW_STRIDE_PARAMETERS = ("row_stride",)

FLOATS = ("float32", "float16", "bfloat16", "float64")


class CompileOnlyDriver:
    """What ``JITFunction.run`` asks of Triton's driver, for a GPU that is not there."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def compile_only(arch: int, records: list[dict]) -> Iterator[None]:
    """Within: every kernel launch compiles for ``sm_<arch>`` instead; one record each."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    original, previous = JITFunction.run, driver._active

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = _compile(original, self, args, kwargs, grid, records, wide=False)
        # Positional arguments only: constexprs come as keywords.
        names = self.arg_names[: len(args)]
        sizes = [
            name in SIZE_PARAMETERS and isinstance(value, int)
            for name, value in zip(names, args, strict=True)
        ]
        if any(sizes):
            wide = [WIDE if size else value for size, value in zip(sizes, args, strict=True)]
            _compile(original, self, wide, kwargs, grid, records, wide=True)
        return kernel

    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    JITFunction.run = compile_instead
    try:
        yield
    finally:
        JITFunction.run = original
        driver._active = previous  # reset_active() would look for a GPU driver


def _compile(original, function, args, kwargs, grid, records: list[dict], wide: bool):
    record = {"kernel": function.fn.__name__, "wide": wide}
    try:
        kernel = original(function, *args, grid=grid, warmup=True, **kwargs)
    except Exception as error:  # noqa: BLE001 - reported, then the run fails
        record["error"] = "".join(traceback.format_exception_only(error))[-3000:]
        records.append(record)
        return None
    ptx = kernel.asm["ptx"]
    record.update(
        signature={k: str(v) for k, v in kernel.src.signature.items()},
        constants={str(k): repr(v) for k, v in kernel.src.constants.items()},
        fp_fusion=bool(kernel.metadata.enable_fp_fusion),
        # PTX instructions that round differently from torch: a fused
        # multiply-add (one rounding for two), flushed subnormals, approximations
        # (``div.full.f32``, what Triton makes of ``/`` between fp32 values, is one:
        # within 2 ulp, where torch's division is correctly rounded).
        fma=sum("fma.rn.f32" in line for line in ptx.splitlines()),
        ftz=sum(".ftz" in line for line in ptx.splitlines()),
        approximate=sum(".approx" in line or "div.full" in line for line in ptx.splitlines()),
        narrow_row_offsets=sum(
            len(narrow_products(kernel.asm["ttir"], name))
            for name in ROW_STRIDE_PARAMETERS
            if name in function.arg_names
        ),
        arch=kernel.metadata.target.arch,
        # What a launch is specialised on besides types and constants (divisibility by 16).
        attrs=repr(sorted(kernel.src.attrs.items())),
    )
    records.append(record)
    return kernel


_DEFINITION = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*([\w.]+)(.*)$")


def narrow_products(ttir: str, parameter: str) -> list[str]:
    """The lines of ``ttir`` (Triton IR, one operation a line) that multiply a
    value made from argument ``parameter`` in fewer than 64 bits.

    A value is made from ``parameter`` if an operation on it or on such a value
    produced it (``row_stride // 4``, a splat of it), until a sign or zero
    extension widens it to 64 bits: a product of that can no longer wrap.
    """
    made = {f"%{parameter}"}
    found = []
    for line in ttir.splitlines():
        definition = _DEFINITION.match(line)
        if definition is None:
            continue
        result, operation, rest = definition.groups()
        code = rest.split(" loc(")[0]
        operands = {re.sub(r"#\d+$", "", name) for name in re.findall(r"%[\w.$#-]+", code)}
        if not operands & made:
            continue
        types = code.rsplit(" : ", 1)[-1]
        if operation in ("arith.extsi", "arith.extui") and types.endswith(("i64", "xi64>")):
            continue
        made.add(result)
        if operation == "arith.muli" and not types.endswith(("i64", "xi64>")):
            found.append(line.strip())
    return found


# ----------------------------------------------------------------------------- cases


def _cases() -> list[tuple[str, Callable[[], object]]]:
    """(description, call) for every launcher variant; calls build their CPU tensors."""
    import torch

    from gradcomp import kernels
    from gradcomp.ops import triton_backend

    dtype = {name: getattr(torch, name) for name in FLOATS}
    cases = []

    def add(description: str, call: Callable[[], object]) -> None:
        cases.append((description, call))

    def tensor(numel: int, name: str = "float32"):
        return torch.zeros(numel, dtype=dtype[name])

    # (numel, block) pairs in rotation: divisible by 16 and packed, odd and
    # straddling bytes, a single element in a single-element block.
    shapes = itertools.cycle([(4096, 256), (1023, 255), (1, 1), (4097, 100)])
    # Rows hold whole bytes of codes a block: blocks of 256 and 128, sizes odd and even.
    rows_shapes = itertools.cycle([(4096, 256), (1023, 128), (4097, 256), (1, 128)])
    quantizers = [
        (8, 127, "absmax"),
        (4, 7, "absmax"),
        (2, 1, "absmax"),
        (2, 1, "norm"),
        (4, 7, "norm"),
    ]
    residuals = [None, "float32", "same"]
    for x_name, residual, (bits, levels, scale), stochastic in itertools.product(
        FLOATS, residuals, quantizers, (False, True)
    ):
        if residual == "same" and x_name == "float32":
            continue
        numel, block = next(shapes)
        r_name = x_name if residual == "same" else residual

        def quantize(
            x_name=x_name,
            r_name=r_name,
            numel=numel,
            block=block,
            bits=bits,
            levels=levels,
            scale=scale,
            stochastic=stochastic,
        ):
            r = None if r_name is None else tensor(numel, r_name)
            return kernels.quantize_blockwise(
                tensor(numel, x_name), bits, block, stochastic, 5, r, levels=levels, scale=scale
            )

        add(
            f"quantize x={x_name} r={r_name} bits={bits} levels={levels} {scale} "
            f"stochastic={stochastic} numel={numel} block={block}",
            quantize,
        )
    for out_name, accumulate, (bits, levels, _) in itertools.product(
        (None, *FLOATS), (False, True), quantizers
    ):
        if out_name is None and accumulate:
            continue
        numel, block = next(shapes)

        def dequantize(
            out_name=out_name, accumulate=accumulate, bits=bits, levels=levels, numel=numel, block=block
        ):
            codes = torch.zeros(-(-numel * bits // 8), dtype=torch.uint8)
            scales = torch.zeros(-(-numel // block))
            out = None if out_name is None else tensor(numel, out_name)
            return kernels.dequantize_blockwise(
                codes, scales, bits, block, numel, out, accumulate, levels=levels
            )

        add(
            f"dequantize out={out_name} accumulate={accumulate} bits={bits} levels={levels} "
            f"numel={numel} block={block}",
            dequantize,
        )
    for x_name, residual, (bits, levels, scale), stochastic in itertools.product(
        FLOATS, (None, "float32"), quantizers, (False, True)
    ):
        numel, block = next(rows_shapes)

        def quantize_rows(
            x_name=x_name,
            residual=residual,
            bits=bits,
            levels=levels,
            scale=scale,
            stochastic=stochastic,
            numel=numel,
            block=block,
        ):
            r = None if residual is None else tensor(numel, residual)
            rows = torch.zeros(4, 8 * (numel // 8 + 2), dtype=torch.uint8)
            return kernels.quantize_rows(
                tensor(numel, x_name),
                bits,
                block,
                2 * block,
                rows,
                stochastic,
                5,
                r,
                levels=levels,
                scale=scale,
            )

        add(
            f"quantize_rows x={x_name} r={residual} bits={bits} levels={levels} {scale} "
            f"stochastic={stochastic} numel={numel} block={block}",
            quantize_rows,
        )
    for out_name, (bits, levels, _) in itertools.product(FLOATS, quantizers):
        numel, block = next(rows_shapes)

        def dequantize_rows(out_name=out_name, bits=bits, levels=levels, numel=numel, block=block):
            rows = torch.zeros(4, 8 * (numel // 8 + 2), dtype=torch.uint8)
            out = tensor(numel, out_name)
            kernels.dequantize_rows(rows, bits, block, numel, 2 * block, out, levels=levels)
            return kernels.dequantize_sum(rows, bits, block, numel, out, levels=levels, divisor=3)

        add(
            f"dequantize_rows out={out_name} bits={bits} levels={levels} numel={numel} block={block}",
            dequantize_rows,
        )
    for x_name, residual, out_name in itertools.product(FLOATS, (None, "float32"), FLOATS):
        numel, block = next(rows_shapes)

        def sign_rows(x_name=x_name, residual=residual, out_name=out_name, numel=numel, block=block):
            rows = torch.zeros(4, 8 * (numel // 8 + 2), dtype=torch.uint8)
            r = None if residual is None else tensor(numel, residual)
            kernels.sign_compress_rows(tensor(numel, x_name), block * 8, 16 * block, rows, r)
            kernels.sign_decompress_rows(rows, block * 8, numel, 16 * block, tensor(numel, out_name))
            return kernels.sign_decompress_sum(rows, block * 8, numel, tensor(numel, out_name), divisor=2)

        add(f"sign_rows x={x_name} r={residual} out={out_name} numel={numel} block={block * 8}", sign_rows)
    # The block-scaled formats: MXFP8, MXFP4 (blocks of 32) and NVFP4 (16), sizes odd and even.
    scaled_shapes = itertools.cycle([4096, 1023, 1, 4097])
    for x_name, residual, element in itertools.product(FLOATS, residuals, ("e4m3", "e2m1", "nvfp4")):
        if residual == "same" and x_name == "float32":
            continue
        numel, r_name = next(scaled_shapes), x_name if residual == "same" else residual

        def scaled(x_name=x_name, r_name=r_name, element=element, numel=numel):
            r = None if r_name is None else tensor(numel, r_name)
            if element == "nvfp4":
                return kernels.nvfp4_quantize(tensor(numel, x_name), 16, r)
            return kernels.mx_quantize(tensor(numel, x_name), element, 32, r)

        # NVFP4's encoder is a launcher of its own (three kernels): its first case compiles too.
        launcher = "block_scaled_nvfp4" if element == "nvfp4" else "block_scaled"
        add(f"{launcher} {element} x={x_name} r={r_name} numel={numel}", scaled)
    for out_name, accumulate, element in itertools.product((None, *FLOATS), (False, True), ("e4m3", "e2m1")):
        if out_name is None and accumulate:
            continue
        numel = next(scaled_shapes)

        def scaled_decode(out_name=out_name, accumulate=accumulate, element=element, numel=numel):
            out = None if out_name is None else tensor(numel, out_name)
            codes = torch.zeros(numel, dtype=torch.uint8)
            scales = torch.zeros(-(-numel // 16), dtype=torch.uint8)
            kernels.nvfp4_dequantize(codes, scales, torch.ones(1), 16, numel, out, accumulate)
            return kernels.mx_dequantize(codes, scales, element, 32, numel, out, accumulate)

        add(
            f"block_scaled_decode {element} out={out_name} accumulate={accumulate} numel={numel}",
            scaled_decode,
        )
    for out_name, element in itertools.product(FLOATS, ("e4m3", "e2m1")):
        numel = next(scaled_shapes)

        def scaled_rows(out_name=out_name, element=element, numel=numel):
            rows = torch.zeros(4, 8 * (numel // 8 + 2) + 8 * (numel // 16 + 2), dtype=torch.uint8)
            kernels.nvfp4_dequantize_sum(rows, 16, numel, tensor(numel, out_name), divisor=3)
            return kernels.mx_dequantize_sum(rows, element, 32, numel, tensor(numel, out_name), divisor=3)

        add(f"block_scaled_rows {element} out={out_name} numel={numel}", scaled_rows)
    for bits, numel in itertools.product((1, 2, 4), (1, 7, 4096)):
        add(
            f"pack bits={bits} numel={numel}",
            lambda bits=bits, numel=numel: kernels.pack_bits(torch.zeros(numel, dtype=torch.uint8), bits),
        )
        add(
            f"unpack bits={bits} numel={numel}",
            lambda bits=bits, numel=numel: kernels.unpack_bits(
                torch.zeros(numel, dtype=torch.uint8), bits, numel
            ),
        )
    for x_name, residual in itertools.product(FLOATS, residuals):
        if residual == "same" and x_name == "float32":
            continue
        r_name = x_name if residual == "same" else residual
        for numel, block in [(4096, 1024), (1023, 100), (1, 1)]:

            def sign(x_name=x_name, r_name=r_name, numel=numel, block=block):
                r = None if r_name is None else tensor(numel, r_name)
                return kernels.sign_compress(tensor(numel, x_name), block, r)

            add(f"sign x={x_name} r={r_name} numel={numel} block={block}", sign)
    for out_name, accumulate in itertools.product((None, *FLOATS), (False, True)):
        if out_name is None and accumulate:
            continue
        numel, block = next(shapes)

        def sign_decode(out_name=out_name, accumulate=accumulate, numel=numel, block=block):
            out = None if out_name is None else tensor(numel, out_name)
            signs, scales = torch.zeros(-(-numel // 8), dtype=torch.uint8), torch.zeros(-(-numel // block))
            return kernels.sign_decompress(signs, scales, block, numel, out, accumulate)

        add(
            f"sign_decompress out={out_name} accumulate={accumulate} numel={numel} block={block}", sign_decode
        )
    for numel, k in [(1, 1), (4097, 41), (2**20, 10_000)]:
        add(
            f"randk_indices numel={numel} k={k}",
            lambda numel=numel, k=k: kernels.randk_indices(numel, k, 11, [1, 2, 3, 4], "cpu"),
        )
    # Keys and seeds change every step: each kind of value must reuse one
    # specialization (small and large, divisible by 16 or not, equal to 1).
    for keys in ([1, 2, 3, 4], [16, 2**31 + 5, 2**32 - 1, 32]):
        add(
            f"randk_indices numel=4097 k=41 seeded keys={keys}",
            lambda keys=keys: kernels.randk_indices(4097, 41, 11, keys, "cpu"),
        )
    for seed in (5, 16, 2**40 + 16, 1):
        add(
            f"quantize x=float32 bits=8 stochastic=True seeded seed={seed}",
            lambda seed=seed: kernels.quantize_blockwise(tensor(4096), 8, 256, True, seed, None, levels=127),
        )
    for x_name, residual, value_name in itertools.product(FLOATS, residuals, FLOATS[:3]):
        if residual == "same" and x_name == "float32":
            continue
        r_name = x_name if residual == "same" else residual

        def gather(x_name=x_name, r_name=r_name, value_name=value_name):
            r = None if r_name is None else tensor(4097, r_name)
            indices = torch.zeros(41, dtype=torch.int64)
            return kernels.gather_compensated(tensor(4097, x_name), r, indices, 2.5, dtype[value_name])

        add(f"gather_compensated x={x_name} r={r_name} values={value_name}", gather)
        if value_name == "float32":

            def select(x_name=x_name, r_name=r_name):
                r = None if r_name is None else tensor(4097, r_name)
                return kernels.select_candidates(tensor(4097, x_name), r, torch.ones(1), 62)

            add(f"select_candidates x={x_name} r={r_name}", select)
        if value_name == "float32":
            add(
                f"fold_into_residual x={x_name} r={r_name}",
                lambda x_name=x_name, r_name=r_name: kernels.fold_into_residual(
                    tensor(4097, x_name), None if r_name is None else tensor(4097, r_name)
                ),
            )
    for k in (1, 41):  # k: an integer the first digit's kernel specialises on when 1
        add(
            f"keep_largest k={k}",
            lambda k=k: kernels.keep_largest(tensor(62), torch.zeros((), dtype=torch.int64), k),
        )
    for residual_name, sent_name in itertools.product(FLOATS, FLOATS):

        def write_back(residual_name=residual_name, sent_name=sent_name):
            indices, kept = torch.zeros(62, dtype=torch.int64), torch.zeros(62, dtype=torch.bool)
            count = torch.zeros((), dtype=torch.int64)
            return kernels.write_back(
                tensor(62), tensor(62, sent_name), indices, kept, count, tensor(4097, residual_name)
            )

        add(f"write_back residual={residual_name} sent={sent_name}", write_back)
    for out_name, index_name, value_name in itertools.product(FLOATS, ("int32", "int64"), FLOATS):
        indices = torch.zeros(41, dtype=getattr(torch, index_name))
        add(
            f"scatter_add out={out_name} indices={index_name} values={value_name}",
            lambda out_name=out_name, indices=indices, value_name=value_name: kernels.scatter_add(
                indices, tensor(41, value_name), tensor(4097, out_name)
            ),
        )
    del triton_backend  # the op layer adds no kernel of its own
    return cases


def _control_cases() -> list[tuple[str, Callable[[], object]]]:
    """``a * b + c`` with and without fusion, ``a / b`` and ``div_rn(a, b)``, and a row
    sum with its row index in 32 and in 64 bits: the PTX and IR checks must see the
    differences."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _control_multiply_add_kernel(a_ptr, b_ptr, c_ptr, out_ptr, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        a, b, c = tl.load(a_ptr + offsets), tl.load(b_ptr + offsets), tl.load(c_ptr + offsets)
        tl.store(out_ptr + offsets, a * b + c)

    @triton.jit
    def _control_divide_kernel(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr, ROUNDED: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        a, b = tl.load(a_ptr + offsets), tl.load(b_ptr + offsets)
        if ROUNDED:
            quotient = tl.math.div_rn(a, b)
        else:
            quotient = a / b
        tl.store(out_ptr + offsets, quotient)

    @triton.jit
    def _control_row_sum_kernel(rows_ptr, out_ptr, row_stride, summed_rows, WIDE_ROW: tl.constexpr):
        lane = tl.arange(0, 16)
        total = tl.zeros((16,), tl.float32)
        if WIDE_ROW:
            row = tl.zeros((), tl.int64)
        else:
            row = 0
        while row < summed_rows:
            total += tl.load(rows_ptr + row * row_stride + lane).to(tl.float32)
            row += 1
        tl.store(out_ptr + lane, total)

    def launch(fused: bool):
        a, b, c, out = (torch.zeros(64) for _ in range(4))
        _control_multiply_add_kernel[(1,)](a, b, c, out, BLOCK=64, enable_fp_fusion=fused)

    def divide(rounded: bool):
        a, b, out = (torch.zeros(64) for _ in range(3))
        _control_divide_kernel[(1,)](a, b, out, BLOCK=64, ROUNDED=rounded, enable_fp_fusion=False)

    def row_sum(wide: bool):
        rows = torch.zeros(4, 32, dtype=torch.uint8)
        _control_row_sum_kernel[(1,)](rows, torch.zeros(16), rows.stride(0), 4, WIDE_ROW=wide)

    return [
        ("control fused", lambda: launch(True)),
        ("control exact", lambda: launch(False)),
        ("control divide", lambda: divide(False)),
        ("control divide rounded", lambda: divide(True)),
        ("control narrow rows", lambda: row_sum(False)),
        ("control wide rows", lambda: row_sum(True)),
    ]


def defined_kernels() -> list[str]:
    """Names of the kernels (``_..._kernel``) that ``gradcomp.kernels`` defines."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import gradcomp.kernels as package

    names = set()
    for module_info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{module_info.name}")
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and name.startswith("_") and name.endswith("_kernel"):
                names.add(name)
    return sorted(names)


def subset(cases: list, every: int, only: list[str] | None = None) -> list:
    """Every ``every``-th case of each launcher (the first word of a description), the first
    included; of the launchers in ``only`` alone where it is given."""
    seen: dict[str, int] = {}
    chosen = []
    for description, call in cases:
        launcher = description.split()[0]
        if only and launcher not in only:
            continue
        if seen.get(launcher, 0) % every == 0:
            chosen.append((description, call))
        seen[launcher] = seen.get(launcher, 0) + 1
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument(
        "--every", type=int, default=1, help="every n-th case of each launcher only (a quick subset)"
    )
    parser.add_argument("--only", nargs="+", help="these launchers' cases only (and the controls)")
    arguments = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(
            "kernel_compile: TRITON_INTERPRET=1 would define interpreted kernels; unset it", file=sys.stderr
        )
        return 2
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="gradcomp-triton-"))
    failures = 0
    print(json.dumps({"defined_kernels": defined_kernels()}), flush=True)
    for arch in arguments.arch:
        for description, call in _control_cases() + subset(_cases(), arguments.every, arguments.only):
            records: list[dict] = []
            with compile_only(arch, records):
                try:
                    call()
                except Exception as error:  # noqa: BLE001 - a launcher that fails outside Triton
                    records.append({"kernel": "(launcher)", "error": repr(error)})
            for record in records:
                record.update(case=description, target=arch)
                failures += "error" in record
                print(json.dumps(record), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
