"""Packing and unpacking of 1, 2, 4 and 8-bit codes (element i in byte i // (8 // bits))."""

import torch
import triton
import triton.language as tl

from .common import flat

BYTES_PER_PROGRAM = 1024


@triton.jit
def _pack_kernel(codes_ptr, packed_ptr, numel, nbytes, BITS: tl.constexpr, BYTES: tl.constexpr):
    per_byte: tl.constexpr = 8 // BITS
    start = tl.program_id(0).to(tl.int64) * BYTES
    byte_index = start + tl.arange(0, BYTES)
    element = byte_index[:, None] * per_byte + tl.arange(0, per_byte)[None, :]
    codes = tl.load(codes_ptr + element, mask=element < numel, other=0).to(tl.int32)
    shifts = tl.arange(0, per_byte) * BITS
    packed = tl.sum(codes << shifts[None, :], axis=1)
    tl.store(packed_ptr + byte_index, packed.to(tl.uint8), mask=byte_index < nbytes)


@triton.jit
def _unpack_kernel(packed_ptr, codes_ptr, numel, BITS: tl.constexpr, BLOCK: tl.constexpr):
    per_byte: tl.constexpr = 8 // BITS
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    byte = tl.load(packed_ptr + offsets // per_byte, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((offsets % per_byte) * BITS).to(tl.int32)) & ((1 << BITS) - 1)
    tl.store(codes_ptr + offsets, code.to(tl.uint8), mask=mask)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference.pack_bits`."""
    codes = flat(codes).to(torch.uint8)
    if bits == 8:
        return codes.clone()
    numel = codes.numel()
    nbytes = -(-numel * bits // 8)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if nbytes:
        grid = (triton.cdiv(nbytes, BYTES_PER_PROGRAM),)
        _pack_kernel[grid](codes, packed, numel, nbytes, BITS=bits, BYTES=BYTES_PER_PROGRAM)
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference.unpack_bits`."""
    packed = flat(packed)
    if bits == 8:
        return packed[:numel]
    codes = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    if numel:
        _unpack_kernel[(triton.cdiv(numel, 4096),)](packed, codes, numel, BITS=bits, BLOCK=4096)
    return codes
