"""Torch reference of every gradcomp op: the definition of correct.

Every backend (the CPU one in :mod:`gradcomp.ops.cpu_backend`, Triton in
``gradcomp.kernels``, CUDA in ``csrc/``) is tested against these functions.
They are written to be read, not to be fast; they run on any device torch
supports and perform error feedback unfused:
``y = x + residual; c = C(y); residual <- y - D(c)``. Arguments arrive
checked and completed (``levels``, ``index_dtype``) by
:mod:`gradcomp.ops.checks`.

Conventions shared by all ops:

* Inputs are flattened; the caller keeps shape and dtype.
* Arithmetic is fp32 whatever the input dtype (fp16 / bf16 are upcast).
* Randomness comes from a ``torch.Generator`` seeded with ``seed``; the
  global RNG is never touched.
* A residual never becomes non-finite: where the compensated value or its
  decoding is inf or NaN, the residual entry is set to zero. The step that
  saw the non-finite gradient is skipped by the optimizer (GradScaler), and a
  poisoned residual would break every later step.
* Non-finite inputs are never hidden: a block holding inf or NaN decodes to
  a non-finite value.
"""

from __future__ import annotations

import math

import torch

INT32_LIMIT = 2**31 - 1


def generator(seed: int, device: torch.device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with the 63 low bits of ``seed``."""
    result = torch.Generator(device=device)
    result.manual_seed(int(seed) & (2**63 - 1))
    return result


def index_dtype_for(numel: int) -> torch.dtype:
    """Smallest index dtype that addresses ``numel`` elements (int32 or int64)."""
    return torch.int32 if numel <= INT32_LIMIT else torch.int64


def code_bits(levels: int) -> int:
    """Bits needed for the codes ``0 .. 2 * levels`` (a signed level plus an offset)."""
    needed = max(1, math.ceil(math.log2(2 * levels + 1)))
    for bits in (1, 2, 4, 8):
        if needed <= bits:
            return bits
    raise ValueError(f"levels={levels} needs more than 8 bits per code")


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` rounded once, as the kernels and torch on CPU divide.

    On CUDA, torch divides by a Python number (or a 0-dim CPU tensor) as a
    multiplication by its reciprocal, one ulp off at times
    (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu, ``div_true_kernel_cuda``
    under ``iter.is_cpu_scalar(2)``); a divisor on the device is divided by.
    """
    return x / torch.full((1,), float(divisor), dtype=torch.float32, device=x.device)


def compensate(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``x + residual`` in fp32, flattened (a fresh tensor: never aliases ``x``)."""
    if residual is None:
        return x.reshape(-1).to(torch.float32, copy=True)
    return torch.add(x.reshape(-1).float(), residual.reshape(-1).float())


def store_residual(residual: torch.Tensor | None, y: torch.Tensor, decoded: torch.Tensor) -> None:
    """``residual <- y - decoded``, non-finite entries zeroed, in the residual's dtype."""
    if residual is not None:
        residual.view(-1).copy_((y - decoded).nan_to_num(0.0, 0.0, 0.0))


def write_out(decoded: torch.Tensor, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
    """``decoded`` itself, or written (``accumulate``: added) into ``out``, rounded once to its dtype."""
    if out is None:
        return decoded
    flat = out.view(-1)
    if not accumulate:
        flat.copy_(decoded)
    elif torch.promote_types(decoded.dtype, flat.dtype) == flat.dtype:
        flat += decoded  # widened exactly, then added
    else:
        flat += decoded.to(flat.dtype)
    return out


def blocks_of(y: torch.Tensor, block: int) -> torch.Tensor:
    """``y`` as rows of ``block``, the last one padded with zeros."""
    pad = (-y.numel()) % block
    if pad:
        y = torch.nn.functional.pad(y, (0, pad))
    return y.view(-1, block)


# ----------------------------------------------------------------------------- bit packing


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-wide codes (uint8, values < 2**bits) into bytes.

    Element ``i`` lands in byte ``i // (8 // bits)`` at bit offset
    ``(i % (8 // bits)) * bits`` (little end first). The tail is zero-padded.

    Example:
        >>> pack_bits(torch.tensor([1, 2, 3], dtype=torch.uint8), 2)
        tensor([57], dtype=torch.uint8)
    """
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes.clone()
    per_byte = 8 // bits
    grouped = blocks_of(codes, per_byte)
    packed = grouped[:, 0].clone()
    for position in range(1, per_byte):
        packed |= grouped[:, position] << (position * bits)
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes as uint8."""
    packed = packed.reshape(-1)
    if bits == 8:
        return packed[:numel]
    per_byte = 8 // bits
    codes = torch.stack(
        [(packed >> (position * bits)) & ((1 << bits) - 1) for position in range(per_byte)], 1
    )
    return codes.view(-1)[:numel]


# Five codes of three values (0, 1, 2) fit a byte in base 3: 3**5 = 243 <= 256.
TRITS_PER_BYTE = 5


def pack_trits(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..2 (uint8) along the last dimension, five a byte in base 3,
    the first code lowest: ``ceil(n / 5)`` bytes for ``n`` codes (1.6 bits a
    code where 2-bit packing takes 2). 1-D, or 2-D (a row at a time)."""
    count = codes.shape[-1]
    groups = -(-count // TRITS_PER_BYTE)
    padded = codes.new_zeros(*codes.shape[:-1], groups * TRITS_PER_BYTE)
    padded[..., :count] = codes
    digits = padded.view(*codes.shape[:-1], groups, TRITS_PER_BYTE)
    packed = digits[..., -1].clone()
    for position in range(TRITS_PER_BYTE - 2, -1, -1):  # Horner: no constant tensor on the device
        packed.mul_(3).add_(digits[..., position])
    return packed


def unpack_trits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_trits`: the first ``count`` codes (of each row) as uint8."""
    rest = packed.clone()
    digits = packed.new_empty(*packed.shape, TRITS_PER_BYTE)
    for position in range(TRITS_PER_BYTE):
        digits[..., position] = rest % 3
        rest.div_(3, rounding_mode="floor")
    return digits.view(*packed.shape[:-1], -1)[..., :count]


# ----------------------------------------------------------------------------- quantization


def quantize_blockwise(
    x: torch.Tensor,
    bits: int,
    block: int,
    stochastic: bool = False,
    seed: int = 0,
    residual: torch.Tensor | None = None,
    *,
    levels: int | None = None,
    scale: str = "absmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear quantization with one fp32 scale per block, error feedback fused.

    Each block of ``block`` elements gets a scale ``s`` (``absmax / levels`` or,
    for QSGD, ``l2norm / levels``) and each element the signed level
    ``q = round(y / s)`` in ``[-levels, levels]`` (stochastic rounding when
    ``stochastic``: ``floor(y / s + u)``, ``u ~ U[0, 1)``, unbiased). Codes
    ``q + levels`` are packed ``bits`` wide. Where ``levels * s`` would round
    past the largest float, ``s`` is one ulp lower, so that the top level of
    a finite block decodes finite.

    Args:
        x: floating tensor of any shape (read as flat).
        bits: code width, 1, 2, 4 or 8; must hold ``2 * levels + 1`` codes.
        block: elements per scale.
        stochastic: stochastic instead of round-to-nearest.
        seed: generator seed for stochastic rounding.
        residual: error-feedback memory (same numel as ``x``), updated in place.
        levels: largest level; default ``2 ** (bits - 1) - 1``.
        scale: ``"absmax"`` or ``"norm"`` (QSGD).

    Returns:
        ``(packed codes uint8, scales fp32 of ceil(numel / block))``.

    Example:
        >>> q, s = quantize_blockwise(torch.randn(1000), bits=8, block=256)
    """
    y = compensate(x, residual)
    numel = y.numel()
    blocks = blocks_of(y, block)
    peak = blocks.abs().amax(dim=1)  # amax propagates NaN: a block with NaN gets a NaN scale
    if scale == "norm":
        # Scaled by the absmax first: squaring values above ~1.8e19 overflows fp32.
        safe_peak = torch.where(peak > 0, peak, torch.ones_like(peak)).unsqueeze(1)
        peak = (blocks / safe_peak).norm(dim=1) * peak
    scales = divide(peak, levels)
    over = torch.isfinite(scales) & ~torch.isfinite(scales * levels)
    scales.view(torch.int32)[over] -= 1  # positive floats: the next one down
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    level = blocks / divisor
    if stochastic:
        level = torch.floor(
            level + torch.rand(level.shape, generator=generator(seed, y.device), device=y.device)
        )
    else:
        level = torch.round(level)
    level = level.nan_to_num(0.0, 0.0, 0.0).clamp(-levels, levels)
    codes = (level.view(-1)[:numel] + levels).to(torch.uint8)
    store_residual(residual, y, (level * scales.unsqueeze(1)).view(-1)[:numel])
    return pack_bits(codes, bits), scales


def dequantize_blockwise(
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    *,
    levels: int | None = None,
) -> torch.Tensor:
    """Decode :func:`quantize_blockwise`'s output.

    Args:
        q, scales: the packed codes and per-block scales.
        bits, block, levels: as given to :func:`quantize_blockwise`.
        numel: number of elements encoded.
        out: optional flat-viewable tensor to write (or add) into; any float dtype.
        accumulate: ``out += decoded`` instead of ``out = decoded``.

    Returns:
        ``out`` if given, else a new fp32 tensor of ``numel`` elements.
    """
    level = unpack_bits(q, bits, numel).to(torch.float32) - levels
    decoded = (blocks_of(level, block) * scales.reshape(-1, 1).float()).view(-1)[:numel]
    return write_out(decoded, out, accumulate)


# ----------------------------------------------------------------------------- 1-bit sign


def sign_compress(
    x: torch.Tensor, block: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled sign: one bit per element (1 = non-negative) and per block the mean magnitude.

    Returns:
        ``(packed signs uint8 with 8 signs a byte, scales fp32 per block)``.
    """
    y = compensate(x, residual)
    numel = y.numel()
    blocks = blocks_of(y, block)
    counts = torch.full((blocks.shape[0],), float(block), device=y.device)
    if numel % block:
        counts[-1] = numel % block
    scales = blocks.abs().sum(dim=1) / counts
    # NaN has no sign: it must still decode to NaN, which its block's NaN scale ensures.
    positive = (blocks >= 0).view(-1)[:numel]
    decoded = torch.where(blocks >= 0, scales.unsqueeze(1), -scales.unsqueeze(1)).view(-1)[:numel]
    store_residual(residual, y, decoded)
    return pack_bits(positive.to(torch.uint8), 1), scales


def sign_decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Decode :func:`sign_compress`: ``scale * (+1 | -1)``."""
    signs = unpack_bits(packed, 1, numel).to(torch.float32) * 2 - 1
    decoded = (blocks_of(signs, block) * scales.reshape(-1, 1).float()).view(-1)[:numel]
    return write_out(decoded, out, accumulate)


# ----------------------------------------------------------------------------- payload rows
#
# The two-phase all-reduce moves one payload per chunk of a tensor: chunk j
# (elements j * chunk up to (j + 1) * chunk, the last chunk shorter) as row
# j of a 2-D uint8 tensor, in the wire format of gradcomp.payload: the
# payload's fp32 scales, then its codes, then zeros up to a multiple of
# ALIGN bytes; the rest of the row is left as it was. Backends write and
# read such rows with one kernel launch however many rows there are: the
# encoding of the whole tensor, the decoding of every chunk, and the sum of
# many ranks' payloads of one chunk. A chunk holds whole blocks, a block
# whole bytes of codes.

# Payload buffers are padded to ALIGN bytes, so that every tensor view inside
# a gathered buffer stays aligned for its dtype (int64 needs 8).
ALIGN = 8


def row_bounds(numel: int, chunk: int) -> list[tuple[int, int]]:
    """Element range of each non-empty row: ``chunk`` elements, the last one fewer."""
    return [(start, min(start + chunk, numel)) for start in range(0, numel, chunk)]


def write_rows(
    rows: torch.Tensor, codes, scales, numel: int, block: int, bits: int, chunk: int
) -> torch.Tensor:
    """The codes and scales of ``numel`` elements as one payload a chunk, in ``rows``."""
    for row, (start, end) in zip(rows, row_bounds(numel, chunk), strict=False):
        parts = [
            scales[start // block : math.ceil(end / block)],
            codes[start * bits // 8 : math.ceil(end * bits / 8)],
        ]
        offset = 0
        for part in parts:
            raw = part.view(torch.uint8)
            row[offset : offset + raw.numel()] = raw
            offset += raw.numel()
        row[offset : math.ceil(offset / ALIGN) * ALIGN].zero_()
    return rows


def read_row(row: torch.Tensor, block: int, bits: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of the payload of ``numel`` elements in ``row``."""
    blocks = math.ceil(numel / block)
    return row[4 * blocks : 4 * blocks + math.ceil(numel * bits / 8)], row[: 4 * blocks].view(torch.float32)


def decode_rows(rows, block: int, bits: int, chunk: int, out: torch.Tensor, decode) -> torch.Tensor:
    """Chunk ``j`` of ``out`` from row ``j``, by ``decode(codes, scales, numel, out, accumulate)``."""
    flat = out.view(-1)
    for row, (start, end) in zip(rows, row_bounds(flat.numel(), chunk), strict=False):
        decode(*read_row(row, block, bits, end - start), end - start, flat[start:end], False)
    return out


def decode_sum(rows, block: int, bits: int, out: torch.Tensor, divisor: int, decode) -> torch.Tensor:
    """``out`` = every row's payload decoded, added in fp32 in row order, divided, rounded once."""
    numel = out.numel()
    total = torch.zeros(numel, dtype=torch.float32, device=rows.device)
    for row in rows:
        decode(*read_row(row, block, bits, numel), numel, total, True)
    out.view(-1).copy_(divide(total, divisor) if divisor != 1 else total)
    return out


def quantize_rows(
    x: torch.Tensor,
    bits: int,
    block: int,
    chunk: int,
    rows: torch.Tensor,
    stochastic: bool = False,
    seed: int = 0,
    residual: torch.Tensor | None = None,
    *,
    levels: int | None = None,
    scale: str = "absmax",
) -> torch.Tensor:
    """:func:`quantize_blockwise` of ``x`` (one seed for the whole tensor), as one
    payload per chunk of ``chunk`` elements: chunk ``j`` in row ``j`` of ``rows``.
    Returns ``rows``."""
    codes, scales = quantize_blockwise(x, bits, block, stochastic, seed, residual, levels=levels, scale=scale)
    return write_rows(rows, codes, scales, x.numel(), block, bits, chunk)


def dequantize_rows(
    rows: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    chunk: int,
    out: torch.Tensor,
    *,
    levels: int | None = None,
) -> torch.Tensor:
    """Decode :func:`quantize_rows`: chunk ``j`` of ``out`` (any float dtype,
    ``numel`` elements) from row ``j``. Returns ``out``."""

    def decode(codes, scales, count, into, accumulate):
        dequantize_blockwise(codes, scales, bits, block, count, into, accumulate, levels=levels)

    decode_rows(rows, block, bits, chunk, out.view(-1)[:numel], decode)
    return out


def dequantize_sum(
    rows: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    out: torch.Tensor,
    *,
    levels: int | None = None,
    divisor: int = 1,
) -> torch.Tensor:
    """``out = (sum of the payloads of numel elements in every row, added in
    fp32 in row order) / divisor``, rounded once to ``out``'s dtype: what the
    ranks' compressed chunks add up to. Returns ``out``."""

    def decode(codes, scales, count, into, accumulate):
        dequantize_blockwise(codes, scales, bits, block, count, into, accumulate, levels=levels)

    decode_sum(rows, block, bits, out.view(-1)[:numel], divisor, decode)
    return out


def sign_compress_rows(
    x: torch.Tensor, block: int, chunk: int, rows: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`sign_compress` of ``x`` as one payload per chunk, as :func:`quantize_rows`."""
    signs, scales = sign_compress(x, block, residual)
    return write_rows(rows, signs, scales, x.numel(), block, 1, chunk)


def sign_decompress_rows(
    rows: torch.Tensor, block: int, numel: int, chunk: int, out: torch.Tensor
) -> torch.Tensor:
    """Decode :func:`sign_compress_rows`, as :func:`dequantize_rows`."""

    def decode(signs, scales, count, into, accumulate):
        sign_decompress(signs, scales, block, count, into, accumulate)

    decode_rows(rows, block, 1, chunk, out.view(-1)[:numel], decode)
    return out


def sign_decompress_sum(
    rows: torch.Tensor, block: int, numel: int, out: torch.Tensor, *, divisor: int = 1
) -> torch.Tensor:
    """The sum of sign payloads in rows, as :func:`dequantize_sum`."""

    def decode(signs, scales, count, into, accumulate):
        sign_decompress(signs, scales, block, count, into, accumulate)

    decode_sum(rows, block, 1, out.view(-1)[:numel], divisor, decode)
    return out


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
    sample_size = min(numel, max(4096, math.ceil(SAMPLE_HITS * numel / k)))
    if sample_size >= numel:
        return None
    return torch.randint(numel, (sample_size,), generator=generator(seed, device), device=device)


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
    """``out.view(-1)[indices] += values`` with repeated indices summed; returns ``out``.

    An index outside ``out`` raises here; the GPU kernels, which cannot raise
    without a host sync or a trap that ends the CUDA context, drop its value
    and make element 0 NaN instead."""
    flat = out.view(-1)
    flat.index_add_(0, indices.reshape(-1).long(), values.reshape(-1).to(flat.dtype))
    return out
