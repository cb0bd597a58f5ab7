"""Bit packing for the CPU backend: 1-bit codes through numpy's packbits, 2- and 4-bit
codes a byte at a time as little-endian words (the reference's bits, tested against it)."""

from __future__ import annotations

import sys

import numpy as np
import torch


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference: :func:`gradcomp.ops.reference.pack_bits`."""
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes.clone()
    if bits == 1:
        # numpy's packbits, in place of eight shifted ORs.
        return torch.from_numpy(np.packbits(codes.numpy(), bitorder="little"))
    per_byte = 8 // bits
    pad = (-codes.numel()) % per_byte
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    if _words_apply(codes):
        return _pack_words(codes, bits)
    return _pack_positions(codes, bits)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Reference: :func:`gradcomp.ops.reference.unpack_bits`."""
    if bits == 8:
        return packed.reshape(-1)[:numel]
    packed = packed.reshape(-1)
    if bits == 1:
        count = min(numel, 8 * packed.numel())
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=count, bitorder="little"))
    if _words_apply(packed):
        return _unpack_words(packed, bits)[:numel]
    return _unpack_positions(packed, bits)[:numel]


# 2- and 4-bit codes on CPU: the codes of one packed byte, read as one
# little-endian word (int32 or int16), are moved into place all at once by a
# few shifts and masks: contiguous ops, where one strided op per position
# costs several times as much.
_WORDS = {2: torch.int32, 4: torch.int16}


def _words_apply(tensor: torch.Tensor) -> bool:
    return sys.byteorder == "little"


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
