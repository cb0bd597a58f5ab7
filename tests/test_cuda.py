"""CUDA kernels of ``csrc/`` against the torch reference, and their compilation.

With a CUDA GPU and CuPy, every op of :mod:`gradcomp.ops.cuda_backend` runs
against :mod:`gradcomp.ops.reference` on the same device. Bit-exact
(``torch.equal``, NaN equal to NaN): Top-K values, indices and residuals
(against the reference's exact selection with ties at the k-th magnitude
broken towards the lowest index, the backend's documented rule), signs, sign
residuals given the backend's scales, sign decoding, bit packing, and
scatter-add without repeated indices. Sign scales are block sums added in
another order than torch's: within 2 ulp of the fp64 sum, close to the
reference. Without a GPU or CuPy those tests are skipped with the reason.

The compile tests need only nvcc: every ``csrc/*.cu`` must build with all
warnings as errors, so that a broken kernel cannot land from a machine
without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy
import pytest
import torch

import gradcomp
from gradcomp import ops
from gradcomp.compressors import Context
from gradcomp.ops import cuda_backend, reference

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "csrc").glob("*.cu"))
HAS_GPU = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
DEVICE = torch.device("cuda")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FUNCTIONS = cuda_backend.FUNCTIONS


def on_gpu(test):
    """Skip ``test``, saying why, unless a CUDA GPU and CuPy are present."""
    test = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")(test)
    test = pytest.mark.skipif(not HAS_CUPY, reason="needs CuPy (pip install 'gradcomp[cuda]')")(test)
    return pytest.mark.gpu(test)


def randn(numel: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator).to(dtype).to(DEVICE)


def mismatch(expected: torch.Tensor, actual: torch.Tensor) -> str:
    expected, actual = expected.cpu(), actual.cpu()
    differ = (expected != actual) & ~(expected.isnan() & actual.isnan())
    where = torch.nonzero(differ).view(-1)[:5].tolist()
    return f"{int(differ.sum())} of {expected.numel()} differ, first at {where}: " + ", ".join(
        f"{expected[i].item()} vs {actual[i].item()}" for i in where
    )


def assert_same(expected: torch.Tensor, actual: torch.Tensor) -> None:
    """Same dtype, shape and values, bit for bit; NaN equal to NaN."""
    assert expected.dtype == actual.dtype, (expected.dtype, actual.dtype)
    assert expected.shape == actual.shape, (expected.shape, actual.shape)
    expected, actual = expected.cpu(), actual.cpu()
    if expected.is_floating_point():
        same = torch.equal(expected.isnan(), actual.isnan()) and torch.equal(
            expected.nan_to_num(), actual.nan_to_num()
        )
        # torch.equal takes -0.0 == 0.0: compare sign bits too.
        same = same and torch.equal(torch.signbit(expected.nan_to_num()), torch.signbit(actual.nan_to_num()))
    else:
        same = torch.equal(expected, actual)
    assert same, mismatch(expected, actual)


# ----------------------------------------------------------------------------- compilation (CPU)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("source", SOURCES, ids=[source.name for source in SOURCES])
def test_source_compiles_without_warnings(source, tmp_path):
    # sm_80 is the oldest target setup.py builds; CI compiles for sm_90.
    command = [
        "nvcc",
        "--fatbin",
        "-gencode=arch=compute_80,code=sm_80",
        "--Werror",
        "all-warnings",
        "-I",
        str(ROOT / "csrc"),
        "-o",
        str(tmp_path / f"{source.stem}.fatbin"),
        str(source),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@functools.cache
def ptx_entries(family: str) -> dict[str, tuple[list[int], int]]:
    """Kernel name -> (parameter widths in bytes, most threads a block) of ``csrc/<family>.cu``."""
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / f"{family}.ptx"
        command = ["nvcc", "--ptx", "-arch=sm_90", "-I", str(ROOT / "csrc"), "-o", str(ptx)]
        subprocess.run([*command, str(ROOT / "csrc" / f"{family}.cu")], check=True, timeout=300)
        text = ptx.read_text()
    entries = {}
    for match in re.finditer(r"\.entry (\w+)\(([^)]*)\)\s*(\.maxntid (\d+))?", text):
        widths = [int(bits) // 8 for bits in re.findall(r"\.param \.[us](\d+)", match.group(2))]
        entries[match.group(1)] = (widths, int(match.group(4) or 1024))
    return entries


def _launcher_cases():
    """``(op, args, options)`` for every launch the CuPy launchers make, on CPU tensors (nothing runs)."""

    def tensor(numel, dtype=torch.float32):
        return torch.zeros(numel, dtype=dtype)

    for x_dtype, residual_dtype in itertools.product(
        cuda_backend.FLOAT_NAMES, [None, *cuda_backend.FLOAT_NAMES]
    ):
        x, residual = tensor(5000, x_dtype), None if residual_dtype is None else tensor(5000, residual_dtype)
        for index_dtype in (torch.int32, torch.int64):
            yield "topk_select", (x, 50, residual), {"index_dtype": index_dtype}
            yield "scatter_add", (tensor(50, index_dtype), tensor(50), x), {}
        for block in (1024, 100):
            yield "sign_compress", (x, block, residual), {}
        yield "sign_decompress", (tensor(5000, torch.uint8), tensor(5), 1024, 5000, x), {}
    for bits in (1, 2, 4):
        yield "pack_bits", (tensor(5000, torch.uint8), bits), {}
        yield "unpack_bits", (tensor(5000, torch.uint8), bits, 5000), {}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_every_launch_matches_a_kernel_in_the_sources(monkeypatch):
    """Names, argument counts and widths, and block sizes of the launches, against
    the PTX of csrc/; and every kernel there is launched by some case."""
    launches = []
    monkeypatch.setattr(cuda_backend, "_launch", lambda device, *launch: launches.append(launch))
    monkeypatch.setattr(cuda_backend, "_multiprocessors", lambda index: 132)
    for op, args, options in _launcher_cases():
        FUNCTIONS[op](*args, **options)
    launched = set()
    for family, name, grid, threads, *args in launches:
        entries = ptx_entries(family)
        assert name in entries, f"{family}.cu has no kernel {name}"
        widths, most_threads = entries[name]
        given = [4 if isinstance(a, numpy.int32) else 8 for a in args]
        assert all(isinstance(a, (int, numpy.int32)) for a in args), (name, args)
        assert given == widths, f"{name}: arguments of {given} bytes, the kernel takes {widths}"
        assert 0 < threads <= most_threads and grid > 0, (name, grid, threads)
        launched.add(name)
    unused = {name for family in cuda_backend.FAMILIES for name in ptx_entries(family)} - launched
    assert not unused, f"kernels no launcher uses: {sorted(unused)}"


def test_launcher_constants_are_the_sources():
    """The Top-K workspace layout and block sizes the launcher assumes are csrc/topk.cu's."""

    def constant(source: str, name: str) -> int:
        text = (ROOT / "csrc" / source).read_text()
        value = re.search(rf"constexpr int {name} = ([^;]+);", text).group(1)
        return eval(
            value, {}, {"TOPK_LAST_BINS": constant(source, "TOPK_LAST_BINS")} if "BINS" in value else {}
        )

    first, last = constant("topk.cu", "TOPK_FIRST_BINS"), constant("topk.cu", "TOPK_LAST_BINS")
    assert cuda_backend.TOPK_THREADS == constant("topk.cu", "TOPK_THREADS")
    assert cuda_backend.TOPK_CHOOSE_THREADS == constant("topk.cu", "TOPK_CHOOSE_THREADS")
    assert cuda_backend.TOPK_HISTOGRAM_OFFSETS == (0, first, first + last)
    assert cuda_backend.TOPK_HISTOGRAM_WORDS == first + 2 * last
    assert cuda_backend.TOPK_SUFFIX_ENTRIES == constant("topk.cu", "TOPK_SUFFIX_ENTRIES") == last + 1
    assert cuda_backend.SIGN_MAX_THREADS == constant("sign.cu", "SIGN_MAX_THREADS")


def test_every_family_has_a_source():
    assert {source.stem for source in SOURCES} == set(cuda_backend.FAMILIES)
    for family in cuda_backend.FAMILIES:
        text = cuda_backend.source_text(family)
        assert "#include" not in text, f"{family}.cu includes something NVRTC cannot find"


@pytest.mark.parametrize("numel", [1, 1023, 16384, 16385, 10**6, 3 * 10**9])
@pytest.mark.parametrize("multiprocessors", [1, 132])
def test_topk_chunks_cover_the_input(numel, multiprocessors):
    chunks, chunk = cuda_backend.topk_chunks(numel, multiprocessors)
    assert chunks >= 1 and (chunks - 1) * chunk < numel <= chunks * chunk
    assert chunk < 2**32  # per-chunk counts are 32-bit
    assert chunks <= max(1, cuda_backend.TOPK_CHUNKS_PER_MULTIPROCESSOR * multiprocessors)


def test_not_available_for_cpu_tensors():
    assert not cuda_backend.is_available(torch.device("cpu"))


@pytest.mark.parametrize(
    "driver, capability, loads, expected",
    [
        (13000, (9, 0), True, None),
        (12080, (9, 0), True, "the driver supports CUDA 12.8, CuPy needs CUDA 13.0"),
        (13000, (7, 5), True, "compute capability 7.5 is older than the fatbins' sm_80"),
        (13000, (9, 0), False, "the kernels do not load (no kernel image is available)"),
    ],
)
def test_availability_checks_driver_architecture_and_loading(
    monkeypatch, caplog, driver, capability, loads, expected
):
    """A GPU the kernels cannot run on turns the backend off, with the reason
    logged, and the ops fall back to Triton instead of failing at launch."""

    class Runtime:
        driverGetVersion = staticmethod(lambda: driver)  # noqa: N815 - CuPy's names
        runtimeGetVersion = staticmethod(lambda: 13000)  # noqa: N815

    class FakeCupy:
        class cuda:  # noqa: N801 - CuPy's name
            runtime = Runtime

    def load(family, name, index):
        if not loads:
            raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(cuda_backend, "_cupy", lambda: FakeCupy)
    monkeypatch.setattr(cuda_backend, "_function", load)
    monkeypatch.setattr(cuda_backend, "_fatbin", lambda family: Path("built.fatbin"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    cuda_backend.unavailable_reason.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="gradcomp.ops.cuda_backend"):
            assert cuda_backend.is_available(torch.device("cuda", 0)) == (expected is None)
            assert cuda_backend.unavailable_reason(0) == expected
        assert (expected in caplog.text) if expected else not caplog.text
        # As if CuPy were installed: the backend is registered, and passed over.
        monkeypatch.setitem(ops._REGISTRY, "cuda", (cuda_backend.is_available, cuda_backend.FUNCTIONS))
        if expected is None:
            assert ops.implementation("sign_compress", torch.device("cuda", 0)) is FUNCTIONS["sign_compress"]
        else:
            pytest.importorskip("triton")
            chosen = ops.implementation("sign_compress", torch.device("cuda", 0))
            assert chosen is not cuda_backend.FUNCTIONS["sign_compress"]
            monkeypatch.setenv("GRADCOMP_BACKEND", "cuda")
            with pytest.raises(RuntimeError, match=expected.split("(")[0].strip()):
                ops.implementation("sign_compress", torch.device("cuda", 0))
    finally:
        cuda_backend.unavailable_reason.cache_clear()


# ----------------------------------------------------------------------------- Top-K


def expected_topk(x, k, residual, value_dtype=torch.float32, index_dtype=None):
    """``reference.topk_select(exact=True)`` with ties at the k-th magnitude broken
    towards the lowest index, indices ascending: what the backend must return.
    Returns ``(values, indices, residual after the op or None)``."""
    y = reference.compensate(x, residual)
    magnitude = reference.selection_magnitude(y)
    # A stable sort keeps equal magnitudes in index order.
    indices = torch.sort(magnitude, descending=True, stable=True).indices[:k].sort().values
    picked = y[indices]
    values = picked.to(value_dtype)
    updated = None
    if residual is not None:
        updated = residual.clone()
        reference._keep_unsent(updated, y, indices, picked - values.float())
    return values, indices.to(index_dtype or reference.index_dtype_for(x.numel())), updated


def check_topk(x, k, residual=None, **options):
    """Run the backend on copies and compare everything with :func:`expected_topk`
    and, for the magnitudes it keeps, with the reference itself."""
    value_dtype = options.get("value_dtype", torch.float32)
    values, indices, updated = expected_topk(x, k, residual, value_dtype, options.get("index_dtype"))
    actual_residual = None if residual is None else residual.clone()
    got_values, got_indices = FUNCTIONS["topk_select"](x, k, actual_residual, **options)
    assert_same(indices, got_indices)
    assert_same(values, got_values)
    if residual is not None:
        assert_same(updated, actual_residual)
    reference_values, _ = reference.topk_select(x, k, None if residual is None else residual.clone(), True)
    kept = reference.selection_magnitude(got_values.float()).sort().values
    wanted = reference.selection_magnitude(reference_values.float()).sort().values
    if value_dtype == torch.float32:
        assert_same(wanted, kept)
    return got_values, got_indices


@on_gpu
@pytest.mark.parametrize("numel", [1, 1023, 4097, 50_000])
@pytest.mark.parametrize("ratio", [0.0, 0.01, 0.1, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_matches_reference(numel, ratio, dtype):
    k = min(numel, max(1, round(ratio * numel)))
    x = randn(numel, seed=numel + k, dtype=dtype)
    residual = randn(numel, seed=3) * 0.3
    if numel > 3000:
        x[1024:2048], residual[1024:2048] = 0, 0  # an all-zero block
    check_topk(x, k, residual, value_dtype=dtype)
    check_topk(x, k)


@on_gpu
@pytest.mark.parametrize("residual_dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_topk_residual_and_value_dtypes(residual_dtype, value_dtype):
    x = randn(5000, seed=4)
    residual = (randn(5000, seed=5) * 0.1).to(residual_dtype)
    check_topk(x, 60, residual, value_dtype=value_dtype)
    check_topk(x.double(), 60, residual, value_dtype=value_dtype)


@on_gpu
def test_topk_int64_indices_and_sampling_flag():
    x = randn(10_000, seed=6)
    residual = torch.zeros(10_000, device=DEVICE)
    values, indices = check_topk(x, 100, residual, index_dtype=torch.int64)
    # exact=False takes the same path: exactly k, the same entries.
    sampled = FUNCTIONS["topk_select"](x, 100, exact=False, seed=9, index_dtype=torch.int64)
    assert_same(indices, sampled[1])
    assert_same(values, sampled[0])


@on_gpu
@pytest.mark.parametrize("numel", [4000, 300_000])
@pytest.mark.parametrize("k_fraction", [0.001, 0.5, 0.999])
def test_topk_ties_go_to_the_lowest_indices(numel, k_fraction):
    # 300_000 elements are many chunks: the ties at the threshold span chunk boundaries.
    k = max(1, int(k_fraction * numel))
    check_topk(torch.ones(numel, device=DEVICE), k, torch.zeros(numel, device=DEVICE))
    generator = torch.Generator().manual_seed(numel)
    levels = torch.randint(-3, 4, (numel,), generator=generator).float().to(DEVICE)
    check_topk(levels, k, torch.zeros(numel, device=DEVICE))
    check_topk(torch.zeros(numel, device=DEVICE), k)


@on_gpu
@pytest.mark.parametrize("k", [1, 2, 3, 50])
def test_topk_non_finite_values_are_selected_first(k):
    x = randn(5000, seed=10)
    x[17], x[4000], x[2500] = math.nan, -math.inf, math.inf
    residual = randn(5000, seed=11) * 0.1
    residual[3000] = math.inf  # a non-finite compensated value from the residual
    values, indices = check_topk(x, k, residual)
    non_finite = [17, 2500, 3000, 4000]  # NaN ties with inf: the lowest indices win
    if k < len(non_finite):
        assert indices.tolist() == non_finite[:k]
    else:
        assert set(non_finite) <= set(indices.tolist())
    assert not torch.isfinite(values).all()


@on_gpu
def test_topk_large_input_against_torch_topk():
    x = randn(1 << 22, seed=12)
    residual = randn(1 << 22, seed=13) * 0.01
    check_topk(x, 1 << 15, residual)


@on_gpu
def test_topk_rejects_bad_arguments():
    x = randn(100, seed=14)
    with pytest.raises(ValueError, match="k must be"):
        FUNCTIONS["topk_select"](x, 0)
    with pytest.raises(ValueError, match="k must be"):
        FUNCTIONS["topk_select"](x, 101)
    with pytest.raises(ValueError, match="residual"):
        FUNCTIONS["topk_select"](x, 5, torch.zeros(99, device=DEVICE))
    with pytest.raises(TypeError):
        FUNCTIONS["topk_select"](x.int(), 5)


# ----------------------------------------------------------------------------- sign


def sign_scales_in_float64(y: torch.Tensor, block: int) -> torch.Tensor:
    """Mean |y| per block from an fp64 sum, rounded to fp32: what the kernel's scales approximate."""
    pad = (-y.numel()) % block
    blocks = torch.nn.functional.pad(y.double().abs(), (0, pad)).view(-1, block)
    counts = torch.full((blocks.shape[0],), float(block), dtype=torch.float64, device=y.device)
    if y.numel() % block:
        counts[-1] = y.numel() % block
    return (blocks.sum(dim=1).float() / counts.float()).float()


@on_gpu
@pytest.mark.parametrize("numel", [1, 1023, 4097, 20_000])
@pytest.mark.parametrize("block", [1024, 64, 100, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_matches_reference(numel, block, dtype):
    x = randn(numel, seed=numel + block, dtype=dtype)
    residual = randn(numel, seed=9) * 0.1
    if numel > 3000:
        x[2048:3072], residual[2048:3072] = 0, 0  # all-zero blocks
    expected_signs, expected_scales = reference.sign_compress(x, block, residual.clone())
    actual_residual = residual.clone()
    signs, scales = FUNCTIONS["sign_compress"](x, block, actual_residual)
    assert_same(expected_signs, signs)
    y = reference.compensate(x, residual)
    torch.testing.assert_close(scales, sign_scales_in_float64(y, block), rtol=2 * 2**-23, atol=0)
    torch.testing.assert_close(scales, expected_scales, rtol=1e-5, atol=0)
    # Given the kernel's scales, the residual is the reference's arithmetic, bit for bit.
    expected_residual = residual.clone()
    reference.store_residual(expected_residual, y, reference.sign_decompress(signs, scales, block, numel))
    assert_same(expected_residual, actual_residual)


@on_gpu
@pytest.mark.parametrize("residual_dtype", [torch.float16, torch.bfloat16, torch.float64, None])
def test_sign_residual_dtypes(residual_dtype):
    x = randn(3000, seed=2)
    residual = None if residual_dtype is None else (randn(3000, seed=3) * 0.1).to(residual_dtype)
    expected_signs, _ = reference.sign_compress(x, 256, None if residual is None else residual.clone())
    actual_residual = None if residual is None else residual.clone()
    signs, scales = FUNCTIONS["sign_compress"](x, 256, actual_residual)
    assert_same(expected_signs, signs)
    if residual is not None:
        y = reference.compensate(x, residual)
        expected_residual = residual.clone()
        reference.store_residual(expected_residual, y, reference.sign_decompress(signs, scales, 256, 3000))
        assert_same(expected_residual, actual_residual)


@on_gpu
@pytest.mark.parametrize("block", [1024, 100])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_sign_non_finite_blocks_decode_non_finite(block, bad):
    x = randn(4096, seed=1)
    x[5] = bad
    residual = torch.zeros(4096, device=DEVICE)
    signs, scales = FUNCTIONS["sign_compress"](x, block, residual)
    decoded = FUNCTIONS["sign_decompress"](signs, scales, block, 4096)
    assert not torch.isfinite(decoded[:block]).any()
    assert torch.isfinite(decoded[block:]).all() and torch.isfinite(residual).all()
    assert_same(reference.sign_compress(x, block)[0], signs)


@on_gpu
@pytest.mark.parametrize("numel", [1, 1023, 5000])
@pytest.mark.parametrize("block", [1024, 100])
@pytest.mark.parametrize("out_dtype", [*DTYPES, torch.float64])
def test_sign_decompress_is_bit_exact(numel, block, out_dtype):
    x = randn(numel, seed=numel)
    signs, scales = reference.sign_compress(x, block)
    assert_same(
        reference.sign_decompress(signs, scales, block, numel),
        FUNCTIONS["sign_decompress"](signs, scales, block, numel),
    )
    for accumulate in (False, True):
        base = randn(numel, seed=3, dtype=out_dtype)
        expected = reference.sign_decompress(signs, scales, block, numel, base.clone(), accumulate)
        actual = FUNCTIONS["sign_decompress"](signs, scales, block, numel, base.clone(), accumulate)
        assert_same(expected, actual)


# ----------------------------------------------------------------------------- bits


@on_gpu
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [1, 7, 1023, 4096, 100_003])
def test_pack_unpack_bit_exact(bits, numel):
    generator = torch.Generator().manual_seed(numel + bits)
    codes = torch.randint(0, 2**bits, (numel,), generator=generator, dtype=torch.uint8).to(DEVICE)
    packed = FUNCTIONS["pack_bits"](codes, bits)
    assert_same(reference.pack_bits(codes, bits), packed)
    assert_same(codes, FUNCTIONS["unpack_bits"](packed, bits, numel))
    assert_same(
        reference.unpack_bits(packed, bits, numel + 5), FUNCTIONS["unpack_bits"](packed, bits, numel + 5)
    )


# ----------------------------------------------------------------------------- scatter-add


@on_gpu
@pytest.mark.parametrize("out_dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_scatter_add_distinct_indices_is_bit_exact(out_dtype, index_dtype):
    generator = torch.Generator().manual_seed(7)
    indices = torch.randperm(10_001, generator=generator)[:3001].to(index_dtype).to(DEVICE)
    values = randn(3001, seed=8)
    base = randn(10_001, seed=9, dtype=out_dtype)
    assert_same(
        reference.scatter_add(indices, values, base.clone()),
        FUNCTIONS["scatter_add"](indices, values, base.clone()),
    )
    # Odd element offsets: fp16 / bf16 adds land in both halves of a 32-bit word.
    view = base.clone()[1:]
    expected = reference.scatter_add(indices[indices < 10_000], values[indices < 10_000], view.clone())
    assert_same(expected, FUNCTIONS["scatter_add"](indices[indices < 10_000], values[indices < 10_000], view))


@on_gpu
@pytest.mark.parametrize("out_dtype", [*DTYPES, torch.float64])
def test_scatter_add_outside_the_output_makes_element_0_nan_and_the_context_lives(out_dtype):
    out = torch.zeros(10, dtype=out_dtype, device=DEVICE)
    indices = torch.tensor([1, 12, 3, -1], device=DEVICE)
    FUNCTIONS["scatter_add"](indices, torch.tensor([1.0, 2.0, 3.0, 4.0], device=DEVICE), out)
    torch.cuda.synchronize()  # a trap would raise here, and every later CUDA call too
    assert out[0].isnan() and out[1] == 1 and out[3] == 3 and not out[4:].any()


@on_gpu
@pytest.mark.parametrize("out_dtype", [*DTYPES, torch.float64])
def test_scatter_add_sums_repeats(out_dtype):
    out = torch.zeros(10, dtype=out_dtype, device=DEVICE)
    indices = torch.tensor([1, 3, 3, 9, 1, 1, 0], device=DEVICE)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, -1.0], device=DEVICE)
    # Small integers: every order of the atomic adds gives the same sums.
    assert_same(
        reference.scatter_add(indices, values, out.clone()), FUNCTIONS["scatter_add"](indices, values, out)
    )
    batch = torch.stack([indices, indices.flip(0)])  # W = 2 ranks' payloads in one call
    twice = FUNCTIONS["scatter_add"](batch, torch.stack([values, values.flip(0)]), torch.zeros_like(out))
    assert_same(reference.scatter_add(indices, values * 2, torch.zeros_like(out)), twice)


# ----------------------------------------------------------------------------- loading


@on_gpu
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_a_built_fatbin_is_what_runs(tmp_path, monkeypatch):
    # The other tests compile the sources with NVRTC (no fatbin beside the
    # package); setup.py's fatbins take their place when present and newer.
    command = ["nvcc", "--fatbin", "-arch=native", "-I", str(ROOT / "csrc")]
    subprocess.run(
        [*command, "-o", str(tmp_path / "bits.fatbin"), str(ROOT / "csrc" / "bits.cu")],
        check=True,
        timeout=300,
    )
    monkeypatch.setattr(cuda_backend, "PACKAGE_DIR", tmp_path)
    cuda_backend._module.cache_clear()
    cuda_backend._function.cache_clear()
    try:
        assert cuda_backend._fatbin("bits") == tmp_path / "bits.fatbin"
        codes = torch.arange(1000, device=DEVICE).remainder(4).to(torch.uint8)
        assert_same(reference.pack_bits(codes, 2), FUNCTIONS["pack_bits"](codes, 2))
    finally:
        cuda_backend._module.cache_clear()
        cuda_backend._function.cache_clear()


# ----------------------------------------------------------------------------- dispatch and compressors


@on_gpu
def test_cuda_backend_is_preferred_for_its_ops(monkeypatch):
    monkeypatch.delenv("GRADCOMP_BACKEND", raising=False)
    for op in FUNCTIONS:
        assert ops.implementation(op, DEVICE) is FUNCTIONS[op]
    monkeypatch.setenv("GRADCOMP_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="quantize_blockwise"):
        ops.implementation("quantize_blockwise", DEVICE)


@on_gpu
@pytest.mark.parametrize("name,options", [("topk", {"exact": True}), ("topk", {}), ("sign", {})])
def test_compressors_agree_with_the_torch_backend(name, options, monkeypatch):
    compressor = gradcomp.get_compressor(name, **options)
    x = randn(30_000, seed=21)
    residuals, decoded = {}, {}
    for backend in ("torch", "cuda"):
        monkeypatch.setenv("GRADCOMP_BACKEND", backend)
        residual = torch.zeros(30_000, device=DEVICE) + 0.01
        payload = compressor.compress(x, Context(residual=residual, step=3, key=1))
        residuals[backend], decoded[backend] = residual, compressor.decompress(payload)
    # Distinct Gaussian magnitudes: the sampling path's result is the exact top-k, as the backend's.
    if name == "sign":
        # Scales are block sums in another order: compare decoded + residual (conservation).
        for backend in ("torch", "cuda"):
            torch.testing.assert_close(decoded[backend] + residuals[backend], x + 0.01, rtol=0, atol=1e-6)
        return
    assert_same(decoded["torch"], decoded["cuda"])
    assert_same(residuals["torch"], residuals["cuda"])
