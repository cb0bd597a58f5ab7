"""Fused error-feedback blockwise quantization (int8/int4/int2, QSGD) and its decoder.

One program per block: it reads the block of ``x`` and of the residual once,
computes the block's scale, the codes and the new residual, and writes the
packed codes, the scale and the residual once. The decoder writes or adds
(``out += decoded``) so that collectives can sum payloads without temporaries.

Round-to-nearest absmax results are bit-identical to
:func:`gradcomp.ops.reference.quantize_blockwise`; stochastic rounding uses
Triton's counter-based generator (seed, element index), so it is
reproducible but draws other numbers than the reference; the L2 norm of QSGD
is summed in another order than torch's (within a few ulp).
"""

import torch
import triton
import triton.language as tl

from .bits import pack_bits, unpack_bits
from .common import (
    EXACT,
    block_lanes,
    block_place,
    block_width,
    finite_or_zero,
    flat,
    floor,
    is_finite,
    load_compensated,
    pad_row,
    random_seed,
    residual_view,
    round_half_even,
    store_decoded,
)


# `levels` is 1 for int2 and QSGD(levels=1): specialised, it would reach the
# kernel as a Python int, which has no `.to`. `seed` changes every step: typed
# by its value (i32 below 2**31, else i64) and specialised on divisibility by 16,
# it would compile the kernel again for each kind of seed in a training run.
@triton.jit(do_not_specialize=["levels", "seed"])
def _quantize_kernel(
    x_ptr,
    residual_ptr,
    codes_ptr,
    scales_ptr,
    numel,
    block,
    levels,
    seed: tl.int64,
    chunk_blocks,
    total_blocks,
    row_stride,
    BITS: tl.constexpr,
    WIDTH: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    NORM: tl.constexpr,
    PACKED: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid, offsets, mask = block_lanes(numel, block, WIDTH)
    y = load_compensated(x_ptr, residual_ptr, offsets, mask, HAS_RESIDUAL)
    magnitude = tl.abs(y)
    peak = tl.max(magnitude, axis=0)
    # tl.max skips NaN; the reference's amax does not, and a NaN must decode to NaN.
    has_nan = tl.max((y != y).to(tl.int32), axis=0) > 0
    levels_f = levels.to(tl.float32)
    if NORM:
        safe_peak = tl.where(peak > 0, peak, 1.0)
        unit = tl.math.div_rn(y, safe_peak)
        peak = tl.sqrt_rn(tl.sum(unit * unit, axis=0)) * peak
    scale = tl.math.div_rn(tl.where(has_nan, float("nan"), peak), levels_f)
    # Where levels * scale rounds past the largest float, the next float down,
    # so that the top level of a finite block decodes finite (as the reference).
    over = is_finite(scale) & ~is_finite(scale * levels_f)
    scale = tl.where(over, (scale.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), scale)
    divisor = tl.where(scale > 0, scale, 1.0)
    scaled = tl.math.div_rn(y, divisor)
    if STOCHASTIC:
        # 64-bit offsets: 32-bit ones would repeat the noise past 2**31 elements.
        level = floor(scaled + tl.rand(seed, offsets))
    else:
        level = round_half_even(scaled)
    level = tl.where(is_finite(level), level, 0.0)
    level = tl.minimum(tl.maximum(level, -levels_f), levels_f)
    scale_index, codes_base, local = block_place(pid, chunk_blocks, total_blocks, row_stride, ROWS)
    tl.store(scales_ptr + scale_index, scale)
    if HAS_RESIDUAL:
        error = finite_or_zero(y - level * scale)
        tl.store(residual_ptr + offsets, error, mask=mask)
    code = tl.where(mask, level + levels_f, 0.0).to(tl.int32)
    if PACKED:
        per_byte: tl.constexpr = 8 // BITS
        grouped = tl.reshape(code, (WIDTH // per_byte, per_byte))
        shifts = tl.arange(0, per_byte) * BITS
        byte = tl.sum(grouped << shifts[None, :], axis=1)
        group = tl.arange(0, WIDTH // per_byte)
        byte_index = codes_base + local * (block // per_byte) + group
        byte_mask = (group * per_byte < block) & (pid * block + group * per_byte < numel)
        tl.store(codes_ptr + byte_index, byte.to(tl.uint8), mask=byte_mask)
    else:
        element = local * block + (offsets - pid * block)  # within the row (the tensor without ROWS)
        tl.store(codes_ptr + codes_base + element, code.to(tl.uint8), mask=mask)
    if ROWS:
        pad_row(codes_ptr, pid, numel, block, chunk_blocks, total_blocks, row_stride, BITS)


@triton.jit(do_not_specialize=["levels"])
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    numel,
    block,
    levels,
    chunk_blocks,
    total_blocks,
    row_stride,
    summed_rows,
    divisor,
    BITS: tl.constexpr,
    WIDTH: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    ROWS: tl.constexpr,
    SUM: tl.constexpr,
):
    pid, offsets, mask = block_lanes(numel, block, WIDTH)
    per_byte: tl.constexpr = 8 // BITS
    scale_index, codes_base, local = block_place(pid, chunk_blocks, total_blocks, row_stride, ROWS)
    element = local * block + (offsets - pid * block)  # within the row (the tensor without ROWS)
    shift = ((element % per_byte) * BITS).to(tl.int32)
    if SUM:
        # Rows 0..summed_rows-1 each hold the whole tensor; added in row order, then divided.
        value = tl.zeros((WIDTH,), tl.float32)
        # A while loop: Triton's interpreter (under numpy 2.4) cannot take a
        # runtime bound in range(). The row index in 64 bits: a literal 0 would
        # make it (and row * row_stride) 32-bit, which wraps in a buffer of 2 GiB.
        row = tl.zeros((), tl.int64)
        while row < summed_rows:
            byte = tl.load(
                codes_ptr + row * row_stride + codes_base + element // per_byte, mask=mask, other=0
            )
            code = (byte.to(tl.int32) >> shift) & ((1 << BITS) - 1)
            scale = tl.load(scales_ptr + row * (row_stride // 4) + scale_index)
            value += (code.to(tl.float32) - levels.to(tl.float32)) * scale
            row += 1
        value = tl.math.div_rn(value, divisor)
    else:
        byte = tl.load(codes_ptr + codes_base + element // per_byte, mask=mask, other=0).to(tl.int32)
        code = (byte >> shift) & ((1 << BITS) - 1)
        scale = tl.load(scales_ptr + scale_index).to(tl.float32)
        value = (code.to(tl.float32) - levels.to(tl.float32)) * scale
    store_decoded(out_ptr, offsets, mask, value, ACCUMULATE)


def _quantize(x, bits, block, stochastic, seed, residual, levels, scale, codes, scales, chunk, rows) -> None:
    """Launch the quantizer over ``x`` into ``codes`` and ``scales`` (views of
    ``rows`` when given: chunk ``j`` into row ``j``)."""
    numel = x.numel()
    blocks = triton.cdiv(numel, block)
    if not blocks:
        return
    _quantize_kernel[(blocks,)](
        x,
        residual if residual is not None else x,
        codes,
        scales,
        numel,
        block,
        levels,
        random_seed(seed),
        triton.cdiv(chunk, block),
        blocks,
        0 if rows is None else rows.stride(0),
        BITS=bits,
        WIDTH=block_width(block),
        HAS_RESIDUAL=residual is not None,
        STOCHASTIC=stochastic,
        NORM=scale == "norm",
        PACKED=bits < 8 and block % (8 // bits) == 0,
        ROWS=rows is not None,
        **EXACT,
    )


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
    """Triton version of :func:`gradcomp.ops.reference.quantize_blockwise`."""
    x = flat(x)
    numel = x.numel()
    residual = residual_view(residual)
    scales = torch.empty(triton.cdiv(numel, block), dtype=torch.float32, device=x.device)
    packed = bits == 8 or block % (8 // bits) == 0
    codes = torch.empty(triton.cdiv(numel * bits, 8) if packed else numel, dtype=torch.uint8, device=x.device)
    _quantize(x, bits, block, stochastic, seed, residual, levels, scale, codes, scales, numel, None)
    return (codes if packed else pack_bits(codes, bits)), scales


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
    """Triton version of :func:`gradcomp.ops.reference.quantize_rows`: one launch."""
    x = flat(x)
    residual = residual_view(residual)
    _quantize(
        x, bits, block, stochastic, seed, residual, levels, scale, rows, rows.view(torch.float32), chunk, rows
    )
    return rows


def _dequantize(
    codes, scales, bits, block, numel, levels, out, accumulate, chunk, rows, summed=None, divisor=1
):
    """Launch the decoder: ``summed`` rows added (and divided), or every block once."""
    blocks = triton.cdiv(numel, block)
    if not blocks:
        return
    _dequantize_kernel[(blocks,)](
        codes,
        scales,
        out,
        numel,
        block,
        levels,
        triton.cdiv(chunk, block),
        blocks,
        0 if rows is None else rows.stride(0),
        summed or 1,
        float(divisor),
        BITS=bits,
        WIDTH=block_width(block),
        ACCUMULATE=accumulate,
        ROWS=rows is not None,
        SUM=summed is not None,
        **EXACT,
    )


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
    """Triton version of :func:`gradcomp.ops.reference.dequantize_blockwise`."""
    target = torch.empty(numel, dtype=torch.float32, device=q.device) if out is None else out.view(-1)
    _dequantize(flat(q), flat(scales), bits, block, numel, levels, target, accumulate, numel, None)
    return target if out is None else out


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
    """Triton version of :func:`gradcomp.ops.reference.dequantize_rows`: one launch."""
    _dequantize(rows, rows.view(torch.float32), bits, block, numel, levels, out.view(-1), False, chunk, rows)
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
    """Triton version of :func:`gradcomp.ops.reference.dequantize_sum`: one launch."""
    codes, scales = rows, rows.view(torch.float32)
    _dequantize(
        codes, scales, bits, block, numel, levels, out.view(-1), False, numel, rows, rows.shape[0], divisor
    )
    return out


__all__ = [
    "dequantize_blockwise",
    "dequantize_rows",
    "dequantize_sum",
    "pack_bits",
    "quantize_blockwise",
    "quantize_rows",
    "unpack_bits",
]
