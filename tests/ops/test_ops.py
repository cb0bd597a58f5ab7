"""What every op means, through the dispatch (the CPU backend on CPU tensors), the
CPU backend's own paths (chunks, numpy, word packing), and backend dispatch.

Every backend is compared with the reference in ``test_parity.py``; the
tolerances are those of ``tests/utils.py``.
"""

from __future__ import annotations

import itertools
import math
import types

import pytest
import torch

from gradcomp import ops, streams
from gradcomp.ops import cpu_backend, cpu_packing, cpu_shared, cpu_small, cpu_sparse, index_cache, reference
from tests.utils import DTYPES, EPS32, REFERENCE, assert_conserved, assert_unbiased, block_view, seeded_randn

CPU = torch.device("cpu")


# ============================================================================= bit packing


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [1, 7, 1023, 4096])
def test_pack_unpack_round_trip(bits, numel):
    generator = torch.Generator().manual_seed(bits * 10_000 + numel)
    codes = torch.randint(0, 2**bits, (numel,), generator=generator, dtype=torch.uint8)
    packed = ops.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == math.ceil(numel * bits / 8)
    unpacked = ops.unpack_bits(packed, bits, numel)
    assert unpacked.dtype == torch.uint8
    assert torch.equal(unpacked, codes)
    # Asked for more than was packed: the codes there are, padding included.
    beyond = ops.unpack_bits(packed, bits, numel + 9)
    assert beyond.numel() == packed.numel() * (8 // bits)
    assert torch.equal(beyond[:numel], codes) and not beyond[numel:].any()


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("offset, stride", [(0, 1), (1, 1), (3, 1), (0, 2), (1, 2)])
def test_pack_bits_word_path_is_the_position_path(bits, offset, stride):
    """On CPU 2- and 4-bit codes are packed and unpacked a word at a time; the
    per-position ops (GPUs) give the same bytes, also for codes that start
    at an odd address or are strided."""
    generator = torch.Generator().manual_seed(bits + offset)
    storage = torch.randint(
        0, 2**bits, (4099 + offset + 4096 * stride,), generator=generator, dtype=torch.uint8
    )
    codes = storage[offset : offset + 4096 * stride : stride]
    expected = cpu_packing._pack_positions(codes.clone(), bits)
    assert torch.equal(cpu_packing._pack_words(codes, bits), expected)
    assert torch.equal(ops.pack_bits(codes, bits), expected)
    assert torch.equal(
        cpu_packing._unpack_words(expected, bits), cpu_packing._unpack_positions(expected, bits)
    )
    assert torch.equal(cpu_packing._unpack_words(expected, bits), codes)


@pytest.mark.parametrize(
    "bits, codes, expected",
    [
        (2, [1, 2, 3], [0b00111001]),
        (1, [1, 0, 1, 1, 0, 0, 0, 0, 1], [0b00001101, 0b00000001]),
        (1, [1] * 7, [0b01111111]),
        (4, [0xA, 0x5, 0xF], [0x5A, 0x0F]),
        (2, [3, 3, 3, 3, 0, 1], [0xFF, 0b00000100]),
        (8, [0, 17, 255], [0, 17, 255]),
    ],
)
def test_pack_bits_known_bytes(bits, codes, expected):
    packed = ops.pack_bits(torch.tensor(codes, dtype=torch.uint8), bits)
    assert packed.tolist() == expected
    assert ops.unpack_bits(packed, bits, len(codes)).tolist() == codes


def test_pack_bits_rejects_other_widths():
    codes = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError):
        ops.pack_bits(codes, 3)
    with pytest.raises(ValueError):
        ops.unpack_bits(codes, 16, 8)


# ============================================================================= blockwise quantization

QUANT_SIZES_BLOCKS = [(1, 64), (1023, 64), (1023, 100), (4097, 256), (4097, 100)]


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("numel, block", QUANT_SIZES_BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_round_to_nearest_error_bound(bits, numel, block, dtype):
    x = seeded_randn(numel, seed=numel + bits, dtype=dtype)
    q, scales = ops.quantize_blockwise(x, bits, block)
    levels = 2 ** (bits - 1) - 1
    assert scales.dtype == torch.float32
    assert scales.numel() == math.ceil(numel / block)
    assert q.numel() == math.ceil(numel * bits / 8)
    y = x.float()
    expected_scales = block_view(y, block).abs().amax(dim=1) / levels
    assert torch.equal(scales, expected_scales)
    decoded = ops.dequantize_blockwise(q, scales, bits, block, numel)
    assert decoded.dtype == torch.float32 and decoded.shape == (numel,)
    error = block_view(decoded - y, block).abs()
    # Half a step per element, per block, up to fp32 rounding of y / s and level * s.
    bound = scales.unsqueeze(1) / 2 + 4 * EPS32 * block_view(y, block).abs()
    assert (error <= bound).all()


@pytest.mark.parametrize("scale", ["absmax", "norm"])
@pytest.mark.parametrize("numel, block", [(1023, 100), (4097, 256)])
def test_quantize_stochastic_is_deterministic_per_seed(scale, numel, block):
    x = seeded_randn(numel, seed=5)
    first = ops.quantize_blockwise(x, 4, block, stochastic=True, seed=77, scale=scale, levels=7)
    second = ops.quantize_blockwise(x, 4, block, stochastic=True, seed=77, scale=scale, levels=7)
    other = ops.quantize_blockwise(x, 4, block, stochastic=True, seed=78, scale=scale, levels=7)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_round_to_nearest_is_deterministic(bits):
    x = seeded_randn(4097, seed=6)
    first = ops.quantize_blockwise(x, bits, 100, seed=1)
    second = ops.quantize_blockwise(x, bits, 100, seed=2)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("scale", ["absmax", "norm"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_all_zero_blocks_decode_to_exact_zeros(stochastic, scale, bits):
    block = 64
    x = seeded_randn(5 * block + 17, seed=bits)
    x[block : 3 * block] = 0  # blocks 1 and 2
    x[4 * block :] = 0  # the partial last block and block 4
    q, scales = ops.quantize_blockwise(x, bits, block, stochastic, seed=3, scale=scale)
    decoded = ops.dequantize_blockwise(q, scales, bits, block, x.numel())
    assert torch.equal(scales[[1, 2, 4, 5]], torch.zeros(4))
    zero = x == 0
    assert torch.equal(decoded[zero], torch.zeros(int(zero.sum())))
    assert torch.isfinite(decoded).all()


@pytest.mark.parametrize("scale", ["absmax", "norm"])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize(
    "planted", [[math.inf], [-math.inf], [math.nan], [math.inf, math.nan], [math.nan, -math.inf]]
)
def test_quantize_non_finite_block_decodes_non_finite_others_unchanged(scale, stochastic, planted):
    block, numel = 100, 1023
    x = seeded_randn(numel, seed=9)
    clean = x.clone()
    clean[300:400] = 0
    positions = [317, 388][: len(planted)]
    for position, value in zip(positions, planted, strict=True):
        x[position] = value
    args = (4, block, stochastic, 11)
    q, scales = ops.quantize_blockwise(x, *args, levels=7, scale=scale)
    decoded = ops.dequantize_blockwise(q, scales, 4, block, numel, levels=7)
    assert not torch.isfinite(decoded[positions]).any(), "a planted non-finite value decoded finite"
    # Blocks are independent: every other block decodes as without the planted values.
    q_clean, scales_clean = ops.quantize_blockwise(clean, *args, levels=7, scale=scale)
    decoded_clean = ops.dequantize_blockwise(q_clean, scales_clean, 4, block, numel, levels=7)
    others = torch.ones(numel, dtype=torch.bool)
    others[300:400] = False
    assert torch.isfinite(decoded[others]).all()
    assert torch.equal(decoded[others], decoded_clean[others])


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("scale, magnitude", [("absmax", 3e38), ("norm", 3e19)])
def test_quantize_large_finite_values_decode_finite(stochastic, scale, magnitude):
    """Values whose block scale is representable in fp32 must decode finite and close.

    For "norm" the block's L2 norm (about 4.2e19 here) is far below fp32's max,
    even though its square is not.
    """
    x = torch.tensor([magnitude, -magnitude, magnitude / 2, 0.0])
    q, scales = ops.quantize_blockwise(x, 4, 4, stochastic, 1, levels=7, scale=scale)
    decoded = ops.dequantize_blockwise(q, scales, 4, 4, 4, levels=7)
    assert torch.isfinite(scales).all(), scales
    assert torch.isfinite(decoded).all(), decoded
    assert ((decoded - x).abs() <= scales + 4 * EPS32 * x.abs()).all()


def test_quantize_one_bit_default_levels_rejected():
    """bits=1 leaves ``2 ** 0 - 1 = 0`` levels: nothing but zero is representable, so it must be refused
    (instead it divides by zero levels and decodes finite input, even all-zero blocks, to NaN/inf)."""
    x = torch.tensor([1.0, -2.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        ops.quantize_blockwise(x, 1, 2)


def test_dequantize_out_and_accumulate():
    x = seeded_randn(1000, seed=12)
    q, scales = ops.quantize_blockwise(x, 8, 256)
    decoded = ops.dequantize_blockwise(q, scales, 8, 256, 1000)
    base = seeded_randn(1000, seed=13)
    out = base.clone()
    result = ops.dequantize_blockwise(q, scales, 8, 256, 1000, out=out, accumulate=True)
    assert result is out
    assert torch.equal(out, base + decoded)
    out = base.clone().view(10, 100)
    ops.dequantize_blockwise(q, scales, 8, 256, 1000, out=out)
    assert torch.equal(out.view(-1), decoded)


# ============================================================================= fused error feedback


def _quantize_case(bits, stochastic, scale, levels=None):
    block = 100

    def run(x, residual):
        q, scales = ops.quantize_blockwise(
            x, bits, block, stochastic, 5, residual, levels=levels, scale=scale
        )
        return ops.dequantize_blockwise(q, scales, bits, block, x.numel(), levels=levels)

    return run, False


def _sign_case():
    def run(x, residual):
        packed, scales = ops.sign_compress(x, 100, residual)
        return ops.sign_decompress(packed, scales, 100, x.numel())

    return run, False


def _topk_case(exact):
    def run(x, residual):
        values, indices = ops.topk_select(x, 50, residual, exact, seed=4)
        return ops.scatter_add(indices, values, torch.zeros(x.numel()))

    return run, True


def _randk_case(rescale):
    def run(x, residual):
        k = 50
        scale = x.numel() / k if rescale else 1.0
        values = ops.randk_select(x, k, 8, residual, multiplier=scale)
        indices = ops.randk_indices(x.numel(), k, 8)
        return ops.scatter_add(indices, values, torch.zeros(x.numel()))

    # Without rescaling the sent values are copies: conservation is exact.
    return run, not rescale


FUSED_CASES = {
    "int8": _quantize_case(8, False, "absmax"),
    "int8-stochastic": _quantize_case(8, True, "absmax"),
    "int4": _quantize_case(4, False, "absmax"),
    "int4-stochastic": _quantize_case(4, True, "absmax"),
    "int2": _quantize_case(2, False, "absmax"),
    "qsgd": _quantize_case(4, True, "norm", levels=7),
    "sign": _sign_case(),
    "topk-exact": _topk_case(True),
    "topk-approximate": _topk_case(False),
    "randk": _randk_case(False),
    "randk-rescale": _randk_case(True),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_error_feedback_conserves(case, dtype):
    run, exact = FUSED_CASES[case]
    numel = 1023
    residual = seeded_randn(numel, seed=21) * 0.3
    for step in range(3):
        x = seeded_randn(numel, seed=100 + step, dtype=dtype)
        y = x.float() + residual
        residual_before = residual.clone()
        decoded = run(x, residual)
        assert_conserved(decoded, residual, y, exact)
        assert not torch.equal(residual, residual_before), "the residual was not updated in place"


@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("planted", [math.inf, -math.inf, math.nan])
def test_fused_residual_stays_finite(case, planted):
    run, _ = FUSED_CASES[case]
    numel = 1023
    residual = seeded_randn(numel, seed=22)
    x = seeded_randn(numel, seed=23)
    x[[5, 640]] = planted
    decoded = run(x, residual)
    assert torch.isfinite(residual).all()
    assert not torch.isfinite(decoded).all(), "a non-finite input was hidden"


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_residual_finite_at_the_largest_floats(case):
    # Finite input at the edge of fp32: int8's 127 * (max / 127) rounds past the
    # largest float, so the scale steps one ulp down there; the decoded values
    # and the residual must come out finite.
    run, _ = FUSED_CASES[case]
    biggest = torch.finfo(torch.float32).max
    residual = torch.zeros(1023)
    x = seeded_randn(1023, seed=24)
    x[[5, 300, 640]] = torch.tensor([biggest, -biggest, 0.999 * biggest])
    decoded = run(x, residual)
    assert torch.isfinite(residual).all()
    if case != "randk-rescale":  # numel / k times the largest float is not a float
        assert torch.isfinite(decoded).all(), "a finite input decoded to inf"


def test_sign_scale_at_the_largest_float_decodes_exactly():
    """A one-element tail block at the largest float: its scale is that float,
    and twice it overflows, so +-scale must not be formed through 2 * scale."""
    biggest = torch.finfo(torch.float32).max
    x = seeded_randn(201, seed=25)
    x[200] = -biggest
    residual = torch.zeros(201)
    packed, scales = ops.sign_compress(x, 100, residual)
    decoded = ops.sign_decompress(packed, scales, 100, 201)
    assert scales[2] == biggest and decoded[200] == -biggest
    assert residual[200] == 0 and torch.isfinite(residual).all()


# ============================================================================= unbiasedness


def _stochastic_mean(x: torch.Tensor, block: int, levels: int, scale: str, trials: int) -> torch.Tensor:
    bits = reference.code_bits(levels)
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for seed in range(trials):
        q, scales = ops.quantize_blockwise(x, bits, block, True, seed, levels=levels, scale=scale)
        total += ops.dequantize_blockwise(q, scales, bits, block, x.numel(), levels=levels).double()
    return (total / trials).float()


@pytest.mark.slow
@pytest.mark.parametrize("scale, levels", [("absmax", 7), ("absmax", 1), ("norm", 7), ("norm", 2)])
def test_stochastic_rounding_is_unbiased(scale, levels):
    numel, block, trials = 300, 64, 1500
    x = seeded_randn(numel, seed=31)
    mean = _stochastic_mean(x, block, levels, scale, trials)
    blocks = block_view(x, block)
    magnitude = blocks.abs().amax(dim=1) if scale == "absmax" else blocks.norm(dim=1)
    step = (magnitude / levels).repeat_interleave(block)[:numel]
    fraction = x / step - torch.floor(x / step)
    # floor(t + u) takes ceil(t) with probability frac(t): a Bernoulli of that p times the step.
    variance = step.pow(2) * fraction * (1 - fraction)
    assert_unbiased(mean, x, variance, trials)


def test_round_to_nearest_mean_is_not_unbiased():
    """The unbiasedness check can fail: round-to-nearest violates it."""
    numel, block = 300, 64
    x = seeded_randn(numel, seed=31)
    q, scales = ops.quantize_blockwise(x, 4, block, False, levels=7)
    decoded = ops.dequantize_blockwise(q, scales, 4, block, numel, levels=7)
    step = (scales).repeat_interleave(block)[:numel]
    fraction = x / step - torch.floor(x / step)
    variance = step.pow(2) * fraction * (1 - fraction)
    with pytest.raises(AssertionError):
        assert_unbiased(decoded, x, variance, 1500)


# ============================================================================= sign


@pytest.mark.parametrize("numel, block", [(1, 64), (1023, 100), (4097, 1024)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sign_magnitude_is_block_mean_and_sign_matches(numel, block, dtype):
    x = seeded_randn(numel, seed=41, dtype=dtype)
    x[0] = 0  # zero counts as non-negative
    packed, scales = ops.sign_compress(x, block)
    assert packed.numel() == math.ceil(numel / 8)
    assert scales.numel() == math.ceil(numel / block)
    decoded = ops.sign_decompress(packed, scales, block, numel)
    y = x.float()
    mean_abs = torch.stack([chunk.abs().mean() for chunk in y.split(block)])
    torch.testing.assert_close(scales, mean_abs, rtol=4 * EPS32, atol=0)
    expected = torch.where(y >= 0, 1.0, -1.0) * scales.repeat_interleave(block)[:numel]
    assert torch.equal(decoded, expected)


# ============================================================================= chunking


CPU_OPS = ops.backend("cpu")


def _blockwise_round_trip(op: str, x: torch.Tensor, residual: torch.Tensor, bits: int, block: int):
    """(payload, residual after, decoded into None / into a fp16 accumulator) of one op,
    on the CPU backend."""
    numel = x.numel()
    if op == "quantize":
        payload = CPU_OPS.quantize_blockwise(x, bits, block, residual=residual)
        decode = lambda **kw: CPU_OPS.dequantize_blockwise(*payload, bits, block, numel, **kw)  # noqa: E731
    else:
        payload = CPU_OPS.sign_compress(x, block, residual)
        decode = lambda **kw: CPU_OPS.sign_decompress(*payload, block, numel, **kw)  # noqa: E731
    accumulator = torch.linspace(-1, 1, numel, dtype=torch.float16)
    return payload, residual, decode(), decode(out=accumulator, accumulate=True)


@pytest.mark.parametrize("op, bits", [("quantize", 8), ("quantize", 4), ("quantize", 2), ("sign", 1)])
@pytest.mark.parametrize("numel, block", [(10_007, 100), (8_192, 256), (3_001, 64)])
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float16], ids=str)
def test_blockwise_ops_give_the_same_bits_in_chunks(monkeypatch, op, bits, numel, block, residual_dtype):
    # The CPU backend walks long tensors a chunk at a time; a tensor cut into
    # many chunks (blocks and code bytes never straddling one) must give
    # exactly the bits of one pass, non-finite blocks included. (Small ones
    # would go through numpy, in one piece: not here.)
    monkeypatch.setattr(cpu_small, "SMALL", 0)
    x = seeded_randn(numel, seed=numel + bits)
    x[numel // 3] = math.nan
    x[numel // 2] = -math.inf
    residual = (seeded_randn(numel, seed=7) * 0.01).to(residual_dtype)
    whole = _blockwise_round_trip(op, x, residual.clone(), bits, block)
    monkeypatch.setattr(cpu_shared, "CHUNK_ELEMENTS", 1)  # one unit: lcm(block, 8) elements
    assert len(cpu_backend.chunks(numel, block)) > 10
    chunked = _blockwise_round_trip(op, x, residual.clone(), bits, block)
    leaves = torch.utils._pytree.tree_leaves
    for got, expected in zip(leaves(chunked), leaves(whole), strict=True):
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(0.0), expected.nan_to_num(0.0))


@pytest.mark.parametrize("k", [100, 2_000])  # the second one samples
@pytest.mark.parametrize("planted", [False, True])
def test_topk_threshold_selection_gives_the_same_bits_in_chunks(monkeypatch, k, planted):
    numel = 20_011
    x = seeded_randn(numel, seed=k)
    if planted:
        x[[5, 9_000, 20_010]] = torch.tensor([math.nan, math.inf, -math.inf])
    residual = seeded_randn(numel, seed=3) * 0.01

    def select():  # on the CPU backend, which walks the tensor a chunk at a time
        kept = residual.clone()
        values, indices = CPU_OPS.topk_select(x, k, kept, seed=11)
        return values, indices, kept

    monkeypatch.setattr(cpu_small, "SMALL", 0)  # not through numpy, in one piece

    whole = select()
    monkeypatch.setattr(cpu_shared, "CHUNK_ELEMENTS", 1)
    assert len(cpu_backend.chunks(numel, 1)) > 1000
    for got, expected in zip(select(), whole, strict=True):
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(0.0), expected.nan_to_num(0.0))


@pytest.mark.parametrize("numel, block", [(10_007, 100), (64, 256)])
def test_chunks_cover_whole_blocks_and_bytes(numel, block):
    chunks = cpu_backend.chunks(numel, block)
    assert chunks[0][0] == 0 and chunks[-1][1] == numel
    assert all(end == next_start for (_, end), (next_start, _) in itertools.pairwise(chunks))
    assert all(start % block == 0 and start % 8 == 0 for start, _ in chunks)


# ============================================================================= top-k


@pytest.mark.parametrize("numel, k", [(1, 1), (1023, 1), (1023, 100), (4097, 4097), (4097, 409)])
def test_topk_exact_returns_the_k_largest(numel, k):
    x = seeded_randn(numel, seed=numel + k)
    values, indices = ops.topk_select(x, k, exact=True)
    assert values.numel() == k and indices.numel() == k
    assert indices.dtype == torch.int32
    assert torch.unique(indices).numel() == k
    assert torch.equal(values, x[indices.long()])
    expected = torch.topk(x.abs(), k).values
    assert torch.equal(values.abs().sort(descending=True).values, expected)


def sent_entries(values: torch.Tensor, indices: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-padding entries of a sampling-path payload: exactly ``k`` slots,
    ascending indices first, then (index 0, value 0) padding."""
    assert values.numel() == k and indices.numel() == k
    real = (values != 0) | values.isnan()
    count = int(real.sum())
    assert bool(real[:count].all()) and not bool(real[count:].any()), "padding before a real entry"
    assert not bool(indices[count:].any()) and not bool(values[count:].any())
    indices = indices[:count].long()
    assert bool((indices[1:] > indices[:-1]).all()), "indices not ascending"
    return values[:count], indices


@pytest.mark.parametrize("numel, ratio", [(10_000, 0.1), (50_000, 0.01), (200_000, 0.01), (200_000, 0.05)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_topk_sampling_path_sends_exactly_the_top_k(numel, ratio, seed):
    x = seeded_randn(numel, seed=seed + 50)
    k = round(ratio * numel)
    values, indices = sent_entries(*ops.topk_select(x, k, seed=seed), k)
    assert indices.numel() == k
    assert torch.equal(values, x[indices])
    assert torch.equal(indices, torch.topk(x.abs(), k).indices.sort().values)


@pytest.mark.parametrize("numel, k", [(1023, 100), (50_000, 500)])
def test_topk_ties_at_the_kth_magnitude_go_to_the_lowest_indices(numel, k):
    """Magnitudes 1 everywhere but three 4s, the last one far past the
    candidate capacity: every element reaches the threshold, the 4s are
    ranked first all the same, and the ties take the lowest indices."""
    generator = torch.Generator().manual_seed(numel)
    x = torch.randint(0, 2, (numel,), generator=generator).float() * 2 - 1
    large = [3, numel // 2, numel - 1]
    x[large] = 4.0
    values, indices = sent_entries(*ops.topk_select(x, k, seed=3), k)
    ties = [i for i in range(k) if i not in large][: k - len(large)]
    assert torch.equal(indices, torch.tensor(sorted(large + ties)))
    assert torch.equal(values, x[indices])


@pytest.mark.parametrize("with_residual", [False, True])
def test_topk_threshold_too_high_sends_every_candidate_and_pads(misjudge_threshold, with_residual):
    # A threshold that only 0.7 k reach: all of them are sent, the rest is padding.
    numel, k = 200_000, 2_000
    x = seeded_randn(numel, seed=71)
    residual = seeded_randn(numel, seed=72) * 0.3 if with_residual else None
    y = x + (0 if residual is None else residual)
    threshold = torch.topk(y.abs(), round(0.7 * k)).values.min()
    misjudge_threshold(lambda sampled: threshold)
    assert reference.sample_threshold(x, residual, k, seed=5) == threshold
    values, indices = sent_entries(*REFERENCE.topk_select(x, k, residual, seed=5), k)
    assert torch.equal(indices, torch.nonzero(y.abs() >= threshold).view(-1))
    assert torch.equal(values, y[indices])
    if residual is not None:
        expected = y.clone()
        expected[indices] = 0
        assert torch.equal(residual, expected)


def test_topk_threshold_too_low_ranks_only_the_capacity(misjudge_threshold):
    # Every element reaches a threshold of 0: only the first candidate_capacity(k)
    # elements (index order) are ranked, and their k largest are sent.
    numel, k = 50_000, 500
    x = seeded_randn(numel, seed=73)
    capacity = reference.candidate_capacity(k)
    misjudge_threshold(torch.zeros_like)
    values, indices = sent_entries(*REFERENCE.topk_select(x, k, seed=5), k)
    expected = torch.topk(x[:capacity].abs(), k).indices.sort().values
    assert torch.equal(indices, expected) and torch.equal(values, x[expected])


@pytest.mark.parametrize("nonzero", [0, 3, 40])
def test_topk_never_sends_zeros(nonzero):
    """Fewer non-zeros than k: every one is sent, wherever it lies, and zeros
    never take the capacity (a threshold of 0 would have filled it with zeros)."""
    numel, k = 100_000, 50
    x = torch.zeros(numel)
    planted = torch.arange(numel - nonzero, numel)
    x[planted] = seeded_randn(nonzero, seed=74)
    residual = torch.zeros(numel)
    values, indices = sent_entries(*ops.topk_select(x, k, residual, seed=5), k)
    assert torch.equal(indices, planted) and torch.equal(values, x[planted])
    assert not residual.any()


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("numel, k", [(1023, 5), (50_000, 500)])
def test_topk_always_selects_non_finite(exact, numel, k):
    x = seeded_randn(numel, seed=61)
    planted = {3: math.nan, numel // 2: math.inf, numel - 1: -math.inf}
    for position, value in planted.items():
        x[position] = value
    values, indices = ops.topk_select(x, k, exact=exact, seed=7)
    assert set(planted) <= set(indices.tolist())
    assert not torch.isfinite(values).all()


SPECIAL_VALUES = [0.0, -0.0, 1e-45, -1e-45, 1.1754944e-38, 0.5, -0.5, 2.0, -3.4028235e38, math.inf, -math.inf]


def test_selection_magnitude_ranks_nan_and_inf_alike():
    """As the Triton and CUDA kernels do: NaN and +-inf are all the largest magnitude, inf."""
    y = torch.tensor([math.nan, math.inf, -math.inf, -3.4028235e38, -0.0])
    assert torch.equal(reference.selection_magnitude(y), torch.tensor([math.inf] * 3 + [3.4028235e38, 0.0]))


@pytest.mark.parametrize("threshold", [0.0, 1e-45, 0.5, 2.0, 3.4028235e38, math.inf])
@pytest.mark.parametrize("pending", [False, True])
def test_topk_bit_pattern_compare_is_the_magnitude_compare(threshold, pending):
    """The CPU selection compares bit patterns; it must pick what |y| >= t (NaN as inf) picks."""
    values = torch.tensor(SPECIAL_VALUES * 3 + [math.nan, -math.nan], dtype=torch.float32)
    # NaNs with other payloads and the sign bit set, too.
    odd_nans = torch.tensor([0x7FC00001, 0x7F800001, -0x00000001, -0x003FFFFF], dtype=torch.int32)
    y = torch.cat([values, odd_nans.view(torch.float32), seeded_randn(997, seed=71)])
    assert y.isnan().sum() == 6
    bound = torch.tensor(threshold, dtype=torch.float32)
    expected = torch.nonzero(reference.selection_magnitude(y) >= bound).view(-1)
    if pending:
        add = seeded_randn(y.numel(), seed=72, dtype=torch.float16)
        base = y.clone()
        expected = torch.nonzero(reference.selection_magnitude(y + add.float()) >= bound).view(-1)
        got = cpu_sparse._reaching(base, bound, add)
        assert torch.equal(base.isnan(), (y + add.float()).isnan())
    else:
        got = cpu_sparse._reaching(y.clone(), bound)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)


@pytest.mark.parametrize("exact", [True, False])
def test_topk_residual_finite_when_non_finite_outnumber_k(exact):
    """More inf/NaN than k: some stay unsent, and the residual must still be cleaned of them."""
    numel, k = 50_000, 20
    x = seeded_randn(numel, seed=73)
    generator = torch.Generator().manual_seed(74)
    planted = torch.randperm(numel, generator=generator)[:60]
    x[planted[:20]], x[planted[20:40]], x[planted[40:]] = math.nan, math.inf, -math.inf
    residual = seeded_randn(numel, seed=75) * 0.1
    values, indices = ops.topk_select(x, k, residual, exact=exact, seed=5)
    assert set(indices.tolist()) <= set(planted.tolist())
    assert not torch.isfinite(values).any()
    assert torch.isfinite(residual).all()
    # Finite entries were kept whole.
    finite = torch.isfinite(x)
    expected = x + seeded_randn(numel, seed=75) * 0.1
    assert torch.equal(residual[finite], expected[finite])


def test_topk_index_dtype_and_bad_k():
    x = seeded_randn(100, seed=62)
    assert ops.topk_select(x, 5, index_dtype=torch.int64)[1].dtype == torch.int64
    for k in (0, 101, -1):
        with pytest.raises(ValueError):
            ops.topk_select(x, k)


# ============================================================================= random-k


@pytest.mark.parametrize("numel, k", [(1, 1), (10, 10), (10, 3), (1000, 10), (1000, 500), (100_000, 1000)])
def test_randk_indices_distinct_sorted_in_range_and_seeded(numel, k):
    indices = ops.randk_indices(numel, k, seed=123)
    assert indices.dtype == torch.int64 and indices.numel() == k
    assert (indices[1:] > indices[:-1]).all(), "not strictly ascending (so not distinct, or unsorted)"
    assert indices.min() >= 0 and indices.max() < numel
    assert torch.equal(indices, ops.randk_indices(numel, k, seed=123))
    if k < numel:
        assert not torch.equal(indices, ops.randk_indices(numel, k, seed=124))


@pytest.mark.parametrize(
    "numel, k, seed",
    [
        # The long walks (2**20 and 63 000 indices): one seed in the fast tier, each in the full suite.
        pytest.param(numel, k, seed, marks=[pytest.mark.slow] * (k > 10_000 and seed != 0))
        for numel, k in [(1, 1), (7, 7), (1000, 10), (2**20, 2**20), (6_300_000, 63_000), (2**33 + 5, 1000)]
        for seed in [0, 12345, 2**63 + 5]
    ],
)
def test_randk_indices_numpy_walk_is_the_torch_walk(numel, k, seed):
    """The CPU backend walks the cycles in numpy (uint32 halves), the reference in
    torch (int64 with masks): the same permutation, so the same indices."""
    half_bits, keys = reference.feistel_half_bits(numel), reference.feistel_keys(seed)
    walked = cpu_sparse._walk_numpy(numel, k, half_bits, keys)
    assert walked.dtype == torch.int64
    assert torch.equal(walked, REFERENCE.randk_indices(numel, k, seed))


@pytest.mark.slow
@pytest.mark.parametrize("numel, k, seeds", [(50, 5, 4000), (20, 10, 2000), (1000, 100, 1000)])
def test_randk_indices_uniform(numel, k, seeds):
    """Each index is picked with probability k / numel: a chi-square test over many seeds."""
    counts = torch.zeros(numel, dtype=torch.float64)
    for seed in range(seeds):
        counts[ops.randk_indices(numel, k, seed)] += 1
    expected = seeds * k / numel
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    degrees = numel - 1
    # Sampling without replacement only shrinks the spread; 5 sd of chi2(df) above its mean.
    assert chi_square < degrees + 5 * math.sqrt(2 * degrees), chi_square
    # Position bias (e.g. favouring low indices) would move the mean index.
    mean_index = (counts * torch.arange(numel)).sum().item() / counts.sum().item()
    index_sd = math.sqrt((numel**2 - 1) / 12 / (seeds * k))
    assert abs(mean_index - (numel - 1) / 2) < 5 * index_sd


@pytest.mark.parametrize("planted", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("numel, k", [(1023, 10), (5000, 4000)])
def test_randk_select_never_hides_non_finite(planted, numel, k):
    x = seeded_randn(numel, seed=71)
    indices = ops.randk_indices(numel, k, seed=9)
    unpicked = torch.ones(numel, dtype=torch.bool)
    unpicked[indices] = False
    position = int(torch.nonzero(unpicked)[-1])
    x[position] = planted
    values = ops.randk_select(x, k, 9)
    assert torch.isnan(values).any()


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_randk_select_values_are_scaled_picks(scale):
    x = seeded_randn(1023, seed=72)
    values = ops.randk_select(x, 30, 10, multiplier=scale)
    assert torch.equal(values, x[ops.randk_indices(1023, 30, 10)] * scale)


def test_randk_indices_recent_ones_are_reused_as_copies(monkeypatch):
    monkeypatch.setattr(index_cache, "_recent", {})  # what this test caches stays here
    first = cpu_sparse.randk_indices(100_000, 1000, seed=77)
    first[:] = 0  # a caller scribbling on its copy
    calls = []
    walk = cpu_sparse._walk_numpy
    monkeypatch.setattr(cpu_sparse, "_walk_numpy", lambda *a: calls.append(a) or walk(*a))
    again = cpu_sparse.randk_indices(100_000, 1000, seed=77)
    assert not calls, "recomputed"
    assert torch.unique(again).numel() == 1000 and again.max() < 100_000
    assert torch.equal(again, again.sort().values)
    cpu_sparse.randk_indices(100_000, 1000, seed=78)  # another seed is computed
    assert calls


def test_randk_indices_are_remembered_per_device_whatever_its_name(monkeypatch):
    """``cuda`` is the current CUDA device: its indices are those of ``cuda:N``."""

    class Cuda:  # torch.cuda as the cache uses it: the current device and its stream
        @staticmethod
        def current_device():
            return 1

        @staticmethod
        def current_stream(device):
            assert device == torch.device("cuda", 1), device
            return types.SimpleNamespace(stream_id=7)

    monkeypatch.setattr(index_cache, "_recent", {})
    monkeypatch.setattr(streams, "cuda", Cuda)
    calls = []
    compute = lambda: calls.append(1) or torch.arange(5)  # noqa: E731
    for name in ("cuda:1", "cuda", "cuda:1"):
        index_cache.remembered("triton", 100, 5, 3, torch.device(name), compute)
    assert len(calls) == 1


def test_randk_select_finite_input_stays_finite():
    """Finite values whose fp32 sum overflows must not turn a sent value into NaN."""
    x = torch.tensor([3e38, 3e38, 1.0, 2.0])
    values = ops.randk_select(x, 2, 0)
    assert torch.isfinite(values).all(), values


@pytest.mark.slow
def test_randk_rescaled_is_unbiased():
    numel, k, trials = 200, 20, 3000
    x = seeded_randn(numel, seed=73)
    total = torch.zeros(numel, dtype=torch.float64)
    for seed in range(trials):
        values = ops.randk_select(x, k, seed, multiplier=numel / k)
        total[ops.randk_indices(numel, k, seed)] += values.double()
    mean = (total / trials).float()
    # Sent with probability k / n as x * n / k: variance x^2 (n / k - 1).
    variance = x.pow(2) * (numel / k - 1)
    assert_unbiased(mean, x, variance, trials)


# ============================================================================= scatter_add


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_scatter_add_sums_repeated_indices(index_dtype):
    indices = torch.tensor([0, 2, 2, 0, 5, 2], dtype=index_dtype)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 0.5])
    out = torch.full((2, 3), 10.0)
    result = ops.scatter_add(indices, values, out)
    assert result is out
    assert out.view(-1).tolist() == [15.0, 10.0, 15.5, 10.0, 10.0, 15.0]


# ============================================================================= dispatch


def _call_every_op(x: torch.Tensor) -> None:
    q, scales = ops.quantize_blockwise(x, 8, 64)
    ops.dequantize_blockwise(q, scales, 8, 64, x.numel())
    ops.sign_compress(x, 64)
    ops.topk_select(x, 3)
    ops.randk_select(x, 3, 0)


@pytest.mark.parametrize("backend", ["triton", "cuda", "TRITON"])
def test_forced_unavailable_backend_raises(monkeypatch, backend):
    # On CPU tensors Triton runs only in its interpreter, and no CUDA backend
    # runs on CPU at all: forcing either without that must raise, not fall back.
    # The kernels are defined first, interpreted (conftest): defined without the
    # interpreter, they would need a GPU driver in every later test of this process.
    ops.functions("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("GRADCOMP_BACKEND", backend)
    x = seeded_randn(100, seed=81)
    with pytest.raises(RuntimeError, match="GRADCOMP_BACKEND"):
        ops.quantize_blockwise(x, 8, 64)
    for op in ops.OP_NAMES:
        with pytest.raises(RuntimeError):
            ops.implementation(op, x.device)


def test_forced_bogus_backend_raises(monkeypatch):
    monkeypatch.setenv("GRADCOMP_BACKEND", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        ops.topk_select(seeded_randn(100, seed=82), 3)


@pytest.mark.parametrize(
    "setting, backend", [("torch", "torch"), (" Torch ", "torch"), ("", "cpu"), ("cpu", "cpu")]
)
def test_forced_backend_runs_and_cpu_tensors_default_to_the_cpu_backend(monkeypatch, setting, backend):
    monkeypatch.setenv("GRADCOMP_BACKEND", setting)
    x = seeded_randn(1000, seed=83)
    _call_every_op(x)
    for op in ops.OP_NAMES:
        expected = getattr(reference, op) if backend == "torch" else cpu_backend.FUNCTIONS[op]
        assert ops.implementation(op, x.device) is expected, op
    q, scales = ops.quantize_blockwise(x, 4, 100, True, 3)
    q_ref, scales_ref = REFERENCE.quantize_blockwise(x, 4, 100, True, 3)
    assert torch.equal(q, q_ref) and torch.equal(scales, scales_ref)


def test_an_optional_backend_that_fails_to_import_fails_alike_at_every_use(monkeypatch):
    # Its package is there but its module does not import: the import's own error, every time,
    # never "not installed" and never a silent fallback to another backend.
    monkeypatch.setitem(ops.dispatch._OPTIONAL, "triton", ("gradcomp.ops.no_such_backend", "json"))
    monkeypatch.delitem(ops.dispatch._REGISTRY, "triton", raising=False)
    monkeypatch.setattr(ops.dispatch, "_FAILED", {})
    monkeypatch.setattr(ops.dispatch, "_ABSENT", set())
    for _ in range(2):
        with pytest.raises(ModuleNotFoundError, match="no_such_backend"):
            ops.functions("triton")
    monkeypatch.setenv("GRADCOMP_BACKEND", "triton")
    with pytest.raises(ModuleNotFoundError, match="no_such_backend"):
        ops.implementation("pack_bits", torch.device("cpu"))


def test_a_backends_functions_are_its_own_copy():
    functions = ops.functions("cpu")
    functions["pack_bits"] = None
    assert ops.functions("cpu")["pack_bits"] is not None and ops.runs_on("cpu", "cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        ops.functions("tpu")


def test_a_backends_availability_is_the_test_it_was_registered_with():
    assert ops.availability("cpu") is cpu_backend.is_available
    assert ops.availability("torch")(torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown backend"):
        ops.availability("tpu")


def test_the_availability_of_a_backend_not_installed_is_refused(monkeypatch):
    monkeypatch.setitem(ops.dispatch._OPTIONAL, "cuda", ("gradcomp.ops.cuda_backend", "no_such_package"))
    monkeypatch.delitem(ops.dispatch._REGISTRY, "cuda", raising=False)
    monkeypatch.setattr(ops.dispatch, "_ABSENT", set())
    with pytest.raises(RuntimeError, match="'cuda' is not installed"):
        ops.availability("cuda")


def test_topk_dispatches_to_the_one_pass_backend_before_the_radix_select(monkeypatch):
    # Where both run on a GPU: Triton's sampling path passes once over the tensor, the CUDA
    # radix select four times (ops.OP_PREFERENCE); every other op takes the CUDA kernels.
    device = torch.device("cuda", 0)
    fakes = {name: {op: object() for op in ops.OP_NAMES} for name in ("triton", "cuda")}
    for name, functions in fakes.items():
        monkeypatch.setitem(ops.dispatch._REGISTRY, name, (lambda device: True, functions))
    monkeypatch.setattr(ops.dispatch, "_CHOSEN", {})
    monkeypatch.delenv("GRADCOMP_BACKEND", raising=False)
    assert ops.implementation("topk_select", device) is fakes["triton"]["topk_select"]
    for op in set(ops.OP_NAMES) - {"topk_select"}:
        assert ops.implementation(op, device) is fakes["cuda"][op], op
    monkeypatch.setenv("GRADCOMP_BACKEND", "cuda")
    assert ops.implementation("topk_select", device) is fakes["cuda"]["topk_select"]
