"""Block-scaled floats: MXFP8 and MXFP4 (OCP Microscaling v1.0) and NVFP4.

The encoders fuse error feedback: one program reads a tile of blocks of ``x``
and of the residual once, computes each block's scale, the element codes and
the new residual, and writes the codes, the scales and the residual once.
NVFP4's tensor scale is the absmax of the whole compensated tensor: its
encoder first reads ``x`` and the residual once more (each program's largest
finite magnitude, then their maximum in one program: a maximum, exact in any
order). The decoder writes or adds (``out += decoded``); the row sum decodes
every row's payload and adds them in fp32 in row order, in one launch.

Bit-identical to :mod:`gradcomp.ops.reference_mx`, which defines the formats:
an E8M0 scale is built from the exponent field of the block's absmax, a
division by it is a multiplication by its exact reciprocal (a power of two:
the same correctly rounded quotient), an element is rounded to nearest even
as the reference rounds it (its binade's step, found from the exponent field),
and NVFP4's divisions are correctly rounded (``div_rn``).
"""

import torch
import triton
import triton.language as tl

from .common import (
    EXACT,
    block_width,
    finite_or_zero,
    flat,
    is_finite,
    load_compensated,
    residual_view,
    round_half_even,
    store_decoded,
)

# Elements a program encodes or decodes: whole blocks, so a block of 32 makes 64 a program.
ELEMENTS_PER_PROGRAM = 2048
# Partial maxima the tensor-scale program reads at a time.
PEAKS_PER_STEP = 1024


class Element:
    """An element format as the kernels take it (:class:`gradcomp.ops.reference_mx.Minifloat`,
    which the kernels cannot import, is the definition; a test holds the two equal)."""

    def __init__(self, bits: int, mantissa_bits: int, min_exponent: int, largest: float, largest_power: int):
        self.bits, self.mantissa_bits, self.min_exponent = bits, mantissa_bits, min_exponent
        self.largest, self.largest_power = largest, largest_power
        # E4M3 has a NaN code (all magnitude bits set); E2M1 has none.
        self.has_nan = bits == 8

    def constants(self) -> dict:
        """The format as a kernel's constexpr arguments."""
        return {
            "BITS": self.bits,
            "MANTISSA": self.mantissa_bits,
            "MIN_EXPONENT": self.min_exponent,
            "SUBNORMAL_STEP": 2.0 ** (self.min_exponent - self.mantissa_bits),
            "HAS_NAN": self.has_nan,
        }


E4M3 = Element(8, 3, -6, 448.0, 8)
E2M1 = Element(4, 1, 0, 6.0, 2)
ELEMENTS = {"e4m3": E4M3, "e2m1": E2M1}
E8M0_NAN = tl.constexpr(255)
E4M3_NAN = tl.constexpr(0x7F)
E4M3_SMALLEST_NORMAL = tl.constexpr(2.0**-6)
E4M3_SUBNORMAL_STEP = tl.constexpr(2.0**-9)
E4M3_MIN_EXPONENT = tl.constexpr(-6)
E4M3_LARGEST = tl.constexpr(448.0)
E2M1_LARGEST = tl.constexpr(6.0)
NVFP4_TENSOR_RANGE = tl.constexpr(448.0 * 6.0)
SMALLEST_TENSOR_SCALE = tl.constexpr(2.0**-120)


@triton.jit
def _exponent_field(value):
    """The biased exponent of fp32 ``value``: 0 for zeros and subnormals."""
    return (value.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def _power_of_two(exponent):
    """``2 ** exponent`` (int32 tensor, -127 ..127) as fp32; 2**-127 is the subnormal 0x00400000."""
    bits = tl.where(exponent > -127, (exponent + 127) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _negated_where(negative, value):
    """``value`` with its sign bit set where ``negative`` (``-value`` is ``0 - value`` in
    Triton, which makes +0 of 0)."""
    bits = value.to(tl.int32, bitcast=True) | (negative.to(tl.int32) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tile(numel, block, WIDTH: tl.constexpr, BLOCKS: tl.constexpr):
    """This program's ``BLOCKS`` blocks: ``(block index, element offsets, mask)``, the
    offsets ``(BLOCKS, WIDTH)`` in 64 bits."""
    index = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    lane = tl.arange(0, WIDTH)
    offsets = index[:, None] * block + lane[None, :]
    return index, offsets, (lane[None, :] < block) & (offsets < numel)


@triton.jit
def _round_to_element(
    v, BITS: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, LARGEST: tl.constexpr
):
    """``v`` (fp32, not NaN) rounded to nearest even on the element's grid and saturated,
    its sign kept (of a zero too): ``(rounded value, element code)``."""
    magnitude = tl.minimum(tl.abs(v), LARGEST)
    # The spacing of values in magnitude's binade, subnormals sharing the smallest normal one.
    exponent = tl.maximum(_exponent_field(magnitude) - 127, MIN_EXPONENT)
    # Scaled by powers of two: exact, so one rounding, to the element.
    steps = round_half_even(magnitude * _power_of_two(MANTISSA - exponent))
    rounded = steps * _power_of_two(exponent - MANTISSA)
    # The code counts steps from zero: a value rounded up into the next binade is its first.
    code = ((exponent - MIN_EXPONENT + 1) << MANTISSA) + steps.to(tl.int32) - (1 << MANTISSA)
    negative = v.to(tl.int32, bitcast=True) < 0
    code = tl.where(negative, code | (1 << (BITS - 1)), code)
    return _negated_where(negative, rounded), code


@triton.jit
def _element_value(
    code,
    BITS: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    SUBNORMAL_STEP: tl.constexpr,
    HAS_NAN: tl.constexpr,
):
    """fp32 value of element codes (int32): NaN where the format has it."""
    magnitude = code & ((1 << (BITS - 1)) - 1)
    exponent = magnitude >> MANTISSA
    mantissa = magnitude & ((1 << MANTISSA) - 1)
    normal = ((exponent + (MIN_EXPONENT + 126)) << 23) | (mantissa << (23 - MANTISSA))
    value = tl.where(
        exponent == 0, mantissa.to(tl.float32) * SUBNORMAL_STEP, normal.to(tl.float32, bitcast=True)
    )
    if HAS_NAN:
        value = tl.where(magnitude == (1 << (BITS - 1)) - 1, float("nan"), value)
    return _negated_where(code >= (1 << (BITS - 1)), value)


@triton.jit
def _finish_encoding(
    y,
    rounded,
    code,
    block_value,
    residual_ptr,
    codes_ptr,
    index,
    offsets,
    mask,
    numel,
    block,
    BITS: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCKS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """The residual ``y - decoded`` (non-finite entries zeroed) and the packed codes."""
    if HAS_RESIDUAL:
        decoded = rounded * block_value[:, None]
        tl.store(residual_ptr + offsets, finite_or_zero(y - decoded), mask=mask)
    code = tl.where(mask, code, 0)
    if BITS == 8:
        tl.store(codes_ptr + offsets, code.to(tl.uint8), mask=mask)
    else:
        # Two codes a byte, the first in the low nibble; a block holds whole bytes (ops.checks).
        pairs = tl.reshape(code, (BLOCKS, WIDTH // 2, 2))
        byte = tl.sum(pairs << (tl.arange(0, 2) * 4)[None, None, :], axis=2)
        pair = tl.arange(0, WIDTH // 2)
        first = index[:, None] * block + 2 * pair[None, :]
        byte_mask = (2 * pair[None, :] < block) & (first < numel)
        tl.store(codes_ptr + first // 2, byte.to(tl.uint8), mask=byte_mask)


@triton.jit
def _block_finite(y):
    """Per block (row of ``y``): whether it holds no inf or NaN."""
    return tl.min(is_finite(y).to(tl.int32), axis=1) > 0


@triton.jit
def _mx_quantize_kernel(
    x_ptr,
    residual_ptr,
    codes_ptr,
    scales_ptr,
    numel,
    block,
    total_blocks,
    BITS: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    LARGEST: tl.constexpr,
    LARGEST_POWER: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCKS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    index, offsets, mask = _tile(numel, block, WIDTH, BLOCKS)
    y = load_compensated(x_ptr, residual_ptr, offsets, mask, HAS_RESIDUAL)
    finite = _block_finite(y)
    # E8M0 bits: floor(log2(absmax)) - LARGEST_POWER + 127, clamped to 0..254 (an all-zero or
    # subnormal absmax gives 0: below 2**-126 the shared exponent is under E8M0's -127).
    biased = tl.minimum(tl.maximum(_exponent_field(tl.max(tl.abs(y), axis=1)) - LARGEST_POWER, 0), 254)
    tl.store(scales_ptr + index, tl.where(finite, biased, E8M0_NAN).to(tl.uint8), mask=index < total_blocks)
    # y / 2**(biased - 127) as y * 2**(127 - biased): both the exact quotient, rounded once.
    scaled = tl.where(finite[:, None], y * _power_of_two(127 - biased)[:, None], 0.0)
    rounded, code = _round_to_element(scaled, BITS, MANTISSA, MIN_EXPONENT, LARGEST)
    block_value = tl.where(finite, _power_of_two(biased - 127), float("nan"))
    _finish_encoding(
        y, rounded, code, block_value, residual_ptr, codes_ptr, index, offsets, mask, numel, block,
        BITS, WIDTH, BLOCKS, HAS_RESIDUAL,
    )  # fmt: skip


@triton.jit
def _finite_peak_kernel(
    x_ptr, residual_ptr, peaks_ptr, numel, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr
):
    """Each program's largest finite ``|x + residual|``."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    y = load_compensated(x_ptr, residual_ptr, offsets, mask, HAS_RESIDUAL)
    tl.store(peaks_ptr + tl.program_id(0), tl.max(finite_or_zero(tl.abs(y)), axis=0))


@triton.jit
def _nvfp4_tensor_scale_kernel(peaks_ptr, tensor_scale_ptr, count, STEP: tl.constexpr):
    """NVFP4's tensor scale from the partial maxima: ``max / (448 * 6)``, at least 2**-120."""
    peak = tl.zeros((STEP,), tl.float32)
    start = tl.zeros((), tl.int64)  # a while loop: the interpreter takes no runtime bound in range()
    while start < count:
        offsets = start + tl.arange(0, STEP)
        peak = tl.maximum(peak, tl.load(peaks_ptr + offsets, mask=offsets < count, other=0.0))
        start += STEP
    scale = tl.math.div_rn(tl.max(peak, axis=0), NVFP4_TENSOR_RANGE)
    tl.store(tensor_scale_ptr, tl.maximum(scale, SMALLEST_TENSOR_SCALE))


@triton.jit
def _nvfp4_quantize_kernel(
    x_ptr,
    residual_ptr,
    codes_ptr,
    scales_ptr,
    tensor_scale_ptr,
    numel,
    block,
    total_blocks,
    WIDTH: tl.constexpr,
    BLOCKS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    index, offsets, mask = _tile(numel, block, WIDTH, BLOCKS)
    y = load_compensated(x_ptr, residual_ptr, offsets, mask, HAS_RESIDUAL)
    tensor_scale = tl.load(tensor_scale_ptr)
    finite = _block_finite(y)
    peak = tl.where(finite, tl.max(tl.abs(y), axis=1), 0.0)
    wanted = tl.math.div_rn(tl.math.div_rn(peak, E2M1_LARGEST), tensor_scale)
    wanted = tl.minimum(tl.maximum(wanted, E4M3_SMALLEST_NORMAL), E4M3_LARGEST)
    scale, scale_code = _round_to_element(wanted, 8, 3, E4M3_MIN_EXPONENT, E4M3_LARGEST)
    tl.store(
        scales_ptr + index, tl.where(finite, scale_code, E4M3_NAN).to(tl.uint8), mask=index < total_blocks
    )
    reciprocal = tl.math.div_rn(tl.math.div_rn(1.0, tensor_scale), scale)
    # Saturated at E2M1's largest value by the rounding (the reference clamps first: the same).
    scaled = tl.where(finite[:, None], y * reciprocal[:, None], 0.0)
    rounded, code = _round_to_element(scaled, 4, 1, 0, E2M1_LARGEST)
    block_value = tl.where(finite, scale * tensor_scale, float("nan"))
    _finish_encoding(
        y, rounded, code, block_value, residual_ptr, codes_ptr, index, offsets, mask, numel, block,
        4, WIDTH, BLOCKS, HAS_RESIDUAL,
    )  # fmt: skip


@triton.jit
def _decoded(
    codes_ptr,
    scales_ptr,
    tensor_scale_ptr,
    base,
    tensor_scale_index,
    index,
    offsets,
    mask,
    total_blocks,
    BITS: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    SUBNORMAL_STEP: tl.constexpr,
    HAS_NAN: tl.constexpr,
    NVFP4: tl.constexpr,
):
    """The tile's values decoded in fp32 from the payload at ``base`` (bytes) of the
    codes and scales pointers."""
    if BITS == 8:
        code = tl.load(codes_ptr + base + offsets, mask=mask, other=0).to(tl.int32)
    else:
        byte = tl.load(codes_ptr + base + offsets // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((offsets % 2) * 4).to(tl.int32)) & 0xF
    value = _element_value(code, BITS, MANTISSA, MIN_EXPONENT, SUBNORMAL_STEP, HAS_NAN)
    scale_code = tl.load(scales_ptr + base + index, mask=index < total_blocks, other=0).to(tl.int32)
    if NVFP4:
        tensor_scale = tl.load(tensor_scale_ptr + tensor_scale_index)
        scale = _element_value(scale_code, 8, 3, E4M3_MIN_EXPONENT, E4M3_SUBNORMAL_STEP, True) * tensor_scale
    else:
        scale = tl.where(scale_code == E8M0_NAN, float("nan"), _power_of_two(scale_code - 127))
    return value * scale[:, None]


@triton.jit
def _decode_kernel(
    codes_ptr,
    scales_ptr,
    tensor_scale_ptr,
    out_ptr,
    numel,
    block,
    total_blocks,
    codes_start,
    row_stride,
    summed_rows,
    divisor,
    BITS: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    SUBNORMAL_STEP: tl.constexpr,
    HAS_NAN: tl.constexpr,
    NVFP4: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCKS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    SUM: tl.constexpr,
):
    index, offsets, mask = _tile(numel, block, WIDTH, BLOCKS)
    if SUM:
        # Rows 0..summed_rows-1 each hold a whole payload (the scales at its start, the codes
        # at codes_start), added in row order from zero, then divided once. The row in 64
        # bits: row * row_stride passes 2**31 in a buffer of 2 GiB.
        value = tl.zeros((BLOCKS, WIDTH), tl.float32)
        row = tl.zeros((), tl.int64)
        while row < summed_rows:
            base = row * row_stride
            value += _decoded(
                codes_ptr + codes_start, scales_ptr, tensor_scale_ptr, base, row, index, offsets, mask,
                total_blocks, BITS, MANTISSA, MIN_EXPONENT, SUBNORMAL_STEP, HAS_NAN, NVFP4,
            )  # fmt: skip
            row += 1
        value = tl.math.div_rn(value, divisor)
    else:
        value = _decoded(
            codes_ptr, scales_ptr, tensor_scale_ptr, 0, 0, index, offsets, mask,
            total_blocks, BITS, MANTISSA, MIN_EXPONENT, SUBNORMAL_STEP, HAS_NAN, NVFP4,
        )  # fmt: skip
    store_decoded(out_ptr, offsets, mask, value, ACCUMULATE)


def _blocks_a_program(block: int) -> int:
    return max(1, ELEMENTS_PER_PROGRAM // block_width(block))


def _encode_outputs(numel: int, block: int, bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(triton.cdiv(numel * bits, 8), dtype=torch.uint8, device=device)
    return codes, torch.empty(triton.cdiv(numel, block), dtype=torch.uint8, device=device)


def mx_quantize(
    x: torch.Tensor, element: str, block: int = 32, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`gradcomp.ops.reference_mx.mx_quantize`: one launch."""
    x, residual, fmt = flat(x), residual_view(residual), ELEMENTS[element]
    numel = x.numel()
    codes, scales = _encode_outputs(numel, block, fmt.bits, x.device)
    blocks = scales.numel()
    if blocks:
        _mx_quantize_kernel[(triton.cdiv(blocks, _blocks_a_program(block)),)](
            x,
            residual if residual is not None else x,
            codes,
            scales,
            numel,
            block,
            blocks,
            BITS=fmt.bits,
            MANTISSA=fmt.mantissa_bits,
            MIN_EXPONENT=fmt.min_exponent,
            LARGEST=fmt.largest,
            LARGEST_POWER=fmt.largest_power,
            WIDTH=block_width(block),
            BLOCKS=_blocks_a_program(block),
            HAS_RESIDUAL=residual is not None,
            **EXACT,
        )
    return codes, scales


def nvfp4_quantize(
    x: torch.Tensor, block: int = 16, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`gradcomp.ops.reference_mx.nvfp4_quantize`: three launches
    (the partial maxima, the tensor scale, the encoding)."""
    x, residual = flat(x), residual_view(residual)
    numel = x.numel()
    codes, scales = _encode_outputs(numel, block, E2M1.bits, x.device)
    tensor_scale = torch.empty(min(numel, 1), dtype=torch.float32, device=x.device)
    blocks = scales.numel()
    if not blocks:
        return codes, scales, tensor_scale
    compensating = {"HAS_RESIDUAL": residual is not None, **EXACT}
    other = residual if residual is not None else x
    peaks = torch.empty(triton.cdiv(numel, ELEMENTS_PER_PROGRAM), dtype=torch.float32, device=x.device)
    _finite_peak_kernel[(peaks.numel(),)](x, other, peaks, numel, BLOCK=ELEMENTS_PER_PROGRAM, **compensating)
    _nvfp4_tensor_scale_kernel[(1,)](peaks, tensor_scale, peaks.numel(), STEP=PEAKS_PER_STEP, **EXACT)
    _nvfp4_quantize_kernel[(triton.cdiv(blocks, _blocks_a_program(block)),)](
        x,
        other,
        codes,
        scales,
        tensor_scale,
        numel,
        block,
        blocks,
        WIDTH=block_width(block),
        BLOCKS=_blocks_a_program(block),
        **compensating,
    )
    return codes, scales, tensor_scale


def _decode(
    codes,
    scales,
    tensor_scale,
    fmt,
    nvfp4,
    block,
    numel,
    out,
    accumulate,
    codes_start=0,
    rows=None,
    divisor=1,
):
    """Launch the decoder: every row of ``rows`` added (and divided), or one payload."""
    blocks = triton.cdiv(numel, block)
    if not blocks:
        return
    _decode_kernel[(triton.cdiv(blocks, _blocks_a_program(block)),)](
        codes,
        scales,
        tensor_scale,
        out,
        numel,
        block,
        blocks,
        codes_start,
        0 if rows is None else rows.stride(0),
        1 if rows is None else rows.shape[0],
        float(divisor),
        NVFP4=nvfp4,
        WIDTH=block_width(block),
        BLOCKS=_blocks_a_program(block),
        ACCUMULATE=accumulate,
        SUM=rows is not None,
        **fmt.constants(),
        **EXACT,
    )


def _target(out: torch.Tensor | None, numel: int, device) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.float32, device=device) if out is None else out.view(-1)


def mx_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    element: str,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference_mx.mx_dequantize`: one launch."""
    target = _target(out, numel, codes.device)
    codes, scales = flat(codes), flat(scales)
    _decode(codes, scales, scales, ELEMENTS[element], False, block, numel, target, accumulate)
    return target if out is None else out


def nvfp4_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference_mx.nvfp4_dequantize`: one launch."""
    target = _target(out, numel, codes.device)
    tensor_scale = flat(tensor_scale).float()
    _decode(flat(codes), flat(scales), tensor_scale, E2M1, True, block, numel, target, accumulate)
    return target if out is None else out


def mx_dequantize_sum(
    rows: torch.Tensor, element: str, block: int, numel: int, out: torch.Tensor, *, divisor: int = 1
) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference_mx.mx_dequantize_sum`: one launch."""
    codes_start = triton.cdiv(numel, block)
    fmt = ELEMENTS[element]
    _decode(rows, rows, rows, fmt, False, block, numel, out.view(-1), False, codes_start, rows, divisor)
    return out


def nvfp4_dequantize_sum(
    rows: torch.Tensor, block: int, numel: int, out: torch.Tensor, *, divisor: int = 1
) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference_mx.nvfp4_dequantize_sum`: one launch
    (and a gather of the rows' tensor scales)."""
    if not numel:
        return out
    # Each row's first 4 bytes, as fp32: a row's width need not be a multiple of 4.
    tensor_scales = rows[:, :4].contiguous().view(torch.float32).reshape(-1)
    scales = rows[:, 4:]
    codes_start = triton.cdiv(numel, block)
    _decode(
        scales,
        scales,
        tensor_scales,
        E2M1,
        True,
        block,
        numel,
        out.view(-1),
        False,
        codes_start,
        rows,
        divisor,
    )
    return out


__all__ = [
    "mx_dequantize",
    "mx_dequantize_sum",
    "mx_quantize",
    "nvfp4_dequantize",
    "nvfp4_dequantize_sum",
    "nvfp4_quantize",
]
