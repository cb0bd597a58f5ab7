"""Torch reference of every gradcomp op: the definition of correct.

Every GPU implementation (Triton in ``gradcomp.kernels``, CUDA in ``csrc/``) is
tested against these functions. They run on any device torch supports and
perform error feedback unfused: ``y = x + residual; c = C(y); residual <- y - D(c)``.

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

import functools
import math
import sys
import threading
from collections.abc import Callable

import numpy as np
import torch

from gradcomp import streams

__all__ = [
    "code_bits",
    "candidate_capacity",
    "keep_largest",
    "feistel_permute",
    "sample_positions",
    "sample_threshold",
    "selection_magnitude",
    "threshold_from_sample",
    "store_residual",
    "write_out",
    "compensate",
    "dequantize_blockwise",
    "index_dtype_for",
    "pack_bits",
    "quantize_blockwise",
    "randk_indices",
    "randk_select",
    "remembered_indices",
    "scatter_add",
    "sign_compress",
    "sign_decompress",
    "topk_select",
    "unpack_bits",
]

INT32_LIMIT = 2**31 - 1


def _generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed) & (2**63 - 1))
    return generator


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


def compensate(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``x + residual`` in fp32, flattened (a fresh tensor: never aliases ``x``)."""
    if residual is None:
        return x.reshape(-1).to(torch.float32, copy=True)
    return torch.add(x.reshape(-1).float(), residual.reshape(-1).float())


def _compensate_in_residual(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """:func:`compensate`, computed in an fp32 ``residual`` itself (returned flat).

    For ops that rewrite the whole residual afterwards: it saves a
    tensor-sized temporary and a copy.
    """
    if residual is None or residual.dtype != torch.float32:
        return compensate(x, residual)
    flat = residual.view(-1)
    flat += x.reshape(-1)
    return flat


def store_residual(
    residual: torch.Tensor | None,
    y: torch.Tensor,
    decoded: torch.Tensor,
    scratch: torch.Tensor | None = None,
    finite: bool = False,
) -> None:
    """``residual <- y - decoded``, non-finite entries zeroed (a pass skipped
    when the caller knows the difference ``finite``).

    Written straight into an fp32 residual; any other residual dtype gets the
    fp32 error through ``scratch`` (default ``y``), which is overwritten.
    """
    if residual is None:
        return
    flat = residual.view(-1)
    target = flat if flat.dtype == torch.float32 else (y if scratch is None else scratch)
    torch.sub(y, decoded, out=target)
    if not finite:
        target.nan_to_num_(0.0, 0.0, 0.0)
    if target is not flat:
        flat.copy_(target)


def _read_on_cpu(flag: torch.Tensor) -> bool:
    """``bool(flag)`` on CPU, where reading it costs nothing; False on other
    devices, where it would be a host sync (callers then take the safe path)."""
    return flag.device.type == "cpu" and bool(flag)


def _blocks(y: torch.Tensor, block: int) -> torch.Tensor:
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
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes.clone()
    if bits == 1 and codes.device.type == "cpu":
        # numpy's packbits: ~15x faster than eight shifted ORs on CPU.
        return torch.from_numpy(np.packbits(codes.numpy(), bitorder="little"))
    per_byte = 8 // bits
    pad = (-codes.numel()) % per_byte
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    if _words_apply(codes):
        return _pack_words(codes, bits)
    return _pack_positions(codes, bits)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes as uint8."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    if bits == 8:
        return packed.reshape(-1)[:numel]
    packed = packed.reshape(-1)
    if bits == 1 and packed.device.type == "cpu":
        count = min(numel, 8 * packed.numel())
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=count, bitorder="little"))
    if _words_apply(packed):
        return _unpack_words(packed, bits)[:numel]
    return _unpack_positions(packed, bits)[:numel]


# 2- and 4-bit codes on CPU: the codes of one packed byte, read as one
# little-endian word (int32 or int16), are moved into place all at once by a
# few shifts and masks: contiguous ops, where one strided op per position
# costs 2.5-3x as much there.
_WORDS = {2: torch.int32, 4: torch.int16}


def _words_apply(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and sys.byteorder == "little"


def _pack_positions(codes: torch.Tensor, bits: int) -> torch.Tensor:
    grouped = codes.view(-1, 8 // bits)
    packed = grouped[:, 0].clone()
    for position in range(1, 8 // bits):
        packed |= grouped[:, position] << (position * bits)
    return packed


def _pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if not codes.is_contiguous() or codes.storage_offset() % (8 // bits):
        # A word view needs contiguous, word-aligned storage (a word is 8 // bits bytes).
        codes = codes.clone(memory_format=torch.contiguous_format)
    word, mask = codes.view(_WORDS[bits]), (1 << bits) - 1
    packed = word & mask
    for position in range(1, 8 // bits):
        # Code `position` sits at bit 8 * position; it goes to bits * position.
        moved = word >> ((8 - bits) * position)
        packed |= moved.bitwise_and_(mask << (bits * position))
    return packed.to(torch.uint8)


def _unpack_positions(packed: torch.Tensor, bits: int) -> torch.Tensor:
    codes = torch.empty(packed.numel(), 8 // bits, dtype=torch.uint8, device=packed.device)
    for position in range(8 // bits):
        torch.bitwise_and(packed >> (position * bits), (1 << bits) - 1, out=codes[:, position])
    return codes.view(-1)


def _unpack_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    word, mask = packed.to(_WORDS[bits]), (1 << bits) - 1
    codes = word & mask
    for position in range(1, 8 // bits):
        moved = word << ((8 - bits) * position)
        codes |= moved.bitwise_and_(mask << (8 * position))
    return codes.view(torch.uint8)


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
    ``q + levels`` are packed ``bits`` wide.

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
    levels = levels if levels is not None else 2 ** (bits - 1) - 1
    if levels < 1:
        raise ValueError(f"levels must be at least 1 (bits={bits} without levels gives {levels})")
    if code_bits(levels) > bits:
        raise ValueError(f"{bits} bits cannot hold levels={levels}")
    if scale not in ("absmax", "norm"):
        raise ValueError(f"scale must be 'absmax' or 'norm', got {scale!r}")
    x = x.reshape(-1)
    numel = x.numel()
    packed = torch.empty(math.ceil(numel * bits / 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(math.ceil(numel / block), dtype=torch.float32, device=x.device)
    generator = _generator(seed, x.device) if stochastic else None
    for start, end in chunks(numel, block, x.device):
        part_residual = None if residual is None else residual.view(-1)[start:end]
        _quantize_part(
            compensate(x[start:end], part_residual),
            part_residual,
            bits,
            block,
            levels,
            scale,
            generator,
            packed[start * bits // 8 : math.ceil(end * bits / 8)],
            scales[start // block : math.ceil(end / block)],
        )
    return packed, scales


def _quantize_part(
    y: torch.Tensor,
    residual: torch.Tensor | None,
    bits: int,
    block: int,
    levels: int,
    scale: str,
    generator: torch.Generator | None,
    packed: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """:func:`quantize_blockwise` of the compensated ``y`` into ``packed`` and ``scales``."""
    numel = y.numel()
    blocks = _blocks(y, block)
    if scale == "absmax":
        # amax propagates NaN, so a block holding NaN gets a NaN scale.
        magnitude = blocks.abs().amax(dim=1)
    else:
        # Scale by the absmax first: squaring values above ~1.8e19 overflows fp32.
        peak = blocks.abs().amax(dim=1, keepdim=True)
        safe_peak = torch.where(peak > 0, peak, torch.ones_like(peak))
        magnitude = (blocks / safe_peak).norm(dim=1) * peak.squeeze(1)
    torch.div(magnitude, levels, out=scales)
    # Every scale finite, and far enough below the largest float that
    # level * scale cannot round past it: every element is finite, and so are
    # the levels, the decoded values and the error (a level never has the
    # opposite sign of its element), so two nan_to_num passes go. (amax
    # propagates NaN.)
    finite = _read_on_cpu(torch.isfinite(scales.amax() * (2 * levels)))
    if not finite:
        _keep_top_level_finite(scales, levels)
    # All-zero blocks keep scale 0 and codes of level 0; inf/NaN blocks keep a
    # non-finite scale so that they decode to non-finite values.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    level = blocks / divisor
    if generator is not None:
        level += torch.rand(level.shape, generator=generator, device=y.device)
        level.floor_()
    else:
        level.round_()
    if not finite:
        level.nan_to_num_(0.0, 0.0, 0.0)
    level.clamp_(-levels, levels)
    # Codes level + levels, made in bytes: levels <= 127 fits int8 exactly and
    # the uint8 add wraps the negative ones into place.
    if bits == 8:
        packed.view(torch.int8).copy_(level.view(-1)[:numel])
        packed.add_(levels)
    else:
        codes = level.view(-1)[:numel].to(torch.int8).view(torch.uint8).add_(levels)
        packed.copy_(pack_bits(codes, bits))
    if residual is not None:
        # In place (fresh buffers cost page faults): level becomes the decoded value.
        decoded = level.mul_(scales.unsqueeze(1)).view(-1)[:numel]
        store_residual(residual, blocks.view(-1)[:numel], decoded, scratch=decoded, finite=finite)


def _keep_top_level_finite(scales: torch.Tensor, levels: int) -> None:
    """Step a finite scale down one ulp where ``levels * scale`` rounds past the
    largest float (int8: ``127 * (max / 127)`` does), so that every level of
    a finite block decodes to a finite value. One ulp is enough: the scale is
    within half an ulp of ``peak / levels``."""
    over = torch.isfinite(scales) & ~torch.isfinite(scales * levels)
    scales.view(torch.int32)[over] -= 1  # positive floats: the next one down


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
    levels = levels if levels is not None else 2 ** (bits - 1) - 1
    target = torch.empty(numel, dtype=torch.float32, device=q.device) if out is None else out
    q, scales, flat = q.reshape(-1), scales.reshape(-1), target.view(-1)
    for start, end in chunks(numel, block, q.device):
        codes = unpack_bits(q[start * bits // 8 : math.ceil(end * bits / 8)], bits, end - start)
        # The signed levels, made in bytes (the uint8 subtraction wraps into int8).
        level = _blocks(torch.sub(codes, levels).view(torch.int8).to(torch.float32), block)
        _scale_out(level, scales[start // block : math.ceil(end / block)], flat[start:end], accumulate)
    return target


def _scale_out(level: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= level * scale`` per block; ``level`` is ``(blocks, block)``, overwritten."""
    column = scales.float().unsqueeze(1)
    numel = out.numel()
    if not accumulate and out.dtype == torch.float32 and level.numel() == numel:
        torch.mul(level, column, out=out.view(level.shape))
        return
    write_out(level.mul_(column).view(-1)[:numel], out, accumulate)


def write_out(decoded: torch.Tensor, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
    if out is None:
        return decoded
    flat = out.view(-1)
    if not accumulate:
        flat.copy_(decoded)
    elif torch.promote_types(decoded.dtype, flat.dtype) == flat.dtype:
        flat += decoded  # widened exactly, then added: no temporary
    else:
        flat += decoded.to(flat.dtype)
    return out


# On CPU, long tensors are worked through a chunk at a time: the temporaries
# of one chunk (512 KB each at 2**17 fp32 elements) stay in a core's L2
# between the passes over them and are reused by the allocator, where
# tensor-sized ones cost a page fault per page. Against 2**20, on 16.8M
# elements, calls interleaved in one process: int8 quantization with
# feedback 20% faster, int4 10%, sign 6%, Top-K 7%; 2**16 was no faster and
# adds per-chunk overhead. Blocks never straddle chunks, so the results are
# those of one pass over the whole tensor, which is what other devices get
# (there chunks would only add launches and, for Top-K, host syncs).
CHUNK_ELEMENTS = 2**17


def chunks(numel: int, block: int, device: torch.device) -> list[tuple[int, int]]:
    """Element ranges covering ``numel``: whole blocks, whole bytes of codes."""
    if device.type != "cpu":
        return [(0, numel)] if numel else []
    unit = math.lcm(block, 8)
    step = max(1, CHUNK_ELEMENTS // unit) * unit
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


# ----------------------------------------------------------------------------- 1-bit sign


def sign_compress(
    x: torch.Tensor, block: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled sign: one bit per element (1 = non-negative) and per block the mean magnitude.

    Returns:
        ``(packed signs uint8 with 8 signs a byte, scales fp32 per block)``.
    """
    x = x.reshape(-1)
    numel = x.numel()
    packed = torch.empty(math.ceil(numel / 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(math.ceil(numel / block), dtype=torch.float32, device=x.device)
    for start, end in chunks(numel, block, x.device):
        part_residual = None if residual is None else residual.view(-1)[start:end]
        part = end - start
        blocks = _blocks(compensate(x[start:end], part_residual), block)
        counts = torch.full((blocks.shape[0],), float(block), device=x.device)
        if part % block:
            counts[-1] = part % block
        part_scales = scales[start // block : math.ceil(end / block)]
        torch.div(blocks.abs().sum(dim=1), counts, out=part_scales)
        # NaN has no sign: it must still decode to NaN, which its block's NaN scale ensures.
        positive = _non_negative(blocks)
        packed[start // 8 : math.ceil(end / 8)] = pack_bits(positive.view(-1)[:part].view(torch.uint8), 1)
        if part_residual is not None:
            signs = positive.view(torch.uint8).to(torch.float32).mul_(2).sub_(1)
            decoded = signs.mul_(part_scales.unsqueeze(1)).view(-1)[:part]
            # As in quantization: finite scales, finite error (same signs).
            finite = _read_on_cpu(torch.isfinite(part_scales).all())
            store_residual(part_residual, blocks.view(-1)[:part], decoded, scratch=decoded, finite=finite)
    return packed, scales


def _non_negative(y: torch.Tensor) -> torch.Tensor:
    """``y >= 0`` (False for NaN), through numpy on CPU, where torch's
    comparison into a bool tensor is about ten times slower."""
    if y.device.type != "cpu":
        return y >= 0
    return torch.from_numpy(np.greater_equal(y.numpy(), 0))


def sign_decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Decode :func:`sign_compress`: ``scale * (+1 | -1)``."""
    target = torch.empty(numel, dtype=torch.float32, device=packed.device) if out is None else out
    packed, scales, flat = packed.reshape(-1), scales.reshape(-1), target.view(-1)
    for start, end in chunks(numel, block, packed.device):
        signs = unpack_bits(packed[start // 8 : math.ceil(end / 8)], 1, end - start)
        level = _blocks(signs.to(torch.float32).mul_(2).sub_(1), block)
        _scale_out(level, scales[start // block : math.ceil(end / block)], flat[start:end], accumulate)
    return target


# ----------------------------------------------------------------------------- payload rows
#
# The two-phase all-reduce moves one payload per chunk of a tensor: chunk j
# (elements j * chunk up to (j + 1) * chunk, the last chunk shorter) as row
# j of a 2-D uint8 tensor, in the wire format of gradcomp.payload: the
# payload's fp32 scales, then its codes, then zeros up to a multiple of
# ALIGN bytes; the rest of the row is left as it was. The row ops write and
# read such rows with one kernel launch however many rows there are: the
# encoding of the whole tensor, the decoding of every chunk, and the sum of
# many ranks' payloads of one chunk.

# Payload buffers are padded to ALIGN bytes, so that every tensor view inside
# a gathered buffer stays aligned for its dtype (int64 needs 8).
ALIGN = 8


def row_bounds(numel: int, chunk: int) -> list[tuple[int, int]]:
    """Element range of each non-empty row: ``chunk`` elements, the last one fewer."""
    return [(start, min(start + chunk, numel)) for start in range(0, numel, chunk)]


def _check_rows(rows: torch.Tensor, block: int, bits: int, chunk: int | None = None) -> None:
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1 or rows.stride(0) % ALIGN:
        raise ValueError(
            f"rows must be 2-D uint8, rows a multiple of {ALIGN} bytes apart; got {tuple(rows.shape)}"
        )
    if (block * bits) % 8 or (chunk is not None and chunk % block):
        raise ValueError(
            f"rows hold whole blocks of whole bytes: block {block}, {bits}-bit codes, chunk {chunk}"
        )


def _write_rows(rows: torch.Tensor, codes, scales, numel: int, block: int, bits: int, chunk: int) -> None:
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


def _read_row(row: torch.Tensor, block: int, bits: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of the payload of ``numel`` elements in ``row``."""
    blocks = math.ceil(numel / block)
    return row[4 * blocks : 4 * blocks + math.ceil(numel * bits / 8)], row[: 4 * blocks].view(torch.float32)


def _decode_rows(
    rows, block: int, bits: int, numel: int, chunk: int, out: torch.Tensor, decode
) -> torch.Tensor:
    flat = out.view(-1)
    for row, (start, end) in zip(rows, row_bounds(numel, chunk), strict=False):
        decode(*_read_row(row, block, bits, end - start), end - start, flat[start:end], False)
    return out


def _decode_sum(
    rows, block: int, bits: int, numel: int, out: torch.Tensor, divisor: int, decode
) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.float32, device=rows.device)
    for row in rows:
        decode(*_read_row(row, block, bits, numel), numel, total, True)
    if divisor != 1:
        total /= divisor
    out.view(-1).copy_(total)
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
    payload per chunk of ``chunk`` elements: chunk ``j`` in row ``j`` of ``rows``
    (see above). ``chunk`` is a multiple of ``block``, a block whole bytes of
    codes. Returns ``rows``."""
    _check_rows(rows, block, bits, chunk)
    codes, scales = quantize_blockwise(x, bits, block, stochastic, seed, residual, levels=levels, scale=scale)
    _write_rows(rows, codes, scales, x.numel(), block, bits, chunk)
    return rows


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
    _check_rows(rows, block, bits, chunk)

    def decode(codes, scales, count, into, accumulate):
        dequantize_blockwise(codes, scales, bits, block, count, into, accumulate, levels=levels)

    return _decode_rows(rows, block, bits, numel, chunk, out, decode)


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
    _check_rows(rows, block, bits)

    def decode(codes, scales, count, into, accumulate):
        dequantize_blockwise(codes, scales, bits, block, count, into, accumulate, levels=levels)

    return _decode_sum(rows, block, bits, numel, out, divisor, decode)


def sign_compress_rows(
    x: torch.Tensor, block: int, chunk: int, rows: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`sign_compress` of ``x`` as one payload per chunk, as :func:`quantize_rows`."""
    _check_rows(rows, block, 1, chunk)
    signs, scales = sign_compress(x, block, residual)
    _write_rows(rows, signs, scales, x.numel(), block, 1, chunk)
    return rows


def sign_decompress_rows(
    rows: torch.Tensor, block: int, numel: int, chunk: int, out: torch.Tensor
) -> torch.Tensor:
    """Decode :func:`sign_compress_rows`, as :func:`dequantize_rows`."""
    _check_rows(rows, block, 1, chunk)

    def decode(signs, scales, count, into, accumulate):
        sign_decompress(signs, scales, block, count, into, accumulate)

    return _decode_rows(rows, block, 1, numel, chunk, out, decode)


def sign_decompress_sum(
    rows: torch.Tensor, block: int, numel: int, out: torch.Tensor, *, divisor: int = 1
) -> torch.Tensor:
    """The sum of sign payloads in rows, as :func:`dequantize_sum`."""
    _check_rows(rows, block, 1)

    def decode(signs, scales, count, into, accumulate):
        sign_decompress(signs, scales, block, count, into, accumulate)

    return _decode_sum(rows, block, 1, numel, out, divisor, decode)


# ----------------------------------------------------------------------------- sparsification


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
# ones. Gathering the sample costs about 30 ns an element on CPU, the
# largest cost after the selection pass.
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
    return torch.randint(numel, (sample_size,), generator=_generator(seed, device), device=device)


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
    sample = x.float() if picks is None else x[picks].float()
    if residual is not None:
        residual = residual.reshape(-1)
        sample = sample + (residual.float() if picks is None else residual[picks].float())
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


def _sampled_top_k(x, residual, y, pending, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (ascending) and values in ``y`` of the sampling path's picks, before padding.

    ``y`` is ``x + residual``, or will be once ``pending`` is added."""
    # Read before the residual is touched: the same bits as y's samples.
    threshold = sample_threshold(x, residual, k, seed)
    candidates = _reaching(y, threshold, pending)
    picked = y.index_select(0, candidates)  # on CPU much faster than y[candidates]
    magnitude = selection_magnitude(picked)
    capacity = candidate_capacity(k)
    if candidates.numel() > capacity:
        ranked = _within_capacity(magnitude > threshold, capacity)
        candidates, picked, magnitude = candidates[ranked], picked[ranked], magnitude[ranked]
    if candidates.numel() <= k:
        return candidates, picked
    kept = keep_largest(magnitude, k)
    return candidates[kept], picked[kept]


def _within_capacity(above: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which of the candidates (in index order; ``above`` the threshold or
    equal to it) are ranked: those above it first, then those equal, each in
    index order, ``capacity`` in all."""
    above_before = above.cumsum(0) - above.long()
    equal_before = (~above).cumsum(0) - (~above).long()
    room_for_equal = capacity - min(int(above.sum()), capacity)
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
        indices (then the padding) in the sampling path, int32 unless
        ``numel`` needs int64 (or ``index_dtype`` says otherwise). The residual
        keeps what rounding to ``value_dtype`` lost.
    """
    numel = x.numel()
    if not 0 < k <= numel:
        raise ValueError(f"k must be in [1, {numel}], got {k}")
    index_dtype = index_dtype or index_dtype_for(numel)
    # y = x + residual. An fp32 residual becomes y in place, lazily: the
    # sampling path adds x a chunk at a time inside the selection loop.
    if residual is not None and residual.dtype == torch.float32:
        y, pending = residual.view(-1), x.reshape(-1)
    else:
        y, pending = compensate(x, residual), None
    if exact or k == numel:
        if pending is not None:
            y += pending
        indices = torch.topk(selection_magnitude(y), k, sorted=False).indices
        picked = y.index_select(0, indices)
    else:
        indices, picked = _sampled_top_k(x, residual, y, pending, k, seed)
    values = picked.to(value_dtype)
    # Every selection takes inf and NaN first (up to k of them), so y has a
    # non-finite entry outside the picks only if a pick is non-finite.
    clean = residual is not None and bool(torch.isfinite(picked).all())
    _keep_unsent(residual, y, indices, picked - values.float(), finite=clean)
    if indices.numel() < k:
        padding = k - indices.numel()
        values = torch.cat([values, values.new_zeros(padding)])
        indices = torch.cat([indices, indices.new_zeros(padding)])
    return values, indices.to(index_dtype)


def _reaching(y: torch.Tensor, threshold: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor:
    """Ascending indices (int64) where :func:`selection_magnitude` of ``y`` reaches ``threshold``.

    With ``pending``, ``y += pending`` first (in the same chunk loop on CPU).
    On CPU a chunk at a time, in numpy, on the bit patterns: for floats of
    either sign, ``bits & 0x7FFFFFFF`` orders as ``|y|`` does, inf included,
    and NaN's patterns lie above inf's, so NaN reaches every threshold, as
    in :func:`selection_magnitude`. Two integer passes and no temporaries
    instead of abs, nan_to_num and a float compare.
    """
    if y.device.type != "cpu":
        if pending is not None:
            y += pending
        return torch.nonzero(selection_magnitude(y) >= threshold).view(-1)
    bound = int(np.float32(threshold.item()).view(np.int32))
    pieces = chunks(y.numel(), 1, y.device)
    size = max(end - start for start, end in pieces)
    bits, mask = np.empty(size, np.int32), np.empty(size, np.bool_)
    patterns = y.numpy().view(np.int32)
    found = []
    for start, end in pieces:
        if pending is not None:
            y[start:end] += pending[start:end]
        n = end - start
        np.bitwise_and(patterns[start:end], 0x7FFFFFFF, out=bits[:n])
        np.greater_equal(bits[:n], bound, out=mask[:n])
        found.append(np.flatnonzero(mask[:n]) + start)
    return torch.from_numpy(found[0] if len(found) == 1 else np.concatenate(found))


def _keep_unsent(
    residual: torch.Tensor | None,
    y: torch.Tensor,
    indices: torch.Tensor,
    lost: torch.Tensor,
    finite: bool = False,
) -> None:
    """Residual of a sparse send: ``y`` where nothing was sent, ``lost`` at ``indices``.
    Consumes ``y`` (non-finite entries zeroed in place, a pass skipped when
    the caller knows them ``finite``)."""
    if residual is None:
        return
    flat = residual.view(-1)
    if not finite:
        y.nan_to_num_(0.0, 0.0, 0.0)
    if y.data_ptr() != flat.data_ptr():  # else y is the residual already
        flat.copy_(y)
    flat[indices] = lost.nan_to_num(0.0, 0.0, 0.0).to(flat.dtype)


# Random-K indices: the first k outputs of a pseudo-random permutation of
# [0, numel) keyed by the seed -- a 4-round Feistel network on 2h bits
# (2**(2h) >= numel), cycle-walked back into range. Counter-based, O(k), and
# integer-exact, so the Triton kernel reproduces it bit for bit.
FEISTEL_ROUNDS = 4
_HASH_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)  # odd, below 2**31: products stay inside int64


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
    value = (value * _HASH_MULTIPLIERS[0]) & 0xFFFFFFFF
    value = value ^ (value >> 15)
    value = (value * _HASH_MULTIPLIERS[1]) & 0xFFFFFFFF
    return value ^ (value >> 16)


def feistel_permute(x: torch.Tensor, half_bits: int, keys: list[int]) -> torch.Tensor:
    """One pass of the keyed permutation of [0, 2**(2 * half_bits)) (int64 in and out)."""
    mask = (1 << half_bits) - 1
    left, right = x >> half_bits, x & mask
    for key in keys:
        left, right = right, left ^ (_hash32(right ^ key) & mask)
    return (left << half_bits) | right


def _feistel_permute_numpy(x: np.ndarray, half_bits: int, keys: list[int]) -> np.ndarray:
    """:func:`feistel_permute` on uint64 arrays, the halves in uint32, whose
    products wrap modulo 2**32 as ``& 0xFFFFFFFF`` makes them there."""
    mask = np.uint32((1 << half_bits) - 1)
    left = (x >> np.uint64(half_bits)).astype(np.uint32)
    right = (x & np.uint64(mask)).astype(np.uint32)
    for key in keys:
        value = right ^ np.uint32(key)
        value ^= value >> np.uint32(16)
        value *= np.uint32(_HASH_MULTIPLIERS[0])
        value ^= value >> np.uint32(15)
        value *= np.uint32(_HASH_MULTIPLIERS[1])
        value ^= value >> np.uint32(16)
        value &= mask
        value ^= left
        left, right = right, value
    return (left.astype(np.uint64) << np.uint64(half_bits)) | right


def _walk_torch(numel: int, k: int, half_bits: int, keys: list[int], device: torch.device) -> torch.Tensor:
    """The first ``k`` outputs of the permutation, each walked back into
    ``[0, numel)``, ascending (int64 on ``device``)."""
    chosen = feistel_permute(torch.arange(k, dtype=torch.int64, device=device), half_bits, keys)
    outside = chosen >= numel
    while bool(outside.any()):
        chosen[outside] = feistel_permute(chosen[outside], half_bits, keys)
        outside = chosen >= numel
    return chosen.sort().values


def _walk_numpy(numel: int, k: int, half_bits: int, keys: list[int]) -> torch.Tensor:
    """:func:`_walk_torch` on CPU: each walk takes only the entries still out
    of range, in numpy, where an op on a few elements costs a microsecond, not
    the ten of a torch op (the walk takes about 20 rounds)."""
    chosen = _feistel_permute_numpy(np.arange(k, dtype=np.uint64), half_bits, keys)
    pending = np.flatnonzero(chosen >= numel)
    while pending.size:
        moved = _feistel_permute_numpy(chosen[pending], half_bits, keys)
        chosen[pending] = moved
        pending = pending[moved >= numel]
    chosen = chosen.astype(np.int64)
    chosen.sort()
    return torch.from_numpy(chosen)


def randk_indices(numel: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``k`` distinct ascending indices in ``[0, numel)`` that ``seed`` picks (int64).

    Every rank (and every backend) that passes the same seed gets the same
    indices, so random-K payloads can be summed with a plain all-reduce.
    """
    if not 0 < k <= numel:
        raise ValueError(f"k must be in [1, {numel}], got {k}")
    device = torch.device(device)
    half_bits, keys = feistel_half_bits(numel), feistel_keys(seed)
    if device.type == "cpu":
        walk = functools.partial(_walk_numpy, numel, k, half_bits, keys)
    else:
        walk = functools.partial(_walk_torch, numel, k, half_bits, keys, device)
    return remembered_indices("torch", numel, k, seed, device, walk)


def remembered_indices(
    backend: str, numel: int, k: int, seed: int, device: torch.device, compute: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """A copy of ``backend``'s random-K indices for these arguments: ``compute()``
    unless they are among the last few asked for.

    A payload is encoded and then decoded with the same seed (the all-reduce
    decodes the sum right away), and computing the indices costs more than a
    pass over the tensor. Kept per backend, so that no backend hands out what
    another computed, and per stream, so that no stream reads indices another
    stream may still be computing (threads share this cache)."""
    key = (backend, numel, k, seed, device, streams.current_stream_id(device))
    with _RECENT_INDICES_LOCK:
        cached = _RECENT_INDICES.get(key)
    if cached is not None:
        return cached.clone()
    chosen = compute()
    with _RECENT_INDICES_LOCK:
        _RECENT_INDICES[key] = chosen
        while len(_RECENT_INDICES) > RECENT_INDICES:
            _RECENT_INDICES.pop(next(iter(_RECENT_INDICES)))
    return chosen.clone()


RECENT_INDICES = 2
_RECENT_INDICES: dict[tuple, torch.Tensor] = {}
_RECENT_INDICES_LOCK = threading.Lock()


def randk_select(
    x: torch.Tensor,
    k: int,
    seed: int,
    residual: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    value_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Values of ``(x + residual) * scale`` at :func:`randk_indices` in ``value_dtype``.

    The residual keeps ``y - sent`` at the picked indices (zero unless
    ``scale != 1`` or rounding to ``value_dtype`` lost something) and ``y``
    elsewhere.

    If any entry of ``x + residual`` is inf or NaN, the first value becomes
    NaN, so a non-finite gradient is never hidden by not being picked.
    """
    indices = randk_indices(x.numel(), k, seed, x.device)
    y = _compensate_in_residual(x, residual)
    picked = y[indices]
    scaled = picked * scale
    # No host sync: adds NaN to the first value exactly when y holds inf or NaN.
    # (min and max propagate NaN: both are finite exactly when every entry is.)
    finite = torch.isfinite(torch.stack(torch.aminmax(y))).all()
    scaled[:1] += torch.where(finite, 0.0, math.nan)
    values = scaled.to(value_dtype)
    # Known finite: the residual's nan_to_num pass goes.
    clean = residual is not None and _read_on_cpu(finite)
    _keep_unsent(residual, y, indices, picked - values.float(), finite=clean)
    return values


def scatter_add(indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out.view(-1)[indices] += values`` with repeated indices summed; returns ``out``.

    An index outside ``out`` raises here; the GPU kernels, which cannot raise
    without a host sync or a trap that ends the CUDA context, drop its value
    and make element 0 NaN instead."""
    flat = out.view(-1)
    flat.index_add_(0, indices.long(), values.to(flat.dtype))
    return out
