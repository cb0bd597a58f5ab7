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
    block_width,
    finite_or_zero,
    flat,
    load_compensated,
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
    nbytes,
    block,
    WIDTH: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PACKED: tl.constexpr,
):
    pid, offsets, mask = block_lanes(numel, block, WIDTH)
    y = load_compensated(x_ptr, residual_ptr, offsets, mask, HAS_RESIDUAL)
    count = tl.minimum(numel - pid * block, block).to(tl.float32)
    scale = tl.sum(tl.abs(y), axis=0) / count
    positive = y >= 0
    tl.store(scales_ptr + pid, scale)
    if HAS_RESIDUAL:
        error = finite_or_zero(y - tl.where(positive, scale, -scale))
        tl.store(residual_ptr + offsets, error, mask=mask)
    bit = (positive & mask).to(tl.int32)
    if PACKED:
        grouped = tl.reshape(bit, (WIDTH // 8, 8))
        byte = tl.sum(grouped << tl.arange(0, 8)[None, :], axis=1)
        group = tl.arange(0, WIDTH // 8)
        byte_index = pid * (block // 8) + group
        tl.store(signs_ptr + byte_index, byte.to(tl.uint8), mask=(group * 8 < block) & (byte_index < nbytes))
    else:
        tl.store(signs_ptr + offsets, bit.to(tl.uint8), mask=mask)


@triton.jit
def _sign_decode_kernel(
    signs_ptr, scales_ptr, out_ptr, numel, block, WIDTH: tl.constexpr, ACCUMULATE: tl.constexpr
):
    pid, offsets, mask = block_lanes(numel, block, WIDTH)
    byte = tl.load(signs_ptr + offsets // 8, mask=mask, other=0).to(tl.int32)
    bit = (byte >> (offsets % 8).to(tl.int32)) & 1
    scale = tl.load(scales_ptr + pid).to(tl.float32)
    value = (bit.to(tl.float32) * 2.0 - 1.0) * scale
    store_decoded(out_ptr, offsets, mask, value, ACCUMULATE)


def sign_compress(
    x: torch.Tensor, block: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`gradcomp.ops.reference.sign_compress`."""
    x = flat(x, "x")
    numel = x.numel()
    residual = residual_view(residual, numel, x.device)
    blocks = triton.cdiv(numel, block)
    nbytes = triton.cdiv(numel, 8)
    packed = block % 8 == 0
    signs = torch.empty(nbytes if packed else numel, dtype=torch.uint8, device=x.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    if blocks:
        _sign_kernel[(blocks,)](
            x,
            residual if residual is not None else x,
            signs,
            scales,
            numel,
            nbytes,
            block,
            WIDTH=block_width(block),
            HAS_RESIDUAL=residual is not None,
            PACKED=packed,
            **EXACT,
        )
    return (signs if packed else pack_bits(signs, 1)), scales


def sign_decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference.sign_decompress`."""
    packed = flat(packed, "packed")
    target = torch.empty(numel, dtype=torch.float32, device=packed.device) if out is None else out.view(-1)
    blocks = triton.cdiv(numel, block)
    if blocks:
        _sign_decode_kernel[(blocks,)](
            packed,
            flat(scales, "scales"),
            target,
            numel,
            block,
            WIDTH=block_width(block),
            ACCUMULATE=accumulate,
            **EXACT,
        )
    return target if out is None else out
