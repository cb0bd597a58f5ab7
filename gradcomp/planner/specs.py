"""Candidate specs: a compressor from a short string (``"int8"``, ``"topk@0.01"``,
``"int4:block=128"``), and the short string of a compressor (its label)."""

from __future__ import annotations

from gradcomp import compressors
from gradcomp.compressors import Compressor, get_compressor

# What ``auto`` may choose unless told: the compressors that kept accuracy on
# every task measured (bench/reports/). Sign, sparse and low-rank ones only
# when allowed.
SAFE = ("none", "bf16", "int8", "int4")


def from_spec(spec: str | Compressor) -> Compressor:
    """A compressor from ``"int8"``, ``"topk@0.01"``, ``"int4:block=128"`` or an instance
    (:func:`gradcomp.get_compressor`'s grammar)."""
    return get_compressor(spec)


def label(compressor: Compressor) -> str:
    """A short name: the compressor's name and the options that differ from its defaults
    (:func:`gradcomp.compressors.label`, what the statistics call it)."""
    return compressors.label(compressor)
