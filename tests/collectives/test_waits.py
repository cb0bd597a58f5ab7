"""A rank that waits for others says so long before the group's timeout, naming the call
and the ranks that have not reached it, then raises gradcomp's own error at the timeout
(collectives/waiting.py): a skipped ddp.register, a skipped first or later all_reduce,
a peer stopped inside a job. Warnings come at a lowered interval; rank 0 is the one
that waits."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import gradcomp
from gradcomp.collectives import waiting, worker
from tests.utils import run_ranks

TIMEOUT = 3.0  # the group's
WARN_AFTER, WARN_EVERY = 0.5, 1.0


@contextlib.contextmanager
def _warnings_logged():
    """(seconds since the block began, message) of each warning of the ``gradcomp``
    loggers while the block runs, with the warn interval lowered."""
    waiting.WARN_AFTER_SECONDS, waiting.WARN_EVERY_SECONDS = WARN_AFTER, WARN_EVERY
    began, records = time.monotonic(), []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append((time.monotonic() - began, record.getMessage()))
    logging.getLogger("gradcomp").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("gradcomp").removeHandler(handler)


def _skipped(rank: int, world_size: int, what: str) -> dict:
    """Rank 1 leaves out one call rank 0 makes (``what``), and sleeps past the timeout."""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8)) if what == "register" else None
    x = torch.ones(1000)
    progress = ""  # the store key rank 0 posts its job's number under, once one waits
    if what == "later all_reduce":
        gradcomp.all_reduce(x, "int8")  # together: the group's queue exists
        progress = f"gradcomp/progress/{worker.queue_for(None).group.group_name}/0"
    with _warnings_logged() as warned:
        if rank == 1:
            time.sleep(TIMEOUT + 2)
            return {}
        # No job waited yet: nothing was posted in the store.
        posted = bool(progress) and dist.distributed_c10d._get_default_store().check([progress])
        began = time.monotonic()
        try:
            if what == "register":
                gradcomp.ddp.register(model, "int8")
            else:
                gradcomp.all_reduce(x, "int8")
        except RuntimeError as error:
            seconds = time.monotonic() - began
            kind = type(error).__name__
            return dict(error=str(error), kind=kind, seconds=seconds, warned=warned, posted=posted)
    return {}


def _assert_warned_then_raised(result: dict, named: str) -> None:
    warned = [(at, message) for at, message in result["warned"] if "ranks [1]" in message]
    assert len(warned) >= 2, result["warned"]  # the first, and again
    assert warned[0][0] < TIMEOUT / 2 + 0.5, warned  # within the interval (half the timeout here)
    assert all(named in message for _, message in warned), warned
    assert result["kind"] == "TimedOut", result  # gradcomp's own error, not the store's or Gloo's
    assert "ranks [1]" in result["error"] and "within the group's timeout (3 s)" in result["error"], result
    assert TIMEOUT - 0.5 < result["seconds"] < TIMEOUT + 2, result  # the user's timeout, not longer


@pytest.mark.slow
def test_a_skipped_all_reduce_is_warned_of_naming_the_call_then_raises_in_time():
    result = run_ranks(_skipped, 2, "later all_reduce", group_timeout=TIMEOUT)
    named = "gradcomp.all_reduce of 1,000 float32 elements, job 2 of group [0, 1]"
    _assert_warned_then_raised(result, named)
    assert named in result["error"], result
    assert result["posted"] is False  # a call that does not wait costs no store round trip


@pytest.mark.slow
def test_a_skipped_first_all_reduce_raises_gradcomps_error_not_the_stores():
    result = run_ranks(_skipped, 2, "first all_reduce", group_timeout=TIMEOUT)
    _assert_warned_then_raised(result, "gradcomp's process group of ranks [0, 1]")
    assert "DistStoreError" not in result["kind"] and "/default_pg/" not in result["error"], result


@pytest.mark.slow
def test_a_skipped_register_is_warned_of_then_named_in_time():
    result = run_ranks(_skipped, 2, "register", group_timeout=TIMEOUT)
    _assert_warned_then_raised(result, "gradcomp.ddp.register")
    assert "did not call it" in result["error"], result


def _continue_until_it_goes_on(store, pid: int, limit: float = 30.0) -> None:
    """SIGCONT ``pid`` whenever it is stopped, until it says (``continued`` in the store) that it
    went on: a SIGCONT sent before its SIGSTOP (a loaded machine may run rank 1's job late)
    would be lost, and rank 1 stopped for good."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not store.check(["continued"]):
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] in "Tt":
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)


def _stopped_in_a_job(rank: int, world_size: int) -> dict:
    """Rank 1 stops (SIGSTOP) inside a job on the worker, before its collective; rank 0
    waits in that collective, then lets rank 1 go on."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    q = worker.queue_for(None)
    mine, everyone = torch.full((8,), float(rank)), torch.empty(16)

    def gather():
        if rank == 1:
            # To this thread: it stops before the call returns (a signal to the process may be
            # taken by another thread, and this one run on for a moment: past the line below).
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            store.set("continued", "1")
        worker.all_gather_async(everyone, mine, q.group).wait()

    with _warnings_logged() as warned:
        began = time.monotonic()
        try:
            q.submit(gather, torch.device("cpu"), writes=everyone, name="test.gather").wait()
        except RuntimeError as error:
            seconds = time.monotonic() - began
            if rank == 0:  # rank 1 fails here too, once it goes on
                _continue_until_it_goes_on(store, int(store.get("pid/1")))
            return dict(error=str(error), kind=type(error).__name__, seconds=seconds, warned=warned)
    return {}


@pytest.mark.slow
def test_a_peer_stopped_inside_a_job_is_named_by_the_rank_that_waits_for_it():
    result = run_ranks(_stopped_in_a_job, 2, group_timeout=TIMEOUT, timeout=60)
    named = "test.gather of 16 float32 elements, job 1 of group [0, 1]"
    _assert_warned_then_raised(result, named)
    assert "rank 1: no job" in result["warned"][0][1], result["warned"]
