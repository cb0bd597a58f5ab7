"""Sparsification: Top-K by magnitude and random-K with a shared seed."""

from __future__ import annotations

import math

import torch

from gradcomp import ops
from gradcomp.compressors.base import Compressor, Context, resolve_k, without_grad
from gradcomp.payload import Layout, Payload, row_views

INDEX_DTYPES = {"auto": None, "int32": torch.int32, "int64": torch.int64}
# Top-K's kept values quantized (value_bits): the values sharing one absmax scale.
VALUE_BLOCK = 64


def _check_ratio_k(ratio, k) -> tuple[float | None, int | None]:
    if k is not None:
        if ratio is not None:
            raise ValueError("give ratio or k, not both")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        return None, k
    ratio = 0.01 if ratio is None else ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    return float(ratio), None


class _Sparse(Compressor):
    """Payloads of ``k`` values at indices: decoded by a scatter-add, and a
    mean divides the ``k`` values, not the output (see ``decompress``).

    Several ranks' payloads are added in rank order (:func:`gradcomp.ops.scatter_add`
    of their rows), so that an index that several ranks chose is summed in one order
    on every rank and backend, under any GPU schedule."""

    sparse = True

    def _indices(self, payload: Payload) -> torch.Tensor:
        raise NotImplementedError

    def _row_indices(self, fields: dict[str, torch.Tensor], numel: int, meta: dict[str, int]) -> torch.Tensor:
        """The indices of every row's payload, ``(rows, k)``, a rank's a row."""
        raise NotImplementedError

    @without_grad
    def decompress_sum(self, rows, dtype, out, *, meta=None, divisor: int = 1) -> None:
        """Every rank's payload added in rank order by one scatter-add of their rows; a
        mean divides each payload's ``k`` values before they are added, not the output."""
        self._sum(rows, dtype, out, meta, divisor, ops.scatter_add)

    @without_grad
    def decode_rows(self, rows: torch.Tensor, out: torch.Tensor, meta: dict[str, int], divisor: int) -> None:
        self._sum(rows, out.dtype, out, meta, divisor, ops.implementation("scatter_add", out.device))

    def _values(self, fields: dict[str, torch.Tensor], k: int) -> torch.Tensor:
        """The kept values of each row of ``fields``, ``(rows, k)``."""
        return fields["values"]

    def _sum(self, rows, dtype, out, meta, divisor: int, scatter_add) -> None:
        fields = row_views(rows, self.payload_layout(out.numel(), dtype, meta))
        values = self._values(fields, meta["k"])
        values = values.to(torch.promote_types(values.dtype, torch.float32))
        if divisor != 1:
            values = values / divisor
        total = out if out.dtype == torch.float32 else torch.empty(out.numel(), device=out.device)
        scatter_add(self._row_indices(fields, out.numel(), meta), values, total.zero_())
        if total is not out:
            out.copy_(total)

    def _decode(self, payload: Payload, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        return self._decode_divided(payload, out, accumulate, 1)

    def _decode_divided(self, payload: Payload, out, accumulate: bool, divisor: int) -> torch.Tensor:
        fields = {name: tensor.view(1, -1) for name, tensor in payload.tensors.items()}
        values = self._values(fields, payload.meta.get("k", 0)).view(-1)
        if divisor != 1:
            values = values.to(torch.promote_types(values.dtype, torch.float32)) / divisor
        if out is None:
            out = torch.zeros(payload.numel, dtype=torch.float32, device=values.device)
        elif not accumulate:
            out.zero_()
        return ops.scatter_add(self._indices(payload), values, out)


class TopK(_Sparse):
    """Keeps the ``k`` largest-magnitude elements: values plus indices.

    Args:
        ratio: fraction of elements kept (default 0.01), or
        k: number kept (give one of the two).
        exact: rank every element (a true top-k). The default ranks only
            the candidates that reach a threshold estimated from a sample:
            the same k elements unless the sample misjudged badly, and
            exactly ``k`` entries either way (see
            :func:`gradcomp.ops.reference.topk_select`).
        index_dtype: ``"auto"`` (int32 below 2**31 elements, else int64),
            ``"int32"`` or ``"int64"``.
        value_bits: None (the values in the tensor's dtype), or 8, 4 or 2: the
            kept values quantized too, with one absmax scale per
            :data:`VALUE_BLOCK` values (int2: -1, 0, +1 times the scale), their
            error kept in the residual with what was not selected (Top-K and
            2-bit values, as SparseLoCo sends DiLoCo's pseudo-gradients). Its
            payloads go through ``allgather``.

    Example:
        >>> c = gradcomp.get_compressor("topk", ratio=0.01)
        >>> p = c.compress(grad); p.meta["k"]
        >>> c = gradcomp.get_compressor("topk:ratio=0.02,value_bits=2")
    """

    name = "topk"

    def __init__(
        self,
        *,
        ratio: float | None = None,
        k: int | None = None,
        exact: bool = False,
        index_dtype: str = "auto",
        value_bits: int | None = None,
        feedback: bool | None = None,
        seed: int = 0,
    ):
        super().__init__(feedback=feedback, seed=seed)
        self.ratio, self.k = _check_ratio_k(ratio, k)
        if index_dtype not in INDEX_DTYPES:
            raise ValueError(f"index_dtype must be one of {list(INDEX_DTYPES)}, got {index_dtype!r}")
        if value_bits is not None and (type(value_bits) is not int or value_bits not in (8, 4, 2)):
            raise ValueError(f"value_bits must be None, 8, 4 or 2, got {value_bits!r}")
        self.exact = bool(exact)
        self.index_dtype = index_dtype
        self.value_bits = value_bits

    def _index_dtype(self, numel: int) -> torch.dtype:
        return INDEX_DTYPES[self.index_dtype] or ops.index_dtype_for(numel)

    def payload_layout(self, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Layout:
        k = meta["k"]
        if self.value_bits is not None:
            return [
                ("indices", self._index_dtype(numel), k),
                ("scales", torch.float32, math.ceil(k / VALUE_BLOCK)),
                ("codes", torch.uint8, math.ceil(k * self.value_bits / 8)),
            ]
        return [("indices", self._index_dtype(numel), k), ("values", dtype, k)]

    def _levels(self) -> int:
        return 2 ** (self.value_bits - 1) - 1

    def _encode(self, flat: torch.Tensor, ctx: Context):
        k = resolve_k(flat.numel(), self.ratio, self.k)
        values, indices = ops.topk_select(
            flat,
            k,
            ctx.residual,
            self.exact,
            seed=self._private_seed(ctx),
            index_dtype=self._index_dtype(flat.numel()),
            value_dtype=torch.float32 if self.value_bits is not None else flat.dtype,
        )
        if self.value_bits is None:
            return {"indices": indices, "values": values}, {"k": k}
        # The selected values' rounding error joins the residual, where the selection left 0.
        error = None if ctx.residual is None else torch.zeros_like(values)
        bits, levels = self.value_bits, self._levels()
        codes, scales = ops.quantize_blockwise(values, bits, VALUE_BLOCK, False, 0, error, levels=levels)
        if error is not None:
            ctx.residual.view(-1).index_copy_(0, indices.long(), error.to(ctx.residual.dtype))
        return {"indices": indices, "scales": scales, "codes": codes}, {"k": k}

    def _values(self, fields: dict[str, torch.Tensor], k: int) -> torch.Tensor:
        """The kept values of each row of ``fields`` (``(rows, k)``, fp32), decoded."""
        if self.value_bits is None:
            return fields["values"]
        bits, levels = self.value_bits, self._levels()
        decode = ops.dequantize_blockwise
        rows = zip(fields["codes"], fields["scales"], strict=True)
        return torch.stack(
            [decode(codes, scales, bits, VALUE_BLOCK, k, levels=levels) for codes, scales in rows]
        )

    @without_grad
    def encode_row(self, flat: torch.Tensor, row: torch.Tensor, ctx: Context) -> dict[str, int]:
        if self.value_bits is not None:  # no row op of its own: compress's bytes
            return super().encode_row(flat, row, ctx)
        numel = flat.numel()
        k = resolve_k(numel, self.ratio, self.k)
        select = ops.implementation("topk_select", flat.device)
        options = {"seed": self._private_seed(ctx), "index_dtype": self._index_dtype(numel)}
        values, indices = select(flat, k, ctx.residual, self.exact, value_dtype=flat.dtype, **options)
        layout = self.payload_layout(numel, flat.dtype, {"k": k})
        fields = row_views(row.view(1, -1), layout)
        fields["indices"][0].copy_(indices)
        fields["values"][0].copy_(values)
        row[sum(count * dtype.itemsize for _, dtype, count in layout) :].zero_()  # as to_buffer pads
        return {"k": k}

    def _indices(self, payload: Payload) -> torch.Tensor:
        return payload.tensors["indices"]

    def _row_indices(self, fields: dict[str, torch.Tensor], numel: int, meta: dict[str, int]) -> torch.Tensor:
        return fields["indices"]


class RandK(_Sparse):
    """Keeps ``k`` elements chosen by a seed that every rank shares.

    Only the values travel; indices follow from ``(seed, step, key)``, so the
    payloads of all ranks add up with a plain all-reduce (summable).

    Args:
        ratio / k: as for :class:`TopK`.
        rescale: multiply values by ``numel / k`` (unbiased; feedback off by
            default). Without it random-K is biased and feedback is on.

    Example:
        >>> c = gradcomp.get_compressor("randk", ratio=0.01)
    """

    name = "randk"
    summable = True

    def __init__(
        self,
        *,
        ratio: float | None = None,
        k: int | None = None,
        rescale: bool = False,
        feedback: bool | None = None,
        seed: int = 0,
    ):
        super().__init__(feedback=feedback, seed=seed)
        self.ratio, self.k = _check_ratio_k(ratio, k)
        self.rescale = bool(rescale)

    @property
    def unbiased(self) -> bool:
        return self.rescale

    def payload_layout(self, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Layout:
        return [("values", dtype, meta["k"])]

    def _encode(self, flat: torch.Tensor, ctx: Context):
        numel = flat.numel()
        k = resolve_k(numel, self.ratio, self.k)
        seed = self._shared_seed(ctx)
        multiplier = numel / k if self.rescale else 1.0
        values = ops.randk_select(flat, k, seed, ctx.residual, multiplier=multiplier, value_dtype=flat.dtype)
        return {"values": values}, {"k": k, "seed": seed}

    def _indices(self, payload: Payload) -> torch.Tensor:
        device = payload.tensors["values"].device
        return ops.randk_indices(payload.numel, payload.meta["k"], payload.meta["seed"], device)

    def _row_indices(self, fields: dict[str, torch.Tensor], numel: int, meta: dict[str, int]) -> torch.Tensor:
        indices = ops.randk_indices(numel, meta["k"], meta["seed"], fields["values"].device)
        return indices.expand(fields["values"].shape[0], -1)
