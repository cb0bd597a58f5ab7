"""The CUDA backend beyond parity (``test_parity.py``): its sources and launchers on
any machine, its loading and dispatch on a GPU.

On CPU: every ``csrc/*.cu`` builds with nvcc, all warnings errors; every
launch the CuPy launchers make matches a kernel of the compiled PTX; the
launcher's constants are the sources'; the backend turns itself off, with
the reason, where it cannot run. With a GPU and CuPy: a built fatbin is what
runs, and the backend is preferred for its ops.
"""

from __future__ import annotations

import functools
import itertools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy
import pytest
import torch

from gradcomp import ops
from gradcomp.ops import cuda_backend
from tests.utils import HAS_CUPY, HAS_GPU, REFERENCE, assert_same

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "csrc").glob("*.cu"))
DEVICE = torch.device("cuda")
FUNCTIONS = cuda_backend.FUNCTIONS


def on_gpu(test):
    """Skip ``test``, saying why, unless a CUDA GPU and CuPy are present."""
    test = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")(test)
    test = pytest.mark.skipif(not HAS_CUPY, reason="needs CuPy (pip install 'gradcomp[cuda]')")(test)
    return pytest.mark.gpu(test)


# ----------------------------------------------------------------------------- compilation (CPU)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("source", SOURCES, ids=[source.name for source in SOURCES])
def test_source_compiles_without_warnings(source, tmp_path):
    # The architectures setup.py builds by default: sm_80 and sm_90.
    command = [
        "nvcc",
        "--fatbin",
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
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


@pytest.mark.slow
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
    "driver, runtime, capability, loads, expected",
    [
        (13000, 13000, (9, 0), True, None),
        # An H200's driver 580 (CUDA 13.0) with CuPy 14.2's CUDA 13.2 runtime: minor versions are compatible.
        (13000, 13020, (9, 0), True, None),
        (12080, 13000, (9, 0), True, "the driver supports CUDA 12.8, CuPy needs CUDA 13.0"),
        (13000, 13000, (7, 5), True, "compute capability 7.5 is older than the fatbins' sm_80"),
        (13000, 13000, (9, 0), False, "the kernels do not load (no kernel image is available)"),
    ],
)
def test_availability_checks_driver_architecture_and_loading(
    monkeypatch, caplog, driver, runtime, capability, loads, expected
):
    """A GPU the kernels cannot run on turns the backend off, with the reason
    logged, and the ops fall back to Triton instead of failing at launch."""

    class Runtime:
        driverGetVersion = staticmethod(lambda: driver)  # noqa: N815 - CuPy's names
        runtimeGetVersion = staticmethod(lambda: runtime)  # noqa: N815

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
        monkeypatch.setitem(
            ops.dispatch._REGISTRY, "cuda", (cuda_backend.is_available, cuda_backend.FUNCTIONS)
        )
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
        assert_same(REFERENCE.pack_bits(codes, 2), FUNCTIONS["pack_bits"](codes, 2))
    finally:
        cuda_backend._module.cache_clear()
        cuda_backend._function.cache_clear()


# ----------------------------------------------------------------------------- dispatch and compressors


@on_gpu
def test_cuda_backend_is_preferred_for_its_ops(monkeypatch):
    monkeypatch.delenv("GRADCOMP_BACKEND", raising=False)
    monkeypatch.setattr(ops.dispatch, "_CHOSEN", {})  # choices other tests made under their fakes
    cuda_backend.unavailable_reason.cache_clear()
    assert cuda_backend.unavailable_reason(torch.cuda.current_device()) is None
    for op in FUNCTIONS:
        chosen = ops.implementation(op, DEVICE)
        assert chosen is FUNCTIONS[op], f"{op} from {chosen.__module__}"
    monkeypatch.setenv("GRADCOMP_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="quantize_blockwise"):
        ops.implementation("quantize_blockwise", DEVICE)
