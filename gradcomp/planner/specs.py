"""Candidate specs: a compressor from a short string (``"int8"``, ``"topk@0.01"``,
``"int4:block=128"``), and the short string of a compressor (its label)."""

from __future__ import annotations

from gradcomp.compressors import Compressor, get_compressor

# What ``auto`` may choose unless told: the compressors that kept accuracy on
# every task measured (bench/reports/). Sign, sparse and low-rank ones only
# when allowed.
SAFE = ("none", "bf16", "int8", "int4")
# ``name@value`` sets this option of the compressor (``topk@0.01``).
_SHORT_OPTION = {"topk": "ratio", "randk": "ratio", "powersgd": "rank", "int8": "block", "int4": "block"}


def from_spec(spec: str | Compressor) -> Compressor:
    """A compressor from ``"int8"``, ``"topk@0.01"``, ``"int4:block=128"`` or an instance."""
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a candidate is a compressor's name or a Compressor, got {spec!r}")
    name, at, value = spec.strip().partition("@")
    if at:
        option = _SHORT_OPTION.get(name.lower())
        if option is None:
            raise ValueError(f"{spec!r}: only {sorted(_SHORT_OPTION)} take name@value")
        return get_compressor(name, **{option: _number(value, spec)})
    name, _, rest = name.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{spec!r}: expected key=value, got {item!r}")
        options[key.strip()] = _number(value, spec)
    return get_compressor(name, **options)


def _number(text: str, spec: str):
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text  # a string option (index_dtype=int32); the compressor checks it


def label(compressor: Compressor) -> str:
    """A short name: the compressor's name and the options that differ from its defaults."""
    default = get_compressor(compressor.name).settings()
    changed = {k: v for k, v in compressor.settings().items() if default.get(k) != v}
    return compressor.name + "".join(f",{k}={v}" for k, v in sorted(changed.items())).replace(",", ":", 1)
