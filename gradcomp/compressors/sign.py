"""1-bit scaled sign compression."""

from __future__ import annotations

import math

import torch

from gradcomp import ops
from gradcomp.compressors.base import Compressor, Context, check_positive_int
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

    def _decode(self, payload: Payload, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        return ops.sign_decompress(
            payload.tensors["signs"], payload.tensors["scales"], self.block, payload.numel, out, accumulate
        )
