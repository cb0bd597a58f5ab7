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
    block_width,
    finite_or_zero,
    flat,
    floor,
    is_finite,
    load_compensated,
    random_seed,
    residual_view,
    round_half_even,
    store_decoded,
)


# `levels` is 1 for int2 and QSGD(levels=1): specialised, it would reach the
# kernel as a Python int, which has no `.to`.
@triton.jit(do_not_specialize=["levels"])
def _quantize_kernel(
    x_ptr,
    residual_ptr,
    codes_ptr,
    scales_ptr,
    numel,
    nbytes,
    block,
    levels,
    seed,
    BITS: tl.constexpr,
    WIDTH: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    NORM: tl.constexpr,
    PACKED: tl.constexpr,
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
    tl.store(scales_ptr + pid, scale)
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
        byte_index = pid * (block // per_byte) + group
        byte_mask = (group * per_byte < block) & (byte_index < nbytes)
        tl.store(codes_ptr + byte_index, byte.to(tl.uint8), mask=byte_mask)
    else:
        tl.store(codes_ptr + offsets, code.to(tl.uint8), mask=mask)


@triton.jit(do_not_specialize=["levels"])
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    numel,
    block,
    levels,
    BITS: tl.constexpr,
    WIDTH: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    pid, offsets, mask = block_lanes(numel, block, WIDTH)
    per_byte: tl.constexpr = 8 // BITS
    byte = tl.load(codes_ptr + offsets // per_byte, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((offsets % per_byte) * BITS).to(tl.int32)) & ((1 << BITS) - 1)
    scale = tl.load(scales_ptr + pid).to(tl.float32)
    value = (code.to(tl.float32) - levels.to(tl.float32)) * scale
    store_decoded(out_ptr, offsets, mask, value, ACCUMULATE)


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
    levels = levels if levels is not None else 2 ** (bits - 1) - 1
    if levels < 1:
        raise ValueError(f"levels must be at least 1 (bits={bits} without levels gives {levels})")
    if bits not in (1, 2, 4, 8) or 2 * levels + 1 > 2**bits:
        raise ValueError(f"{bits} bits cannot hold levels={levels}")
    if scale not in ("absmax", "norm"):
        raise ValueError(f"scale must be 'absmax' or 'norm', got {scale!r}")
    x = flat(x, "x")
    numel = x.numel()
    residual = residual_view(residual, numel, x.device)
    blocks = triton.cdiv(numel, block)
    nbytes = triton.cdiv(numel * bits, 8)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    packed = bits == 8 or block % (8 // bits) == 0
    codes = torch.empty(nbytes if packed else numel, dtype=torch.uint8, device=x.device)
    if blocks:
        _quantize_kernel[(blocks,)](
            x,
            residual if residual is not None else x,
            codes,
            scales,
            numel,
            nbytes,
            block,
            levels,
            random_seed(seed),
            BITS=bits,
            WIDTH=block_width(block),
            HAS_RESIDUAL=residual is not None,
            STOCHASTIC=stochastic,
            NORM=scale == "norm",
            PACKED=packed and bits < 8,
            **EXACT,
        )
    if not packed:
        codes = pack_bits(codes, bits)
    return codes, scales


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
    levels = levels if levels is not None else 2 ** (bits - 1) - 1
    q = flat(q, "q")
    target = torch.empty(numel, dtype=torch.float32, device=q.device) if out is None else out.view(-1)
    blocks = triton.cdiv(numel, block)
    if blocks:
        _dequantize_kernel[(blocks,)](
            q,
            flat(scales, "scales"),
            target,
            numel,
            block,
            levels,
            BITS=bits,
            WIDTH=block_width(block),
            ACCUMULATE=accumulate,
            **EXACT,
        )
    return target if out is None else out


__all__ = ["dequantize_blockwise", "pack_bits", "quantize_blockwise", "unpack_bits"]
