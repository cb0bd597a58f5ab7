"""The hook state's checkpoint: a versioned schema, one upgrade function, the
``torch.distributed.checkpoint`` adapter and the rank files.

Version 2 (this one)::

    {"version": 2, "step": int, "settings": the compressor's (or auto's),
     "feedback": ErrorFeedback.state_dict(), "layouts": ..., "pieces": ...,
     "auto": None, or {"sizes": {"step": int, "numels": {bucket: int}} or None,
                       "offsets": [float] or None, "plan": [saved] or None,
                       "adopted_at": int or None, "last": {bucket: (label, algorithm, between)},
                       "next_plan": [saved] or None, "remeasure": str or None,
                       "trial": {"plans": [[saved]], "seconds": [float]} or None,
                       "trials": [dict]}}

A saved plan is a list of ``(numel, compressor, algorithm, bytes_sent, exchange_seconds,
codec_seconds, overlap_seconds, inter_algorithm)``. Version 1 (no ``"version"``) kept
auto's fields flat beside the others (``auto_sizes`` with a ``"step"`` key among bucket
indices, ``plan`` of 3, 7 or 8 fields, ...); :func:`upgrade` reads it.
"""

from __future__ import annotations

import io
import logging
import os
import sys

import torch
import torch.distributed as dist

from gradcomp import files, planner
from gradcomp.ddp import records
from gradcomp.ddp.auto import BucketPlans, Phase, Remeasure, StepSizes
from gradcomp.ddp.records import on_device as on_device
from gradcomp.ddp.trial import Trial

logger = logging.getLogger("gradcomp.ddp")

SCHEMA_VERSION = 2
_PLAN_DEFAULTS = (0, 0.0, 0.0, 0.0, None)  # bytes, exchange, codec, overlap seconds, between nodes


def saved_plan(plan: list[planner.Prediction]) -> list:
    return [
        (
            p.numel,
            p.compressor,
            p.algorithm,
            p.bytes_sent,
            p.exchange_seconds,
            p.codec_seconds,
            p.overlap_seconds,
            p.inter_algorithm,
        )
        for p in plan
    ]


def loaded_plan(saved: list) -> list[planner.Prediction]:
    return [planner.Prediction(c, a, n, *rest) for n, c, a, *rest in saved]


def saved_auto(auto: BucketPlans, sent_as: dict) -> dict:
    """(hook, between steps) What a resumed run needs of ``auto`` (schema 2's ``"auto"``);
    ``sent_as``: the route each bucket last went through, as labels."""
    auto.wait()  # a check of the step just ended: its plan applies from the next
    planned = auto.plan is not None
    trial, sizes = auto.trial, auto.sizes
    return {
        "sizes": None if sizes is None else {"step": sizes.step, "numels": dict(sizes.numels)},
        "offsets": auto.offsets,
        "plan": saved_plan(auto.plan) if planned else None,
        "adopted_at": auto.adopted_at if planned else None,
        "last": dict(sent_as) if planned else {},
        "next_plan": saved_plan(auto.next_plan) if planned and auto.next_plan is not None else None,
        "remeasure": auto.remeasure_due.why if planned and auto.remeasure_due is not None else None,
        "trial": (
            None
            if not planned or trial is None
            else {"plans": [saved_plan(p) for p in trial.plans], "seconds": list(trial.seconds)}
        ),
        "trials": list(auto.trials),
    }


def restore_auto(auto: BucketPlans, saved: dict) -> dict:
    """(hook) Restore :func:`saved_auto`'s output into a fresh ``auto``; the routes each
    bucket last went through (labels), for the hook state."""
    sizes = saved["sizes"]
    if sizes is not None:
        auto.sizes = StepSizes(sizes["step"], {int(k): v for k, v in sizes["numels"].items()})
    auto.offsets, auto.trials = saved["offsets"], list(saved["trials"])
    if saved["trial"] is not None:
        trial = saved["trial"]
        auto.trial = Trial([loaded_plan(p) for p in trial["plans"]], list(trial["seconds"]))
    if saved["plan"] is None:
        return {}
    auto.planned_at = -1
    auto.adopt(loaded_plan(saved["plan"]))
    auto.adopted_at = saved["adopted_at"]
    auto.phase = Phase.TRIAL if auto.trial is not None else Phase.RUNNING
    if saved["next_plan"] is not None:
        auto.next_plan = loaded_plan(saved["next_plan"])
    if saved["remeasure"] is not None:
        auto.remeasure_due = Remeasure(saved["remeasure"])
    return dict(saved["last"])


def upgrade(saved: dict) -> dict:
    """A hook state saved by any version of gradcomp, in this version's schema.

    Raises:
        ValueError: saved by a newer gradcomp.
    """
    version = saved.get("version", 1)
    if version > SCHEMA_VERSION:
        raise ValueError(
            f"the hook state was saved with checkpoint schema {version}; this gradcomp reads up to "
            f"{SCHEMA_VERSION}: upgrade gradcomp"
        )
    if version == SCHEMA_VERSION:
        return saved
    upgraded = {k: v for k, v in saved.items() if not (k.startswith("auto_") or k in ("plan", "next_plan"))}
    upgraded["version"] = SCHEMA_VERSION
    is_auto = saved["settings"].get("name") == "auto"
    if not is_auto:
        upgraded["auto"] = None
        return upgraded
    sizes = dict(saved.get("auto_sizes") or {})
    step = sizes.pop("step", None)
    plan = saved.get("plan")
    trial = saved.get("auto_trial")
    upgraded["auto"] = {
        "sizes": None if step is None else {"step": step, "numels": sizes},
        "offsets": saved.get("auto_ready"),
        "plan": None if plan is None else _full(plan),
        "adopted_at": saved.get("auto_adopted_at", int(saved["step"])) if plan is not None else None,
        "last": dict(saved.get("auto_last", {})),
        "next_plan": _full(saved["next_plan"]) if "next_plan" in saved else None,
        "remeasure": saved.get("auto_remeasure"),
        "trial": None if trial is None else {**trial, "plans": [_full(p) for p in trial["plans"]]},
        "trials": list(saved.get("auto_trials", [])),
    }
    return upgraded


def _full(plan: list) -> list:
    # Version 1 saved plans of 3 fields (before predictions were kept) and 7 (before the
    # algorithm between nodes): the missing ones take the defaults.
    return [(*entry, *_PLAN_DEFAULTS[len(entry) - 3 :]) for entry in plan]


class Checkpointable:
    """A state (DDP's :class:`HookState`, :class:`gradcomp.fsdp.FSDPState`, a
    :class:`gradcomp.DiLoCo`) for
    ``torch.distributed.checkpoint`` (a ``Stateful``):
    one checkpoint directory holds the model, the optimizer and every rank's
    residuals, each rank's under a key of its own, with what it belongs to
    (:mod:`gradcomp.ddp.records`); a load refuses another rank's entry, another
    kind of state, other settings and a non-finite residual, on every rank.

    Args:
        state: the hook state to save or restore.
        mismatch: what loading a checkpoint of another world size does, on every
            rank: ``"raise"`` (default) a ``ValueError``; ``"drop"`` keeps the
            step but starts the residuals afresh, with a warning (DiLoCo: every
            rank takes rank 0's weights, anchor and steps).

    ``torch.distributed.checkpoint``'s default load planner unpickles every entry that
    is not a tensor (this one, the optimizer's settings) with ``weights_only=False``
    (torch 2.13): trust a checkpoint directory as a whole, or load it with a planner
    that does not. :func:`save_rank_file`'s files load with ``weights_only=True``.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> everything = {"model": model.state_dict(), "optim": optimizer.state_dict(),
        ...               "gradcomp": gradcomp.ddp.Checkpointable(state)}
        >>> dcp.save(everything, checkpoint_id=directory)
        >>> dcp.load(everything, checkpoint_id=directory)  # later, same world size
    """

    def __init__(self, state, mismatch: str = "raise"):
        if mismatch not in ("raise", "drop"):
            raise ValueError(f"mismatch must be 'raise' or 'drop', got {mismatch!r}")
        self.state = state
        self.mismatch = mismatch

    def state_dict(self) -> dict:
        rank, world = _rank_and_world(self.state.process_group)
        loading = _checkpoint_being_loaded()
        if loading is None:
            buffer = io.BytesIO()
            torch.save(records.record(self.state, rank, world), buffer)
            buffer.seek(0)
        else:  # what the load fills in; where the checkpoint has no entry of this rank, nothing
            key, saved = loading
            lacks = f"{key}.world_size" in saved and f"{key}.rank{rank}" not in saved
            buffer = None if lacks else io.BytesIO()
        self._placeholder = buffer  # what a load that finds nothing leaves in place
        return {"world_size": world, **({} if buffer is None else {f"rank{rank}": buffer})}

    def load_state_dict(self, state_dict: dict) -> None:
        group = self.state.process_group
        rank, world = _rank_and_world(group)
        saved_world = int(state_dict["world_size"])
        entry = state_dict.get(f"rank{rank}")
        if entry is getattr(self, "_placeholder", None):
            entry = None  # the checkpoint had no state for this rank
        mine, summaries = records.on_every_rank(group, lambda: self._opened(entry, rank))
        missing = [r for r, (found, _) in enumerate(summaries) if not found]
        if saved_world == world and not missing:
            records.on_every_rank(group, lambda: (self.state.load_state_dict(mine), None))
            return  # residuals move to their gradients' device at first use
        message = (
            f"the checkpoint holds the hook state of {saved_world} ranks and this run has {world}"
            if saved_world != world
            else f"the checkpoint holds no hook state for rank {missing[0]} of {world}"
        ) + ": residuals belong to their rank"
        if self.mismatch == "raise":
            raise ValueError(message + "; resume on as many ranks, or pass mismatch='drop'")
        logger.warning("gradcomp: %s; the residuals start afresh (mismatch='drop')", message)
        self._start_afresh(mine, [step for _, step in summaries if step is not None])

    def _opened(self, entry, rank: int) -> tuple:
        """(this rank's checked state dict or None, (whether it has one, its step))."""
        if entry is None:
            return None, (False, None)
        where = f"the checkpoint's gradcomp entry rank{rank}"
        # torch.distributed.checkpoint hands over what it unpickled; a direct call, the buffer.
        saved = files.load_file(_rewound(entry), where) if isinstance(entry, io.BytesIO) else entry
        mine, _ = records.opened(saved, self.state, rank, where)
        return mine, (True, mine.get("step"))

    def _start_afresh(self, mine: dict | None, steps: list[int]) -> None:
        """(every rank) Keep the saved step (``steps``: every rank's that has one), not the residuals."""
        restart = getattr(self.state, "restart", None)  # DiLoCo: its shared state, the ranks agreeing
        if restart is not None:
            restart(mine)
            return
        if len(set(steps)) > 1:
            raise ValueError(f"the checkpoint's ranks were saved at different steps: {sorted(set(steps))}")
        if steps:
            self.state.step = int(steps[0])


def _rewound(buffer: io.BytesIO) -> io.BytesIO:
    buffer.seek(0)
    return buffer


def _checkpoint_being_loaded() -> tuple[str, set[str]] | None:
    """Where ``torch.distributed.checkpoint.load`` asks :meth:`Checkpointable.state_dict` what
    to fill in: the key it is under and the keys of the checkpoint being read; None
    otherwise (a save). A ``Stateful`` is asked before the load with no word of what the
    checkpoint holds, and an entry it names that the checkpoint lacks (this rank's, where
    the saving run had fewer ranks) fails the load on every rank before ``mismatch``
    could apply: the checkpoint's keys are read where ``load`` holds its reader."""
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_code.co_name == "load" and frame.f_globals.get("__name__") == _DCP_LOADER
    ):
        frame = frame.f_back
    if frame is None:
        return None
    reader, key = frame.f_locals.get("storage_reader"), frame.f_locals.get("key")
    try:
        keys = reader.read_metadata().state_dict_metadata
    except Exception:  # another torch's loader or reader: every entry is asked for, as before
        return None
    return None if key is None else (str(key), set(keys))


_DCP_LOADER = "torch.distributed.checkpoint.state_dict_loader"
RANK_FILE = "gradcomp_rank{rank}.pt"


def save_rank_file(state, directory: str) -> str:
    """Write this rank's ``state`` (a :class:`HookState`, :class:`gradcomp.fsdp.FSDPState`)
    into ``directory`` as a file of its own, beside a framework's checkpoint (as
    Trainer's ``rng_state_{rank}.pth``); every rank calls it. The file is written whole
    or not at all (:func:`gradcomp.files.atomic_write`): a process killed while saving
    leaves the previous file. Returns the file's path."""
    rank, world = _rank_and_world(state.process_group)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RANK_FILE.format(rank=rank))
    saved = records.record(state, rank, world)
    files.atomic_write(path, lambda file: torch.save(saved, file))
    return path


MISSING_RESIDUALS = ("raise", "zero")


def check_missing_residuals(value: str) -> str:
    """``value``, where it is one of :data:`MISSING_RESIDUALS`: what a load does with a
    checkpoint that holds no gradcomp state (saved by a run without compression).

    Raises:
        ValueError: any other value, naming the choices.
    """
    if value not in MISSING_RESIDUALS:
        raise ValueError(
            "missing_residuals must be 'raise' (refuse a checkpoint without gradcomp's state) or "
            f"'zero' (begin compressing from it, residuals at zero), got {value!r}"
        )
    return value


def without_residuals(missing_residuals: str, what: str, error: type[Exception] = FileNotFoundError) -> None:
    """(every rank) ``what``, a checkpoint, holds no gradcomp state for any rank: raise
    ``error``, naming the option that begins compression from it, or (``"zero"``) warn
    that the residuals start at zero, and the hook's step and warm-up from the start."""
    if check_missing_residuals(missing_residuals) == "raise":
        raise error(
            f"gradcomp: {what} holds no compression state (saved without gradcomp): resuming it would "
            "lose the residuals of a compressed run. To begin compressing from it, with residuals at "
            "zero, pass missing_residuals='zero'"
        )
    logger.warning(
        "gradcomp: %s holds no compression state: compression begins here, residuals at zero and "
        "the hook's steps (warm-up included) from the start (missing_residuals='zero')",
        what,
    )


def load_rank_file(state, directory: str, missing_residuals: str = "raise") -> None:
    """Restore this rank's ``state`` from :func:`save_rank_file`'s file in ``directory``;
    every rank calls it, and where one rank's file is refused, every rank raises.

    Args:
        state: the hook state to restore (as registered).
        directory: the checkpoint's folder.
        missing_residuals: where no rank's file is in ``directory`` (a checkpoint saved
            without gradcomp): ``"raise"`` (default) refuses it; ``"zero"`` warns and
            leaves ``state`` as registered, so that compression begins from this
            checkpoint with zero residuals.

    Raises:
        FileNotFoundError: the folder holds no gradcomp state (with ``"raise"``; the
            message names ``missing_residuals``).
        ValueError: some ranks' files are missing (saved by fewer ranks), or a file is
            truncated or corrupt, needs more than tensors to load
            (:func:`gradcomp.files.load_file`), belongs to another rank or kind of state,
            was saved by a run of another world size or settings, or holds a non-finite
            residual (each naming the file).
    """
    check_missing_residuals(missing_residuals)
    rank, world = _rank_and_world(state.process_group)
    path = os.path.join(directory, RANK_FILE.format(rank=rank))
    _, found = records.on_every_rank(state.process_group, lambda: (None, os.path.exists(path)))
    if not any(found):
        without_residuals(missing_residuals, directory)
        return
    if not all(found):
        lacking = [r for r, here in enumerate(found) if not here]
        raise ValueError(
            f"gradcomp: {directory} holds no compression state for ranks {lacking} of {world} (saved by "
            "fewer ranks): residuals belong to their rank; resume on as many ranks"
        )

    def load() -> tuple:
        saved, saved_world = records.opened(files.load_file(path), state, rank, path)
        if saved_world is not None and int(saved_world) != world:
            raise ValueError(
                f"{path} holds the hook state of {saved_world} ranks and this run has {world}: "
                "residuals belong to their rank; resume on as many ranks"
            )
        try:
            state.load_state_dict(saved)  # residuals move to their gradients' device at first use
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from error
        return None, None

    records.on_every_rank(state.process_group, load)


def _rank_and_world(group) -> tuple[int, int]:
    """This process's global rank (a key no replica in another group shares) and the group's size."""
    return dist.get_rank(), dist.get_world_size(group)
