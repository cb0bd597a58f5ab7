"""Every backend against the reference, op by op: one suite, parametrized over backends.

``cpu`` runs on CPU tensors; ``triton`` on the GPU, or without one on CPU
tensors in Triton's interpreter; ``cuda`` (the kernels of ``csrc/``) only on
a GPU with CuPy, and only for the ops it implements. Calls go through
``ops.run_on``, so every backend gets the arguments the op boundary checked
and completed.

Bit for bit wherever the arithmetic is the same operations in the same
order. Where a backend adds in another order (block sums of sign scales and
QSGD norms on a GPU) it is within a few ulp; where it draws other random
numbers (stochastic rounding on a GPU) it is checked for unbiasedness and
conservation instead. The CUDA Top-K is an exact radix select: the exact
top-k with ties to the lowest index, which the reference's sampling path
also returns for inputs whose sample is not misjudged (tested here).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradcomp
from gradcomp import ops
from gradcomp.compressors import Context
from gradcomp.ops import reference
from tests.utils import (
    DTYPES,
    INTERPRETED,
    REFERENCE,
    assert_same,
    backend_device,
    backend_params,
    provides,
    seeded_randn,
)

SIZES = (1, 1023, 4097)
# The backends that run on a GPU (Triton in its interpreter without one).
GPU_BACKENDS = [param for param in backend_params() if param.values[0] != "cpu"]
GPU_SUMS = {"triton", "cuda"}  # block sums in another order than torch's


@pytest.fixture(params=backend_params())
def backend(request):
    return request.param


def pytest_generate_tests(metafunc):
    """Tests marked ``matrix(name=[values], ...)`` run every combination of the
    values on each backend, except in Triton's interpreter (seconds a kernel):
    there a covering subset, every value of every parameter at least once.
    The whole matrix runs on a GPU (``bench/gpu_check.sh``)."""
    marker = metafunc.definition.get_closest_marker("matrix")
    if marker is None:
        return
    names, values = list(marker.kwargs), list(marker.kwargs.values())
    every = list(itertools.product(*values))
    covering = [tuple(v[i % len(v)] for v in values) for i in range(max(map(len, values)))]
    params = []
    for backend in backend_params():
        name = backend.values[0]
        for row in covering if name == "triton" and INTERPRETED else every:
            params.append(pytest.param(name, *row, marks=backend.marks, id="-".join(map(str, (name, *row)))))
    metafunc.parametrize(["backend", *names], params)


class On:
    """One backend in a test: its device, its ops (checked), and what it provides."""

    def __init__(self, name: str):
        self.name = name
        self.device = backend_device(name)
        self.ops = ops.backend(name)

    def need(self, op: str) -> None:
        if not provides(self.name, op):
            pytest.skip(f"the {self.name} backend has no {op}")

    def randn(self, numel: int, seed: int, dtype=torch.float32) -> torch.Tensor:
        return seeded_randn(numel, seed, dtype, self.device)

    def zeros(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    @property
    def bf16_rounds_otherwise(self) -> bool:
        """Whether stored bfloat16 values may be one step off (the interpreter truncates)."""
        return self.name == "triton" and INTERPRETED


@pytest.fixture
def on(backend) -> On:
    return On(backend)


# ----------------------------------------------------------------------------- quantization


@pytest.mark.matrix(numel=SIZES, block=[256, 100, 64], bits=[8, 4, 2], dtype=DTYPES)
def test_quantize_round_to_nearest_is_bit_exact(on, numel, block, bits, dtype):
    on.need("quantize_blockwise")
    x = on.randn(numel, seed=numel + bits, dtype=dtype)
    if numel > 300:
        x[block : 2 * block] = 0  # an all-zero block
    residual = on.randn(numel, seed=7) * 0.1
    expected_residual, actual_residual = residual.clone(), residual.clone()
    codes, scales = REFERENCE.quantize_blockwise(x, bits, block, residual=expected_residual)
    got_codes, got_scales = on.ops.quantize_blockwise(x, bits, block, residual=actual_residual)
    assert_same(codes, got_codes)
    assert_same(scales, got_scales)
    assert_same(expected_residual, actual_residual)
    decoded = REFERENCE.dequantize_blockwise(codes, scales, bits, block, numel)
    assert_same(decoded, on.ops.dequantize_blockwise(codes, scales, bits, block, numel))
    for out_dtype in (*DTYPES, torch.float64):
        base = on.randn(numel, seed=3, dtype=out_dtype)
        expected = REFERENCE.dequantize_blockwise(codes, scales, bits, block, numel, base.clone(), True)
        actual = on.ops.dequantize_blockwise(codes, scales, bits, block, numel, base.clone(), True)
        operands = base.float().abs() + decoded.abs()
        bf16 = out_dtype == torch.bfloat16 and on.bf16_rounds_otherwise
        assert_same(expected, actual, bf16_stored=bf16, magnitude=operands)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantize_non_finite_blocks_decode_non_finite(on, bad):
    on.need("quantize_blockwise")
    x = on.randn(1000, seed=1)
    x[10] = bad
    residual = on.zeros(1000)
    codes, scales = on.ops.quantize_blockwise(x, 8, 256, residual=residual)
    decoded = on.ops.dequantize_blockwise(codes, scales, 8, 256, 1000)
    assert not torch.isfinite(decoded[:256]).all()
    assert torch.isfinite(decoded[256:]).all() and torch.isfinite(residual).all()
    assert_same(
        REFERENCE.dequantize_blockwise(*REFERENCE.quantize_blockwise(x, 8, 256), 8, 256, 1000), decoded
    )


# The interpreter computes with numpy, which warns of the overflow the kernel tests for.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("bits, levels, scale", [(8, None, "absmax"), (4, None, "absmax"), (4, 7, "norm")])
def test_quantize_at_the_largest_floats_matches_and_decodes_finite(on, bits, levels, scale):
    """Where levels * scale rounds past the largest float, every backend steps the
    scale one ulp down: the same scales and codes, finite decoded values and residual."""
    on.need("quantize_blockwise")
    biggest = torch.finfo(torch.float32).max
    x = on.randn(1000, seed=8)
    x[[5, 300, 640]] = torch.tensor([biggest, -biggest, 0.999 * biggest], device=on.device)
    options = {"levels": levels, "scale": scale}
    expected_residual, actual_residual = on.zeros(1000), on.zeros(1000)
    codes, scales = REFERENCE.quantize_blockwise(x, bits, 256, residual=expected_residual, **options)
    got_codes, got_scales = on.ops.quantize_blockwise(x, bits, 256, residual=actual_residual, **options)
    assert_same(scales, got_scales)
    assert_same(codes, got_codes)
    assert_same(expected_residual, actual_residual)
    decoded = on.ops.dequantize_blockwise(got_codes, got_scales, bits, 256, 1000, levels=levels)
    assert torch.isfinite(decoded).all() and torch.isfinite(actual_residual).all()


@pytest.mark.parametrize("numel, block", [(5000, 256), (1023, 100)])
def test_stochastic_rounding_on_cpu_draws_the_references_numbers(numel, block):
    cpu = On("cpu")
    x = cpu.randn(numel, seed=2)
    expected_residual, actual_residual = cpu.zeros(numel), cpu.zeros(numel)
    expected = REFERENCE.quantize_blockwise(x, 4, block, True, 5, expected_residual)
    actual = cpu.ops.quantize_blockwise(x, 4, block, True, 5, actual_residual)
    for want, got in zip((*expected, expected_residual), (*actual, actual_residual), strict=True):
        assert_same(want, got)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_stochastic_rounding_on_a_gpu_is_unbiased_and_conserves(on):
    """A GPU backend draws its own (counter-based) numbers: unbiased, and what
    it drops stays in the residual."""
    on.need("quantize_blockwise")
    numel, block, trials = 512, 128, 200
    x = on.randn(numel, seed=2)
    total = torch.zeros(numel, dtype=torch.float64, device=on.device)
    for seed in range(trials):
        residual = on.zeros(numel)
        codes, scales = on.ops.quantize_blockwise(x, 4, block, True, seed, residual)
        decoded = on.ops.dequantize_blockwise(codes, scales, 4, block, numel)
        bound = 2**-23 * (x.abs() + decoded.abs())
        assert ((decoded + residual - x).abs() <= bound).all(), "error feedback lost mass"
        total += decoded.double()
    step = scales.repeat_interleave(block).double()
    standard_error = step / 2 / math.sqrt(trials)
    assert ((total / trials - x.double()).abs() <= 5 * standard_error + 1e-7).all()
    again = on.ops.quantize_blockwise(x, 4, block, True, 5)
    assert torch.equal(again[0], on.ops.quantize_blockwise(x, 4, block, True, 5)[0])


def test_qsgd_norm_scale_matches_reference(on):
    on.need("quantize_blockwise")
    x = on.randn(3000, seed=4)
    _, expected = REFERENCE.quantize_blockwise(x, 4, 256, levels=7, scale="norm")
    _, actual = on.ops.quantize_blockwise(x, 4, 256, levels=7, scale="norm")
    ulps = 4 if on.name in GPU_SUMS else 0
    torch.testing.assert_close(actual, expected, rtol=ulps * 2**-23, atol=0)


# ----------------------------------------------------------------------------- sign


@pytest.mark.matrix(numel=SIZES, block=[1024, 64, 100], dtype=DTYPES)
def test_sign_matches_reference(on, numel, block, dtype):
    on.need("sign_compress")
    x = on.randn(numel, seed=numel, dtype=dtype)
    residual = on.randn(numel, seed=9) * 0.1
    expected_residual, actual_residual = residual.clone(), residual.clone()
    signs, scales = REFERENCE.sign_compress(x, block, expected_residual)
    got_signs, got_scales = on.ops.sign_compress(x, block, actual_residual)
    assert_same(signs, got_signs)
    if on.name in GPU_SUMS:
        torch.testing.assert_close(got_scales, scales, rtol=4 * 2**-23, atol=0)
        # Given the backend's scales, the residual is the reference's arithmetic.
        y = reference.compensate(x, residual)
        decoded = REFERENCE.sign_decompress(got_signs, got_scales, block, numel)
        torch.testing.assert_close(
            decoded + actual_residual, y, rtol=0, atol=4e-7 * y.abs().max().item() + 1e-7
        )
    else:
        assert_same(scales, got_scales)
        assert_same(expected_residual, actual_residual)
    for out_dtype in (torch.float32, torch.float64):
        for accumulate in (False, True):
            base = on.randn(numel, seed=3, dtype=out_dtype)
            expected = REFERENCE.sign_decompress(signs, scales, block, numel, base.clone(), accumulate)
            actual = on.ops.sign_decompress(signs, scales, block, numel, base.clone(), accumulate)
            assert_same(expected, actual)


@pytest.mark.parametrize("block", [1024, 100])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_sign_non_finite_blocks_decode_non_finite(on, block, bad):
    on.need("sign_compress")
    x = on.randn(4096, seed=1)
    x[5] = bad
    residual = on.zeros(4096)
    signs, scales = on.ops.sign_compress(x, block, residual)
    decoded = on.ops.sign_decompress(signs, scales, block, 4096)
    assert not torch.isfinite(decoded[:block]).any()
    assert torch.isfinite(decoded[block:]).all() and torch.isfinite(residual).all()
    assert_same(REFERENCE.sign_compress(x, block)[0], signs)


# ----------------------------------------------------------------------------- payload rows


def _rows(on: On, count: int, numel: int, bits: int, block: int) -> torch.Tensor:
    """Rows long enough for payloads of ``numel`` elements, filled with a marker byte."""
    width = -(-(4 * -(-numel // block) + -(-numel * bits // 8)) // 8) * 8 + 16
    return torch.full((count, width), 0xA5, dtype=torch.uint8, device=on.device)


ROW_CASES = [(8, None, 256, 4097), (4, None, 128, 1023), (2, None, 64, 3001), (4, 7, 256, 1), (2, 1, 64, 640)]


@pytest.mark.matrix(case=ROW_CASES, dtype=DTYPES)
def test_quantize_rows_are_bit_exact(on, case, dtype):
    """One payload a chunk (scales, codes, zeros to 8 bytes; the rest of the
    row untouched), decoded into every float dtype: the reference's bits."""
    on.need("quantize_rows")
    bits, levels, block, numel = case
    x = on.randn(numel, seed=numel + bits, dtype=dtype)
    residual = on.randn(numel, seed=5) * 0.1
    chunk = 2 * block
    count = -(-numel // chunk) + 1  # a trailing row no chunk uses
    expected, actual = _rows(on, count, chunk, bits, block), _rows(on, count, chunk, bits, block)
    expected_residual, actual_residual = residual.clone(), residual.clone()
    options = {"levels": levels, "scale": "norm" if levels else "absmax"}
    REFERENCE.quantize_rows(x, bits, block, chunk, expected, residual=expected_residual, **options)
    on.ops.quantize_rows(x, bits, block, chunk, actual, residual=actual_residual, **options)
    if levels and on.name in GPU_SUMS:  # QSGD's norms summed in another order: a few ulp
        torch.testing.assert_close(actual_residual, expected_residual, rtol=1e-5, atol=1e-6)
    else:
        assert_same(expected, actual)
        assert_same(expected_residual, actual_residual)
    for out_dtype in DTYPES:
        decoded = [
            backend.dequantize_rows(
                actual, bits, block, numel, chunk, on.zeros(numel, out_dtype), levels=levels
            )
            for backend in (REFERENCE, on.ops)
        ]
        assert_same(*decoded, bf16_stored=out_dtype == torch.bfloat16 and on.bf16_rounds_otherwise)


@pytest.mark.matrix(case=ROW_CASES, divisor=[1, 3])
def test_dequantize_sum_adds_rows_in_order_bit_exactly(on, case, divisor):
    on.need("dequantize_sum")
    bits, levels, block, numel = case
    rows = _rows(on, 3, numel, bits, block)
    whole = -(-numel // block) * block
    for r in range(3):
        REFERENCE.quantize_rows(on.randn(numel, seed=r), bits, block, whole, rows[r : r + 1], levels=levels)
    expected, actual = (
        backend.dequantize_sum(rows, bits, block, numel, on.zeros(numel), levels=levels, divisor=divisor)
        for backend in (REFERENCE, on.ops)
    )
    assert_same(expected, actual)


@pytest.mark.parametrize("case", ROW_CASES)
def test_cpu_dequantize_sum_decodes_chunks_of_every_row_in_order(case, monkeypatch):
    """The CPU backend decodes a chunk of every row at once: with chunks of a few blocks
    (the last one short, and signed zeros in the rows), the reference's bits."""
    monkeypatch.setattr(gradcomp.ops.cpu_shared, "CHUNK_ELEMENTS", 1500)
    monkeypatch.setattr(gradcomp.ops.cpu_small, "SMALL", 0)  # small ones go through numpy, unchunked
    cpu = On("cpu")
    bits, levels, block, numel = case
    numel = 3 * numel + 5
    rows = _rows(cpu, 3, numel, bits, block)
    whole = -(-numel // block) * block
    for r in range(3):
        x = cpu.randn(numel, seed=r)
        x[r::7] = -0.0
        REFERENCE.quantize_rows(x, bits, block, whole, rows[r : r + 1], levels=levels)
    expected, actual = (
        backend.dequantize_sum(rows, bits, block, numel, cpu.zeros(numel), levels=levels, divisor=3)
        for backend in (REFERENCE, cpu.ops)
    )
    assert_same(expected, actual)
    # No rows at all: the sum of nothing.
    nothing = cpu.ops.dequantize_sum(rows[:0], bits, block, numel, cpu.zeros(numel) + 1, levels=levels)
    assert not nothing.any()


@pytest.mark.parametrize("block, numel", [(1024, 5000), (64, 1), (256, 1023)])
def test_sign_rows_match_the_reference(on, block, numel):
    on.need("sign_compress_rows")
    x = on.randn(numel, seed=numel)
    chunk = 2 * block
    count = -(-numel // chunk)
    expected, actual = _rows(on, count, chunk, 1, block), _rows(on, count, chunk, 1, block)
    REFERENCE.sign_compress_rows(x, block, chunk, expected, on.zeros(numel))
    on.ops.sign_compress_rows(x, block, chunk, actual, on.zeros(numel))
    scales = 4 * -(-min(chunk, numel) // block)
    ulps = 4 if on.name in GPU_SUMS else 0
    torch.testing.assert_close(
        actual[:, :scales].view(torch.float32),
        expected[:, :scales].view(torch.float32),
        rtol=ulps * 2**-23,
        atol=0,
    )
    assert_same(expected[:, scales:], actual[:, scales:])  # signs, padding, the rest of the rows
    decoded = [
        b.sign_decompress_rows(actual, block, numel, chunk, on.zeros(numel)) for b in (REFERENCE, on.ops)
    ]
    assert_same(*decoded)
    first = min(numel, chunk)
    summed = [
        b.sign_decompress_sum(actual[:1], block, first, on.zeros(first), divisor=2)
        for b in (REFERENCE, on.ops)
    ]
    assert_same(*summed)


# ----------------------------------------------------------------------------- bits


@pytest.mark.matrix(bits=[1, 2, 4, 8], numel=[1, 7, 1023, 4096])
def test_pack_unpack_bit_exact(on, bits, numel):
    on.need("pack_bits")
    generator = torch.Generator().manual_seed(numel + bits)
    codes = torch.randint(0, 2**bits, (numel,), generator=generator, dtype=torch.uint8).to(on.device)
    packed = on.ops.pack_bits(codes, bits)
    assert_same(REFERENCE.pack_bits(codes, bits), packed)
    assert_same(codes, on.ops.unpack_bits(packed, bits, numel))


# ----------------------------------------------------------------------------- random-K


@pytest.mark.parametrize(
    "numel,k,seed", [(1, 1, 0), (1000, 10, 1), (4097, 41, 2), (50_000, 500, 3), (300, 300, 4)]
)
def test_randk_indices_match_reference(on, numel, k, seed):
    on.need("randk_indices")
    assert_same(
        REFERENCE.randk_indices(numel, k, seed, on.device), on.ops.randk_indices(numel, k, seed, on.device)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("multiplier", [1.0, 25.0])
def test_randk_select_matches_reference(on, dtype, multiplier):
    on.need("randk_select")
    x = on.randn(5000, seed=5, dtype=dtype)
    residual = on.randn(5000, seed=6) * 0.1
    expected_residual, actual_residual = residual.clone(), residual.clone()
    options = {"multiplier": multiplier, "value_dtype": dtype}
    expected = REFERENCE.randk_select(x, 200, 11, expected_residual, **options)
    actual = on.ops.randk_select(x, 200, 11, actual_residual, **options)
    bf16 = dtype == torch.bfloat16 and on.bf16_rounds_otherwise
    assert_same(expected, actual, bf16_stored=bf16)
    if bf16:
        # The values were rounded otherwise; what each rounding lost stays in
        # its own residual, and the unpicked entries match exactly.
        picked = REFERENCE.randk_indices(5000, 200, 11, on.device)
        if multiplier == 1.0:
            y = (x.float() + residual)[picked]
            torch.testing.assert_close(actual.float() + actual_residual[picked], y, rtol=0, atol=0)
        unpicked = torch.ones(5000, dtype=torch.bool, device=on.device)
        unpicked[picked] = False
        assert_same(expected_residual[unpicked], actual_residual[unpicked])
    else:
        assert_same(expected_residual, actual_residual)


def test_randk_nan_anywhere_reaches_the_values(on):
    on.need("randk_select")
    x = on.randn(5000, seed=5)
    x[4321] = math.nan
    residual = on.zeros(5000)
    values = on.ops.randk_select(x, 50, 1, residual)
    assert values.isnan().any() and torch.isfinite(residual).all()


# ----------------------------------------------------------------------------- Top-K


def exact_topk(x, k, residual, value_dtype=torch.float32, index_dtype=None):
    """The exact top-k, ties at the k-th magnitude to the lowest index, indices
    ascending, and the residual after it: what the sampling path returns when
    its sample does not misjudge, and what the CUDA radix select returns always."""
    y = reference.compensate(x, residual)
    magnitude = reference.selection_magnitude(y)
    indices = torch.sort(magnitude, descending=True, stable=True).indices[:k].sort().values
    picked = y[indices]
    values = picked.to(value_dtype)
    updated = None
    if residual is not None:
        kept = y.nan_to_num(0.0, 0.0, 0.0)
        kept[indices] = (picked - values.float()).nan_to_num(0.0, 0.0, 0.0)
        updated = kept.to(residual.dtype)
    return values, indices.to(index_dtype or reference.index_dtype_for(x.numel())), updated


@pytest.mark.matrix(size=[(1000, 0.05), (4097, 0.01), (60_000, 0.001), (20_000, 0.3)], dtype=DTYPES)
def test_topk_sampling_path_is_the_exact_top_k(on, size, dtype):
    on.need("topk_select")
    numel, ratio = size
    x = on.randn(numel, seed=numel, dtype=dtype)
    residual = on.randn(numel, seed=12) * 0.3
    k = max(1, round(ratio * numel))
    actual_residual = residual.clone()
    expected = exact_topk(x, k, residual, dtype)
    got = on.ops.topk_select(x, k, actual_residual, seed=77, value_dtype=dtype)
    bf16 = dtype == torch.bfloat16 and on.bf16_rounds_otherwise
    assert_same(expected[1], got[1])
    assert_same(expected[0], got[0], bf16_stored=bf16)
    if not bf16:
        assert_same(expected[2], actual_residual)
    reference_residual = residual.clone()
    assert_same(REFERENCE.topk_select(x, k, reference_residual, seed=77, value_dtype=dtype)[1], got[1])


@pytest.mark.matrix(
    residual_dtype=[torch.float16, torch.bfloat16, torch.float64, None],
    value_dtype=[torch.float16, torch.float64],
    index_dtype=[torch.int32, torch.int64],
)
def test_topk_residual_value_and_index_dtypes(on, residual_dtype, value_dtype, index_dtype):
    on.need("topk_select")
    x = on.randn(5000, seed=4)
    residual = None if residual_dtype is None else (on.randn(5000, seed=5) * 0.1).to(residual_dtype)
    actual_residual = None if residual is None else residual.clone()
    expected = exact_topk(x, 60, residual, value_dtype, index_dtype)
    got = on.ops.topk_select(x, 60, actual_residual, value_dtype=value_dtype, index_dtype=index_dtype)
    assert_same(expected[1], got[1])
    assert_same(expected[0], got[0])
    if residual is not None and not (residual_dtype == torch.bfloat16 and on.bf16_rounds_otherwise):
        assert_same(expected[2], actual_residual)


@pytest.mark.matrix(numel=[4000, 40_000], k_fraction=[0.001, 0.5])
def test_topk_ties_go_to_the_lowest_indices(on, numel, k_fraction):
    """Many equal magnitudes: every element reaches the threshold, and the ties
    at the k-th magnitude go to the lowest indices (the sampling path ranks
    the larger candidates first, so a flood of ties cannot crowd them out)."""
    on.need("topk_select")
    k = max(1, int(k_fraction * numel))
    generator = torch.Generator().manual_seed(numel)
    levels = torch.randint(-3, 4, (numel,), generator=generator).float().to(on.device)
    for x in (torch.ones(numel, device=on.device), levels):
        expected = exact_topk(x, k, on.zeros(numel))
        actual_residual = on.zeros(numel)
        got = on.ops.topk_select(x, k, actual_residual, seed=1)
        assert_same(expected[1], got[1])
        assert_same(expected[0], got[0])
        assert_same(expected[2], actual_residual)


@pytest.mark.parametrize("misjudged", ["too high", "too low", "above everything"])
def test_topk_misjudged_threshold_matches_the_reference(on, misjudge_threshold, misjudged):
    """Too few candidates (padding), more than the capacity, or none at all: the
    sampling backends give the reference's payload and residual."""
    on.need("topk_select")
    if on.name == "cuda":
        pytest.skip("the CUDA radix select takes no sample")
    x = on.randn(20_000, seed=18)
    residual = on.randn(20_000, seed=19) * 0.3
    change = {
        "too high": lambda t: t * 1.5,
        "too low": lambda t: t * 0.2,
        "above everything": lambda t: torch.full_like(t, 1e30),
    }[misjudged]
    misjudge_threshold(change)
    expected_residual, actual_residual = residual.clone(), residual.clone()
    expected = REFERENCE.topk_select(x, 200, expected_residual, seed=4)
    actual = on.ops.topk_select(x, 200, actual_residual, seed=4)
    assert actual[0].numel() == 200
    if misjudged == "above everything":  # the misjudged threshold took effect: nothing reaches it
        assert not expected[0].any() and not expected[1].any()
    assert_same(expected[1], actual[1])
    assert_same(expected[0], actual[0])
    assert_same(expected_residual, actual_residual)


def test_topk_residual_keeps_the_sign_of_zero(on):
    """Candidates too small for a 16-bit residual round to -0.0 there, sent or not, and
    the residual at index 0, where the padding's slots point, keeps its -0.0: the
    reference's bits (no candidate's residual starts from +0.0 and is added to)."""
    on.need("topk_select")
    generator = torch.Generator().manual_seed(9)
    x = torch.zeros(6000)
    picked = torch.randperm(6000, generator=generator)[:300]
    x[picked] = -(torch.rand(300, generator=generator) + 0.5) * 1e-9
    x[7], x[0] = 0.5, -1e-9
    x = x.to(on.device)
    for residual_dtype, k in ((torch.float16, 50), (torch.float16, 400), (torch.float32, 50)):
        residual = torch.zeros(6000, dtype=residual_dtype, device=on.device)
        residual[0] = -0.0
        expected_residual, actual_residual = residual.clone(), residual.clone()
        expected = REFERENCE.topk_select(x, k, expected_residual, seed=3)
        actual = on.ops.topk_select(x, k, actual_residual, seed=3)
        assert_same(expected[1], actual[1])
        assert_same(expected[0], actual[0])
        assert_same(expected_residual, actual_residual)


@pytest.mark.parametrize("k", [1, 3, 50])
def test_topk_non_finite_values_are_selected_first(on, k):
    on.need("topk_select")
    x = on.randn(5000, seed=10)
    x[17], x[4000], x[2500] = math.nan, -math.inf, math.inf
    residual = on.randn(5000, seed=11) * 0.1
    residual[3000] = math.inf  # a non-finite compensated value from the residual
    values, indices = on.ops.topk_select(x, k, residual.clone())
    non_finite = [17, 2500, 3000, 4000]  # NaN ties with inf: the lowest indices win
    if k < len(non_finite):
        assert indices.tolist() == non_finite[:k]
    else:
        assert set(non_finite) <= set(indices.tolist())
    assert not torch.isfinite(values).all()


# ----------------------------------------------------------------------------- scatter-add


@pytest.mark.matrix(out_dtype=[*DTYPES, torch.float64], index_dtype=[torch.int32, torch.int64])
def test_scatter_add_distinct_indices_is_bit_exact(on, out_dtype, index_dtype):
    on.need("scatter_add")
    if on.bf16_rounds_otherwise and out_dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter truncates bfloat16 at each add; a GPU rounds it (gpu_check.sh)")
    generator = torch.Generator().manual_seed(7)
    indices = torch.randperm(10_001, generator=generator)[:3001].to(index_dtype).to(on.device)
    values = on.randn(3001, seed=8)
    base = on.randn(10_001, seed=9, dtype=out_dtype)
    bf16 = out_dtype == torch.bfloat16 and on.bf16_rounds_otherwise
    expected = REFERENCE.scatter_add(indices, values, base.clone())
    assert_same(expected, on.ops.scatter_add(indices, values, base.clone()), bf16_stored=bf16)


def test_scatter_add_sums_repeats(on):
    on.need("scatter_add")
    out = on.zeros(10)
    indices = torch.tensor([1, 3, 3, 9, 1, 1, 0], device=on.device)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, -1.0], device=on.device)
    # Small integers: every order of atomic adds gives the same sums.
    assert_same(REFERENCE.scatter_add(indices, values, out.clone()), on.ops.scatter_add(indices, values, out))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_scatter_add_outside_the_output_makes_element_0_nan(on):
    """The reference raises; a GPU kernel cannot without a host sync or a trap
    (which would end the CUDA context): it drops the value and makes element 0 NaN."""
    on.need("scatter_add")
    out = on.zeros(10)
    indices = torch.tensor([1, 12, 3, -1], device=on.device)
    on.ops.scatter_add(indices, torch.tensor([1.0, 2.0, 3.0, 4.0], device=on.device), out)
    if on.device.type == "cuda":
        torch.cuda.synchronize()  # a trap would raise here, and every later CUDA call too
    assert out[0].isnan()
    assert torch.equal(out[1:].cpu(), torch.tensor([1.0, 0, 3.0, 0, 0, 0, 0, 0, 0]))


class _ScalarDivisions(TorchDispatchMode):
    """Records divisions by a Python number or a 0-dim tensor: on CUDA torch
    computes those as a multiplication by the reciprocal
    (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu, ``div_true_kernel_cuda``
    under ``iter.is_cpu_scalar(2)``), one ulp off the kernels' division at times."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name().split("::")[-1].split(".")[0] in ("div", "div_", "true_divide", "true_divide_"):
            divisor = args[1]
            if not isinstance(divisor, torch.Tensor) or divisor.dim() == 0:
                self.found.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_reference_divides_as_the_kernels_do_on_every_device():
    """A scale is peak / levels and a mean sum / ranks, rounded once: the
    reference never divides by a scalar, which torch on CUDA does otherwise."""
    x = seeded_randn(3000, seed=4)
    rows = torch.zeros(3, 4096, dtype=torch.uint8)
    with _ScalarDivisions() as mode:
        for bits, scale in ((8, "absmax"), (4, "absmax"), (4, "norm"), (2, "absmax")):
            levels = 2 ** (bits - 1) - 1
            options = {"residual": torch.zeros(3000), "levels": levels, "scale": scale}
            codes, scales = reference.quantize_blockwise(x, bits, 256, **options)
            reference.dequantize_blockwise(codes, scales, bits, 256, 3000, levels=levels)
        for r in range(3):
            reference.quantize_rows(x, 8, 256, 3072, rows[r : r + 1], levels=127)
        reference.dequantize_sum(rows, 8, 256, 3000, torch.zeros(3000), levels=127, divisor=3)
        signs, scales = reference.sign_compress(x, 256, torch.zeros(3000))
        reference.sign_decompress(signs, scales, 256, 3000)
        for r in range(3):
            reference.sign_compress_rows(x, 256, 3072, rows[r : r + 1])
        reference.sign_decompress_sum(rows, 256, 3000, torch.zeros(3000), divisor=3)
    assert mode.found == []


# ----------------------------------------------------------------------------- compressors


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "sign", "topk", "randk", "none", "fp16"])
def test_compressors_agree_with_the_reference(on, name, monkeypatch):
    """Payloads, residuals and decoding of a compressor with this backend's ops
    against the reference's (sign: its scales within a few ulp)."""
    compressor = gradcomp.get_compressor(name)
    x = on.randn(30_000, seed=21)
    payloads, residuals, decoded = {}, {}, {}
    for backend in ("torch", on.name):
        monkeypatch.setenv("GRADCOMP_BACKEND", backend)
        if backend == "cuda":
            monkeypatch.delenv("GRADCOMP_BACKEND")  # ops it lacks come from Triton
        residual = on.zeros(30_000) + 0.01
        payloads[backend] = compressor.compress(x, Context(residual=residual, step=3, key=1))
        residuals[backend] = residual
        decoded[backend] = compressor.decompress(payloads[backend])
    if name == "sign" and on.name in GPU_SUMS:
        for backend in ("torch", on.name):
            torch.testing.assert_close(decoded[backend] + residuals[backend], x + 0.01, rtol=0, atol=1e-6)
        return
    for key in payloads["torch"].tensors:
        assert_same(payloads["torch"].tensors[key], payloads[on.name].tensors[key])
    assert_same(residuals["torch"], residuals[on.name])
    assert_same(decoded["torch"], decoded[on.name])
