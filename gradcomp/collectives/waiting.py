"""Waits for other ranks that say what they wait for, and for whom, long before the
group's timeout ends them.

A rank that makes a gradcomp call its peers do not (``if rank == 0:``), or a peer
that stalls, leaves the others waiting until the group's timeout: thirty minutes
by Gloo's default, with nothing printed. Every place where gradcomp waits for other
ranks warns instead, :data:`WARN_AFTER_SECONDS` into the wait (half the group's
timeout where that is sooner) and again every :data:`WARN_EVERY_SECONDS`, naming the
call and the ranks that have not reached it; the timeout raises gradcomp's own
error, naming the call.

Two kinds of wait. *In the store* (a rank's arrival at a call, the creation of
gradcomp's groups, the exchange of node layouts): each rank sets a key of its own,
so the keys that are not there name the missing ranks (:func:`wait_for_ranks`).
*In a collective* (a job on the collective worker): a collective cannot say who is
missing, so a job that has waited :func:`posting_time` posts its number in the
store, and reads its peers' (:class:`Progress`); a rank that posted a lower
number, or none, has not reached the job. Nothing of this runs on a call that does
not wait: no store round trip, no collective, not a byte on the wire.

The warnings go to the ``gradcomp`` loggers, as gradcomp's other run-time reports
do (a warning that repeats is a log line, not a ``warnings.warn``, which shows
once per place).
"""

from __future__ import annotations

import datetime
import logging
import time

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Seconds into a wait for other ranks before the first warning (sooner where the
# group's timeout is short: at half of it), then between warnings. Module constants:
# read at every wait, so that tests may lower them.
WARN_AFTER_SECONDS = 30.0
WARN_EVERY_SECONDS = 60.0
# The shortest slice of a store wait (a timeout of zero would not wait at all).
_SHORTEST_SLICE = 0.01


class TimedOut(RuntimeError):
    """gradcomp's error where a wait for other ranks reached the group's timeout: it names
    the call and, where known, the ranks that had not reached it."""


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective's or the store's timeout (Gloo says "Timed out
    waiting", the store "wait timeout", NCCL's watchdog "timed out")."""
    return isinstance(error, dist.DistStoreError) or (
        isinstance(error, RuntimeError)
        and any(word in str(error).lower() for word in ("timed out", "timeout"))
    )


def first_warning(timeout_seconds: float) -> float:
    """Seconds into a wait of at most ``timeout_seconds`` before its first warning."""
    return min(WARN_AFTER_SECONDS, timeout_seconds / 2)


def posting_time(timeout_seconds: float) -> float:
    """Seconds into a job's wait before it posts its number (:class:`Progress`): half
    the first warning's, so that a peer stuck in the same job has posted its number by
    the time this rank reads the others'."""
    return first_warning(timeout_seconds) / 2


def warning_due(waited: float, warned: int, timeout_seconds: float) -> bool:
    """Whether a wait of ``waited`` seconds that has warned ``warned`` times warns now."""
    return waited >= first_warning(timeout_seconds) + warned * WARN_EVERY_SECONDS


def seconds(value: float) -> str:
    """``value`` seconds, as the messages say them."""
    return f"{value:.3g} s" if value < 10 else f"{value:.0f} s"


def describe_call(name: str, tensor: torch.Tensor | None = None) -> str:
    """A call as the warnings name it: ``"gradcomp.all_reduce of 1,048,576 float32 elements"``."""
    if tensor is None:
        return name
    return f"{name} of {tensor.numel():,} {str(tensor.dtype).removeprefix('torch.')} elements"


def wait_for_ranks(store, keys: dict[int, str], what: str, timeout: datetime.timedelta) -> list[int]:
    """Wait until every key of ``keys`` (a rank -> the key that rank sets) is in ``store``,
    warning while some are not, naming their ranks and ``what`` this rank waits at.

    Returns:
        ``[]`` once every key is there; the ranks whose keys are still missing when
        ``timeout`` has passed (the caller raises, naming its call).
    """
    total = timeout.total_seconds()
    started = time.monotonic()
    deadline = started + total
    warned = 0
    while True:
        now = time.monotonic()
        due = started + first_warning(total) + warned * WARN_EVERY_SECONDS
        try:
            store.wait(list(keys.values()), _slice(min(due, deadline) - now))
            return []
        except (dist.DistStoreError, RuntimeError):  # the slice ended: who is missing?
            missing = missing_ranks(store, keys)
        if not missing:
            continue
        waited = time.monotonic() - started
        if waited >= total:
            return missing
        warned += 1
        logger.warning(
            "gradcomp: rank %d has waited %s for ranks %s, which have not reached %s; "
            "it raises at the group's timeout (%s)",
            dist.get_rank(),
            seconds(waited),
            missing,
            what,
            seconds(total),
        )


def missing_ranks(store, keys: dict[int, str]) -> list[int]:
    """The ranks of ``keys`` whose key is not in ``store``."""
    return [rank for rank, key in keys.items() if not store.check([key])]


def _slice(remaining: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(remaining, _SHORTEST_SLICE))


class Progress:
    """The jobs a group's ranks have reached, as far as ranks stuck in one have said:
    each posts its job's number under its rank (:meth:`post`, only once a job has
    waited :func:`posting_time`), and reads its peers' (:meth:`behind`).

    Args:
        store: the default store, which every rank of the group reaches.
        name: the group's name, the same on every rank (gradcomp's groups are named
            alike on their members).
        ranks: the group's global ranks, in group order.
        rank: this rank's place in the group.
    """

    def __init__(self, store, name: str, ranks: list[int], rank: int):
        self.store = store
        self.prefix = f"gradcomp/progress/{name}"
        self.ranks = ranks
        self.rank = rank

    def post(self, job: int) -> None:
        """Say that this rank has reached job number ``job`` and waits in it."""
        self.store.set(f"{self.prefix}/{self.rank}", str(job))

    def behind(self, job: int) -> dict[int, int | None]:
        """The peers (global ranks) that have not said they reached job ``job``: the last
        job each said it waited in, None where it said none."""
        behind = {}
        for place, rank in enumerate(self.ranks):
            key = f"{self.prefix}/{place}"
            if place == self.rank:
                continue
            seen = int(self.store.get(key)) if self.store.check([key]) else None
            if seen is None or seen < job:
                behind[rank] = seen
        return behind


def describe_behind(behind: dict[int, int | None]) -> str:
    """``Progress.behind``'s answer in words."""
    said = ", ".join(
        f"rank {rank}: {'no job' if seen is None else f'job {seen}'}" for rank, seen in behind.items()
    )
    return f"ranks {list(behind)} have not reached it (the last job each said it waited in: {said})"
