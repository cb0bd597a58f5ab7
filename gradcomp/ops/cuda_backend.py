"""The ops on the CUDA C++ kernels of ``csrc/``, loaded with CuPy.

* ``topk_select``: a radix select of the exact k-th largest magnitude (three
  histogram passes over the input), then one compaction pass that writes
  values and indices and updates the residual. The exact top-k for
  ``exact=True`` and ``exact=False`` alike, indices ascending; of the entries
  tied at the k-th magnitude, those of lowest index are taken (the sampling
  path's rule). Where the reference's sampling path sends the exact top-k
  (unless its sample misjudged badly, and unless fewer than ``k`` entries are
  non-zero: it pads, this sends zeros) the results are the same.
* ``sign_compress`` / ``sign_decompress``: signs and residuals bit-exact, the
  block sums added in fp64 in a fixed order (deterministic; within an ulp or
  two of torch's fp32 sums).
* ``pack_bits`` / ``unpack_bits``, ``scatter_add``: bit-exact (the scatter's pairs
  added in their order, no atomic add).

Kernels come from the fatbins that ``setup.py`` builds into ``gradcomp/``; when
there is none, or it is older than its source, from ``csrc/`` beside the
package directory (a source checkout, or the scratch layout of
``bench/gpu_check.sh``), compiled once with NVRTC (CuPy caches the binary on
disk). CuPy is imported on first use. Every launch goes on torch's current
stream with the tensors' data pointers: no copies of the inputs, no host syncs.

Example:
    >>> from gradcomp.ops import cuda_backend
    >>> cuda_backend.is_available(torch.device("cuda"))
    True
    >>> values, indices = cuda_backend.topk_select(grad.cuda(), k=1000, residual=memory)
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy
import torch

from gradcomp.ops.reference_shared import index_dtype_for

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parents[1]
SOURCE_DIR = PACKAGE_DIR.parent / "csrc"
HEADER = "common.cuh"
FAMILIES = ("topk", "sign", "bits", "scatter")
NVRTC_OPTIONS = ("--std=c++17",)

# Kernel name suffixes and the runtime dtype codes of csrc/common.cuh.
FLOAT_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}
VALUE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
INDEX_CODES = {torch.int32: 0, torch.int64: 1}
INDEX_NAMES = {torch.int32: "int32", torch.int64: "int64"}

ELEMENTWISE_THREADS = 256
MAX_GRID = 65536  # element-wise kernels loop over the rest
SIGN_MAX_THREADS = 256
# Top-K, as csrc/topk.cu has them.
TOPK_THREADS = 512
TOPK_CHOOSE_THREADS = 1024
TOPK_HISTOGRAM_OFFSETS = (0, 2048, 3072)  # one histogram per pass: 2048, 1024, 1024 bins
TOPK_HISTOGRAM_WORDS = 4096
TOPK_SUFFIX_ENTRIES = 1025
# Chunks per multiprocessor: about two waves of resident blocks. Below
# TOPK_MIN_CHUNK elements a chunk's 4 KiB of last-pass counts would cost more
# than its share of the input.
TOPK_CHUNKS_PER_MULTIPROCESSOR = 8
TOPK_MIN_CHUNK = 16384


# ----------------------------------------------------------------------------- loading


@functools.cache
def _cupy():
    """The cupy module, or None where it is missing or cannot load its CUDA libraries."""
    try:
        import cupy
    except Exception:  # ImportError, or the CUDA libraries it links against
        return None
    return cupy


def _sources(family: str) -> list[Path]:
    return [SOURCE_DIR / f"{family}.cu", SOURCE_DIR / HEADER]


def _fatbin(family: str) -> Path | None:
    """The built fatbin of ``family`` unless it is missing or older than its source."""
    path = PACKAGE_DIR / f"{family}.fatbin"
    if not path.is_file():
        return None
    sources = [source for source in _sources(family) if source.is_file()]
    if sources and path.stat().st_mtime < max(source.stat().st_mtime for source in sources):
        return None
    return path


def source_text(family: str) -> str:
    """``csrc/<family>.cu`` with ``common.cuh`` inlined: one self-contained text for
    NVRTC (and for CuPy's disk cache, whose key is the text)."""
    header = (SOURCE_DIR / HEADER).read_text()
    return (SOURCE_DIR / f"{family}.cu").read_text().replace(f'#include "{HEADER}"', header)


@functools.cache
def kernels_found() -> bool:
    """Whether every kernel family has a fatbin or a source to compile."""
    return all(_fatbin(family) is not None or (SOURCE_DIR / f"{family}.cu").is_file() for family in FAMILIES)


def is_available(device: torch.device) -> bool:
    """True for CUDA devices where the kernels load: see :func:`unavailable_reason`."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return unavailable_reason(torch.cuda.current_device() if device.index is None else device.index) is None


# Compute capabilities the fatbins run on: SASS for sm_80 (and the rest of 8.x)
# and sm_90, PTX of compute_90 for newer GPUs (setup.py's default).
OLDEST_CAPABILITY = (8, 0)


@functools.cache
def unavailable_reason(device_index: int) -> str | None:
    """Why the kernels cannot run on GPU ``device_index`` (None when they can).

    Checked once per device, and logged: CuPy loads, the driver is at least
    as new as the CUDA runtime CuPy was built for, the GPU is new enough for
    the built fatbins, and one kernel of every family loads. Ops then fall
    back to the next backend instead of failing at the first launch.
    """
    reason = _find_unavailable_reason(device_index)
    if reason is not None:
        logger.warning(
            "gradcomp: the cuda backend is off on cuda:%d: %s; Triton runs its ops", device_index, reason
        )
    return reason


def _find_unavailable_reason(device_index: int) -> str | None:
    cupy = _cupy()
    if cupy is None:
        return "CuPy is not installed or cannot load its CUDA libraries (pip install 'gradcomp[cuda]')"
    if not kernels_found():
        return f"no fatbins under {PACKAGE_DIR} and no sources under {SOURCE_DIR}"
    try:
        driver, runtime = cupy.cuda.runtime.driverGetVersion(), cupy.cuda.runtime.runtimeGetVersion()
    except Exception as error:  # noqa: BLE001 - any CUDA error means: not usable
        return f"CuPy cannot query the CUDA driver ({error})"
    # A driver runs what any runtime of its major version built (CUDA's minor version
    # compatibility); what it cannot load (PTX newer than it) the load check below finds.
    if driver // 1000 < runtime // 1000:
        return f"the driver supports CUDA {_version(driver)}, CuPy needs CUDA {_version(runtime)}"
    capability = torch.cuda.get_device_capability(device_index)
    if capability < OLDEST_CAPABILITY and all(_fatbin(family) is not None for family in FAMILIES):
        return f"compute capability {capability[0]}.{capability[1]} is older than the fatbins' sm_80"
    try:
        for family, kernel in LOAD_CHECK.items():
            _function(family, kernel, device_index)
    except Exception as error:  # noqa: BLE001 - any load or compile error means: not usable
        return f"the kernels do not load ({error})"
    return None


def _version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


# One kernel of each family, loaded by unavailable_reason.
LOAD_CHECK = {
    "topk": "topk_choose_digit",
    "sign": "sign_decompress_float32",
    "bits": "pack_bits",
    "scatter": "scatter_add_float32_int64",
}


@functools.cache
def _module(family: str):
    cupy = _cupy()
    if cupy is None:
        raise RuntimeError("the cuda backend needs CuPy (pip install 'gradcomp[cuda]')")
    fatbin = _fatbin(family)
    if fatbin is not None:
        return cupy.RawModule(path=str(fatbin))
    if not (SOURCE_DIR / f"{family}.cu").is_file():
        raise RuntimeError(f"no {family}.fatbin under {PACKAGE_DIR} and no {family}.cu under {SOURCE_DIR}")
    return cupy.RawModule(code=source_text(family), options=NVRTC_OPTIONS)


@functools.cache
def _function(family: str, name: str, device_index: int):
    """The kernel ``name`` of ``family``, loaded (or compiled) for one device."""
    with _cupy().cuda.Device(device_index):
        return _module(family).get_function(name).kernel


class _Stream:
    """What CuPy's launcher reads of a stream: its handle."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def _launch(device: torch.device, family: str, name: str, grid: int, threads: int, *args) -> None:
    """Launch kernel ``name`` on ``grid`` blocks of ``threads`` on torch's current stream.

    ``args`` follow the kernel's signature: ints for pointers and ``long long``,
    ``numpy.int32`` for ``int``.
    """
    function = _function(family, name, device.index)
    stream = _Stream(torch.cuda.current_stream(device).cuda_stream)
    with _cupy().cuda.Device(device.index):
        function((grid,), (threads,), args, stream=stream)


def _grid(work: int, threads: int = ELEMENTWISE_THREADS) -> int:
    return max(1, min(MAX_GRID, -(-work // threads)))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# ----------------------------------------------------------------------------- arguments
# Arguments arrive checked and completed by gradcomp.ops.checks.


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a flat contiguous tensor (a copy only if it is not contiguous)."""
    return tensor.reshape(-1).contiguous()


def _residual(residual: torch.Tensor | None) -> torch.Tensor | None:
    """The (contiguous) residual as the flat view the kernels update in place."""
    return None if residual is None else residual.view(-1)


def _kernel_suffix(x: torch.Tensor, residual: torch.Tensor | None) -> str:
    return f"{FLOAT_NAMES[x.dtype]}_{'none' if residual is None else FLOAT_NAMES[residual.dtype]}"


def _pointer(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


# ----------------------------------------------------------------------------- Top-K


def topk_chunks(numel: int, multiprocessors: int) -> tuple[int, int]:
    """``(chunks, chunk)``: how the Top-K kernels split ``numel`` elements, one
    block per chunk of ``chunk`` contiguous elements, no chunk empty."""
    chunks = max(1, min(TOPK_CHUNKS_PER_MULTIPROCESSOR * multiprocessors, -(-numel // TOPK_MIN_CHUNK)))
    chunk = -(-numel // chunks)
    return -(-numel // chunk), chunk


def topk_select(
    x: torch.Tensor,
    k: int,
    residual: torch.Tensor | None = None,
    exact: bool = False,
    *,
    seed: int = 0,
    index_dtype: torch.dtype | None = None,
    value_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gradcomp.ops.reference.topk_select` on the CUDA radix select.

    Always exactly ``k`` entries with ascending indices, whatever ``exact``
    (``seed`` is not needed); ties at the k-th magnitude go to the lowest
    indices. NaN counts as the largest magnitude, like inf.
    """
    x = _flat(x)
    numel = x.numel()
    residual = _residual(residual)
    device = x.device
    chunks, chunk = topk_chunks(numel, _multiprocessors(device.index))
    # Histograms, then state (the threshold's digits and how many of k remain), then per-chunk plans.
    workspace = torch.zeros(TOPK_HISTOGRAM_WORDS + 2 + 3 * chunks, dtype=torch.int64, device=device)
    chunk_suffix = torch.empty(chunks * TOPK_SUFFIX_ENTRIES, dtype=torch.int32, device=device)
    values = torch.empty(k, dtype=value_dtype, device=device)
    indices = torch.empty(k, dtype=index_dtype, device=device)
    word = workspace.element_size()
    state = workspace.data_ptr() + TOPK_HISTOGRAM_WORDS * word
    plan = state + 2 * word
    launch = functools.partial(_launch, device, "topk")
    suffix = _kernel_suffix(x, residual)
    inputs = (x.data_ptr(), _pointer(residual))
    for step, offset in enumerate(TOPK_HISTOGRAM_OFFSETS):
        histogram = workspace.data_ptr() + offset * word
        counts = (state, histogram, chunk_suffix.data_ptr())
        pass_number = numpy.int32(step)
        launch(f"topk_histogram_{suffix}", chunks, TOPK_THREADS, *inputs, *counts, numel, chunk, pass_number)
        launch("topk_choose_digit", 1, TOPK_CHOOSE_THREADS, histogram, state, k, pass_number)
    launch(
        "topk_plan_chunks", 1, TOPK_CHOOSE_THREADS, chunk_suffix.data_ptr(), state, plan, numpy.int32(chunks)
    )
    outputs = (
        values.data_ptr(),
        numpy.int32(VALUE_CODES[value_dtype]),
        indices.data_ptr(),
        numpy.int32(INDEX_CODES[index_dtype]),
    )
    launch(f"topk_compact_{suffix}", chunks, TOPK_THREADS, *inputs, state, plan, *outputs, numel, chunk, k)
    return values, indices


# ----------------------------------------------------------------------------- sign


def sign_compress(
    x: torch.Tensor, block: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gradcomp.ops.reference.sign_compress` on CUDA kernels."""
    x = _flat(x)
    residual = _residual(residual)
    numel = x.numel()
    blocks = -(-numel // block)
    signs = torch.empty(-(-numel // 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    if numel == 0:
        return signs, scales
    suffix = _kernel_suffix(x, residual)
    # One CUDA block per sign block: up to 256 threads, never fewer than a warp.
    threads = min(SIGN_MAX_THREADS, max(32, 1 << (block - 1).bit_length()))
    grid = min(blocks, MAX_GRID)
    launch = functools.partial(_launch, x.device, "sign")
    inputs = (x.data_ptr(), _pointer(residual))
    if block % 8 == 0:
        launch(
            f"sign_compress_{suffix}",
            grid,
            threads,
            *inputs,
            signs.data_ptr(),
            scales.data_ptr(),
            numel,
            block,
            blocks,
        )
        return signs, scales
    # Bytes of signs straddle blocks: scales first, then bits and residuals element-wise.
    launch(f"sign_scales_{suffix}", grid, threads, *inputs, scales.data_ptr(), numel, block, blocks)
    arguments = (*inputs, signs.data_ptr(), scales.data_ptr(), numel, block)
    launch(f"sign_encode_{suffix}", _grid(numel), ELEMENTWISE_THREADS, *arguments)
    return signs, scales


def sign_decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """:func:`gradcomp.ops.reference.sign_decompress` on a CUDA kernel."""
    packed, scales = _flat(packed), _flat(scales).float()
    target = torch.empty(numel, dtype=torch.float32, device=packed.device) if out is None else out.view(-1)
    if numel:
        arguments = (
            packed.data_ptr(),
            scales.data_ptr(),
            target.data_ptr(),
            numel,
            block,
            numpy.int32(accumulate),
        )
        name = f"sign_decompress_{FLOAT_NAMES[target.dtype]}"
        _launch(packed.device, "sign", name, _grid(numel), ELEMENTWISE_THREADS, *arguments)
    return target if out is None else out


# ----------------------------------------------------------------------------- bits


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`gradcomp.ops.reference.pack_bits` on a CUDA kernel."""
    codes = _flat(codes.to(torch.uint8))
    if bits == 8:
        return codes.clone()
    numel = codes.numel()
    nbytes = -(-numel * bits // 8)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if nbytes:
        arguments = (codes.data_ptr(), packed.data_ptr(), numel, nbytes, numpy.int32(bits))
        _launch(codes.device, "bits", "pack_bits", _grid(nbytes), ELEMENTWISE_THREADS, *arguments)
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """:func:`gradcomp.ops.reference.unpack_bits` on a CUDA kernel."""
    if bits == 8:
        return packed.reshape(-1)[:numel]
    packed = _flat(packed.to(torch.uint8))
    # Like the reference's slice: at most the codes the bytes hold.
    count = max(0, min(numel, packed.numel() * (8 // bits)))
    codes = torch.empty(count, dtype=torch.uint8, device=packed.device)
    if count:
        arguments = (packed.data_ptr(), codes.data_ptr(), count, numpy.int32(bits))
        _launch(packed.device, "bits", "unpack_bits", _grid(count), ELEMENTWISE_THREADS, *arguments)
    return codes


# ----------------------------------------------------------------------------- scatter-add


def scatter_add(indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`gradcomp.ops.reference.scatter_add` on CUDA kernels: the pairs added in
    their order (rows in rank order) whatever the GPU's schedule, around a stable sort
    by index (``csrc/scatter.cu``). An index outside ``out`` is dropped and makes
    element 0 NaN (a trap would end the CUDA context)."""
    indices = _flat(indices)
    if indices.dtype not in INDEX_CODES:
        indices = indices.long()
    target = out.view(-1)
    values = _flat(values).to(target.dtype)
    count, numel = indices.numel(), target.numel()
    if count:
        suffix = f"{FLOAT_NAMES[target.dtype]}_{INDEX_NAMES[indices.dtype]}"
        # Keys run up to numel (a zero value's): the index dtype of numel elements holds it.
        keys = torch.empty(count, dtype=index_dtype_for(numel), device=out.device)
        key_code = numpy.int32(INDEX_CODES[keys.dtype])
        launch = functools.partial(_launch, target.device, "scatter")
        pairs = (indices.data_ptr(), values.data_ptr())
        keying = (*pairs, keys.data_ptr(), count, numel, key_code)
        launch(f"scatter_keys_{suffix}", _grid(count), ELEMENTWISE_THREADS, *keying)
        keys, order = torch.sort(keys, stable=True)
        adding = (keys.data_ptr(), key_code, order.data_ptr(), *pairs, target.data_ptr(), count, numel)
        launch(f"scatter_add_{suffix}", _grid(count), ELEMENTWISE_THREADS, *adding)
    return out


FUNCTIONS = {
    "sign_compress": sign_compress,
    "sign_decompress": sign_decompress,
    "topk_select": topk_select,
    "scatter_add": scatter_add,
    "pack_bits": pack_bits,
    "unpack_bits": unpack_bits,
}
