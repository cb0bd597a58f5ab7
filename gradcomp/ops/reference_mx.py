"""Torch reference of the block-scaled float formats: MXFP8, MXFP4 and NVFP4.

The definition of correct for these formats, as :mod:`gradcomp.ops.reference` is
for the others (its conventions hold here: fp32 arithmetic, error feedback
unfused, a residual never non-finite, non-finite input never hidden).

* MXFP8 and MXFP4 (OCP Microscaling Formats v1.0, section 6.3): blocks of 32
  elements share one E8M0 scale ``X = 2 ** (floor(log2(amax)) - emax)``, the
  largest power of two of the block's absmax over the element format's largest
  power of two (``emax``: 8 for E4M3, 2 for E2M1); each element is ``x / X``
  rounded to nearest even in E4M3 or E2M1, saturated to the format's largest
  value. The exponent is clamped to E8M0's range, -127 (an all-zero block's
  too) to 127; a block holding inf or NaN gets the NaN scale ``0xFF``.
* NVFP4: E2M1 elements in blocks of 16, each block an E4M3 scale, and one fp32
  scale for the tensor, ``amax / (448 * 6)``, so that the block scales
  ``(block amax / 6) / tensor scale`` fit E4M3. Rounded as torchao's
  ``nvfp4_quantize`` rounds (the block scale clamped to E4M3's smallest normal
  value, elements multiplied by ``(1 / tensor scale) / block scale``); a block
  holding inf or NaN gets the E4M3 NaN scale ``0x7F``.

Codes are packed as :func:`gradcomp.ops.reference.pack_bits` packs (E2M1: two a
byte, the first element in the low nibble). A payload row holds the fp32 tensor
scale (NVFP4), the block scales, then the codes, as ``gradcomp.payload`` lays a
payload out.
"""

from __future__ import annotations

import dataclasses

import torch

from gradcomp.ops.reference_shared import (
    blocks_of,
    compensate,
    divide,
    pack_bits,
    store_residual,
    unpack_bits,
    write_out,
)

# E8M0: an exponent with bias 127, no sign, no mantissa; 0xFF is NaN.
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# E4M3 (the "fn" variant: no infinities) has NaN at 0x7F and 0xFF.
E4M3_NAN = 0x7F
# NVFP4's tensor scale is at least this: the elements are multiplied by
# (1 / tensor scale) / block scale, block scales at least E4M3's 2**-6, which
# must stay finite (a tensor of absmax below about 2**-109 rounds to zero and
# stays in the residual).
SMALLEST_TENSOR_SCALE = 2.0**-120


@dataclasses.dataclass(frozen=True)
class Minifloat:
    """A small float format: sign, exponent and ``mantissa_bits`` in ``bits``, the
    smallest normal exponent ``min_exponent``, saturating at ``largest``."""

    name: str
    bits: int
    mantissa_bits: int
    min_exponent: int
    largest: float
    largest_power: int  # floor(log2(largest)): the OCP spec's emax_elem
    nan_code: int | None  # the magnitude code that is NaN, if any

    def magnitudes(self) -> list[float]:
        """Value of each magnitude code ``0 .. 2 ** (bits - 1) - 1``, NaN where the code is."""
        values = []
        for code in range(2 ** (self.bits - 1)):
            exponent, mantissa = code >> self.mantissa_bits, code & ((1 << self.mantissa_bits) - 1)
            if exponent == 0:  # subnormal
                value = mantissa * 2.0 ** (self.min_exponent - self.mantissa_bits)
            else:
                value = (2**self.mantissa_bits + mantissa) * 2.0 ** (
                    exponent - 1 + self.min_exponent - self.mantissa_bits
                )
            values.append(float("nan") if code == self.nan_code else value)
        return values


E4M3 = Minifloat("e4m3", 8, 3, -6, 448.0, 8, 0x7F)
E2M1 = Minifloat("e2m1", 4, 1, 0, 6.0, 2, None)
ELEMENTS = {"e4m3": E4M3, "e2m1": E2M1}


def element_values(element: Minifloat, device: torch.device) -> torch.Tensor:
    """fp32 value of every code of ``element`` (``2 ** bits`` of them, the sign the top bit)."""
    magnitudes = torch.tensor(element.magnitudes(), dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def round_to_element(v: torch.Tensor, element: Minifloat) -> torch.Tensor:
    """``v`` (fp32) rounded to nearest even in ``element``, saturated to its largest
    value; the sign kept (also of a zero). Finite input only."""
    magnitude = v.abs().clamp(max=element.largest)
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2 ** exponent, m in [0.5, 1)
    # The spacing of values in magnitude's binade; subnormals share the smallest normal one.
    power = (exponent - 1).clamp(min=element.min_exponent) - element.mantissa_bits
    step = torch.exp2(power.to(torch.float32))  # exact: a small integer power
    # magnitude / step is exact (a power of two within range); torch.round rounds half to even,
    # and a value rounded up to the next binade's first value is that value.
    rounded = (torch.round(magnitude / step) * step).clamp(max=element.largest)
    return torch.copysign(rounded, v)


def element_codes(rounded: torch.Tensor, element: Minifloat) -> torch.Tensor:
    """The codes (uint8) of values already on ``element``'s grid."""
    magnitudes = element_values(element, rounded.device)[: 2 ** (element.bits - 1)]
    finite = magnitudes[torch.isfinite(magnitudes)]  # increasing with the code
    code = torch.searchsorted(finite, rounded.abs())
    sign = torch.signbit(rounded).to(torch.int64) << (element.bits - 1)
    return (code | sign).to(torch.uint8)


def decode_elements(codes: torch.Tensor, element: Minifloat, numel: int) -> torch.Tensor:
    """fp32 values of the first ``numel`` packed codes."""
    unpacked = unpack_bits(codes, element.bits, numel).to(torch.int64)
    return element_values(element, codes.device)[unpacked]


# ----------------------------------------------------------------------------- E8M0


def e8m0_scales(peak: torch.Tensor, element: Minifloat) -> torch.Tensor:
    """The E8M0 bits (uint8) of each block's shared scale, from its absmax ``peak``."""
    _, exponent = torch.frexp(peak)  # floor(log2(peak)) = exponent - 1 for finite peak > 0
    shared = torch.where(peak > 0, exponent - 1 - element.largest_power, -E8M0_BIAS)
    biased = shared.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    return torch.where(torch.isfinite(peak), biased, E8M0_NAN).to(torch.uint8)


def e8m0_values(scales: torch.Tensor) -> torch.Tensor:
    """fp32 value of E8M0 bits: ``2 ** (bits - 127)``, NaN for 0xFF."""
    exponent = scales.to(torch.int32)
    # The exponent field of an fp32; 2 ** -127 (bits 0) is the subnormal 0x00400000.
    value = torch.where(exponent > 0, exponent << 23, 0x00400000).view(torch.float32)
    return torch.where(exponent == E8M0_NAN, torch.nan, value)


# ----------------------------------------------------------------------------- MX


def mx_quantize(
    x: torch.Tensor, element: str, block: int = 32, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX encoding (MXFP8: ``element="e4m3"``, MXFP4: ``"e2m1"``), error feedback fused.

    Args:
        x: floating tensor of any shape (read as flat).
        element: the element format, ``"e4m3"`` or ``"e2m1"``.
        block: elements sharing one scale (32 in the spec).
        residual: error-feedback memory (same numel as ``x``), updated in place.

    Returns:
        ``(packed element codes uint8, E8M0 scale bits uint8 of ceil(numel / block))``.

    Example:
        >>> codes, scales = mx_quantize(torch.randn(100), "e2m1")   # 50 bytes, 4 scales
    """
    fmt = ELEMENTS[element]
    y = compensate(x, residual)
    numel = y.numel()
    blocks = blocks_of(y, block)
    finite = torch.isfinite(blocks).all(dim=1)
    peak = torch.where(finite, blocks.abs().amax(dim=1), torch.inf)
    scales = e8m0_scales(peak, fmt)
    scale = e8m0_values(scales).unsqueeze(1)  # NaN for a block holding inf or NaN
    # Divided by a power of two: exact, or below 2**-126 where the element rounds to zero
    # anyway (E4M3's smallest value is 2**-9), so one rounding, to the element.
    rounded = round_to_element(torch.where(finite.unsqueeze(1), blocks / scale, 0.0), fmt)
    codes = element_codes(rounded, fmt).view(-1)[:numel]
    decoded = (rounded * scale).view(-1)[:numel]
    store_residual(residual, y, decoded)
    return pack_bits(codes, fmt.bits), scales


def mx_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    element: str,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Decode :func:`mx_quantize`: element value times its block's scale, in fp32.

    Returns:
        ``out`` if given (written, or added into if ``accumulate``), else a new
        fp32 tensor of ``numel`` elements.
    """
    values = blocks_of(decode_elements(codes, ELEMENTS[element], numel), block)
    decoded = (values * e8m0_values(scales.reshape(-1)).unsqueeze(1)).view(-1)[:numel]
    return write_out(decoded, out, accumulate)


def mx_dequantize_sum(
    rows: torch.Tensor, element: str, block: int, numel: int, out: torch.Tensor, *, divisor: int = 1
) -> torch.Tensor:
    """``out = (sum of the MX payloads of numel elements in every row, added in fp32
    in row order) / divisor``, rounded once to ``out``'s dtype. A row holds the
    scales, then the codes. Returns ``out``."""
    blocks = -(-numel // block)
    size = -(-numel * ELEMENTS[element].bits // 8)

    def decode(row, total):
        mx_dequantize(row[blocks : blocks + size], row[:blocks], element, block, numel, total, True)

    return _sum_rows(rows, numel, out, divisor, decode)


def _sum_rows(rows: torch.Tensor, numel: int, out: torch.Tensor, divisor: int, decode) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.float32, device=rows.device)
    for row in rows:
        decode(row, total)
    out.view(-1)[:numel].copy_(divide(total, divisor) if divisor != 1 else total)
    return out


# ----------------------------------------------------------------------------- NVFP4


def nvfp4_tensor_scale(y: torch.Tensor) -> torch.Tensor:
    """NVFP4's fp32 tensor scale (one element): the absmax of the finite values over
    ``448 * 6``, at least :data:`SMALLEST_TENSOR_SCALE`."""
    peak = torch.where(torch.isfinite(y), y.abs(), 0.0).amax() if y.numel() else y.new_zeros(())
    return divide(peak.reshape(1), E4M3.largest * E2M1.largest).clamp(min=SMALLEST_TENSOR_SCALE)


def nvfp4_quantize(
    x: torch.Tensor, block: int = 16, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 encoding, error feedback fused.

    Args:
        x: floating tensor of any shape (read as flat).
        block: elements sharing one E4M3 scale (16 in NVFP4).
        residual: error-feedback memory (same numel as ``x``), updated in place.

    Returns:
        ``(packed E2M1 codes uint8, E4M3 scale bits uint8 of ceil(numel / block),
        the fp32 tensor scale: one element, none for an empty tensor)``.

    Example:
        >>> codes, scales, tensor_scale = nvfp4_quantize(torch.randn(100))
    """
    y = compensate(x, residual)
    numel = y.numel()
    tensor_scale = nvfp4_tensor_scale(y)
    blocks = blocks_of(y, block)
    finite = torch.isfinite(blocks).all(dim=1)
    peak = torch.where(finite, blocks.abs().amax(dim=1), 0.0)
    smallest_normal = 2.0**E4M3.min_exponent
    # divide(): a tensor divided by a Python number is multiplied by its reciprocal on CUDA.
    wanted = (divide(peak, E2M1.largest) / tensor_scale).clamp(smallest_normal, E4M3.largest)
    scale = round_to_element(wanted, E4M3)
    reciprocal = (1.0 / tensor_scale) / scale
    rounded = round_to_element((blocks * reciprocal.unsqueeze(1)).clamp(-E2M1.largest, E2M1.largest), E2M1)
    rounded = torch.where(finite.unsqueeze(1), rounded, 0.0)
    scales = torch.where(finite, element_codes(scale, E4M3), E4M3_NAN)
    block_value = torch.where(finite, scale * tensor_scale, torch.nan)
    decoded = (rounded * block_value.unsqueeze(1)).view(-1)[:numel]
    store_residual(residual, y, decoded)
    codes = pack_bits(element_codes(rounded, E2M1).view(-1)[:numel], E2M1.bits)
    return codes, scales, tensor_scale[: min(numel, 1)]  # an empty tensor sends nothing


def nvfp4_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Decode :func:`nvfp4_quantize`: element times (block scale times tensor scale), in fp32."""
    values = blocks_of(decode_elements(codes, E2M1, numel), block)
    block_value = element_values(E4M3, scales.device)[scales.reshape(-1).to(torch.int64)]
    decoded = (values * (block_value * tensor_scale.reshape(-1).float()).unsqueeze(1)).view(-1)[:numel]
    return write_out(decoded, out, accumulate)


def nvfp4_dequantize_sum(
    rows: torch.Tensor, block: int, numel: int, out: torch.Tensor, *, divisor: int = 1
) -> torch.Tensor:
    """The sum of NVFP4 payloads in rows, as :func:`mx_dequantize_sum`; a row holds
    the tensor scale (fp32), the block scales, then the codes."""
    start = 4 * min(numel, 1)
    blocks = -(-numel // block)
    size = -(-numel * E2M1.bits // 8)

    def decode(row, total):
        tensor_scale = row[:start].view(torch.float32)
        scales, codes = row[start : start + blocks], row[start + blocks : start + blocks + size]
        nvfp4_dequantize(codes, scales, tensor_scale, block, numel, total, True)

    return _sum_rows(rows, numel, out, divisor, decode)
