"""Fused error-feedback 1-bit scaled sign and its decoder.

One program per block: scale = mean |y| over the block, one bit per element
(1 = non-negative), residual <- y - scale * (+1 | -1). Signs and residuals are
bit-identical to :func:`gradcomp.ops.reference.sign_compress`; the block sum
behind the scale is added in another order than torch's (within a few ulp).
"""

import torch
import triton
import triton.language as tl

from .bits import pack_bits
from .common import (
    EXACT,
    block_lanes,
    block_place,
    block_width,
    finite_or_zero,
    flat,
    load_compensated,
    pad_row,
    residual_view,
    store_decoded,
)


@triton.jit
def _sign_kernel(
    x_ptr,
    residual_ptr,
    signs_ptr,
    scales_ptr,
    numel,
    block,
    chunk_blocks,
    total_blocks,
    row_stride,
    WIDTH: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PACKED: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid, offsets, mask = block_lanes(numel, block, WIDTH)
    y = load_compensated(x_ptr, residual_ptr, offsets, mask, HAS_RESIDUAL)
    count = tl.minimum(numel - pid * block, block).to(tl.float32)
    # div_rn: Triton compiles `/` of fp32 values to div.full.f32 (within 2 ulp), the
    # reference's division is correctly rounded.
    scale = tl.math.div_rn(tl.sum(tl.abs(y), axis=0), count)
    positive = y >= 0
    scale_index, signs_base, local = block_place(pid, chunk_blocks, total_blocks, row_stride, ROWS)
    tl.store(scales_ptr + scale_index, scale)
    if HAS_RESIDUAL:
        error = finite_or_zero(y - tl.where(positive, scale, -scale))
        tl.store(residual_ptr + offsets, error, mask=mask)
    bit = (positive & mask).to(tl.int32)
    if PACKED:
        grouped = tl.reshape(bit, (WIDTH // 8, 8))
        byte = tl.sum(grouped << tl.arange(0, 8)[None, :], axis=1)
        group = tl.arange(0, WIDTH // 8)
        byte_index = signs_base + local * (block // 8) + group
        byte_mask = (group * 8 < block) & (pid * block + group * 8 < numel)
        tl.store(signs_ptr + byte_index, byte.to(tl.uint8), mask=byte_mask)
    else:
        tl.store(signs_ptr + offsets, bit.to(tl.uint8), mask=mask)
    if ROWS:
        pad_row(signs_ptr, pid, numel, block, chunk_blocks, total_blocks, row_stride, 1)


@triton.jit
def _sign_decode_kernel(
    signs_ptr,
    scales_ptr,
    out_ptr,
    numel,
    block,
    chunk_blocks,
    total_blocks,
    row_stride,
    summed_rows,
    divisor,
    WIDTH: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    ROWS: tl.constexpr,
    SUM: tl.constexpr,
):
    pid, offsets, mask = block_lanes(numel, block, WIDTH)
    scale_index, signs_base, local = block_place(pid, chunk_blocks, total_blocks, row_stride, ROWS)
    element = local * block + (offsets - pid * block)  # within the row (the tensor without ROWS)
    shift = (element % 8).to(tl.int32)
    if SUM:
        # Rows 0..summed_rows-1 each hold the whole tensor; added in row order, then divided.
        value = tl.zeros((WIDTH,), tl.float32)
        # A while loop: Triton's interpreter (under numpy 2.4) cannot take a
        # runtime bound in range(). The row index in 64 bits: a literal 0 would
        # make it (and row * row_stride) 32-bit, which wraps in a buffer of 2 GiB.
        row = tl.zeros((), tl.int64)
        while row < summed_rows:
            byte = tl.load(signs_ptr + row * row_stride + signs_base + element // 8, mask=mask, other=0)
            bit = (byte.to(tl.int32) >> shift) & 1
            scale = tl.load(scales_ptr + row * (row_stride // 4) + scale_index)
            value += (bit.to(tl.float32) * 2.0 - 1.0) * scale
            row += 1
        value = tl.math.div_rn(value, divisor)
    else:
        byte = tl.load(signs_ptr + signs_base + element // 8, mask=mask, other=0).to(tl.int32)
        bit = (byte >> shift) & 1
        scale = tl.load(scales_ptr + scale_index).to(tl.float32)
        value = (bit.to(tl.float32) * 2.0 - 1.0) * scale
    store_decoded(out_ptr, offsets, mask, value, ACCUMULATE)


def _compress(x, block, residual, signs, scales, chunk, rows) -> None:
    numel = x.numel()
    blocks = triton.cdiv(numel, block)
    if not blocks:
        return
    _sign_kernel[(blocks,)](
        x,
        residual if residual is not None else x,
        signs,
        scales,
        numel,
        block,
        triton.cdiv(chunk, block),
        blocks,
        0 if rows is None else rows.stride(0),
        WIDTH=block_width(block),
        HAS_RESIDUAL=residual is not None,
        PACKED=block % 8 == 0,
        ROWS=rows is not None,
        **EXACT,
    )


def sign_compress(
    x: torch.Tensor, block: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`gradcomp.ops.reference.sign_compress`."""
    x = flat(x)
    numel = x.numel()
    residual = residual_view(residual)
    packed = block % 8 == 0
    signs = torch.empty(triton.cdiv(numel, 8) if packed else numel, dtype=torch.uint8, device=x.device)
    scales = torch.empty(triton.cdiv(numel, block), dtype=torch.float32, device=x.device)
    _compress(x, block, residual, signs, scales, numel, None)
    return (signs if packed else pack_bits(signs, 1)), scales


def sign_compress_rows(
    x: torch.Tensor, block: int, chunk: int, rows: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference.sign_compress_rows`: one launch."""
    x = flat(x)
    residual = residual_view(residual)
    _compress(x, block, residual, rows, rows.view(torch.float32), chunk, rows)
    return rows


def _decompress(signs, scales, block, numel, out, accumulate, chunk, rows, summed=None, divisor=1) -> None:
    """Launch the decoder: ``summed`` rows added (and divided), or every block once."""
    blocks = triton.cdiv(numel, block)
    if not blocks:
        return
    _sign_decode_kernel[(blocks,)](
        signs,
        scales,
        out,
        numel,
        block,
        triton.cdiv(chunk, block),
        blocks,
        0 if rows is None else rows.stride(0),
        summed or 1,
        float(divisor),
        WIDTH=block_width(block),
        ACCUMULATE=accumulate,
        ROWS=rows is not None,
        SUM=summed is not None,
        **EXACT,
    )


def sign_decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference.sign_decompress`."""
    target = torch.empty(numel, dtype=torch.float32, device=packed.device) if out is None else out.view(-1)
    _decompress(flat(packed), flat(scales), block, numel, target, accumulate, numel, None)
    return target if out is None else out


def sign_decompress_rows(
    rows: torch.Tensor, block: int, numel: int, chunk: int, out: torch.Tensor
) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference.sign_decompress_rows`: one launch."""
    _decompress(rows, rows.view(torch.float32), block, numel, out.view(-1), False, chunk, rows)
    return out


def sign_decompress_sum(
    rows: torch.Tensor, block: int, numel: int, out: torch.Tensor, *, divisor: int = 1
) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference.sign_decompress_sum`: one launch."""
    _decompress(
        rows, rows.view(torch.float32), block, numel, out.view(-1), False, numel, rows, rows.shape[0], divisor
    )
    return out
