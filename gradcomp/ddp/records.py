"""What a file of a rank's state records, what a load checks before it restores it, and how
every rank learns that one of them refused.

A rank's state (a :class:`~gradcomp.ddp.HookState`, :class:`gradcomp.fsdp.FSDPState` or
:class:`gradcomp.DiLoCo`) goes into a file, a ``torch.distributed.checkpoint`` entry or a
Lightning checkpoint as a record::

    {"format": 2, "rank": int, "world_size": int, "kind": "HookState" | "FSDPState" | "DiLoCo",
     "state": state_dict(), on the CPU: its step, compressor settings and layout included}

Format 1 (gradcomp before records) kept ``{"world_size", "state"}`` in a rank file and the
bare state elsewhere; it loads, with a warning that its rank cannot be checked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger("gradcomp.ddp")

FORMAT = 2
# The ErrorFeedback entries of the states' dicts. Their residuals never hold NaN or Inf
# (the ops zero a non-finite entry): one that does comes from a damaged file.
RESIDUAL_ENTRIES = ("feedback", "scatter_feedback")


def record(state, rank: int, world: int) -> dict:
    """``state``'s record for rank ``rank`` of ``world`` (its tensors copied to the CPU)."""
    return {
        "format": FORMAT,
        "rank": rank,
        "world_size": world,
        "kind": type(state).__name__,
        "state": on_device(state.state_dict(), "cpu"),
    }


def opened(saved, state, rank: int, where: str) -> tuple[dict, int | None]:
    """The state dict ``saved`` (a record, or format 1's file) holds for ``state``, and the
    world size it records (None where format 1 recorded none), once it is known to be of
    ``state``'s kind, rank ``rank``'s, and its residuals finite.

    Raises:
        ValueError: naming ``where``: not a gradcomp state, of a newer format, of another kind
            or another rank, or a residual holding NaN or Inf.
    """
    if not isinstance(saved, dict):
        raise ValueError(f"{where} holds no gradcomp state (it holds a {type(saved).__name__})")
    if "format" not in saved:
        logger.warning(
            "gradcomp: %s was saved by an older gradcomp, which did not record the rank it belongs to: "
            "its rank is not checked",
            where,
        )
        whole_file = "state" in saved and "world_size" in saved
        saved = {
            "kind": None,
            "rank": None,
            "world_size": saved["world_size"] if whole_file else None,
            "state": saved["state"] if whole_file else saved,
        }
    elif saved["format"] > FORMAT:
        raise ValueError(
            f"{where} was saved in gradcomp's format {saved['format']}; this gradcomp reads up to "
            f"{FORMAT}: upgrade gradcomp"
        )
    kind = saved["kind"]
    if kind is not None and kind not in [cls.__name__ for cls in type(state).__mro__]:
        raise ValueError(f"{where} holds a {kind}'s state, not a {type(state).__name__}'s")
    if saved["rank"] is not None and saved["rank"] != rank:
        raise ValueError(
            f"{where} holds rank {saved['rank']}'s state and this is rank {rank}: residuals belong to "
            "their rank; give each rank its own file"
        )
    bad = nonfinite_residual(saved["state"])
    if bad is not None:
        raise ValueError(
            f"{where}: the residual {bad} holds NaN or Inf, which gradcomp never keeps: the file is "
            "damaged; resume from another checkpoint"
        )
    return saved["state"], saved["world_size"]


def nonfinite_residual(state: dict) -> str | None:
    """The first residual of ``state`` (a state dict) that holds NaN or Inf, as
    ``entry[key]``; None where every one is finite."""
    for entry in RESIDUAL_ENTRIES:
        feedback = state.get(entry)
        residuals = feedback.get("residuals", {}) if isinstance(feedback, dict) else {}
        for key, residual in residuals.items():
            if residual.is_floating_point() and not bool(torch.isfinite(residual).all()):
                return f"{entry}[{key!r}]"
    return None


def on_every_rank(group, attempt: Callable[[], tuple]):
    """Run ``attempt`` on every rank of ``group`` (each calls this); where it raised on any
    rank, every rank raises: its own error where it had one, else a ``ValueError`` naming the
    ranks that failed and why. A rank that alone refused its state would otherwise leave
    the others to train on and wait for it.

    Args:
        attempt: returns ``(result, summary)``; ``summary`` is small and picklable.

    Returns:
        This rank's ``result`` and every rank's ``summary``, in the group's rank order.
    """
    try:
        result, summary = attempt()
        error = None
    except Exception as caught:
        result, summary, error = None, None, caught
    described = None if error is None else f"{type(error).__name__}: {error}"
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (summary, described), group=group)
    if error is not None:
        raise error
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(everyone))
    failed = [f"rank {r}: {why}" for r, (_, why) in zip(ranks, everyone, strict=True) if why is not None]
    if failed:
        raise ValueError("gradcomp: another rank could not load its state, " + "; ".join(failed))
    return result, [summary for summary, _ in everyone]


def on_device(value, device: torch.device | str):
    """``value`` (a state dict) with every tensor in it moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device) for v in value)
    return value
