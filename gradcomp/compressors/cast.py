"""Dense baseline and low-precision casts."""

from __future__ import annotations

import torch

from gradcomp.compressors.base import Compressor, Context
from gradcomp.ops import reference
from gradcomp.payload import Layout, Payload


class NoCompression(Compressor):
    """Sends the tensor as it is: the dense baseline.

    Example:
        >>> gradcomp.all_reduce(grad, gradcomp.get_compressor("none"))  # same as dist.all_reduce
    """

    name = "none"
    summable = True

    @property
    def unbiased(self) -> bool:
        return True

    def payload_layout(self, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Layout:
        return [("values", dtype, numel)]

    def _encode(self, flat: torch.Tensor, ctx: Context):
        # Nothing is dropped: a residual only carries over what an earlier
        # compressor left behind (or rounding to the tensor's dtype loses now).
        if ctx.residual is None:
            return {"values": flat}, {}
        y = reference.compensate(flat, ctx.residual)
        values = y.to(flat.dtype, copy=True)  # store_residual consumes y
        reference.store_residual(ctx.residual, y, values.float())
        return {"values": values}, {}

    def _decode(self, payload: Payload, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        values = payload.tensors["values"]
        # The payload may alias the input tensor; a new result must not.
        return reference.write_out(values.clone() if out is None else values, out, accumulate)


class Cast(Compressor):
    """Casts to a 16-bit float type (summable: ranks add the casts directly).

    Args:
        wire_dtype: ``torch.float16`` or ``torch.bfloat16``.
    """

    summable = True

    @property
    def default_feedback(self) -> bool:
        # Rounding to 16 bits loses ~1e-3 relative; like torch's fp16 hook, no memory by default.
        return False

    def payload_layout(self, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Layout:
        return [("values", self.wire_dtype, numel)]

    def _encode(self, flat: torch.Tensor, ctx: Context):
        if ctx.residual is None:
            return {"values": flat.to(self.wire_dtype)}, {}
        y = reference.compensate(flat, ctx.residual)
        values = y.to(self.wire_dtype)
        reference.store_residual(ctx.residual, y, values.float())
        return {"values": values}, {}

    def _decode(self, payload: Payload, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        values = payload.tensors["values"]
        # Into an output, widening happens on the way (no fp32 temporary).
        return reference.write_out(values.float() if out is None else values, out, accumulate)


class FP16(Cast):
    """IEEE half precision on the wire (2 bytes an element)."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16(Cast):
    """bfloat16 on the wire (2 bytes an element, fp32's range)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
