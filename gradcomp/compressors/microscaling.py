"""Block-scaled floats: MXFP8 and MXFP4 (OCP Microscaling v1.0) and NVFP4.

The element and scale formats are defined in :mod:`gradcomp.ops.reference_mx`; the
ops run on the backend :mod:`gradcomp.ops` picks (Triton kernels on a GPU).
Round to nearest is biased: error feedback is on by default, as for ``int8``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from gradcomp import ops
from gradcomp.compressors.base import Compressor, Context, without_grad
from gradcomp.ops import reference_mx
from gradcomp.payload import Layout, Payload


class Microscaling(Compressor):
    """OCP MX: blocks of 32 elements in a small float format, one power-of-two
    (E8M0) scale a block.

    Example:
        >>> c = gradcomp.get_compressor("mxfp8")
        >>> c.compress(torch.randn(1024)).nbytes   # 1024 codes, 32 scales
        1056
    """

    element: ClassVar[str] = "e4m3"
    block: ClassVar[int] = 32

    @property
    def bits(self) -> int:
        return reference_mx.ELEMENTS[self.element].bits

    def payload_layout(self, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Layout:
        return [
            ("scales", torch.uint8, math.ceil(numel / self.block)),
            ("codes", torch.uint8, math.ceil(numel * self.bits / 8)),
        ]

    def _encode(self, flat: torch.Tensor, ctx: Context):
        codes, scales = ops.mx_quantize(flat, self.element, self.block, ctx.residual)
        return {"scales": scales, "codes": codes}, {}

    def _decode(self, payload: Payload, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        codes, scales = payload.tensors["codes"], payload.tensors["scales"]
        numel = payload.numel
        return ops.mx_dequantize(codes, scales, self.element, self.block, numel, out, accumulate)

    @without_grad
    def decompress_sum(self, rows, dtype, out, *, meta=None, divisor: int = 1) -> None:
        ops.mx_dequantize_sum(rows, self.element, self.block, out.numel(), out, divisor=divisor)


class MXFP8(Microscaling):
    """MXFP8: E4M3 elements (largest 448), 32 a block, an E8M0 scale a block:
    1 + 1/32 bytes an element."""

    name = "mxfp8"
    element = "e4m3"


class MXFP4(Microscaling):
    """MXFP4: E2M1 elements (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two a
    byte, 32 a block, an E8M0 scale a block: 0.5 + 1/32 bytes an element."""

    name = "mxfp4"
    element = "e2m1"


class NVFP4(Compressor):
    """NVFP4: E2M1 elements, two a byte, 16 a block, an E4M3 scale a block and an
    fp32 scale for the tensor: 0.5 + 1/16 bytes an element and 4 bytes a tensor.

    Example:
        >>> c = gradcomp.get_compressor("nvfp4")
        >>> c.compress(torch.randn(1024)).nbytes   # 512 code bytes, 64 scales, the tensor scale
        580
    """

    name = "nvfp4"
    block: ClassVar[int] = 16

    def payload_layout(self, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Layout:
        return [
            ("tensor_scale", torch.float32, min(numel, 1)),  # none for an empty tensor
            ("scales", torch.uint8, math.ceil(numel / self.block)),
            ("codes", torch.uint8, math.ceil(numel / 2)),
        ]

    def _encode(self, flat: torch.Tensor, ctx: Context):
        codes, scales, tensor_scale = ops.nvfp4_quantize(flat, self.block, ctx.residual)
        return {"tensor_scale": tensor_scale, "scales": scales, "codes": codes}, {}

    def _decode(self, payload: Payload, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        codes, scales, tensor_scale = (payload.tensors[name] for name in ("codes", "scales", "tensor_scale"))
        numel = payload.numel
        return ops.nvfp4_dequantize(codes, scales, tensor_scale, self.block, numel, out, accumulate)

    @without_grad
    def decompress_sum(self, rows, dtype, out, *, meta=None, divisor: int = 1) -> None:
        ops.nvfp4_dequantize_sum(rows, self.block, out.numel(), out, divisor=divisor)
