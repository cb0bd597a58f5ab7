"""1-bit scaled sign compression."""

from __future__ import annotations

import math

import torch

from gradcomp import ops
from gradcomp.compressors.base import Compressor, Context, check_positive_int, without_grad
from gradcomp.payload import Layout, Payload


class Sign(Compressor):
    """One bit an element (its sign) and one fp32 scale, the mean magnitude, per block.

    Biased: error feedback is on by default (without it sign-SGD may not
    converge).

    Args:
        block: elements sharing one scale (default 1024: 32x smaller than fp32).

    Example:
        >>> c = gradcomp.get_compressor("sign")
        >>> c.compress(torch.randn(4096)).nbytes
        528
    """

    name = "sign"

    def __init__(self, *, block: int = 1024, feedback: bool | None = None, seed: int = 0):
        super().__init__(feedback=feedback, seed=seed)
        self.block = check_positive_int("block", block)

    def payload_layout(self, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Layout:
        return [
            ("scales", torch.float32, math.ceil(numel / self.block)),
            ("signs", torch.uint8, math.ceil(numel / 8)),
        ]

    def _encode(self, flat: torch.Tensor, ctx: Context):
        signs, scales = ops.sign_compress(flat, self.block, ctx.residual)
        return {"scales": scales, "signs": signs}, {}

    def _rows_fit(self, chunk: int) -> bool:
        """Whether the row ops apply: whole blocks a chunk, whole bytes of signs a block."""
        return chunk % self.block == 0 and self.block % 8 == 0

    @without_grad
    def compress_rows(self, flat: torch.Tensor, chunk: int, rows: torch.Tensor, ctx: Context) -> None:
        if not self._rows_fit(chunk):
            return super().compress_rows(flat, chunk, rows, ctx)
        ops.sign_compress_rows(flat, self.block, chunk, rows, ctx.residual)

    @without_grad
    def decompress_rows(self, rows: torch.Tensor, dtype: torch.dtype, chunk: int, out: torch.Tensor) -> None:
        if not self._rows_fit(chunk):
            return super().decompress_rows(rows, dtype, chunk, out)
        ops.sign_decompress_rows(rows, self.block, out.numel(), chunk, out)

    @without_grad
    def decompress_sum(self, rows, dtype, out, *, meta=None, divisor: int = 1) -> None:
        if not self._rows_fit(self.block):
            return super().decompress_sum(rows, dtype, out, meta=meta, divisor=divisor)
        ops.sign_decompress_sum(rows, self.block, out.numel(), out, divisor=divisor)

    def _decode(self, payload: Payload, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        return ops.sign_decompress(
            payload.tensors["signs"], payload.tensors["scales"], self.block, payload.numel, out, accumulate
        )
