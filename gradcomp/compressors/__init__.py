"""Compressor classes, the name registry and the one spec grammar.

A compressor is named the same way everywhere (the DDP hook, FSDP2, the
all-reduce, CompressedAdam, DiLoCo, ``allow=``, the command line): a name
(``"int8"``), a name and its main option (``"topk@0.01"``: the ratio; the rank
of ``powersgd``, the block of ``int8`` and ``int4``), or a name and options
(``"int4:block=128,stochastic=false"``); options may also be given as
arguments.

Example:
    >>> c = get_compressor("topk", ratio=0.01)
    >>> get_compressor("topk@0.01").ratio == get_compressor("topk:ratio=0.01").ratio == c.ratio
    True
    >>> [name for name in COMPRESSORS]  # doctest: +NORMALIZE_WHITESPACE
    ['none', 'fp16', 'bf16', 'int8', 'int4', 'int2', 'ternary', 'qsgd', 'mxfp8', 'mxfp4', 'nvfp4',
     'sign', 'topk', 'randk', 'powersgd']
"""

from __future__ import annotations

import difflib
import functools
import inspect

from gradcomp.compressors.base import Compressor, Context, mix_seed
from gradcomp.compressors.cast import BF16, FP16, NoCompression
from gradcomp.compressors.low_rank import PowerSGD
from gradcomp.compressors.microscaling import MXFP4, MXFP8, NVFP4, Microscaling
from gradcomp.compressors.quantize import QSGD, BlockQuantizer, Int2, Int4, Int8, Ternary
from gradcomp.compressors.sign import Sign
from gradcomp.compressors.sparse import RandK, TopK

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (NoCompression, FP16, BF16, Int8, Int4, Int2, Ternary, QSGD, MXFP8, MXFP4, NVFP4)
    + (Sign, TopK, RandK, PowerSGD)
}


# ``name@value`` sets this option of the compressor (``topk@0.01``).
SHORT_OPTION = {"topk": "ratio", "randk": "ratio", "powersgd": "rank", "int8": "block", "int4": "block"}


def get_compressor(name: str | Compressor, **options) -> Compressor:
    """A compressor from a spec (``"int8"``, ``"topk@0.01"``, ``"int4:block=128"``; see
    ``COMPRESSORS`` for the names) with its options, those of the spec and the arguments.

    A :class:`Compressor` instance is returned as it is (options must then be empty).

    Raises:
        ValueError: unknown name or option (the nearest names said), an option given
            twice, or an option out of range.
        TypeError: a spec that is not a string, or an option of the wrong type.
    """
    if isinstance(name, Compressor):
        if options:
            raise ValueError("options cannot be given with a compressor instance")
        return name
    if not isinstance(name, str):
        raise TypeError(f"a compressor is a spec ('int8', 'topk@0.01') or a Compressor; got {name!r}")
    spec = name
    name, spec_options = parse_spec(spec)
    if name not in COMPRESSORS:
        raise ValueError(
            f"unknown compressor {spec!r}{_nearest(name, COMPRESSORS)}; choose one of {sorted(COMPRESSORS)}"
        )
    twice = sorted(set(spec_options) & set(options))
    if twice:
        raise ValueError(f"{twice} given both in the spec {spec!r} and as an argument")
    options = {**spec_options, **options}
    cls = COMPRESSORS[name]
    accepted = compressor_options(name)
    unknown = [k for k in options if k not in accepted]
    if unknown:
        raise unknown_options(f"compressor {cls.name!r}", unknown, [], (f"compressor {cls.name!r}", accepted))
    return cls(**options)


def split_options(compressor, options: dict, own, owner: str, *, hidden=()) -> tuple[dict, dict]:
    """``(owner's options, the compressor's)`` from ``options``, which hold both: the
    check every entry point makes first, before any collective, so that a typo raises
    on the rank that made it (or on every rank alike) instead of hanging its peers.

    Args:
        compressor: the entry point's compressor argument: a spec (whose options are
            the compressor's), ``"auto"`` or another chooser, an instance, or None.
        options: the keyword arguments the entry point did not bind itself.
        own: every option ``owner`` takes (its named arguments too, for the message).
        owner: the entry point as the user calls it (``"gradcomp.ddp.register"``).
        hidden: options ``owner`` still takes but no longer names (old names).

    Raises:
        ValueError: an option that neither ``owner`` nor the compressor takes
            (:func:`unknown_options`).
    """
    own = [name for name in own if name not in hidden]
    taken = {*own, *hidden}
    mine = {k: v for k, v in options.items() if k in taken}
    rest = {k: v for k, v in options.items() if k not in taken}
    what, accepted = _compressor_described(compressor)
    unknown = [k for k in rest if k not in accepted]
    if unknown:
        raise unknown_options(owner, unknown, own, (what, accepted))
    return mine, rest


def unknown_options(owner: str, unknown, own, compressor: tuple[str, list]) -> ValueError:
    """The one error for options nobody takes, whatever the entry point: ``owner`` named,
    each unknown option with the nearest name among ``owner``'s options and the
    compressor's, then both lists. ``compressor``: ``(what it is, its options)``.

    Example:
        ``gradcomp.ddp.register(model, "int8", blok=128)`` raises ``ValueError:
        gradcomp.ddp.register has no option 'blok' (did you mean 'block'?). Options of
        gradcomp.ddp.register: compressor, group, warmup_steps, ...; of compressor 'int8':
        block, stochastic, feedback, seed.``
    """
    what, accepted = compressor
    names = [*own, *accepted]
    said = ", ".join(f"{name!r}{_nearest(name, names)}" for name in unknown)
    if not accepted:
        theirs = f"{what} takes no compressor options"
    else:
        theirs = f"{'Options of' if owner == what else 'of'} {what}: {', '.join(accepted)}"
    lists = theirs if owner == what else f"Options of {owner}: {', '.join(own)}; {theirs}"
    return ValueError(f"{owner} has no option{'s' if len(unknown) > 1 else ''} {said}. {lists}.")


def _compressor_described(compressor) -> tuple[str, list[str]]:
    """``(what compressor is, in words; the options it takes)`` for :func:`unknown_options`."""
    if compressor is None:
        return "compressor=None", []
    if isinstance(compressor, str):
        name = parse_spec(compressor)[0]
        if name in COMPRESSORS:
            return f"compressor {name!r}", compressor_options(name)
        return f"compressor={compressor!r}", []  # "auto" or another chooser: they take none
    if isinstance(compressor, Compressor):  # made with its options: nothing more to give it
        made = f"made with its options; give the spec {compressor.name!r} to set them here"
        return f"the {type(compressor).__name__} given ({made})", []
    return f"the {type(compressor).__name__} given", []  # a chooser object


def label(compressor: Compressor) -> str:
    """A compressor's short spec: its name and the options that differ from its defaults
    (``"int8"``, ``"topk:ratio=0.05"``); :func:`get_compressor` makes it back. What the
    statistics call the compressor (``ReduceStats.compressor``, the hook's steps)."""
    default = _default_settings(compressor.name)
    changed = {k: v for k, v in compressor.settings().items() if default.get(k) != v}
    return compressor.name + "".join(f",{k}={v}" for k, v in sorted(changed.items())).replace(",", ":", 1)


@functools.cache
def _default_settings(name: str) -> dict:
    return COMPRESSORS[name]().settings()


def compressor_options(name: str) -> list[str]:
    """The options compressor ``name`` takes."""
    return [p for p in inspect.signature(COMPRESSORS[name.lower()].__init__).parameters if p != "self"]


def parse_spec(spec: str) -> tuple[str, dict]:
    """``(name, options)`` of a spec, the name lower-cased; the options' values as numbers,
    booleans or strings (the compressor checks them).

    Raises:
        ValueError: ``name@value`` for a compressor without a main option, or an
            option without ``=``.
    """
    name, at, value = spec.strip().partition("@")
    if at:
        option = SHORT_OPTION.get(name.lower())
        if option is None:
            raise ValueError(f"{spec!r}: only {sorted(SHORT_OPTION)} take name@value")
        return name.lower(), {option: _value(value)}
    name, _, rest = name.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{spec!r}: expected key=value, got {item!r}")
        options[key.strip()] = _value(value)
    return name.strip().lower(), options


def _value(text: str):
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


def _nearest(name: str, names) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``names``, or nothing."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
    "MXFP4",
    "MXFP8",
    "Microscaling",
    "NVFP4",
    "NoCompression",
    "PowerSGD",
    "RandK",
    "Sign",
    "Ternary",
    "TopK",
    "compressor_options",
    "get_compressor",
    "label",
    "parse_spec",
    "split_options",
    "mix_seed",
    "unknown_options",
]
