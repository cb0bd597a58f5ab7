"""The sparse ops of :mod:`gradcomp.ops.reference`: Top-K (its sampled threshold and
candidate ranking), random-K (a keyed Feistel permutation) and the scatter-add that
decodes both. Re-exported by :mod:`gradcomp.ops.reference`, with its conventions."""

from __future__ import annotations

import math

import torch

from gradcomp.ops.reference_shared import compensate, generator, index_dtype_for

# ----------------------------------------------------------------------------- Top-K

# Top-K's sampling path. A seeded sample of |x + residual| gives a threshold
# that about CANDIDATE_REACH * k elements reach; the candidates that reach it
# (strictly larger ones first, then those equal to it, each in index order,
# at most candidate_capacity(k) in all) are ranked, and the k largest of
# them are sent. With SAMPLE_HITS expected hits at reach 1 the candidate
# count's relative spread is about 1 / sqrt(1.25 * SAMPLE_HITS) = 3.2%, so
# it falls below k or above the capacity only when the sample is off by six
# spreads: the result is then the exact top-k, yet every shape is known
# before the data is read, which a GPU needs to run without a host sync.
# Taking the strictly larger candidates first keeps a flood of equal
# magnitudes (a threshold every element reaches) from crowding out larger
# ones.
SAMPLE_HITS = 800
CANDIDATE_REACH = 1.25
CANDIDATE_CAPACITY = 1.5
# Zero is never a candidate: a threshold of 0 (more than 1.25 k zeros) would
# fill the capacity with zeros in index order and leave out the non-zeros.
SMALLEST_MAGNITUDE = 2.0**-149


def candidate_capacity(k: int) -> int:
    """How many candidates the sampling Top-K path ranks at most."""
    return math.ceil(CANDIDATE_CAPACITY * k)


def sample_positions(numel: int, k: int, seed: int, device: torch.device) -> torch.Tensor | None:
    """Positions whose magnitudes estimate the k-th largest (None: use every element)."""
    size = sample_size(numel, k)
    if size >= numel:
        return None
    return torch.randint(numel, (size,), generator=generator(seed, device), device=device)


def sample_size(numel: int, k: int) -> int:
    """How many magnitudes estimate the k-th largest (``numel``: every element)."""
    return min(numel, max(4096, math.ceil(SAMPLE_HITS * numel / k)))


def threshold_from_sample(sample_magnitude: torch.Tensor, k: float, numel: int) -> torch.Tensor:
    """The magnitude that about ``k`` of ``numel`` elements reach, judged from a sample."""
    size = sample_magnitude.numel()
    sample_k = min(size, max(1, round(k * size / numel)))
    return torch.topk(sample_magnitude, sample_k, sorted=False).values.min()


def sample_threshold(x: torch.Tensor, residual: torch.Tensor | None, k: int, seed: int) -> torch.Tensor:
    """The candidate threshold of :func:`topk_select`, read from ``x`` and
    ``residual`` at the sampled positions only (``x + residual`` is not
    formed); never below the smallest positive float. A 0-d fp32 tensor."""
    x = x.reshape(-1)
    picks = sample_positions(x.numel(), k, seed, x.device)
    # index_select: the values indexing gives, a few times faster on CPU.
    sample = x.float() if picks is None else x.index_select(0, picks).float()
    if residual is not None:
        residual = residual.reshape(-1)
        sample = sample + (residual.float() if picks is None else residual.index_select(0, picks).float())
    threshold = threshold_from_sample(selection_magnitude(sample), CANDIDATE_REACH * k, x.numel())
    return threshold.clamp_min(SMALLEST_MAGNITUDE)


def selection_magnitude(y: torch.Tensor) -> torch.Tensor:
    """|y| with NaN as inf: NaN must win a selection like inf does, not be dropped.
    (inf stays inf: nan_to_num's default would turn it into the largest float.)"""
    return y.abs().nan_to_num_(nan=math.inf, posinf=math.inf)


def keep_largest(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the ``k`` largest entries of ``magnitude``; of those tied at the
    k-th largest, the first ones. All entries when there are at most ``k``."""
    if magnitude.numel() <= k:
        return torch.ones_like(magnitude, dtype=torch.bool)
    kth = torch.topk(magnitude, k, sorted=False).values.min()
    above = magnitude > kth
    tied = magnitude == kth
    return above | (tied & (tied.cumsum(0) <= k - above.sum()))


def within_capacity(above: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which candidates (in index order; ``above`` the threshold or equal to it)
    are ranked: those above it first, then those equal, each in index order,
    ``capacity`` in all."""
    above_before = above.cumsum(0) - above.long()
    equal_before = (~above).cumsum(0) - (~above).long()
    room_for_equal = capacity - torch.clamp(above.sum(), max=capacity)
    return torch.where(above, above_before < capacity, equal_before < room_for_equal)


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
    """The ``k`` largest-magnitude entries of ``x + residual``; sent entries leave the residual.

    ``exact`` ranks every element (``torch.topk``; ties in no set order).
    Otherwise the candidates are the entries whose magnitude reaches
    :func:`sample_threshold`, those above it first, then those equal to it,
    each in index order, at most :func:`candidate_capacity` of them; of them
    the ``k`` largest are sent, ties at the k-th magnitude to the first
    candidate: the exact top-k (ties to the lowest index) unless the sample
    misjudged badly. Fewer than ``k`` candidates are all sent and the payload
    is padded with index 0, value 0. Either way the payload has exactly
    ``k`` entries. NaN and inf count as the largest magnitudes; zero is never
    a candidate.

    Returns:
        ``(values in value_dtype, indices)``: ``k`` of each, ascending
        indices (then the padding) in the sampling path, in ``index_dtype``
        (default: int32 unless ``numel`` needs int64). The residual keeps
        what rounding to ``value_dtype`` lost.
    """
    numel = x.numel()
    threshold = None if exact or k == numel else sample_threshold(x, residual, k, seed)
    y = compensate(x, residual)
    magnitude = selection_magnitude(y)
    if threshold is None:
        indices = torch.topk(magnitude, k, sorted=False).indices
    else:
        candidates = torch.nonzero(magnitude >= threshold).view(-1)
        ranked = magnitude[candidates]
        candidates = candidates[within_capacity(ranked > threshold, candidate_capacity(k))]
        indices = candidates[keep_largest(magnitude[candidates], k)]
    picked = y[indices]
    values = picked.to(value_dtype)
    kept = y.nan_to_num(0.0, 0.0, 0.0)
    kept[indices] = (picked - values.float()).nan_to_num(0.0, 0.0, 0.0)
    if residual is not None:
        residual.view(-1).copy_(kept)
    padding = k - indices.numel()
    values = torch.cat([values, values.new_zeros(padding)])
    indices = torch.cat([indices, indices.new_zeros(padding)])
    return values, indices.to(index_dtype or index_dtype_for(numel))


# ----------------------------------------------------------------------------- random-K

# Random-K indices: the first k outputs of a pseudo-random permutation of
# [0, numel) keyed by the seed -- a 4-round Feistel network on 2h bits
# (2**(2h) >= numel), cycle-walked back into range. Counter-based, O(k), and
# integer-exact, so every backend reproduces it bit for bit.
FEISTEL_ROUNDS = 4
HASH_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)  # odd, below 2**31: products stay inside int64


def feistel_half_bits(numel: int) -> int:
    return max(1, math.ceil(math.log2(max(numel, 2)) / 2))


def feistel_keys(seed: int) -> list[int]:
    """The round keys (32-bit) that ``seed`` gives."""
    keys, state = [], int(seed) & (2**64 - 1)
    for _ in range(FEISTEL_ROUNDS):
        state = (state * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
        keys.append(state >> 32)
    return keys


def _hash32(value: torch.Tensor) -> torch.Tensor:
    value = value ^ (value >> 16)
    value = (value * HASH_MULTIPLIERS[0]) & 0xFFFFFFFF
    value = value ^ (value >> 15)
    value = (value * HASH_MULTIPLIERS[1]) & 0xFFFFFFFF
    return value ^ (value >> 16)


def feistel_permute(x: torch.Tensor, half_bits: int, keys: list[int]) -> torch.Tensor:
    """One pass of the keyed permutation of [0, 2**(2 * half_bits)) (int64 in and out)."""
    mask = (1 << half_bits) - 1
    left, right = x >> half_bits, x & mask
    for key in keys:
        left, right = right, left ^ (_hash32(right ^ key) & mask)
    return (left << half_bits) | right


def randk_indices(numel: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``k`` distinct ascending indices in ``[0, numel)`` that ``seed`` picks (int64).

    Every rank (and every backend) that passes the same seed gets the same
    indices, so random-K payloads can be summed with a plain all-reduce.
    """
    half_bits, keys = feistel_half_bits(numel), feistel_keys(seed)
    chosen = feistel_permute(torch.arange(k, dtype=torch.int64, device=device), half_bits, keys)
    outside = chosen >= numel
    while bool(outside.any()):
        chosen[outside] = feistel_permute(chosen[outside], half_bits, keys)
        outside = chosen >= numel
    return chosen.sort().values


def randk_select(
    x: torch.Tensor,
    k: int,
    seed: int,
    residual: torch.Tensor | None = None,
    *,
    multiplier: float = 1.0,
    value_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Values of ``(x + residual) * multiplier`` at :func:`randk_indices` in ``value_dtype``.

    The residual keeps ``y - sent`` at the picked indices (zero unless
    ``multiplier != 1`` or rounding to ``value_dtype`` lost something) and ``y``
    elsewhere.

    If any entry of ``x + residual`` is inf or NaN, the first value becomes
    NaN, so a non-finite gradient is never hidden by not being picked.
    """
    indices = randk_indices(x.numel(), k, seed, x.device)
    y = compensate(x, residual)
    picked = y[indices]
    scaled = picked * multiplier
    scaled[:1] += torch.where(torch.isfinite(y).all(), 0.0, math.nan)
    values = scaled.to(value_dtype)
    kept = y.nan_to_num(0.0, 0.0, 0.0)
    kept[indices] = (picked - values.float()).nan_to_num(0.0, 0.0, 0.0)
    if residual is not None:
        residual.view(-1).copy_(kept)
    return values


def scatter_add(indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out.view(-1)[i] += v`` for every pair ``(i, v)`` of ``indices`` and ``values``,
    one at a time in the order given: a 2-D pair of tensors holds one payload a row,
    added row after row (rank order), each row in its own order; returns ``out``.

    Every element's sum is thus taken in one order, the same on every backend and
    under any GPU schedule, so that every rank decoding the same rows gets the same
    bits. A value of zero adds nothing (Top-K pads its payloads with index 0, value 0):
    not even ``-0.0 + 0.0 = +0.0``. Values are first rounded to ``out``'s dtype.

    An index outside ``out`` raises here; the GPU kernels, which cannot raise
    without a host sync or a trap that ends the CUDA context, drop its value
    and make element 0 NaN instead."""
    flat = out.view(-1)
    rows = indices if indices.dim() == 2 else indices.reshape(1, -1)
    for row_indices, row_values in zip(rows, values.reshape(rows.shape), strict=True):
        row_values = row_values.to(flat.dtype)
        # x + (-0.0) is x for every x, where + 0.0 would turn -0.0 into +0.0.
        row_values = torch.where(row_values == 0, -0.0, row_values)
        # index_add_ adds a row's pairs in order on CPU; on a GPU it adds them in no
        # fixed order, which changes nothing for a payload's row: its indices are
        # distinct but for zero pads.
        flat.index_add_(0, row_indices.long(), row_values)
    return out
