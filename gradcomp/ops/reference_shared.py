"""What every op of :mod:`gradcomp.ops.reference` shares: seeded generators, index
dtypes, the one rounding of a division, error-feedback compensation, residual and
output writes, blocks, bit packing. Re-exported by :mod:`gradcomp.ops.reference`."""

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
