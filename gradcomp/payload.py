"""Payload: the tensors a compressor puts on the wire, plus what decoding needs."""

from __future__ import annotations

import dataclasses

import torch

from gradcomp.ops.reference import ALIGN  # one wire format: the row ops write it too

# (name, dtype, numel) of each payload tensor, in wire order.
Layout = list[tuple[str, torch.dtype, int]]


@dataclasses.dataclass(frozen=True)
class Maker:
    """What made a payload: the compressor (its settings that decide how a payload
    decodes, :meth:`gradcomp.compressors.Compressor.decoding_key`) and the shape and
    dtype of the tensor it compressed. ``decompress`` refuses a payload that another
    compressor made, or whose shape or dtype changed since."""

    compressor: str
    shape: torch.Size
    dtype: torch.dtype


@dataclasses.dataclass
class Payload:
    """Compressed form of one tensor.

    Attributes:
        tensors: name -> 1-D tensor. On the wire they go widest dtype
            first (:func:`wire_order`), so views into a byte buffer stay aligned.
        shape, dtype: of the tensor that was compressed.
        meta: small integers decoding needs beyond the tensors' sizes (for
            example ``k``, a shared ``seed``).
        maker: what made it (None: not known, as for one built from a buffer).

    Example:
        >>> p = gradcomp.get_compressor("int8").compress(torch.randn(1000))
        >>> p.nbytes
        1016
    """

    tensors: dict[str, torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    meta: dict[str, int] = dataclasses.field(default_factory=dict)
    maker: Maker | None = None

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors that go on the wire (without alignment padding)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def layout(self) -> Layout:
        return [(name, t.dtype, t.numel()) for name, t in self.tensors.items()]

    def _wire_tensors(self) -> list[torch.Tensor]:
        return [self.tensors[name] for name, _, _ in wire_order(self.layout())]

    def to_buffer(self, size: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """All tensors as one flat uint8 buffer, zero-padded to ``size`` bytes
        (default: :func:`buffer_size` of the layout), or written into ``out``
        (a flat uint8 tensor, padded to its end) and returned."""
        if out is None:
            size = buffer_size(self.layout()) if size is None else size
            out = torch.empty(size, dtype=torch.uint8, device=self.device)
        offset = 0
        for tensor in self._wire_tensors():
            raw = tensor.contiguous().view(torch.uint8).view(-1)
            if offset + raw.numel() > out.numel():
                raise ValueError(
                    f"payload needs at least {buffer_size(self.layout())} bytes, got {out.numel()}"
                )
            out[offset : offset + raw.numel()] = raw
            offset += raw.numel()
        out[offset:].zero_()
        return out

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> Payload:
        return dataclasses.replace(self, tensors=tensors)

    @classmethod
    def from_buffer(
        cls,
        buffer: torch.Tensor,
        layout: Layout,
        shape: torch.Size,
        dtype: torch.dtype,
        meta: dict[str, int] | None = None,
        maker: Maker | None = None,
    ) -> Payload:
        """Views into ``buffer`` (uint8) laid out as ``layout``: no copies."""
        views = {name: view.view(-1) for name, view in row_views(buffer.view(1, -1), layout).items()}
        return cls(views, torch.Size(shape), dtype, dict(meta or {}), maker)


def row_views(rows: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Views ``(rows, numel)`` of each payload tensor in ``rows`` (2-D uint8, one
    payload laid out as ``layout`` a row), in ``layout``'s order: no copies."""
    views = {}
    offset = 0
    for name, tensor_dtype, numel in wire_order(layout):
        nbytes = numel * _itemsize(tensor_dtype)
        views[name] = rows[:, offset : offset + nbytes].view(tensor_dtype)
        offset += nbytes
    return {name: views[name] for name, _, _ in layout}


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def wire_order(layout: Layout) -> Layout:
    """``layout`` widest dtype first (stable): every view into the buffer stays aligned."""
    return sorted(layout, key=lambda entry: -_itemsize(entry[1]))


def buffer_size(layout: Layout) -> int:
    """Bytes :meth:`Payload.to_buffer` uses for ``layout``, padded to ``ALIGN``."""
    raw = sum(numel * _itemsize(dtype) for _, dtype, numel in layout)
    return -(-raw // ALIGN) * ALIGN
