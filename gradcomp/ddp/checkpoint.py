"""The hook state's checkpoint: a versioned schema, one upgrade function, and the
``torch.distributed.checkpoint`` adapter.

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

import torch
import torch.distributed as dist

from gradcomp import planner
from gradcomp.ddp.auto import BucketPlans, Phase, Remeasure, StepSizes
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
    residuals, each rank's under a key of its own.

    Args:
        state: the hook state to save or restore.
        mismatch: what loading a checkpoint of another world size does:
            ``"raise"`` (default) a ``ValueError``; ``"drop"`` keeps the
            step but starts the residuals afresh, with a warning.

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
        buffer = io.BytesIO()
        torch.save(on_device(self.state.state_dict(), "cpu"), buffer)
        buffer.seek(0)
        self._placeholder = buffer  # what a load that finds nothing leaves in place
        rank, world = _rank_and_world(self.state.process_group)
        return {"world_size": world, f"rank{rank}": buffer}

    def load_state_dict(self, state_dict: dict) -> None:
        rank, world = _rank_and_world(self.state.process_group)
        saved, mine = int(state_dict["world_size"]), state_dict.get(f"rank{rank}")
        if mine is getattr(self, "_placeholder", None):
            mine = None  # the checkpoint had no state for this rank (a partial load)
        if isinstance(mine, io.BytesIO):
            mine.seek(0)
            mine = torch.load(mine, weights_only=False)
        if saved != world or mine is None:
            message = (
                f"the checkpoint holds the hook state of {saved} ranks and this run has {world}: "
                "residuals belong to their rank"
            )
            if self.mismatch == "raise":
                raise ValueError(message + "; resume on as many ranks, or pass mismatch='drop'")
            logger.warning("gradcomp: %s; the residuals start afresh (mismatch='drop')", message)
            restart = getattr(self.state, "restart", None)  # DiLoCo: its shared state, the ranks agreeing
            if restart is not None:
                restart(mine)
            elif mine is not None and "step" in mine:
                self.state.step = int(mine["step"])
            return
        self.state.load_state_dict(mine)  # residuals move to their gradients' device at first use


RANK_FILE = "gradcomp_rank{rank}.pt"


def save_rank_file(state, directory: str) -> str:
    """Write this rank's ``state`` (a :class:`HookState`, :class:`gradcomp.fsdp.FSDPState`)
    into ``directory`` as a file of its own, beside a framework's checkpoint (as
    Trainer's ``rng_state_{rank}.pth``); every rank calls it. Returns the file's path."""
    rank, world = _rank_and_world(state.process_group)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RANK_FILE.format(rank=rank))
    torch.save({"world_size": world, "state": on_device(state.state_dict(), "cpu")}, path)
    return path


def load_rank_file(state, directory: str) -> None:
    """Restore this rank's ``state`` from :func:`save_rank_file`'s file in ``directory``.

    Raises:
        FileNotFoundError: the folder holds no gradcomp state for this rank.
        ValueError: it was saved by a run of another world size.
    """
    rank, world = _rank_and_world(state.process_group)
    path = os.path.join(directory, RANK_FILE.format(rank=rank))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"gradcomp: {path} does not exist: the checkpoint holds no compression state for rank {rank} "
            "(saved without gradcomp, or by fewer ranks); its residuals would be lost"
        )
    saved = torch.load(path, weights_only=False)
    if int(saved["world_size"]) != world:
        raise ValueError(
            f"the checkpoint holds the hook state of {saved['world_size']} ranks and this run has {world}: "
            "residuals belong to their rank; resume on as many ranks"
        )
    state.load_state_dict(saved["state"])  # residuals move to their gradients' device at first use


def _rank_and_world(group) -> tuple[int, int]:
    """This process's global rank (a key no replica in another group shares) and the group's size."""
    return dist.get_rank(), dist.get_world_size(group)


def on_device(value, device: torch.device | str):
    """``value`` (a state dict) with every tensor in it moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device) for v in value)
    return value
