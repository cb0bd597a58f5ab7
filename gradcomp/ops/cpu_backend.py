"""The CPU backend: every op of :mod:`gradcomp.ops.reference`, fast on CPU tensors.

The same bits as the reference (tested against it), computed in ways that
pay on a CPU and would not elsewhere:

* long tensors are worked through a chunk at a time
  (:func:`gradcomp.ops.cpu_shared.chunks`), so that a chunk's temporaries
  stay in a core's L2 and are reused;
* small ones go through numpy (:mod:`gradcomp.ops.cpu_small`), where an
  operation costs a fraction of a torch op's dispatch;
* compare-and-pack and bit tricks run in numpy, where torch's ops into
  bool tensors or one strided op per position cost several times as much;
* a residual of fp32 becomes ``x + residual`` in place, and passes that
  only clean non-finite values are skipped when every value is known
  finite (on a CPU, reading a flag costs nothing).

The sparse ops (Top-K, random-K) are in :mod:`gradcomp.ops.cpu_sparse`, bit
packing in :mod:`gradcomp.ops.cpu_packing`; :data:`FUNCTIONS` lists them all.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gradcomp.ops import cpu_shared, cpu_small, reference
from gradcomp.ops.cpu_packing import pack_bits, unpack_bits
from gradcomp.ops.cpu_shared import chunks, compensate_in_residual, known, sliced, store_residual
from gradcomp.ops.cpu_sparse import randk_indices, randk_select, topk_select
from gradcomp.ops.reference import blocks_of, compensate, write_out


def is_available(device: torch.device) -> bool:
    """CPU tensors only."""
    return torch.device(device).type == "cpu"


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
    """Reference: :func:`gradcomp.ops.reference.quantize_blockwise`."""
    x = x.reshape(-1)
    numel = x.numel()
    packed = torch.empty(math.ceil(numel * bits / 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(math.ceil(numel / block), dtype=torch.float32, device=x.device)
    _quantize_into(x, bits, block, stochastic, seed, residual, levels, scale, packed, scales)
    return packed, scales


def _quantize_into(x, bits, block, stochastic, seed, residual, levels, scale, packed, scales) -> None:
    """:func:`quantize_blockwise` of the flat ``x`` into ``packed`` and ``scales``."""
    numel = x.numel()
    generator = reference.generator(seed, x.device) if stochastic else None
    flat_residual = None if residual is None else residual.view(-1)
    for start, end in chunks(numel, block):
        part_residual = sliced(flat_residual, start, end, numel)
        _quantize_part(
            compensate_in_residual(sliced(x, start, end, numel), part_residual),
            part_residual,
            bits,
            block,
            levels,
            scale,
            generator,
            sliced(packed, start * bits // 8, math.ceil(end * bits / 8), packed.numel()),
            sliced(scales, start // block, math.ceil(end / block), scales.numel()),
        )


# 2**128 - 2**103, halfway between the largest float and 2**128: a float32 product
# whose exact value (computed exactly in float64) lies below it rounds to a finite
# float32, and one at or above it (or NaN) does not.
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


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
    small = generator is None and scale == "absmax"
    if small and cpu_small.quantize(y, residual, bits, block, levels, _FLOAT32_OVERFLOW, packed, scales):
        return
    numel = y.numel()
    blocks = blocks_of(y, block)
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
    # propagates NaN.) Whether ``scales.amax() * (2 * levels)`` is finite in
    # float32, read from its exact value: one kernel fewer than computing it.
    finite = float(scales.amax()) * (2 * levels) < _FLOAT32_OVERFLOW
    if not finite:
        _keep_top_level_finite(scales, levels)
    # All-zero blocks keep scale 0 and codes of level 0; inf/NaN blocks keep a
    # non-finite scale so that they decode to non-finite values.
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
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
    """Reference: :func:`gradcomp.ops.reference.dequantize_blockwise`."""
    target = torch.empty(numel, dtype=torch.float32, device=q.device) if out is None else out
    q, scales, flat = q.reshape(-1), scales.reshape(-1), target.view(-1)
    for start, end in chunks(numel, block):
        codes = unpack_bits(q[start * bits // 8 : math.ceil(end * bits / 8)], bits, end - start)
        # The signed levels, made in bytes (the uint8 subtraction wraps into int8).
        level = blocks_of(torch.sub(codes, levels).view(torch.int8).to(torch.float32), block)
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


# ----------------------------------------------------------------------------- 1-bit sign


def sign_compress(
    x: torch.Tensor, block: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: :func:`gradcomp.ops.reference.sign_compress`."""
    x = x.reshape(-1)
    numel = x.numel()
    packed = torch.empty(math.ceil(numel / 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(math.ceil(numel / block), dtype=torch.float32, device=x.device)
    for start, end in chunks(numel, block):
        part_residual = None if residual is None else residual.view(-1)[start:end]
        part = end - start
        blocks = blocks_of(compensate(x[start:end], part_residual), block)
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
            finite = known(torch.isfinite(part_scales).all())
            store_residual(part_residual, blocks.view(-1)[:part], decoded, scratch=decoded, finite=finite)
    return packed, scales


def _non_negative(y: torch.Tensor) -> torch.Tensor:
    """``y >= 0`` (False for NaN), through numpy, where torch's comparison
    into a bool tensor is several times slower."""
    return torch.from_numpy(np.greater_equal(y.numpy(), 0))


def sign_decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Reference: :func:`gradcomp.ops.reference.sign_decompress`."""
    target = torch.empty(numel, dtype=torch.float32, device=packed.device) if out is None else out
    packed, scales, flat = packed.reshape(-1), scales.reshape(-1), target.view(-1)
    for start, end in chunks(numel, block):
        signs = unpack_bits(packed[start // 8 : math.ceil(end / 8)], 1, end - start)
        level = blocks_of(signs.to(torch.float32).mul_(2).sub_(1), block)
        _scale_out(level, scales[start // block : math.ceil(end / block)], flat[start:end], accumulate)
    return target


# ----------------------------------------------------------------------------- payload rows


def quantize_rows(
    x, bits, block, chunk, rows, stochastic=False, seed=0, residual=None, *, levels=None, scale="absmax"
):
    """:func:`gradcomp.ops.reference.quantize_rows`, encoded by this backend; one
    payload (the collectives' one-row lane) straight into its row."""
    x = x.reshape(-1)
    numel = x.numel()
    if rows.shape[0] == 1 and 0 < numel <= chunk and rows.data_ptr() % 4 == 0:
        row = rows[0]
        scale_bytes, code_bytes = 4 * math.ceil(numel / block), math.ceil(numel * bits / 8)
        end = scale_bytes + code_bytes
        scales, packed = row[:scale_bytes].view(torch.float32), row[scale_bytes:end]
        _quantize_into(x, bits, block, stochastic, seed, residual, levels, scale, packed, scales)
        row[end : math.ceil(end / reference.ALIGN) * reference.ALIGN].zero_()  # as write_rows pads
        return rows
    codes, scales = quantize_blockwise(x, bits, block, stochastic, seed, residual, levels=levels, scale=scale)
    return reference.write_rows(rows, codes, scales, numel, block, bits, chunk)


def _dequantizer(bits: int, block: int, levels: int):
    def decode(codes, scales, count, into, accumulate):
        dequantize_blockwise(codes, scales, bits, block, count, into, accumulate, levels=levels)

    return decode


def dequantize_rows(rows, bits, block, numel, chunk, out, *, levels=None):
    """:func:`gradcomp.ops.reference.dequantize_rows`, decoded by this backend."""
    reference.decode_rows(rows, block, bits, chunk, out.view(-1)[:numel], _dequantizer(bits, block, levels))
    return out


def _decode_sum(rows, block: int, bits: int, out: torch.Tensor, divisor: int, decode) -> None:
    """:func:`gradcomp.ops.reference.decode_sum`'s bits; an fp32 ``out`` is the
    accumulator itself (tensor-sized temporaries cost a page fault a page)."""
    if out.dtype != torch.float32:
        reference.decode_sum(rows, block, bits, out, divisor, decode)
        return
    numel = out.numel()
    out.zero_()
    for row in rows:
        decode(*reference.read_row(row, block, bits, numel), numel, out, True)
    if divisor != 1:
        out.div_(divisor)


def dequantize_sum(rows, bits, block, numel, out, *, levels=None, divisor=1):
    """:func:`gradcomp.ops.reference.dequantize_sum`, decoded by this backend."""
    flat = sliced(out.view(-1), 0, numel, out.numel())
    if flat.dtype == torch.float32:
        _dequantize_rows_sum(rows, bits, block, levels, flat, divisor)
    else:
        _decode_sum(rows, block, bits, flat, divisor, _dequantizer(bits, block, levels))
    return out


def _dequantize_rows_sum(rows, bits: int, block: int, levels: int, out: torch.Tensor, divisor: int) -> None:
    """:func:`dequantize_sum` into an fp32 ``out``: every row's chunk decoded at once
    (a chunk of all of them stays in L2), then added in row order."""
    if cpu_small.dequantize_sum(rows, bits, block, levels, out, divisor):
        return
    numel, count = out.numel(), rows.shape[0]
    blocks = math.ceil(numel / block)
    scales = rows[:, : 4 * blocks].view(torch.float32)
    codes = rows[:, 4 * blocks : 4 * blocks + math.ceil(numel * bits / 8)]
    out.zero_()
    if count == 0:  # the sum of no payloads
        return
    for start, end in chunks(numel, block, max(1, cpu_shared.CHUNK_ELEMENTS // count)):
        part = codes[:, start * bits // 8 : math.ceil(end * bits / 8)]
        if bits != 8:
            part = unpack_bits(part.reshape(-1), bits, part.numel() * (8 // bits)).view(count, -1)
        # The signed levels, made in bytes (the uint8 subtraction wraps into int8).
        level = torch.sub(part, levels).view(torch.int8).to(torch.float32)
        size, whole = end - start, math.ceil((end - start) / block)
        if level.shape[1] != whole * block:  # the last block's padding, or codes past the end
            level = torch.nn.functional.pad(level[:, :size], (0, whole * block - size))
        first = start // block
        decoded = level.view(count, whole, block).mul_(scales[:, first : first + whole].unsqueeze(2))
        decoded = decoded.view(count, -1)
        target = sliced(out, start, end, numel)
        for row in range(count):
            target += sliced(decoded[row], 0, size, whole * block)
    if divisor != 1:
        out.div_(divisor)


def sign_compress_rows(x, block, chunk, rows, residual=None):
    """:func:`gradcomp.ops.reference.sign_compress_rows`, encoded by this backend."""
    signs, scales = sign_compress(x, block, residual)
    return reference.write_rows(rows, signs, scales, x.numel(), block, 1, chunk)


def _sign_decoder(block: int):
    def decode(signs, scales, count, into, accumulate):
        sign_decompress(signs, scales, block, count, into, accumulate)

    return decode


def sign_decompress_rows(rows, block, numel, chunk, out):
    """:func:`gradcomp.ops.reference.sign_decompress_rows`, decoded by this backend."""
    reference.decode_rows(rows, block, 1, chunk, out.view(-1)[:numel], _sign_decoder(block))
    return out


def sign_decompress_sum(rows, block, numel, out, *, divisor=1):
    """:func:`gradcomp.ops.reference.sign_decompress_sum`, decoded by this backend."""
    _decode_sum(rows, block, 1, out.view(-1)[:numel], divisor, _sign_decoder(block))
    return out


FUNCTIONS = {
    "quantize_blockwise": quantize_blockwise,
    "dequantize_blockwise": dequantize_blockwise,
    "quantize_rows": quantize_rows,
    "dequantize_rows": dequantize_rows,
    "dequantize_sum": dequantize_sum,
    "sign_compress": sign_compress,
    "sign_decompress": sign_decompress,
    "sign_compress_rows": sign_compress_rows,
    "sign_decompress_rows": sign_decompress_rows,
    "sign_decompress_sum": sign_decompress_sum,
    "topk_select": topk_select,
    "randk_select": randk_select,
    "randk_indices": randk_indices,
    "scatter_add": reference.scatter_add,
    "pack_bits": pack_bits,
    "unpack_bits": unpack_bits,
    # The block-scaled formats are the reference's on CPU: no faster CPU code yet.
    "mx_quantize": reference.mx_quantize,
    "mx_dequantize": reference.mx_dequantize,
    "mx_dequantize_sum": reference.mx_dequantize_sum,
    "nvfp4_quantize": reference.nvfp4_quantize,
    "nvfp4_dequantize": reference.nvfp4_dequantize,
    "nvfp4_dequantize_sum": reference.nvfp4_dequantize_sum,
}
