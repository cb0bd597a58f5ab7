"""A bench run's spec: a compressor spec with the DDP hook's options.

The compressor is written as everywhere in gradcomp (:func:`gradcomp.planner.from_spec`:
``int8``, ``topk@0.01``, ``topk:ratio=0.1,exact=true``); the hook's options join
its options after the colon (``int8:algorithm=hierarchical,inter_algorithm=allgather``);
``auto`` or ``auto:allow=bf16|int8|topk@0.01`` is the hook's planner. The spec as
written names the run in tables and result files.

Example:
    >>> parse_run("topk@0.1:algorithm=two_phase")
    ('topk@0.1:algorithm=two_phase', 'topk', {'ratio': 0.1, 'algorithm': 'two_phase'})
"""

from __future__ import annotations

import argparse

from gradcomp.collectives import check_algorithm
from gradcomp.compressors import Compressor, get_compressor
from gradcomp.planner import checked_candidates, from_spec

# Options of the DDP hook rather than of the compressor.
HOOK_OPTIONS = ("algorithm", "inter_algorithm")


def parse_run(text: str) -> tuple[str, str, dict]:
    """``(label, name, options)`` of a run: the spec as written, the compressor's name (or
    ``auto``), and the options to register the hook with (the compressor's that differ
    from its defaults, then the hook's).

    Raises:
        argparse.ArgumentTypeError: an unknown compressor or option, an option out of
            range, or an algorithm the compressor cannot run.
    """
    label = text.strip()
    name, _, rest = label.partition(":")
    hook, kept = {}, []
    for item in filter(None, rest.split(",")):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals:
            raise argparse.ArgumentTypeError(f"option {item!r} is not key=value (in {text!r})")
        if key in (*HOOK_OPTIONS, "allow"):
            hook[key] = value
        else:
            kept.append(item)
    try:
        if name == "auto":
            return label, name, _auto_options(kept, hook)
        compressor = from_spec(f"{name}:{','.join(kept)}" if kept else name)
        _check_hook_options(compressor, hook)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return label, compressor.name, {**compressor_options(compressor), **hook}


def _auto_options(kept: list[str], hook: dict) -> dict:
    if kept or set(hook) - {"allow"}:
        raise ValueError(
            f"auto takes only allow=NAME|NAME|..., not {[*kept, *sorted(set(hook) - {'allow'})]}"
        )
    if "allow" not in hook:
        return {}
    allow = tuple(hook["allow"].split("|"))
    checked_candidates(allow)
    return {"allow": allow}


def _check_hook_options(compressor: Compressor, hook: dict) -> None:
    if "allow" in hook:
        raise ValueError("allow= goes with auto")
    if "algorithm" in hook:
        check_algorithm(compressor, hook["algorithm"])
    if "inter_algorithm" in hook:
        if hook.get("algorithm") != "hierarchical":
            raise ValueError("inter_algorithm= goes with algorithm=hierarchical")
        check_algorithm(compressor, hook["inter_algorithm"])


def compressor_options(compressor: Compressor) -> dict:
    """The options ``compressor`` was made with that differ from its defaults."""
    default = get_compressor(compressor.name).settings()
    return {k: v for k, v in compressor.settings().items() if k != "name" and default.get(k) != v}


def compressor_of(run: dict) -> Compressor:
    """The compressor a run (or its record) reduces through: ``none`` for dense."""
    options = {k: v for k, v in run.get("options", {}).items() if k not in HOOK_OPTIONS}
    return get_compressor(run.get("name") or "none", **options)
