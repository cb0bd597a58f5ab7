"""The checks of every op's arguments, made once, at the op boundary, for every backend.

:func:`checked` binds a call to the op's signature (the reference's), checks
each argument by its name (the ops share their names: ``x``, ``residual``,
``bits``, ``levels``, ``out``, ...), and completes the defaults that depend
on other arguments (``levels``, ``index_dtype``). Backends receive valid,
complete arguments and check nothing themselves.
"""

from __future__ import annotations

import functools
import inspect

import torch

from gradcomp.ops import reference, reference_mx

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


class Bound:
    """A call bound to an op's signature, defaults applied: ``arguments`` (name ->
    value, in the signature's order), and ``args`` / ``kwargs`` to call a backend with."""

    __slots__ = ("arguments", "_signature")

    def __init__(self, arguments: dict, signature: _Signature):
        self.arguments, self._signature = arguments, signature

    @property
    def args(self) -> tuple:
        return tuple(self.arguments[name] for name in self._signature.positional)

    @property
    def kwargs(self) -> dict:
        return {name: self.arguments[name] for name in self._signature.keyword_only}


class _Signature:
    """An op's parameters, read once from its reference: binding a call is then a few
    dict operations (``inspect.Signature.bind`` costs tens of microseconds a call)."""

    def __init__(self, op: str):
        parameters = inspect.signature(getattr(reference, op)).parameters.values()
        kinds = {parameter.kind for parameter in parameters}
        assert kinds <= {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}, op
        self.op = op
        self.names = tuple(parameter.name for parameter in parameters)
        kind = inspect.Parameter
        self.positional = tuple(p.name for p in parameters if p.kind == kind.POSITIONAL_OR_KEYWORD)
        self.keyword_only = tuple(p.name for p in parameters if p.kind == kind.KEYWORD_ONLY)
        self.defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}

    def bind(self, args: tuple, kwargs: dict) -> dict:
        if len(args) > len(self.positional):
            raise TypeError(f"{self.op}: takes {len(self.positional)} positional arguments, got {len(args)}")
        given = dict(zip(self.positional, args, strict=False))  # too many: refused above
        for name, value in kwargs.items():
            if name in given:
                raise TypeError(f"{self.op}: multiple values for argument {name!r}")
            if name not in self.defaults and name not in self.names:
                raise TypeError(f"{self.op}: got an unexpected keyword argument {name!r}")
            given[name] = value
        arguments = {}
        for name in self.names:
            if name in given:
                arguments[name] = given[name]
            elif name in self.defaults:
                arguments[name] = self.defaults[name]
            else:
                raise TypeError(f"{self.op}: missing a required argument: {name!r}")
        return arguments


@functools.cache
def _signature(op: str) -> _Signature:
    return _Signature(op)


def checked(op: str, args: tuple, kwargs: dict) -> Bound:
    """``op``'s arguments bound, checked and completed; raises ``TypeError`` or
    ``ValueError`` naming the argument at fault."""
    signature = _signature(op)
    values = signature.bind(args, kwargs)
    for name in values:
        check = _CHECKS.get(name)
        if check is not None:
            check(values, op)
    return Bound(values, signature)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(name: str):
    def check(values: dict, op: str) -> None:
        value = values[name]
        if not _is_int(value) or value < 1:
            raise ValueError(f"{op}: {name} must be a positive integer, got {value!r}")

    return check


def _float_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if value.dtype not in FLOATS:
        raise TypeError(f"{name}: dtype {value.dtype} is not one of {list(FLOATS)}")


def _numel(values: dict) -> int:
    """The element count the op works on: ``numel``, else ``x``'s."""
    return values["numel"] if "numel" in values else values["x"].numel()


def device_of(values: dict) -> torch.device:
    for name in ("x", "q", "packed", "codes", "rows", "indices"):
        if isinstance(values.get(name), torch.Tensor):
            return values[name].device
    return torch.device(values.get("device", "cpu"))


def _x(values: dict, op: str) -> None:
    _float_tensor("x", values["x"])


def _residual(values: dict, op: str) -> None:
    residual = values["residual"]
    if residual is None:
        return
    _float_tensor("residual", residual)
    if not residual.is_contiguous():
        raise ValueError("the residual must be contiguous: it is updated in place")
    if residual.numel() != values["x"].numel():
        raise ValueError(f"residual has {residual.numel()} elements, the tensor {values['x'].numel()}")
    if residual.device != values["x"].device:
        raise ValueError(f"residual is on {residual.device}, the tensor on {values['x'].device}")


def _bits(values: dict, op: str) -> None:
    if values["bits"] not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {values['bits']!r}")


def _levels(values: dict, op: str) -> None:
    bits, levels = values["bits"], values["levels"]
    if levels is None:
        levels = values["levels"] = 2 ** (bits - 1) - 1
    if not _is_int(levels) or levels < 1:
        raise ValueError(f"levels must be at least 1 (bits={bits} without levels gives {levels})")
    if reference.code_bits(levels) > bits:
        raise ValueError(f"{bits} bits cannot hold levels={levels}")


def _scale(values: dict, op: str) -> None:
    if values["scale"] not in ("absmax", "norm"):
        raise ValueError(f"scale must be 'absmax' or 'norm', got {values['scale']!r}")


def _k(values: dict, op: str) -> None:
    numel, k = _numel(values), values["k"]
    if not _is_int(k) or not 0 < k <= numel:
        raise ValueError(f"k must be in [1, {numel}], got {k!r}")


def _numel_value(values: dict, op: str) -> None:
    if not _is_int(values["numel"]) or values["numel"] < 0:
        raise ValueError(f"numel must be a non-negative integer, got {values['numel']!r}")


def _chunk(values: dict, op: str) -> None:
    _positive("chunk")(values, op)
    if values["chunk"] % values["block"]:
        raise ValueError(f"chunk {values['chunk']} must hold whole blocks of {values['block']}")


def _code_bits(values: dict, op: str) -> int:
    """Bits of each code of the op's payload (1 for sign; an unknown element's checked apart)."""
    if "element" in values:
        element = reference_mx.ELEMENTS.get(values["element"])
        return 1 if element is None else element.bits
    if op.startswith("nvfp4"):
        return reference_mx.E2M1.bits
    return values.get("bits", 1)


def _rows(values: dict, op: str) -> None:
    rows, bits = values["rows"], _code_bits(values, op)
    if (
        rows.dtype != torch.uint8
        or rows.dim() != 2
        or rows.stride(1) != 1
        or rows.stride(0) % reference.ALIGN
    ):
        raise ValueError(
            f"rows must be a 2-D uint8 tensor of contiguous rows {reference.ALIGN} bytes aligned, "
            f"got {rows.dtype} {tuple(rows.shape)} with strides {rows.stride()}"
        )
    if (values["block"] * bits) % 8:
        raise ValueError(f"rows hold whole bytes of codes a block: block {values['block']}, {bits} bits")


def _out(values: dict, op: str) -> None:
    out = values["out"]
    if out is None:
        if values.get("accumulate"):
            raise ValueError("accumulate=True needs out=")
        return
    _float_tensor("out", out)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous: it is written in place")
    if ("numel" in values or "x" in values) and out.numel() != _numel(values):
        raise ValueError(f"out has {out.numel()} elements, expected {_numel(values)}")
    if out.device != device_of(values):
        raise ValueError(f"out is on {out.device}, the inputs on {device_of(values)}")


def _index_dtype(values: dict, op: str) -> None:
    numel = _numel(values)
    if values["index_dtype"] is None:
        values["index_dtype"] = reference.index_dtype_for(numel)
    if values["index_dtype"] not in INDEX_DTYPES:
        raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {values['index_dtype']}")
    if values["index_dtype"] == torch.int32 and numel > reference.INT32_LIMIT:
        raise ValueError(f"int32 indices cannot address {numel} elements")


def _value_dtype(values: dict, op: str) -> None:
    if values["value_dtype"] not in FLOATS:
        raise TypeError(f"value_dtype: {values['value_dtype']} is not one of {list(FLOATS)}")


def _indices(values: dict, op: str) -> None:
    indices, given = values["indices"], values["values"]
    if indices.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8):
        raise TypeError(f"indices must be an integer tensor, got {indices.dtype}")
    if indices.numel() != given.numel():
        raise ValueError(f"{indices.numel()} indices but {given.numel()} values")
    if indices.dim() > 2 or given.shape != indices.shape:
        raise ValueError(
            f"indices and values must be one row (1-D) or rows (2-D) of one shape, "
            f"got {tuple(indices.shape)} and {tuple(given.shape)}"
        )


def _element(values: dict, op: str) -> None:
    if values["element"] not in reference_mx.ELEMENTS:
        raise ValueError(f"element must be one of {sorted(reference_mx.ELEMENTS)}, got {values['element']!r}")


def _block(values: dict, op: str) -> None:
    """A positive block; of the block-scaled formats, one whose codes fill whole bytes
    (their kernels pack a block's codes apart from the next block's)."""
    _positive("block")(values, op)
    bits = _code_bits(values, op)
    if op.startswith(("mx_", "nvfp4_")) and (values["block"] * bits) % 8:
        raise ValueError(f"{op}: a block of {values['block']} {bits}-bit codes must fill whole bytes")


def _codes(name: str):
    def check(values: dict, op: str) -> None:
        if values[name].dtype != torch.uint8:
            raise TypeError(f"{name} must be uint8, got {values[name].dtype}")

    return check


_CHECKS = {
    "x": _x,
    "residual": _residual,
    "bits": _bits,
    "block": _block,
    "element": _element,
    "levels": _levels,
    "scale": _scale,
    "k": _k,
    "numel": _numel_value,
    "chunk": _chunk,
    "rows": _rows,
    "out": _out,
    "index_dtype": _index_dtype,
    "value_dtype": _value_dtype,
    "indices": _indices,
    "divisor": _positive("divisor"),
    "q": _codes("q"),
    "packed": _codes("packed"),
}
