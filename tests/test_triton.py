"""Triton kernels against the torch reference (interpreter on CPU, real kernels on a GPU).

Tolerances: bit-exact (``torch.equal``) wherever the arithmetic is the same
operations in the same order -- round-to-nearest quantization, codes, signs,
residuals, selections, decoding. Sums over a block (sign's mean magnitude,
QSGD's norm) run in another order than torch's: within 4 ulp. Stochastic
rounding draws other random numbers: checked by unbiasedness and exact
error-feedback conservation.

Triton's CPU interpreter converts fp32 to bfloat16 by truncation, where the
GPU rounds to nearest even like torch. Under the interpreter, values a kernel
stores as bfloat16 (and what follows from them) may differ by one bfloat16
step; everywhere else, and on a GPU always, comparisons are exact.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import gradcomp  # noqa: E402
from gradcomp.compressors import Context  # noqa: E402
from gradcomp.ops import reference  # noqa: E402
from gradcomp.ops import triton_backend as triton_ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SIZES = (1, 1023, 4097)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def randn(numel: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator).to(dtype).to(DEVICE)


def mismatch(expected: torch.Tensor, actual: torch.Tensor) -> str:
    differ = (expected != actual) & ~(expected.isnan() & actual.isnan())
    where = torch.nonzero(differ).view(-1)[:5].tolist()
    return f"{int(differ.sum())} of {expected.numel()} differ, first at {where}: " + ", ".join(
        f"{expected[i].item()} vs {actual[i].item()}" for i in where
    )


INTERPRETED = not torch.cuda.is_available()


def assert_same(
    expected: torch.Tensor,
    actual: torch.Tensor,
    bf16_stored: bool = False,
    magnitude: torch.Tensor | None = None,
) -> None:
    """Bit-exact, NaN equal to NaN. ``bf16_stored``: under the interpreter, within
    two bfloat16 steps of ``magnitude`` (the operands' size; default the result's)."""
    assert expected.dtype == actual.dtype and expected.shape == actual.shape
    if bf16_stored and INTERPRETED:
        magnitude = expected.abs() if magnitude is None else magnitude
        step = magnitude.float().cpu() * 2**-6 + 1e-30
        assert ((expected.float().cpu() - actual.float().cpu()).abs() <= step).all(), mismatch(
            expected.cpu(), actual.cpu()
        )
        return
    assert torch.equal(expected.cpu(), actual.cpu()) or (
        torch.equal(expected.isnan().cpu(), actual.isnan().cpu())
        and torch.equal(expected.nan_to_num().cpu(), actual.nan_to_num().cpu())
    ), mismatch(expected.cpu(), actual.cpu())


# ----------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("block", [256, 100, 64])
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_round_to_nearest_is_bit_exact(numel, block, bits, dtype):
    x = randn(numel, seed=numel + bits, dtype=dtype)
    if numel > 300:
        x[block : 2 * block] = 0  # an all-zero block
    residual = randn(numel, seed=7) * 0.1
    expected_residual, actual_residual = residual.clone(), residual.clone()
    codes, scales = reference.quantize_blockwise(x, bits, block, residual=expected_residual)
    got_codes, got_scales = triton_ops.FUNCTIONS["quantize_blockwise"](
        x, bits, block, residual=actual_residual
    )
    assert_same(codes, got_codes)
    assert_same(scales, got_scales)
    assert_same(expected_residual, actual_residual)
    decoded = reference.dequantize_blockwise(codes, scales, bits, block, numel)
    assert_same(decoded, triton_ops.FUNCTIONS["dequantize_blockwise"](codes, scales, bits, block, numel))
    for out_dtype in DTYPES:
        base = randn(numel, seed=3, dtype=out_dtype)
        expected = reference.dequantize_blockwise(codes, scales, bits, block, numel, base.clone(), True)
        actual = triton_ops.FUNCTIONS["dequantize_blockwise"](
            codes, scales, bits, block, numel, base.clone(), True
        )
        operands = base.float().abs() + decoded.abs()
        assert_same(expected, actual, bf16_stored=out_dtype == torch.bfloat16, magnitude=operands)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantize_non_finite_blocks_decode_non_finite(bad):
    x = randn(1000, seed=1)
    x[10] = bad
    residual = torch.zeros(1000, device=DEVICE)
    codes, scales = triton_ops.FUNCTIONS["quantize_blockwise"](x, 8, 256, residual=residual)
    decoded = triton_ops.FUNCTIONS["dequantize_blockwise"](codes, scales, 8, 256, 1000)
    assert not torch.isfinite(decoded[:256]).all()
    assert torch.isfinite(decoded[256:]).all() and torch.isfinite(residual).all()
    expected = reference.dequantize_blockwise(*reference.quantize_blockwise(x, 8, 256), 8, 256, 1000)
    assert_same(expected, decoded)


# The interpreter computes with numpy, which warns of the overflow the kernel tests for.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("bits, levels, scale", [(8, None, "absmax"), (4, None, "absmax"), (4, 7, "norm")])
def test_quantize_at_the_largest_floats_matches_and_decodes_finite(bits, levels, scale):
    """Where levels * scale rounds past the largest float, both step the scale
    one ulp down: same scales and codes, finite decoded values and residual."""
    biggest = torch.finfo(torch.float32).max
    x = randn(1000, seed=8)
    x[[5, 300, 640]] = torch.tensor([biggest, -biggest, 0.999 * biggest], device=DEVICE)
    options = {"levels": levels, "scale": scale}
    expected_residual, actual_residual = torch.zeros(1000, device=DEVICE), torch.zeros(1000, device=DEVICE)
    codes, scales = reference.quantize_blockwise(x, bits, 256, residual=expected_residual, **options)
    got_codes, got_scales = triton_ops.FUNCTIONS["quantize_blockwise"](
        x, bits, 256, residual=actual_residual, **options
    )
    assert_same(scales, got_scales)
    assert_same(codes, got_codes)
    assert_same(expected_residual, actual_residual)
    decode = triton_ops.FUNCTIONS["dequantize_blockwise"]
    decoded = decode(got_codes, got_scales, bits, 256, 1000, levels=levels)
    assert torch.isfinite(decoded).all() and torch.isfinite(actual_residual).all()


def test_stochastic_rounding_is_unbiased_and_conserves():
    x = randn(512, seed=2)
    trials = 200
    total = torch.zeros(512, dtype=torch.float64, device=DEVICE)
    for seed in range(trials):
        residual = torch.zeros(512, device=DEVICE)
        codes, scales = triton_ops.FUNCTIONS["quantize_blockwise"](x, 4, 128, True, seed, residual)
        decoded = triton_ops.FUNCTIONS["dequantize_blockwise"](codes, scales, 4, 128, 512)
        # decoded + residual == input, up to the rounding of one fp32 subtraction.
        bound = 2**-23 * (x.abs() + decoded.abs())
        assert ((decoded + residual - x).abs() <= bound).all(), "error feedback lost mass"
        total += decoded.double()
    # Each decode is within one step s of x with variance <= s^2 / 4.
    step = scales.repeat_interleave(128).double()
    standard_error = step / 2 / math.sqrt(trials)
    assert ((total / trials - x.double()).abs() <= 5 * standard_error + 1e-7).all()
    again = triton_ops.FUNCTIONS["quantize_blockwise"](x, 4, 128, True, 5)
    assert torch.equal(again[0], triton_ops.FUNCTIONS["quantize_blockwise"](x, 4, 128, True, 5)[0])


def test_qsgd_norm_scale_matches_reference():
    x = randn(3000, seed=4)
    _, expected = reference.quantize_blockwise(x, 4, 256, levels=7, scale="norm")
    _, actual = triton_ops.FUNCTIONS["quantize_blockwise"](x, 4, 256, levels=7, scale="norm")
    torch.testing.assert_close(actual, expected, rtol=4 * 2**-23, atol=0)


# ----------------------------------------------------------------------------- sign


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("block", [1024, 64, 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_matches_reference(numel, block, dtype):
    x = randn(numel, seed=numel, dtype=dtype)
    residual = randn(numel, seed=9) * 0.1
    expected_residual, actual_residual = residual.clone(), residual.clone()
    signs, scales = reference.sign_compress(x, block, expected_residual)
    got_signs, got_scales = triton_ops.FUNCTIONS["sign_compress"](x, block, actual_residual)
    assert_same(signs, got_signs)
    torch.testing.assert_close(got_scales, scales, rtol=4 * 2**-23, atol=0)
    # Conservation holds exactly within each implementation.
    decoded = triton_ops.FUNCTIONS["sign_decompress"](got_signs, got_scales, block, numel)
    y = x.float() + residual
    torch.testing.assert_close(decoded + actual_residual, y, rtol=0, atol=4e-7 * y.abs().max().item() + 1e-7)
    assert_same(
        reference.sign_decompress(signs, scales, block, numel),
        triton_ops.FUNCTIONS["sign_decompress"](signs, scales, block, numel),
    )


def test_sign_nan_decodes_nan():
    x = randn(2048, seed=1)
    x[5] = math.nan
    signs, scales = triton_ops.FUNCTIONS["sign_compress"](x, 1024)
    decoded = triton_ops.FUNCTIONS["sign_decompress"](signs, scales, 1024, 2048)
    assert decoded[:1024].isnan().all() and torch.isfinite(decoded[1024:]).all()


# ----------------------------------------------------------------------------- payload rows


def _rows(count: int, numel: int, bits: int, block: int) -> torch.Tensor:
    """Rows long enough for payloads of ``numel`` elements, filled with a marker byte."""
    width = -(-(4 * -(-numel // block) + -(-numel * bits // 8)) // 8) * 8 + 16
    return torch.full((count, width), 0xA5, dtype=torch.uint8, device=DEVICE)


ROW_CASES = [(8, None, 256, 4097), (4, None, 128, 1023), (2, None, 64, 3001), (4, 7, 256, 1), (2, 1, 64, 640)]


@pytest.mark.parametrize("bits, levels, block, numel", ROW_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_are_bit_exact(bits, levels, block, numel, dtype):
    """One payload a chunk (scales, codes, zeros to 8 bytes; the rest of the
    row untouched), decoded into every float dtype: the reference's bits."""
    x = randn(numel, seed=numel + bits, dtype=dtype)
    residual = randn(numel, seed=5) * 0.1
    chunk = 2 * block
    count = -(-numel // chunk) + 1  # a trailing row no chunk uses
    expected, actual = _rows(count, chunk, bits, block), _rows(count, chunk, bits, block)
    expected_residual, actual_residual = residual.clone(), residual.clone()
    options = {"levels": levels, "scale": "norm" if levels else "absmax"}
    reference.quantize_rows(x, bits, block, chunk, expected, residual=expected_residual, **options)
    triton_ops.FUNCTIONS["quantize_rows"](x, bits, block, chunk, actual, residual=actual_residual, **options)
    if levels:  # QSGD's norms are summed in another order: a few ulp
        torch.testing.assert_close(actual_residual, expected_residual, rtol=1e-5, atol=1e-6)
    else:
        assert_same(expected, actual)
        assert_same(expected_residual, actual_residual)
    for out_dtype in DTYPES:
        decoded = [
            decode(
                actual,
                bits,
                block,
                numel,
                chunk,
                torch.zeros(numel, dtype=out_dtype, device=DEVICE),
                levels=levels,
            )
            for decode in (reference.dequantize_rows, triton_ops.FUNCTIONS["dequantize_rows"])
        ]
        assert_same(*decoded, bf16_stored=out_dtype == torch.bfloat16)


@pytest.mark.parametrize("bits, levels, block, numel", ROW_CASES)
@pytest.mark.parametrize("divisor", [1, 3])
def test_dequantize_sum_adds_rows_in_order_bit_exactly(bits, levels, block, numel, divisor):
    count = 3
    rows = _rows(count, numel, bits, block)
    for r in range(count):
        reference.quantize_rows(
            randn(numel, seed=r), bits, block, -(-numel // block) * block, rows[r : r + 1], levels=levels
        )
    expected = reference.dequantize_sum(
        rows, bits, block, numel, torch.empty(numel, device=DEVICE), levels=levels, divisor=divisor
    )
    actual = triton_ops.FUNCTIONS["dequantize_sum"](
        rows, bits, block, numel, torch.empty(numel, device=DEVICE), levels=levels, divisor=divisor
    )
    assert_same(expected, actual)


@pytest.mark.parametrize("block, numel", [(1024, 5000), (64, 1), (256, 1023)])
def test_sign_rows_match_the_reference(block, numel):
    x = randn(numel, seed=numel)
    chunk = 2 * block
    count = -(-numel // chunk)
    expected, actual = _rows(count, chunk, 1, block), _rows(count, chunk, 1, block)
    reference.sign_compress_rows(x, block, chunk, expected, torch.zeros(numel, device=DEVICE))
    triton_ops.FUNCTIONS["sign_compress_rows"](x, block, chunk, actual, torch.zeros(numel, device=DEVICE))
    blocks = -(-min(chunk, numel) // block)
    # Scales are block sums in another order (a few ulp); signs, padding and the rest exact.
    scales = slice(0, 4 * blocks)
    torch.testing.assert_close(
        actual[:, scales].view(torch.float32),
        expected[:, scales].view(torch.float32),
        rtol=4 * 2**-23,
        atol=0,
    )
    assert_same(expected[:, 4 * blocks :], actual[:, 4 * blocks :])
    for decode in ("sign_decompress_rows", "sign_decompress_sum"):
        out = {}
        for name, implementation in (
            ("reference", getattr(reference, decode)),
            ("triton", triton_ops.FUNCTIONS[decode]),
        ):
            target = torch.empty(numel, device=DEVICE)
            if decode.endswith("rows"):
                out[name] = implementation(actual, block, numel, chunk, target)
            else:
                out[name] = implementation(
                    actual[:, : expected.shape[1]] if numel <= chunk else actual[:1],
                    block,
                    min(numel, chunk),
                    target[: min(numel, chunk)],
                    divisor=2,
                )
        assert_same(out["reference"], out["triton"])


# ----------------------------------------------------------------------------- bits


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [1, 7, 1023, 4096])
def test_pack_unpack_bit_exact(bits, numel):
    generator = torch.Generator().manual_seed(numel)
    codes = torch.randint(0, 2**bits, (numel,), generator=generator, dtype=torch.uint8).to(DEVICE)
    packed = triton_ops.FUNCTIONS["pack_bits"](codes, bits)
    assert_same(reference.pack_bits(codes, bits), packed)
    assert_same(codes, triton_ops.FUNCTIONS["unpack_bits"](packed, bits, numel))


# ----------------------------------------------------------------------------- sparse


@pytest.mark.parametrize(
    "numel,k,seed", [(1, 1, 0), (1000, 10, 1), (4097, 41, 2), (50_000, 500, 3), (300, 300, 4)]
)
def test_randk_indices_match_reference(numel, k, seed):
    assert_same(
        reference.randk_indices(numel, k, seed, DEVICE), triton_ops.randk_indices(numel, k, seed, DEVICE)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rescale", [1.0, 25.0])
def test_randk_select_matches_reference(dtype, rescale):
    x = randn(5000, seed=5, dtype=dtype)
    residual = randn(5000, seed=6) * 0.1
    expected_residual, actual_residual = residual.clone(), residual.clone()
    options = {"scale": rescale, "value_dtype": dtype}
    expected = reference.randk_select(x, 200, 11, expected_residual, **options)
    actual = triton_ops.FUNCTIONS["randk_select"](x, 200, 11, actual_residual, **options)
    bf16 = dtype == torch.bfloat16
    assert_same(expected, actual, bf16_stored=bf16)
    if bf16 and INTERPRETED:
        # The values were rounded differently; what each rounding lost stays in
        # its own residual, and the unpicked entries match exactly.
        picked = reference.randk_indices(5000, 200, 11, DEVICE)
        if rescale == 1.0:
            y = (x.float() + residual)[picked]
            torch.testing.assert_close(actual.float() + actual_residual[picked], y, rtol=0, atol=0)
        unpicked = torch.ones(5000, dtype=torch.bool, device=DEVICE)
        unpicked[picked] = False
        assert_same(expected_residual[unpicked], actual_residual[unpicked])
    else:
        assert_same(expected_residual, actual_residual)


def test_randk_nan_anywhere_reaches_the_values():
    x = randn(5000, seed=5)
    x[4321] = math.nan
    residual = torch.zeros(5000, device=DEVICE)
    values = triton_ops.FUNCTIONS["randk_select"](x, 50, 1, residual)
    assert values.isnan().any() and torch.isfinite(residual).all()


@pytest.mark.parametrize("numel,ratio", [(1000, 0.05), (4097, 0.01), (60_000, 0.001), (20_000, 0.3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_sampling_path_matches_reference(numel, ratio, dtype):
    x = randn(numel, seed=numel, dtype=dtype)
    residual = randn(numel, seed=12) * 0.3
    k = max(1, round(ratio * numel))
    expected_residual, actual_residual = residual.clone(), residual.clone()
    options = {"seed": 77, "value_dtype": dtype}
    values, indices = reference.topk_select(x, k, expected_residual, **options)
    got_values, got_indices = triton_ops.FUNCTIONS["topk_select"](x, k, actual_residual, **options)
    assert_same(indices, got_indices)
    assert_same(values, got_values)
    assert_same(expected_residual, actual_residual)
    assert got_values.numel() == k


def test_topk_ties_take_the_lowest_indices():
    # Many equal magnitudes: every element reaches the threshold, the capacity is full.
    x = torch.ones(4000, device=DEVICE)
    x[::7] = 3.0
    residual = torch.zeros(4000, device=DEVICE)
    expected_residual, actual_residual = residual.clone(), residual.clone()
    expected = reference.topk_select(x, 1000, expected_residual, seed=1)
    actual = triton_ops.FUNCTIONS["topk_select"](x, 1000, actual_residual, seed=1)
    assert actual[0].numel() == 1000
    assert_same(expected[1], actual[1])
    assert_same(expected[0], actual[0])
    assert_same(expected_residual, actual_residual)


@pytest.mark.parametrize("misjudged", ["too high", "too low", "above everything"])
def test_topk_misjudged_threshold_matches_the_reference(misjudge_threshold, misjudged):
    """Too few candidates (padding), more than the capacity, or none at all:
    the same payload and residual as the reference, without a host sync."""
    x = randn(20_000, seed=18)
    residual = randn(20_000, seed=19) * 0.3
    change = {
        "too high": lambda t: t * 1.5,
        "too low": lambda t: t * 0.2,
        "above everything": lambda t: torch.full_like(t, 1e30),
    }[misjudged]
    misjudge_threshold(change)
    expected_residual, actual_residual = residual.clone(), residual.clone()
    expected = reference.topk_select(x, 200, expected_residual, seed=4)
    actual = triton_ops.FUNCTIONS["topk_select"](x, 200, actual_residual, seed=4)
    assert actual[0].numel() == 200
    assert_same(expected[1], actual[1])
    assert_same(expected[0], actual[0])
    assert_same(expected_residual, actual_residual)


def test_topk_non_finite_is_selected():
    x = randn(5000, seed=10)
    x[17], x[4000] = math.nan, -math.inf
    values, indices = triton_ops.FUNCTIONS["topk_select"](x, 50, torch.zeros(5000, device=DEVICE))
    assert {17, 4000} <= set(indices.tolist()) and not torch.isfinite(values).all()


def test_scatter_add_sums_repeats():
    out = torch.zeros(10, device=DEVICE)
    indices = torch.tensor([1, 3, 3, 9, 1, 1], device=DEVICE)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], device=DEVICE)
    expected = reference.scatter_add(indices, values, out.clone())
    assert_same(expected, triton_ops.FUNCTIONS["scatter_add"](indices, values, out.clone()))


def test_scatter_add_outside_the_output_makes_element_0_nan():
    out = torch.zeros(10, device=DEVICE)
    indices = torch.tensor([1, 12, 3, -1], device=DEVICE)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], device=DEVICE)
    triton_ops.FUNCTIONS["scatter_add"](indices, values, out)
    assert out[0].isnan()
    assert torch.equal(out[1:].cpu(), torch.tensor([1.0, 0, 3.0, 0, 0, 0, 0, 0, 0]))


# ----------------------------------------------------------------------------- public API


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "topk", "randk", "none", "fp16"])
def test_compressors_agree_across_backends(name, monkeypatch):
    compressor = gradcomp.get_compressor(name)
    x = randn(3000, seed=21)
    payloads, residuals, decoded = {}, {}, {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("GRADCOMP_BACKEND", backend)
        residual = torch.zeros(3000, device=DEVICE) + 0.01
        payloads[backend] = compressor.compress(x, Context(residual=residual, step=3, key=1))
        residuals[backend] = residual
        decoded[backend] = compressor.decompress(payloads[backend])
    for key in payloads["torch"].tensors:
        assert_same(payloads["torch"].tensors[key], payloads["triton"].tensors[key])
    assert_same(residuals["torch"], residuals["triton"])
    assert_same(decoded["torch"], decoded["triton"])


def test_randk_decodes_with_the_index_kernel_it_encoded_with(monkeypatch):
    """On a GPU random-K's decode takes its indices from the Triton kernel, not
    from the reference's walk (a loop of small ops with a host sync per
    round), and reuses the ones its encode computed."""
    monkeypatch.setenv("GRADCOMP_BACKEND", "triton")
    monkeypatch.setattr(reference, "_RECENT_INDICES", {})
    kernel, launches = gradcomp.kernels.randk_indices, []
    monkeypatch.setattr(gradcomp.kernels, "randk_indices", lambda *a: launches.append(a) or kernel(*a))

    def no_walk(*args):
        raise AssertionError("the reference walked")

    monkeypatch.setattr(reference, "_walk_torch", no_walk)
    monkeypatch.setattr(reference, "_walk_numpy", no_walk)
    compressor = gradcomp.get_compressor("randk", ratio=0.02)
    x = randn(3000, seed=22)
    payload = compressor.compress(x, Context(residual=torch.zeros(3000, device=DEVICE), step=5, key=2))
    decoded = compressor.decompress(payload)
    assert len(launches) == 1
    picked = triton_ops.randk_indices(3000, 60, payload.meta["seed"], DEVICE)
    assert len(launches) == 1
    expected = torch.zeros(3000, device=DEVICE)
    expected[picked] = x[picked]
    assert_same(expected, decoded)


def test_forcing_triton_on_a_device_it_cannot_run_on_raises(monkeypatch):
    monkeypatch.setenv("GRADCOMP_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: Triton runs on CUDA tensors")
    with pytest.raises(RuntimeError, match="cannot run on cpu"):
        gradcomp.get_compressor("int8").compress(torch.randn(10))


def _backends_agree_on_ranks(rank: int, world_size: int) -> None:
    import os

    from distributed import same_on_all_ranks
    from test_ddp import DDP, flat_parameters, make_model, register, train

    results = {}
    for backend in ("torch", "triton"):
        os.environ["GRADCOMP_BACKEND"] = backend
        for name in ("int8", "int4", "topk", "randk", "sign"):
            for algorithm in ("allgather", "two_phase", "dense"):
                compressor = gradcomp.get_compressor(name)
                try:
                    gradcomp.collectives.check_algorithm(compressor, algorithm)
                except ValueError:
                    continue
                x = randn(3000, seed=rank)
                memory = gradcomp.ErrorFeedback()
                for step in range(2):
                    gradcomp.all_reduce(
                        x, compressor, algorithm=algorithm, feedback=memory, name="t", step=step
                    )
                results[backend, name, algorithm] = x
        for name in ("int8", "topk"):
            model = DDP(make_model(), bucket_cap_mb=0.02)
            register(model, name, min_numel=0)
            train(model, rank, world_size, 3)
            results[backend, name, "ddp"] = flat_parameters(model)
    del os.environ["GRADCOMP_BACKEND"]
    for (backend, name, algorithm), value in results.items():
        if backend == "torch":
            other = results["triton", name, algorithm]
            assert same_on_all_ranks(other), (name, algorithm)
            if name == "sign":  # block sums in another order: a few ulp per step
                torch.testing.assert_close(other, value, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(other, value), (name, algorithm)


@pytest.mark.slow
def test_collectives_and_ddp_hook_agree_across_backends():
    from distributed import run_ranks

    run_ranks(_backends_agree_on_ranks, 2, timeout=600)
