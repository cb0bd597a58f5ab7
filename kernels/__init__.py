"""Triton kernels of gradcomp (installed as ``gradcomp.kernels``; imports triton and torch only).

Each launcher checks its inputs, allocates, picks the grid and runs one or
two kernels; :mod:`gradcomp.ops.triton_backend` turns them into the ops of
:mod:`gradcomp.ops.reference`, against which they are tested. They run on
CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (Triton's
interpreter: slow, for testing).
"""

import os

import torch

from .bits import pack_bits, unpack_bits
from .quantize import dequantize_blockwise, dequantize_rows, dequantize_sum, quantize_blockwise, quantize_rows
from .sign import (
    sign_compress,
    sign_compress_rows,
    sign_decompress,
    sign_decompress_rows,
    sign_decompress_sum,
)
from .sparse import fold_into_residual, gather_compensated, randk_indices, scatter_add
from .topk import keep_largest, select_candidates, write_back


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_available(device: torch.device) -> bool:
    """CUDA tensors always; CPU tensors only in the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


__all__ = [
    "dequantize_blockwise",
    "dequantize_rows",
    "dequantize_sum",
    "fold_into_residual",
    "gather_compensated",
    "interpreting",
    "is_available",
    "keep_largest",
    "pack_bits",
    "quantize_blockwise",
    "quantize_rows",
    "randk_indices",
    "scatter_add",
    "select_candidates",
    "sign_compress",
    "sign_compress_rows",
    "sign_decompress",
    "sign_decompress_rows",
    "sign_decompress_sum",
    "unpack_bits",
    "write_back",
]
