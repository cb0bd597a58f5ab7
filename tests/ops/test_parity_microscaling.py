"""The block-scaled formats (MXFP8, MXFP4, NVFP4) on the Triton kernels against the reference, bit for bit.

On the inputs the reference's own tests use (tests/compressors/test_microscaling.py):
all-zero blocks, fp32 subnormals, values at and past saturation, blocks spread
over 2**-40 .. 2**40, tails shorter than a block, blocks holding inf or NaN,
fp32, fp16 and bf16 tensors; the residual the encoder writes, the decoder
writing and adding into every float dtype, and the sum of several ranks' rows.
On a GPU the Triton kernels run on CUDA tensors; without one, in Triton's
interpreter on CPU tensors (``slow``, but for one small case of each format).
"""

from __future__ import annotations

import math

import pytest
import torch

from gradcomp import get_compressor, ops
from gradcomp.ops import reference_mx
from gradcomp.payload import buffer_size
from tests.compressors.test_microscaling import wide_range
from tests.utils import (
    DTYPES,
    HAS_TRITON,
    INTERPRETED,
    REFERENCE,
    assert_same,
    backend_device,
    backend_params,
)

pytest.importorskip("triton")

# The backends that have the ops besides the reference (Triton; the cpu backend is the reference).
BACKENDS = [param for param in backend_params() if param.values[0] == "triton"]
# One small case of each format in the fast tier, also in the interpreter (under a second each).
QUICK = pytest.param("triton", id="triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs triton"))
FORMATS = ["mxfp8", "mxfp4", "nvfp4"]
SIZES = [1, 31, 1023, 4097]


def _encode(backend: str, name: str, x: torch.Tensor, residual: torch.Tensor | None):
    functions = ops.backend(backend)
    if name == "nvfp4":
        return functions.nvfp4_quantize(x, 16, residual)
    return functions.mx_quantize(x, _element(name), 32, residual)


def _decode(backend: str, name: str, payload: tuple, numel: int, out=None, accumulate=False):
    functions = ops.backend(backend)
    if name == "nvfp4":
        return functions.nvfp4_dequantize(*payload, 16, numel, out, accumulate)
    return functions.mx_dequantize(*payload, _element(name), 32, numel, out, accumulate)


def _element(name: str) -> str:
    return {"mxfp8": "e4m3", "mxfp4": "e2m1"}[name]


def _residual(numel: int, device, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(numel + 1)
    return (torch.randn(numel, generator=generator) * 2.0**-8).to(dtype).to(device)


def _assert_stored(
    expected: torch.Tensor, actual: torch.Tensor, magnitude: torch.Tensor | None = None
) -> None:
    """:func:`assert_same`, where bfloat16 values stored in the interpreter may be a step
    off (it truncates): NaN where the reference has NaN, the rest within a step."""
    if expected.dtype != torch.bfloat16 or not INTERPRETED:
        assert_same(expected, actual)
        return
    nan = expected.isnan()
    assert torch.equal(nan, actual.isnan())
    magnitude = expected.abs() if magnitude is None else magnitude
    assert_same(expected[~nan], actual[~nan], bf16_stored=True, magnitude=magnitude[~nan])


def _check_encoding(backend: str, name: str, x: torch.Tensor, residual: torch.Tensor | None) -> tuple:
    """The backend's payload and residual are the reference's; returns the payload."""
    expected_residual = None if residual is None else residual.clone()
    expected = _encode("torch", name, x, expected_residual)
    actual = _encode(backend, name, x, residual)
    for want, got in zip(expected, actual, strict=True):
        assert_same(want, got)
    if residual is not None:
        _assert_stored(expected_residual, residual)
    return expected


@pytest.mark.parametrize("backend", [QUICK])
@pytest.mark.parametrize("name", FORMATS)
def test_a_small_tensor_encodes_and_decodes_as_the_reference(backend, name):
    device = backend_device(backend)
    x = wide_range(100, seed=2).to(device)
    payload = _check_encoding(backend, name, x, _residual(100, device))
    assert_same(_decode("torch", name, payload, 100), _decode(backend, name, payload, 100))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encoding_and_decoding_are_bit_exact(backend, name, numel, dtype):
    device = backend_device(backend)
    x = wide_range(numel, seed=numel, dtype=dtype).to(device)
    payload = _check_encoding(backend, name, x, _residual(numel, device))
    _check_encoding(backend, name, x, None)
    decoded = _decode("torch", name, payload, numel)
    assert_same(decoded, _decode(backend, name, payload, numel))
    for out_dtype in (*DTYPES, torch.float64):
        base = wide_range(numel, seed=numel + 7).to(out_dtype).to(device)
        expected = _decode("torch", name, payload, numel, base.clone(), True)
        actual = _decode(backend, name, payload, numel, base.clone(), True)
        _assert_stored(expected, actual, base.float().abs() + decoded.abs())
        _assert_stored(
            _decode("torch", name, payload, numel, base.clone()),
            _decode(backend, name, payload, numel, base.clone()),
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("planted", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_blocks_match(backend, name, planted):
    device = backend_device(backend)
    x = wide_range(1000, seed=3)
    x[[40, 41, 700]] = torch.tensor([planted, 1e30, planted])
    payload = _check_encoding(backend, name, x.to(device), _residual(1000, device))
    assert_same(_decode("torch", name, payload, 1000), _decode(backend, name, payload, 1000))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("residual_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_residual_of_half_precision_is_written_as_the_reference_writes_it(backend, name, residual_dtype):
    device = backend_device(backend)
    x = wide_range(1023, seed=4).clamp(-1e4, 1e4).to(device)
    _check_encoding(backend, name, x, _residual(1023, device, residual_dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("numel", [1, 1000, 4097])
@pytest.mark.parametrize("divisor", [1, 3])
def test_the_sum_of_rows_matches(backend, name, numel, divisor):
    """Three ranks' payloads in rows (each row wider than its payload), decoded and
    added in row order, divided once, rounded to bf16 and to fp32."""
    device = backend_device(backend)
    compressor = get_compressor(name, feedback=False)
    payloads = [compressor.compress(wide_range(numel, seed=rank) * (rank + 1)) for rank in range(3)]
    width = buffer_size(payloads[0].layout())
    rows = torch.stack([p.to_buffer(size=width + 8) for p in payloads]).to(device)
    for out_dtype in (torch.bfloat16, torch.float32):
        expected, actual = (torch.empty(numel, dtype=out_dtype, device=device) for _ in range(2))
        for functions, out in ((REFERENCE, expected), (ops.backend(backend), actual)):
            if name == "nvfp4":
                functions.nvfp4_dequantize_sum(rows, 16, numel, out, divisor=divisor)
            else:
                functions.mx_dequantize_sum(rows, _element(name), 32, numel, out, divisor=divisor)
        _assert_stored(expected, actual)


def test_the_kernels_formats_are_the_references():
    from gradcomp.kernels import microscaling

    for element, theirs in microscaling.ELEMENTS.items():
        ours = reference_mx.ELEMENTS[element]
        fields = ("bits", "mantissa_bits", "min_exponent", "largest", "largest_power")
        assert [getattr(theirs, f) for f in fields] == [getattr(ours, f) for f in fields]
        assert theirs.has_nan == (ours.nan_code is not None)
    assert microscaling.SMALLEST_TENSOR_SCALE.value == reference_mx.SMALLEST_TENSOR_SCALE
