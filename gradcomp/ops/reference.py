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

The sparse ops (Top-K, random-K, scatter-add) are defined in
:mod:`gradcomp.ops.reference_sparse`, the block-scaled float formats (MXFP8,
MXFP4, NVFP4) in :mod:`gradcomp.ops.reference_mx` and these conventions'
helpers in :mod:`gradcomp.ops.reference_shared`; all are re-exported here.
"""

from __future__ import annotations

import math

import torch

from gradcomp.ops.reference_mx import (  # noqa: F401 - re-exported: the block-scaled ops
    mx_dequantize,
    mx_dequantize_sum,
    mx_quantize,
    nvfp4_dequantize,
    nvfp4_dequantize_sum,
    nvfp4_quantize,
)
from gradcomp.ops.reference_shared import (  # noqa: F401 - re-exported: every op's conventions
    INT32_LIMIT,
    blocks_of,
    code_bits,
    compensate,
    divide,
    generator,
    index_dtype_for,
    pack_bits,
    store_residual,
    unpack_bits,
    write_out,
)
from gradcomp.ops.reference_sparse import (  # noqa: F401 - re-exported: the sparse ops
    CANDIDATE_CAPACITY,
    CANDIDATE_REACH,
    FEISTEL_ROUNDS,
    HASH_MULTIPLIERS,
    SAMPLE_HITS,
    SMALLEST_MAGNITUDE,
    candidate_capacity,
    feistel_half_bits,
    feistel_keys,
    feistel_permute,
    keep_largest,
    randk_indices,
    randk_select,
    sample_positions,
    sample_size,
    sample_threshold,
    scatter_add,
    selection_magnitude,
    threshold_from_sample,
    topk_select,
    within_capacity,
)

# ----------------------------------------------------------------------------- trits


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
