"""Compressor classes and the name registry.

Example:
    >>> c = get_compressor("topk", ratio=0.01)
    >>> [name for name in COMPRESSORS]
    ['none', 'fp16', 'bf16', 'int8', 'int4', 'int2', 'ternary', 'qsgd', 'sign', 'topk', 'randk', 'powersgd']
"""

from __future__ import annotations

import inspect

from gradcomp.compressors.base import Compressor, Context, mix_seed
from gradcomp.compressors.cast import BF16, FP16, NoCompression
from gradcomp.compressors.low_rank import PowerSGD
from gradcomp.compressors.quantize import QSGD, BlockQuantizer, Int2, Int4, Int8, Ternary
from gradcomp.compressors.sign import Sign
from gradcomp.compressors.sparse import RandK, TopK

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (NoCompression, FP16, BF16, Int8, Int4, Int2, Ternary, QSGD, Sign, TopK, RandK, PowerSGD)
}


def get_compressor(name: str | Compressor, **options) -> Compressor:
    """A compressor by name (see ``COMPRESSORS``) with its options.

    A :class:`Compressor` instance is returned as it is (options must then be empty).

    Raises:
        ValueError: unknown name or option, or an option out of range.
        TypeError: an option of the wrong type.
    """
    if isinstance(name, Compressor):
        if options:
            raise ValueError("options cannot be given with a compressor instance")
        return name
    if not isinstance(name, str) or name.lower() not in COMPRESSORS:
        raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(COMPRESSORS)}")
    cls = COMPRESSORS[name.lower()]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"compressor {cls.name!r} has no option {unknown}; its options are {accepted}")
    return cls(**options)


__all__ = [
    "BF16",
    "COMPRESSORS",
    "FP16",
    "QSGD",
    "BlockQuantizer",
    "Compressor",
    "Context",
    "Int2",
    "Int4",
    "Int8",
    "NoCompression",
    "PowerSGD",
    "RandK",
    "Sign",
    "Ternary",
    "TopK",
    "get_compressor",
    "mix_seed",
]
