"""Choosers: objects that pick the compressor and algorithm of each
``all_reduce`` call on the worker, and the registry of named ones.

``all_reduce(tensor, chooser)`` takes any object that follows
:class:`Chooser`; ``all_reduce(tensor, "auto")`` takes the one shared
instance a registered name stands for. Nothing here knows a particular
chooser: the package above registers its own (``gradcomp/__init__.py``
registers ``"auto"``, the planner's :class:`gradcomp.planner.Auto`), so the
collectives never import what sits above them.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Protocol, runtime_checkable

import torch

from gradcomp.collectives.agreement import verify_settings
from gradcomp.collectives.dispatch import job_steps
from gradcomp.collectives.job import Job
from gradcomp.collectives.nodes import Hierarchy
from gradcomp.collectives.stats import ReduceStats
from gradcomp.collectives.worker import CollectiveQueue
from gradcomp.compressors import COMPRESSORS, Compressor


class Plan(Protocol):
    """What a chooser picked for one tensor (a :class:`gradcomp.planner.Prediction` is one)."""

    compressor: str  # the compressor's label, reported as ``ReduceStats.compressor``
    algorithm: str
    inter_algorithm: str | None  # between nodes, for ``hierarchical``; None: the default


@runtime_checkable
class Chooser(Protocol):
    """Picks, per call, the compressor and algorithm of a compressed all-reduce.

    Both methods run on the group's worker thread, in call order, so a chooser
    may issue collectives on ``q.group`` (to measure the link, say) as long as
    every rank makes the same calls.
    """

    def settings(self) -> dict:
        """What every rank must agree on before its first choice on a group (a
        ``"name"`` entry names the chooser in the error where they do not)."""
        ...

    def choice(
        self, q: CollectiveQueue, tensor: torch.Tensor, hierarchy: Hierarchy | None
    ) -> tuple[Compressor, Plan]:
        """The compressor and plan for ``tensor`` on ``q``'s group; ``hierarchy``:
        the group's nodes where the hierarchical algorithm may be weighed, else None.
        Every rank must get the same answer."""
        ...


# name -> what makes its chooser; name -> the one instance made from it, at first use.
_FACTORIES: dict[str, Callable[[], Chooser]] = {}
_SHARED: dict[str, Chooser] = {}


def register_chooser(name: str, factory: Callable[[], Chooser]) -> None:
    """Make ``all_reduce(t, name)`` (any case) use one shared ``factory()``, made at first use.

    Raises:
        ValueError: ``name`` is a compressor's name.

    Example:
        >>> collectives.register_chooser("auto", planner.Auto)
    """
    name = name.lower()
    if name in COMPRESSORS:
        raise ValueError(f"{name!r} names a compressor; a chooser needs a name of its own")
    _FACTORIES[name] = factory
    _SHARED.pop(name, None)


def shared_chooser(name: str) -> Chooser:
    """The one instance registered ``name`` (any case) stands for.

    Raises:
        KeyError: no chooser is registered under ``name``.
    """
    name = name.lower()
    found = _SHARED.get(name)
    if found is None:
        found = _SHARED.setdefault(name, _FACTORIES[name]())
    return found


def as_chooser(compressor) -> Chooser | None:
    """``compressor`` as a chooser: a registered name's shared instance, an object that
    follows :class:`Chooser`, or None (a :class:`Compressor` or a compressor's name)."""
    if isinstance(compressor, Compressor):
        return None
    if isinstance(compressor, str):
        return shared_chooser(compressor) if compressor.lower() in _FACTORIES else None
    return compressor if isinstance(compressor, Chooser) else None


def chosen_steps(chooser: Chooser, job: Job, q: CollectiveQueue) -> Generator[None, None, ReduceStats]:
    """(on the worker) Fill in ``job``'s compressor and algorithm from ``chooser``, then run it.

    The first call on a group compares the ranks' settings: ranks that would choose
    apart would issue other collectives and hang."""
    settings = dict(chooser.settings())
    name = settings.get("name", type(chooser).__name__)
    verify_settings(q, f"the all-reduce's compressor={name!r} settings", settings, job.tensor.device)
    job.compressor, plan = chooser.choice(q, job.tensor, job.hierarchy)
    job.algorithm, job.inter_algorithm = plan.algorithm, plan.inter_algorithm
    stats = yield from job_steps(job, q)
    stats.compressor = plan.compressor
    return stats
