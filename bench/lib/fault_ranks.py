"""Ranks for the fault matrix: every rank's ending, whatever it is, and what a case came to.

:func:`gradcomp.spawn.run_ranks` raises at the first rank that fails; a fault case
needs to know how each rank ended (returned, raised, killed by a signal, still
running at the deadline) and when. Each rank writes its ending to a file of its
own as it happens, then leaves with ``os._exit`` (a rank that raised must not
wait on peers in a teardown).

Example:
    >>> endings = run(body, 2, (settings,), deadline=60, group_timeout=10)
    >>> endings[0].status, endings[0].error
    ('raised', 'ValueError: ranks disagree ...')
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import glob
import hashlib
import json
import logging
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradcomp.spawn import free_port

RETURNED, RAISED, KILLED, ABORTED, HUNG = "returned", "raised", "killed", "aborted", "hung"


@dataclasses.dataclass
class Ending:
    """How one rank ended.

    Attributes:
        status: ``returned``, ``raised``, ``killed`` (a signal other than SIGABRT,
            the case's own doing), ``aborted`` (SIGABRT or another native crash)
            or ``hung`` (still running at the deadline, then killed).
        value: what the body returned (JSON), for ``returned``.
        error: ``"Type: message"``, for ``raised``.
        at: ``time.time()`` when it returned or raised.
    """

    status: str
    value: object = None
    error: str = ""
    at: float | None = None


def _entry(rank, world_size, port, group_timeout, directory, body, args) -> None:
    path = os.path.join(directory, f"rank{rank}.json")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=group_timeout),
        )
        ending = {"status": RETURNED, "value": body(rank, world_size, *args)}
    except BaseException as error:  # noqa: BLE001 - every ending is a record
        last = traceback.format_exception_only(type(error), error)[-1].strip()
        ending = {"status": RAISED, "error": last}
    ending["at"] = time.time()
    with open(path + ".tmp", "w") as file:
        json.dump(ending, file, default=str)
    os.replace(path + ".tmp", path)
    os._exit(0)  # no teardown: a peer may be dead or stalled, and the group broken


def run(
    body: Callable,
    world_size: int,
    args: tuple = (),
    deadline: float = 120.0,
    group_timeout: float = 10.0,
    awaited: int | None = None,
) -> list[Ending]:
    """Run ``body(rank, world_size, *args)`` on ``world_size`` spawned Gloo ranks and
    return each rank's :class:`Ending`; ranks still running after ``deadline`` seconds
    are killed and reported ``hung``. With ``awaited``, the run ends once ranks
    ``0 .. awaited - 1`` have (the others are the case's faulty ones: a stopped
    rank never will)."""
    with tempfile.TemporaryDirectory(prefix="gradcomp-faults-") as directory:
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), group_timeout, directory, body, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        processes = context.processes
        end = time.monotonic() + deadline
        watched = processes[: world_size if awaited is None else awaited]
        while any(p.is_alive() for p in watched) and time.monotonic() < end:
            time.sleep(0.05)
        hung = [p.is_alive() and p in watched for p in processes]
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join()
        return [_ending(directory, rank, processes[rank].exitcode, hung[rank]) for rank in range(world_size)]


def ending_in(directory: str, rank: int) -> Ending | None:
    """The ending rank ``rank`` wrote into ``directory``, or None (it wrote none: killed, aborted)."""
    path = os.path.join(directory, f"rank{rank}.json")
    if not os.path.exists(path):
        return None
    with open(path) as file:
        ending = Ending(**json.load(file))
    os.remove(path)  # a later run in the same folder writes its own
    return ending


def _ending(directory: str, rank: int, exitcode: int | None, hung: bool) -> Ending:
    written = ending_in(directory, rank)
    if written is not None:
        return written
    if hung:
        return Ending(HUNG)
    if exitcode is not None and -exitcode in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):
        return Ending(KILLED, error=signal.Signals(-exitcode).name)
    return Ending(ABORTED, error=f"exit code {exitcode}")


# ----------------------------------------------------------------------------- what a case came to

# The safe outcomes keep the promise; the broken ones are what the matrix counts (a
# silent wrong result, a lost checkpoint, code run on a load, a process aborted, a
# hang, an error on some ranks only, an unclear error, shared memory left behind).
RAISED_EVERYWHERE = "raised on every rank"
SURVIVORS_RAISED = "every survivor raised"
REFUSED = "refused, file named"
KEPT = "previous or new checkpoint whole"
SKIPPED = "skipped on every rank, warned"
DROPPED = "dropped as asked, warned"
SAFE = (RAISED_EVERYWHERE, SURVIVORS_RAISED, REFUSED, KEPT, SKIPPED, DROPPED)
SILENT = "silent wrong result"
LOST = "checkpoint lost"
CODE_RAN = "code ran on load"
ABORT = "process aborted"
HANG = "hang"
PARTIAL = "raised on some ranks only"
UNCLEAR = "unclear error"
LEAKED = "shared memory left behind"
BROKEN = (SILENT, LOST, CODE_RAN, ABORT, HANG, PARTIAL, UNCLEAR, LEAKED)


@dataclasses.dataclass
class Row:
    case: str
    fault: str
    promise: str
    outcome: str
    seconds: float | None = None
    detail: str = ""


def digest(tensors) -> str:
    """A short hash of tensors' bytes: equal on two ranks only if every bit is."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def every_rank_raises(endings, started: float) -> tuple[str, float | None, str]:
    """The outcome of a case whose promise is an error on every rank (no wrong result,
    no abort, no hang); the seconds from ``started`` to the last rank's error."""
    statuses = {e.status for e in endings}
    first_error = next((e.error for e in endings if e.status == RAISED), "")
    if ABORTED in statuses:
        return ABORT, None, next(e.error for e in endings if e.status == ABORTED)
    if HUNG in statuses:
        return HANG, None, first_error
    if statuses == {RAISED}:
        return RAISED_EVERYWHERE, max(e.at for e in endings) - started, first_error
    if statuses == {RETURNED}:
        return SILENT, None, "every rank returned"
    return PARTIAL, None, first_error


def mark(directory: str, rank: int) -> None:
    """This rank's fault time, for the case to measure the seconds to the error."""
    with open(os.path.join(directory, f"t0-{rank}"), "w") as file:
        file.write(repr(time.time()))


def started(directory: str) -> float:
    marks = glob.glob(os.path.join(directory, "t0-*"))
    return min(float(open(path).read()) for path in marks) if marks else time.time()


@contextlib.contextmanager
def logged_warnings():
    """Records of the ``gradcomp`` loggers at WARNING and above, while the block runs."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("gradcomp").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("gradcomp").removeHandler(handler)
