"""What the framework integrations share: their options checked in one message, the
module under ``torch.compile``'s wrapper, and the sign of processes that were launched
together but did not join a distributed run."""

from __future__ import annotations

import inspect
import os

import torch

from gradcomp import ddp, fsdp, planner
from gradcomp.compressors import get_compressor, split_options
from gradcomp.ddp.hook import OLD_NAMES

# The options gradcomp.ddp.register and gradcomp.fsdp.register take beside the compressor's.
DDP_OPTIONS = (*ddp.STATE_OPTIONS, *OLD_NAMES)
FSDP_OPTIONS = tuple(
    name for name, p in inspect.signature(fsdp.register).parameters.items() if p.kind is p.KEYWORD_ONLY
) + tuple(fsdp.comms.OPTIONS)


def check_options(compressor, options: dict, hook_options, owner: str, own=()) -> None:
    """Refuse, at once, an option that neither ``owner`` (its parameters ``own`` and the
    hook's ``hook_options``) nor the compressor takes, in one message: the nearest name
    among both and both lists (old names taken, not listed); then the compressor's own values.

    Raises:
        ValueError: an unknown option or compressor, or a value out of range.
        TypeError: a value of the wrong type.
    """
    own = sorted({*own, *hook_options})
    _, compressor_options = split_options(compressor, options, own, owner, hidden=OLD_NAMES)
    if not planner.is_auto(compressor):
        get_compressor(compressor, **compressor_options)


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without ``torch.compile``'s ``OptimizedModule`` wrappers: accelerate (and so
    Trainer's ``torch_compile=True``) compiles the ``DistributedDataParallel`` it built, and
    DDP's reducer, comm hook included, runs under the compiled module as without it."""
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def launched_processes() -> int:
    """How many processes the launcher started (torchrun's ``WORLD_SIZE``; 1 without one)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
