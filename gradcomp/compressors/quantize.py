"""Blockwise linear quantization (int8 / int4 / int2 / ternary) and QSGD."""

from __future__ import annotations

import math

import torch

from gradcomp import ops
from gradcomp.compressors.base import Compressor, Context, check_positive_int, without_grad
from gradcomp.ops import reference
from gradcomp.payload import Layout, Payload, buffer_size, row_views


class BlockQuantizer(Compressor):
    """Linear quantization with one fp32 absmax scale per block.

    Each element becomes a signed level in ``[-L, L]``, ``L = 2**(bits-1) - 1``,
    packed ``bits`` wide (int4: two a byte, int2: four a byte).

    Args:
        block: elements sharing one scale (default 256: 1.6% overhead at 8 bits).
        stochastic: stochastic rounding (unbiased; no error feedback by
            default) instead of round-to-nearest (biased; feedback on).
        feedback, seed: see :class:`Compressor`.

    Example:
        >>> c = gradcomp.get_compressor("int4", block=128, stochastic=True)
        >>> g = c.decompress(c.compress(grad))
    """

    bits: int = 8
    scale_mode = "absmax"

    def __init__(
        self, *, block: int = 256, stochastic: bool = False, feedback: bool | None = None, seed: int = 0
    ):
        super().__init__(feedback=feedback, seed=seed)
        self.block = check_positive_int("block", block)
        if not isinstance(stochastic, bool):
            raise TypeError(f"stochastic must be a bool, got {stochastic!r}")
        self.stochastic = stochastic

    @property
    def levels(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def unbiased(self) -> bool:
        return self.stochastic

    def payload_layout(self, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Layout:
        return [
            ("scales", torch.float32, math.ceil(numel / self.block)),
            ("codes", torch.uint8, math.ceil(numel * self.bits / 8)),
        ]

    def _encode(self, flat: torch.Tensor, ctx: Context):
        codes, scales = ops.quantize_blockwise(
            flat,
            self.bits,
            self.block,
            self.stochastic,
            self._private_seed(ctx),
            ctx.residual,
            levels=self.levels,
            scale=self.scale_mode,
        )
        return {"scales": scales, "codes": codes}, {}

    def _rows_fit(self, chunk: int) -> bool:
        """Whether the row ops apply: whole blocks a chunk, whole bytes of codes a block."""
        return chunk % self.block == 0 and (self.block * self.bits) % 8 == 0

    @without_grad
    def compress_rows(self, flat: torch.Tensor, chunk: int, rows: torch.Tensor, ctx: Context) -> None:
        if not self._rows_fit(chunk):
            return super().compress_rows(flat, chunk, rows, ctx)
        options = {"levels": self.levels, "scale": self.scale_mode}
        random = (self.stochastic, self._private_seed(ctx))
        ops.quantize_rows(flat, self.bits, self.block, chunk, rows, *random, ctx.residual, **options)

    @without_grad
    def decompress_rows(self, rows: torch.Tensor, dtype: torch.dtype, chunk: int, out: torch.Tensor) -> None:
        if not self._rows_fit(chunk):
            return super().decompress_rows(rows, dtype, chunk, out)
        ops.dequantize_rows(rows, self.bits, self.block, out.numel(), chunk, out, levels=self.levels)

    @without_grad
    def decompress_sum(self, rows, dtype, out, *, meta=None, divisor: int = 1) -> None:
        if not self._rows_fit(self.block):
            return super().decompress_sum(rows, dtype, out, meta=meta, divisor=divisor)
        ops.dequantize_sum(rows, self.bits, self.block, out.numel(), out, levels=self.levels, divisor=divisor)

    @without_grad
    def encode_row(self, flat: torch.Tensor, row: torch.Tensor, ctx: Context) -> dict[str, int]:
        # quantize_rows of one row holds quantize_blockwise's bits with the same seed
        # (compress's): the payload's bytes, as Payload.to_buffer lays them out.
        chunk = -(-flat.numel() // self.block) * self.block
        if not self._rows_fit(chunk) or chunk == 0:
            return super().encode_row(flat, row, ctx)
        quantize = ops.implementation("quantize_rows", flat.device)
        options = {"levels": self.levels, "scale": self.scale_mode}
        random = (self.stochastic, self._private_seed(ctx))
        quantize(flat, self.bits, self.block, chunk, row.view(1, -1), *random, ctx.residual, **options)
        return {}

    @without_grad
    def decode_rows(self, rows: torch.Tensor, out: torch.Tensor, meta: dict[str, int], divisor: int) -> None:
        if not self._rows_fit(self.block):
            return super().decode_rows(rows, out, meta, divisor)
        decode = ops.implementation("dequantize_sum", out.device)
        decode(rows, self.bits, self.block, out.numel(), out, levels=self.levels, divisor=divisor)
        return None

    def _decode(self, payload: Payload, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        return ops.dequantize_blockwise(
            payload.tensors["codes"],
            payload.tensors["scales"],
            self.bits,
            self.block,
            payload.numel,
            out,
            accumulate,
            levels=self.levels,
        )


class Int8(BlockQuantizer):
    """8-bit blockwise quantization (levels -127..127)."""

    name = "int8"
    bits = 8


class Int4(BlockQuantizer):
    """4-bit blockwise quantization (levels -7..7, two codes a byte)."""

    name = "int4"
    bits = 4


class Int2(BlockQuantizer):
    """2-bit blockwise quantization (levels -1, 0, 1, four codes a byte)."""

    name = "int2"
    bits = 2


class Ternary(BlockQuantizer):
    """int2's three levels (-1, 0, 1 times the block's absmax) packed five a
    byte in base 3: 1.6 bits a code instead of 2, the same values as ``int2``.

    Example:
        >>> c = gradcomp.get_compressor("ternary", block=512)
        >>> c.compress(torch.randn(1000)).nbytes   # 200 code bytes + 2 scales
        208
    """

    name = "ternary"
    bits = 8  # quantized a code a byte, then packed five a byte

    @property
    def levels(self) -> int:
        return 1

    def payload_layout(self, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Layout:
        return [
            ("scales", torch.float32, math.ceil(numel / self.block)),
            ("codes", torch.uint8, math.ceil(numel / reference.TRITS_PER_BYTE)),
        ]

    def _encode(self, flat: torch.Tensor, ctx: Context):
        tensors, meta = super()._encode(flat, ctx)
        return {**tensors, "codes": reference.pack_trits(tensors["codes"])}, meta

    def _decode(self, payload: Payload, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        codes = reference.unpack_trits(payload.tensors["codes"], payload.numel)
        return super()._decode(payload.with_tensors({**payload.tensors, "codes": codes}), out, accumulate)

    # Rows: int8's row ops on rows of a code a byte, packed (or unpacked) all
    # full rows at once and a short last row apart (it has a layout of its
    # own): the kernels per call do not grow with the number of rows.
    def _wide_size(self, numel: int, dtype: torch.dtype) -> int:
        return buffer_size(BlockQuantizer.payload_layout(self, numel, dtype, {}))

    def _convert(self, wide: torch.Tensor, packed: torch.Tensor, numel: int, dtype, pack: bool) -> None:
        """Rows of payloads of ``numel`` elements: ``wide`` (a code a byte) to
        ``packed`` (five a byte) if ``pack``, else back."""
        packed_layout = self.payload_layout(numel, dtype, {})
        wide_views = row_views(wide, BlockQuantizer.payload_layout(self, numel, dtype, {}))
        packed_views = row_views(packed, packed_layout)
        if pack:
            packed_views["scales"].copy_(wide_views["scales"])
            packed_views["codes"].copy_(reference.pack_trits(wide_views["codes"]))
            raw = sum(count * item.itemsize for _, item, count in packed_layout)
            packed[:, raw : buffer_size(packed_layout)].zero_()  # as Payload.to_buffer pads
        else:
            wide_views["scales"].copy_(packed_views["scales"])
            wide_views["codes"].copy_(reference.unpack_trits(packed_views["codes"], numel))

    @staticmethod
    def _row_groups(total: int, chunk: int) -> list[tuple[slice, int]]:
        """``(rows, numel)``: the full rows, then the short last one."""
        full, rest = divmod(total, chunk)
        groups = [(slice(0, full), chunk)] if full else []
        return groups + ([(slice(full, full + 1), rest)] if rest else [])

    @without_grad
    def compress_rows(self, flat: torch.Tensor, chunk: int, rows: torch.Tensor, ctx: Context) -> None:
        if not self._rows_fit(chunk):
            return Compressor.compress_rows(self, flat, chunk, rows, ctx)
        wide = torch.empty(
            rows.shape[0], self._wide_size(chunk, flat.dtype), dtype=torch.uint8, device=rows.device
        )
        super().compress_rows(flat, chunk, wide, ctx)
        for which, numel in self._row_groups(flat.numel(), chunk):
            self._convert(wide[which], rows[which], numel, flat.dtype, pack=True)

    @without_grad
    def decompress_rows(self, rows: torch.Tensor, dtype: torch.dtype, chunk: int, out: torch.Tensor) -> None:
        if not self._rows_fit(chunk):
            return Compressor.decompress_rows(self, rows, dtype, chunk, out)
        wide = torch.empty(
            rows.shape[0], self._wide_size(chunk, dtype), dtype=torch.uint8, device=rows.device
        )
        for which, numel in self._row_groups(out.numel(), chunk):
            self._convert(wide[which], rows[which], numel, dtype, pack=False)
        super().decompress_rows(wide, dtype, chunk, out)

    # Rows of five codes a byte: the general one-row path (compress, to_buffer, decompress_sum).
    encode_row = Compressor.encode_row
    decode_rows = Compressor.decode_rows

    @without_grad
    def decompress_sum(self, rows, dtype, out, *, meta=None, divisor: int = 1) -> None:
        numel = out.numel()
        wide = torch.empty(
            rows.shape[0], self._wide_size(numel, dtype), dtype=torch.uint8, device=rows.device
        )
        self._convert(wide, rows, numel, dtype, pack=False)
        super().decompress_sum(wide, dtype, out, meta=meta, divisor=divisor)


class QSGD(BlockQuantizer):
    """QSGD: norm-scaled stochastic quantization to ``levels`` levels (unbiased).

    Each block of ``block`` elements is scaled by its L2 norm; an element
    ``y`` is sent as ``norm / levels * l`` with integer ``l`` drawn so that
    ``E[l] = levels * y / norm``.

    Args:
        levels: number of positive levels ``s`` (1 .. 127); codes take
            ``ceil(log2(2 s + 1))`` bits rounded up to 1, 2, 4 or 8.
        block: elements sharing one norm (default 256).
    """

    name = "qsgd"
    scale_mode = "norm"

    def __init__(self, *, levels: int = 7, block: int = 256, feedback: bool | None = None, seed: int = 0):
        super().__init__(block=block, stochastic=True, feedback=feedback, seed=seed)
        check_positive_int("levels", levels)
        if levels > 127:
            raise ValueError(f"levels must be at most 127, got {levels}")
        self._levels = levels
        self.bits = ops.code_bits(levels)

    @property
    def levels(self) -> int:
        return self._levels
