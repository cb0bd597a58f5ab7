"""Tests of the Compressor classes: round trips, wire sizes, error feedback, unbiasedness, bad input.

Every compressor in ``gradcomp.COMPRESSORS`` is exercised with its default
options, and the option variants that change its character (stochastic
rounding, exact top-k, rescaled random-K, ...) are added where they matter.
Tolerances follow ``tests/ops/test_ops.py``: selections and copies are exact,
quantizer feedback holds within ``eps32 * (|y| + |decoded|)``, and
unbiasedness is checked against the estimator's exact per-element variance.
"""

from __future__ import annotations

import math

import pytest
import torch

import gradcomp
from gradcomp import Context, Payload, get_compressor
from gradcomp.payload import ALIGN, buffer_size
from tests.utils import DTYPES, EPS32, assert_conserved, seeded_randn

NAMES = list(gradcomp.COMPRESSORS)

# (name, options): every registered name with defaults, then the variants.
VARIANTS = [(name, {}) for name in NAMES] + [
    ("int8", {"stochastic": True}),
    ("int4", {"stochastic": True}),
    ("int2", {"stochastic": True}),
    ("ternary", {"stochastic": True}),
    ("int8", {"block": 100}),
    ("qsgd", {"levels": 1}),
    ("qsgd", {"levels": 127, "block": 64}),
    ("sign", {"block": 100}),
    ("topk", {"exact": True}),
    ("topk", {"ratio": 0.1, "index_dtype": "int64"}),
    ("topk", {"ratio": 0.1, "value_bits": 2}),
    ("topk", {"value_bits": 8}),
    ("randk", {"rescale": True}),
    ("randk", {"k": 7}),
]


def variant_id(variant) -> str:
    name, options = variant
    return "-".join([name, *(f"{key}={value}" for key, value in options.items())])


VARIANT_IDS = [variant_id(v) for v in VARIANTS]


def feedback_is_exact(name: str, options: dict) -> bool:
    """Whether decoded + residual reproduces x + residual bit for bit (values sent as copies)."""
    plain_topk = name == "topk" and "value_bits" not in options
    return name == "none" or plain_topk or (name == "randk" and not options.get("rescale", False))


# ============================================================================= round trip


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(1,), (1023,), (7, 13, 5)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_keeps_shape_and_dtype(name, shape, dtype):
    compressor = get_compressor(name)
    x = seeded_randn(shape, seed=1, dtype=dtype)
    payload = compressor.compress(x)
    assert payload.shape == x.shape and payload.dtype == dtype and payload.numel == x.numel()
    decoded = compressor.decompress(payload)
    assert decoded.shape == x.shape
    assert decoded.dtype == dtype
    assert torch.isfinite(decoded).all()


# Relative error ||decoded - x|| / ||x|| on 65536 standard normal values, (low, high).
# Expected values for N(0, 1) input (s = the quantization step):
#   fp16 / bf16: uniform relative rounding, about 2**-11 / sqrt(3) and 2**-8 / sqrt(3) at most;
#   int round-to-nearest: s / sqrt(12), s = E[max |x| of a block] / levels (about 2.9 / levels);
#   int stochastic: s / sqrt(6) (E[f (1 - f)] = 1/6 for a uniform fraction f);
#   qsgd: s = ||block|| / levels = 16 / 7, variance about s E|x| - 1, so about 0.91;
#   qsgd 127 levels, block 64: s = 8 / 127, most |x| >> s, so s / sqrt(6) = 0.026;
#   sign: sqrt(1 - 2 / pi) = 0.603;
#   topk 1%: sqrt(1 - energy above the 99% |x| quantile) = 0.957;
#   randk 1%: sqrt(0.99) = 0.995; rescaled: sqrt(n / k - 1) = 9.95.
RELATIVE_ERROR = {
    "none": (0.0, 0.0),
    "fp16": (1.5e-4, 2.8e-4),
    "bf16": (1.2e-3, 2.3e-3),
    "int8": (0.0055, 0.0080),
    "int4": (0.10, 0.14),
    "int2": (0.70, 0.85),
    "ternary": (0.70, 0.85),  # int2's values
    "qsgd": (0.85, 1.00),
    # Block-scaled floats: about 2**-m / sqrt(12) relative (m mantissa bits) where the
    # element is normal, more where the block's scale leaves it subnormal or zero.
    "mxfp8": (0.025, 0.034),
    "mxfp4": (0.10, 0.13),
    "nvfp4": (0.085, 0.105),
    "sign": (0.59, 0.615),
    "topk": (0.945, 0.965),
    "randk": (0.993, 0.997),
    "int8-stochastic=True": (0.0080, 0.011),
    "int4-stochastic=True": (0.15, 0.20),
    "int2-stochastic=True": (1.05, 1.30),
    "ternary-stochastic=True": (1.05, 1.30),
    "int8-block=100": (0.0050, 0.0075),
    "qsgd-levels=1": (2.8, 3.8),
    "qsgd-levels=127-block=64": (0.022, 0.030),
    "sign-block=100": (0.59, 0.615),
    "topk-exact=True": (0.955, 0.959),
    "topk-ratio=0.1-index_dtype=int64": (0.70, 0.78),
    # int2 values: every kept value about the block's absmax (Top-K's 0.75 above).
    "topk-ratio=0.1-value_bits=2": (0.83, 0.86),
    "topk-value_bits=8": (0.955, 0.959),
    "randk-rescale=True": (9.0, 11.0),
    "randk-k=7": (0.9999, 1.0),
    # A vector is sent as it is; tests/compressors/test_low_rank.py covers matrices.
    "powersgd": (0.0, 0.0),
}


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_relative_error_bounds(variant):
    name, options = variant
    low, high = RELATIVE_ERROR[variant_id(variant)]
    compressor = get_compressor(name, **options)
    x = seeded_randn(65536, seed=1234)
    decoded = compressor.decompress(compressor.compress(x, Context(step=3)))
    relative = ((decoded - x).norm() / x.norm()).item()
    assert low <= relative <= high, relative


# ============================================================================= wire size


def _default_k(numel: int, options: dict) -> int:
    if "k" in options:
        return options["k"]
    return max(1, min(numel, round(options.get("ratio", 0.01) * numel)))


def expected_nbytes(name: str, options: dict, numel: int, dtype: torch.dtype, k: int) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    block = options.get("block", 1024 if name == "sign" else 256)
    scales = 4 * math.ceil(numel / block)
    if name in ("none", "powersgd"):  # powersgd: a vector goes as it is
        return element * numel
    if name in ("fp16", "bf16"):
        return 2 * numel
    if name in ("int8", "int4", "int2"):
        bits = int(name[3:])
        return math.ceil(numel * bits / 8) + scales
    if name == "ternary":  # five codes a byte
        return math.ceil(numel / 5) + scales
    if name == "qsgd":
        # 2 * levels + 1 codes in 1, 2, 4 or 8 bits.
        bits = {1: 2, 7: 4, 127: 8}[options.get("levels", 7)]
        return math.ceil(numel * bits / 8) + scales
    if name == "sign":
        return math.ceil(numel / 8) + scales
    if name in ("mxfp8", "mxfp4"):  # an E8M0 byte a block of 32
        return math.ceil(numel * (8 if name == "mxfp8" else 4) / 8) + math.ceil(numel / 32)
    if name == "nvfp4":  # an E4M3 byte a block of 16, the fp32 tensor scale
        return math.ceil(numel / 2) + math.ceil(numel / 16) + 4 * min(numel, 1)
    if name == "topk":
        index = 8 if options.get("index_dtype") == "int64" else 4
        if "value_bits" in options:  # the kept values quantized, one fp32 scale a VALUE_BLOCK
            return k * index + 4 * math.ceil(k / 64) + math.ceil(k * options["value_bits"] / 8)
        return k * (index + element)
    if name == "randk":
        return k * element
    raise AssertionError(f"no formula for {name}")


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("numel", [7, 1000, 1023, 4097, 60_000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nbytes_formula_and_layout(variant, numel, dtype):
    name, options = variant
    compressor = get_compressor(name, **options)
    x = seeded_randn(numel, seed=numel, dtype=dtype)
    payload = compressor.compress(x)
    k = _default_k(numel, options)
    if name == "topk" and not options.get("exact"):
        assert math.ceil(0.9 * k) <= payload.meta["k"] <= math.floor(1.1 * k)
        k = payload.meta["k"]
    if name in ("topk", "randk"):
        assert payload.meta["k"] == k
    assert payload.nbytes == expected_nbytes(name, options, numel, dtype, k)
    assert payload.layout() == compressor.payload_layout(numel, dtype, payload.meta)


def test_nbytes_worked_examples():
    x = seeded_randn(1000, seed=2)
    assert get_compressor("int8").compress(x).nbytes == 1000 + 4 * 4
    assert get_compressor("int4").compress(x).nbytes == 500 + 4 * 4
    assert get_compressor("sign").compress(seeded_randn(4096, seed=2)).nbytes == 512 + 16
    assert get_compressor("topk", k=10, exact=True).compress(x).nbytes == 80
    assert get_compressor("randk", k=10).compress(x).nbytes == 40
    assert get_compressor("fp16").compress(x).nbytes == 2000


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
# 9 elements: top-k keeps k = 1 (an odd count of 4-byte indices before the values).
@pytest.mark.parametrize("numel", [9, 1023])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
def test_buffer_round_trip_decodes_identically(variant, numel, dtype):
    name, options = variant
    compressor = get_compressor(name, **options)
    x = seeded_randn(numel, seed=3, dtype=dtype)
    payload = compressor.compress(x, Context(step=1))
    layout = payload.layout()
    buffer = payload.to_buffer()
    assert buffer.dtype == torch.uint8
    assert buffer.numel() == buffer_size(layout)
    assert buffer.numel() % ALIGN == 0 and payload.nbytes <= buffer.numel() < payload.nbytes + ALIGN
    expected = compressor.decompress(payload)
    for size in (None, buffer.numel() + 3 * ALIGN):
        wire = payload.to_buffer(size)
        restored = Payload.from_buffer(wire, layout, payload.shape, payload.dtype, payload.meta)
        assert restored.nbytes == payload.nbytes
        assert torch.equal(compressor.decompress(restored), expected)
    # Into a given (dirty) buffer: the same bytes, padding zeroed; too small is an error.
    dirty = torch.full((buffer.numel() + ALIGN,), 255, dtype=torch.uint8)
    assert payload.to_buffer(out=dirty) is dirty
    assert torch.equal(dirty, payload.to_buffer(dirty.numel()))
    with pytest.raises(ValueError, match="needs at least"):
        payload.to_buffer(out=torch.empty(payload.nbytes - 1, dtype=torch.uint8))


# ============================================================================= error feedback


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_feedback_conserves_over_steps(variant, dtype):
    """decompress(payload) + new residual == tensor + old residual, step after step.

    The residual is fp32 (ErrorFeedback's default) and the payload is decoded
    into an fp32 ``out``, so decoding adds no rounding of its own: what the
    payload carries plus what the residual keeps must be what was compressed.
    """
    name, options = variant
    compressor = get_compressor(name, **options)
    shape = (31, 33)
    residual = seeded_randn(31 * 33, seed=4) * 0.25
    for step in range(4):
        x = seeded_randn(shape, seed=10 + step, dtype=dtype)
        y = x.float().reshape(-1) + residual
        payload = compressor.compress(x, Context(residual=residual, step=step))
        decoded = compressor.decompress(payload, out=torch.zeros(shape))
        assert_conserved(decoded, residual, y, feedback_is_exact(name, options))


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_residual_and_out_that_cannot_hold_the_values_raise(variant):
    """Wrong size, or an integer dtype, which would truncate the residual or the
    decoded values without a word."""
    name, options = variant
    compressor = get_compressor(name, **options)
    x = seeded_randn(100, seed=5)
    with pytest.raises(ValueError, match="residual has 99 elements"):
        compressor.compress(x, Context(residual=torch.zeros(99)))
    with pytest.raises(TypeError, match="residual must be float32"):
        compressor.compress(x, Context(residual=torch.zeros(100, dtype=torch.int32)))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        compressor.compress(x, Context(residual=[0.0] * 100))
    with pytest.raises(ValueError, match="residual is on meta"):
        compressor.compress(x, Context(residual=torch.zeros(100, device="meta")))
    payload = compressor.compress(x, Context(residual=torch.zeros(100)))
    with pytest.raises(ValueError, match="out has 99 elements"):
        compressor.decompress(payload, out=torch.zeros(99))
    with pytest.raises(TypeError, match="out must be float32"):
        compressor.decompress(payload, out=torch.zeros(100, dtype=torch.int64), accumulate=True)
    with pytest.raises(ValueError, match="out is on meta"):
        compressor.decompress(payload, out=torch.zeros(100, device="meta"))


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_tensor_that_requires_grad_is_read_as_its_value(variant):
    """Compressing is not differentiable: a parameter (or anything in a graph)
    compresses like its detached value, is left as it was, and decodes to a
    tensor outside any graph."""
    name, options = variant
    compressor = get_compressor(name, **options)
    value = seeded_randn(1023, seed=6)
    x = value.clone().requires_grad_()
    residuals = [torch.zeros(1023) if compressor.needs_feedback else None for _ in range(2)]
    payload = compressor.compress(x * 1.0, Context(residual=residuals[0], step=2, key=3))
    expected = compressor.compress(value, Context(residual=residuals[1], step=2, key=3))
    assert torch.equal(x.detach(), value)
    for key, tensor in expected.tensors.items():
        assert not payload.tensors[key].requires_grad
        assert torch.equal(payload.tensors[key], tensor), key
    decoded = compressor.decompress(payload)
    assert not decoded.requires_grad
    assert torch.equal(decoded, compressor.decompress(expected))


UNBIASED_VARIANTS = [
    ("qsgd", {}),
    ("qsgd", {"levels": 1}),
    ("int8", {"stochastic": True}),
    ("int4", {"stochastic": True}),
    ("int2", {"stochastic": True}),
    ("ternary", {"stochastic": True}),
    ("randk", {"rescale": True, "ratio": 0.1}),
]


def _variance(name: str, options: dict, payload: Payload, x: torch.Tensor) -> torch.Tensor:
    if name == "randk":
        # Sent with probability k / n as x * n / k.
        return x.pow(2) * (x.numel() / payload.meta["k"] - 1)
    block = options.get("block", 256)
    step = payload.tensors["scales"].repeat_interleave(block)[: x.numel()]
    fraction = x / step - torch.floor(x / step)
    return step.pow(2) * fraction * (1 - fraction)


@pytest.mark.slow
@pytest.mark.parametrize("variant", UNBIASED_VARIANTS, ids=[variant_id(v) for v in UNBIASED_VARIANTS])
def test_unbiased_compressors_mean_converges(variant):
    name, options = variant
    compressor = get_compressor(name, **options)
    assert compressor.unbiased
    numel, trials = 300, 1500
    x = seeded_randn(numel, seed=6)
    total = torch.zeros(numel, dtype=torch.float64)
    for step in range(trials):
        total += compressor.decompress(compressor.compress(x, Context(step=step))).double()
    mean = (total / trials).float()
    variance = _variance(name, options, compressor.compress(x), x)
    standard_error = torch.sqrt(variance / trials)
    slack = 8 * EPS32 * x.abs()
    error = (mean - x).abs()
    assert (error <= 5 * standard_error + slack).all(), (error / (standard_error + slack)).max()
    # Chi-square on the z-scores: mean 1, standard deviation sqrt(2 / count).
    varying = standard_error > 1e-6
    count = int(varying.sum())
    assert count >= 50
    mean_square_z = ((mean - x)[varying] / standard_error[varying]).pow(2).mean().item()
    assert abs(mean_square_z - 1) < 6 * math.sqrt(2 / count), mean_square_z


def test_steps_vary_the_random_streams():
    x = seeded_randn(1000, seed=7)
    for name, options in UNBIASED_VARIANTS:
        compressor = get_compressor(name, **options)
        first = compressor.decompress(compressor.compress(x, Context(step=0)))
        again = compressor.decompress(compressor.compress(x, Context(step=0)))
        other = compressor.decompress(compressor.compress(x, Context(step=1)))
        assert torch.equal(first, again), name
        assert not torch.equal(first, other), name


# ============================================================================= class facts

NEEDS_FEEDBACK = {
    "none": False,
    "fp16": False,
    "bf16": False,
    "int8": True,
    "int4": True,
    "int2": True,
    "ternary": True,
    "qsgd": False,
    "mxfp8": True,
    "mxfp4": True,
    "nvfp4": True,
    "sign": True,
    "topk": True,
    "randk": True,
    "int8-stochastic=True": False,
    "int4-stochastic=True": False,
    "int2-stochastic=True": False,
    "ternary-stochastic=True": False,
    "int8-block=100": True,
    "qsgd-levels=1": False,
    "qsgd-levels=127-block=64": False,
    "sign-block=100": True,
    "topk-exact=True": True,
    "topk-ratio=0.1-index_dtype=int64": True,
    "topk-ratio=0.1-value_bits=2": True,
    "topk-value_bits=8": True,
    "randk-rescale=True": False,
    "randk-k=7": True,
    "powersgd": True,
}


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_needs_feedback_default_and_overrides(variant):
    name, options = variant
    expected = NEEDS_FEEDBACK[variant_id(variant)]
    compressor = get_compressor(name, **options)
    assert compressor.needs_feedback is expected
    assert compressor.settings()["feedback"] is expected
    for override in (False, True):
        forced = get_compressor(name, feedback=override, **options)
        assert forced.needs_feedback is override
        assert forced.settings()["feedback"] is override
    with pytest.raises(TypeError):
        get_compressor(name, feedback="yes", **options)


def test_unbiased_and_summable_facts():
    unbiased = {name for name in NAMES if get_compressor(name).unbiased}
    assert unbiased == {"none", "qsgd"}
    assert get_compressor("int4", stochastic=True).unbiased
    assert get_compressor("randk", rescale=True).unbiased
    summable = {name for name, cls in gradcomp.COMPRESSORS.items() if cls.summable}
    assert summable == {"none", "fp16", "bf16", "randk"}
    low_rank = {name for name, cls in gradcomp.COMPRESSORS.items() if cls.low_rank}
    assert low_rank == {"powersgd"}


@pytest.mark.parametrize("rescale", [False, True])
def test_randk_payloads_of_two_ranks_are_summable(rescale):
    compressor = get_compressor("randk", ratio=0.05, rescale=rescale)
    x0, x1 = seeded_randn(2000, seed=8), seeded_randn(2000, seed=9)
    p0 = compressor.compress(x0, Context(step=5, key=2, rank=0))
    p1 = compressor.compress(x1, Context(step=5, key=2, rank=1))
    assert p0.meta == p1.meta
    summed = p0.with_tensors({"values": p0.tensors["values"] + p1.tensors["values"]})
    assert torch.equal(compressor.decompress(summed), compressor.decompress(p0) + compressor.decompress(p1))
    # Another step or key draws other indices.
    for ctx in (Context(step=6, key=2), Context(step=5, key=3)):
        other = compressor.compress(x0, ctx)
        assert other.meta["seed"] != p0.meta["seed"]
        assert not torch.equal(compressor.decompress(other) != 0, compressor.decompress(p0) != 0)


# ============================================================================= non-finite values


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("planted", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("position", [0, 517, 1022])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "feedback"])
def test_non_finite_input_is_never_hidden(variant, planted, position, with_residual):
    name, options = variant
    compressor = get_compressor(name, **options)
    x = seeded_randn(1023, seed=10)
    x[position] = planted
    residual = seeded_randn(1023, seed=11) if with_residual else None
    decoded = compressor.decompress(compressor.compress(x, Context(residual=residual, step=2)))
    assert not torch.isfinite(decoded).all()
    if with_residual:
        assert torch.isfinite(residual).all()


# ============================================================================= bad input


def test_unknown_name_and_option_raise():
    with pytest.raises(ValueError):
        get_compressor("int3")
    with pytest.raises(TypeError, match="a compressor is a spec"):
        get_compressor(8)
    with pytest.raises(ValueError):
        get_compressor("int8", ratio=0.1)
    with pytest.raises(ValueError):
        get_compressor("topk", block=64)
    with pytest.raises(ValueError):
        get_compressor("qsgd", stochastic=False)
    instance = get_compressor("INT8")
    assert isinstance(instance, gradcomp.COMPRESSORS["int8"])
    assert get_compressor(instance) is instance
    with pytest.raises(ValueError):
        get_compressor(instance, block=64)


def test_topk_value_bits_are_checked_and_take_allgather():
    from gradcomp.collectives.policy import check_algorithm, default_algorithm

    for bad in (3, 1, 16, "2", 8.0, True):
        with pytest.raises(ValueError, match="value_bits"):
            get_compressor("topk", value_bits=bad)
    quantized = get_compressor("topk:value_bits=2")
    assert default_algorithm(quantized, 16) == "allgather"
    assert default_algorithm(get_compressor("topk"), 16) == "two_phase"
    with pytest.raises(ValueError, match="two_phase"):
        check_algorithm(quantized, "two_phase", 4)


@pytest.mark.parametrize("name", ["topk", "randk"])
def test_bad_ratio_and_k(name):
    for ratio in (0, 1.5, -0.1, True, "0.1"):
        with pytest.raises(ValueError):
            get_compressor(name, ratio=ratio)
    for k in (0, -3, 2.5, True):
        with pytest.raises(ValueError):
            get_compressor(name, k=k)
    with pytest.raises(ValueError):
        get_compressor(name, ratio=0.1, k=5)
    assert get_compressor(name, ratio=1).compress(seeded_randn(10, seed=1)).meta["k"] == 10
    compressor = get_compressor(name, k=11)
    assert compressor.compress(seeded_randn(11, seed=1)).meta["k"] == 11
    with pytest.raises(ValueError):
        compressor.compress(seeded_randn(10, seed=1))


@pytest.mark.parametrize("name", ["topk", "randk"])
@pytest.mark.parametrize("shape", [(0,), (3, 0)], ids=str)
def test_empty_tensor_rejected_by_selections(name, shape):
    with pytest.raises(ValueError):
        get_compressor(name).compress(torch.empty(shape))


@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("topk", "randk")])
@pytest.mark.parametrize("shape", [(0,), (3, 0)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_tensor_round_trips_for_dense_compressors(name, shape, dtype):
    compressor = get_compressor(name)
    payload = compressor.compress(torch.empty(shape, dtype=dtype))
    assert payload.nbytes == 0
    decoded = compressor.decompress(payload)
    assert decoded.shape == shape and decoded.dtype == dtype


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool], ids=str)
def test_non_float_tensors_raise_type_error(name, dtype):
    with pytest.raises(TypeError):
        get_compressor(name).compress(torch.ones(16, dtype=dtype))


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "ternary", "qsgd", "sign"])
@pytest.mark.parametrize("block", [0, -1, 2.5])
def test_bad_block_raises(name, block):
    with pytest.raises(ValueError):
        get_compressor(name, block=block)


@pytest.mark.parametrize("levels", [0, 128, -1])
def test_qsgd_bad_levels_raise(levels):
    with pytest.raises(ValueError):
        get_compressor("qsgd", levels=levels)


# ============================================================================= decompress into out


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_decompress_out_overwrites_and_accumulates(variant):
    name, options = variant
    compressor = get_compressor(name, **options)
    x = seeded_randn((31, 33), seed=12)
    payload = compressor.compress(x, Context(step=1))
    decoded = compressor.decompress(payload)
    out = torch.full((33, 31), 7.0)  # another shape of the same numel is fine
    assert compressor.decompress(payload, out=out) is out
    assert torch.equal(out.view(-1), decoded.view(-1))
    base = seeded_randn(31 * 33, seed=13)
    out = base.clone()
    assert compressor.decompress(payload, out=out, accumulate=True) is out
    assert torch.equal(out, base + decoded.view(-1))
    with pytest.raises(ValueError):
        compressor.decompress(payload, out=torch.zeros(31 * 33 + 1))
    with pytest.raises(ValueError):
        compressor.decompress(payload, out=torch.zeros(31 * 33 - 1))
    with pytest.raises(ValueError):
        compressor.decompress(payload, accumulate=True)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("divisor", [2, 3])
def test_decompress_divisor_divides_before_rounding(variant, dtype, divisor):
    # payload / divisor: the fp32 decoding divided, then rounded once to the
    # payload's dtype (or added into an fp32 out).
    name, options = variant
    compressor = get_compressor(name, **options)
    x = seeded_randn((31, 33), seed=21, dtype=dtype)
    payload = compressor.compress(x, Context(step=3))
    decoded32 = compressor.decompress(payload, out=torch.zeros(31 * 33))
    expected = decoded32 / divisor
    got = compressor.decompress(payload, divisor=divisor)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.view(-1), expected.to(dtype))
    base = seeded_randn(31 * 33, seed=22)
    out = base.clone()
    assert compressor.decompress(payload, out=out, accumulate=True, divisor=divisor) is out
    assert torch.equal(out, base + expected)
    out = torch.full((31 * 33,), 5.0)
    compressor.decompress(payload, out=out, divisor=divisor)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("divisor", [0, -2, 1.5, True])
def test_decompress_bad_divisor_raises(divisor):
    compressor = get_compressor("topk")
    payload = compressor.compress(seeded_randn(1000, seed=1))
    with pytest.raises(ValueError, match="divisor"):
        compressor.decompress(payload, divisor=divisor)


@pytest.mark.parametrize("numel", [1, 4, 5, 6, 1023, 4097])
@pytest.mark.parametrize("stochastic", [False, True])
def test_ternary_sends_the_values_of_int2_in_fewer_bytes(numel, stochastic):
    x = seeded_randn(numel, seed=numel)
    ternary = get_compressor("ternary", stochastic=stochastic)
    int2 = get_compressor("int2", stochastic=stochastic)
    residuals = [seeded_randn(numel, seed=1) * 0.1 for _ in range(2)]
    packed = ternary.compress(x, Context(residual=residuals[0], step=3))
    reference = int2.compress(x, Context(residual=residuals[1], step=3))
    assert torch.equal(ternary.decompress(packed), int2.decompress(reference))
    assert torch.equal(residuals[0], residuals[1])
    assert packed.tensors["codes"].numel() == math.ceil(numel / 5)


def test_trits_round_trip_every_byte():
    from gradcomp.ops.reference import pack_trits, unpack_trits

    codes = torch.cartesian_prod(*[torch.arange(3)] * 5).flip(1).reshape(-1).to(torch.uint8)
    packed = pack_trits(codes)
    assert torch.equal(packed, torch.arange(243, dtype=torch.uint8))
    assert torch.equal(unpack_trits(packed, codes.numel()), codes)
    assert torch.equal(unpack_trits(pack_trits(codes[:7]), 7), codes[:7])


@pytest.mark.parametrize("numel", [5 * 256, 4 * 256 + 77])
@pytest.mark.parametrize("stochastic", [False, True])
def test_ternary_row_ops_match_one_payload_a_row(numel, stochastic):
    """All rows at once (the kernels do not grow with the number of rows) give
    the bytes of compressing each row on its own (with stochastic rounding:
    another random stream), and decode as each row's payload does."""
    from gradcomp.compressors import Compressor

    ternary = get_compressor("ternary", stochastic=stochastic)
    chunk, count = 512, math.ceil(numel / 512)
    x = seeded_randn(numel, seed=numel)
    width = buffer_size(ternary.payload_layout(chunk, torch.float32, {})) + ALIGN
    rows = [torch.full((count, width), 7, dtype=torch.uint8) for _ in range(2)]
    residuals = [seeded_randn(numel, seed=2) * 0.1 for _ in range(2)]
    y = x + residuals[0]
    ternary.compress_rows(x, chunk, rows[0], Context(residuals[0], 3, 11))
    Compressor.compress_rows(ternary, x, chunk, rows[1], Context(residuals[1], 3, 11))
    if not stochastic:
        used = buffer_size(ternary.payload_layout(chunk, torch.float32, {}))
        assert torch.equal(rows[0][:, :used], rows[1][:, :used]) and torch.equal(residuals[0], residuals[1])
    decoded = [torch.zeros(numel) for _ in range(2)]
    ternary.decompress_rows(rows[0], torch.float32, chunk, decoded[0])
    Compressor.decompress_rows(ternary, rows[0], torch.float32, chunk, decoded[1])
    assert torch.equal(decoded[0], decoded[1])
    assert_conserved(decoded[0], residuals[0], y, exact=False)
    sums = [torch.zeros(chunk) for _ in range(2)]
    ternary.decompress_sum(rows[0][:2], torch.float32, sums[0], divisor=2)
    Compressor.decompress_sum(ternary, rows[0][:2], torch.float32, sums[1], divisor=2)
    torch.testing.assert_close(sums[0], sums[1], rtol=0, atol=1e-6)
