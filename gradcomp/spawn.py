"""Processes on this machine as Gloo ranks: what the demo, the bench scripts and the tests share.

Example:
    >>> def body(rank, world_size, scale):
    ...     x = torch.ones(4) * rank * scale
    ...     gradcomp.all_reduce(x, "int8")
    ...     return x.tolist()
    >>> gradcomp.spawn.run_ranks(body, 2, 10.0)  # rank 0's result
    [5.0, 5.0, 5.0, 5.0]
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import pickle
import signal
import socket
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RanksFailed(RuntimeError):
    """A spawned rank raised, died, or was still running at the deadline."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _entry(rank, world_size, address, port, setup, group_timeout, threads, result_path, body, args) -> None:
    # A rank still running at the deadline is sent SIGUSR1 first: its threads' stacks go to stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # And one that aborts (a C++ terminate, a segfault) says where each of its threads was.
    faulthandler.enable(all_threads=True)
    if setup is not None:
        setup(rank, world_size)  # first: threads started later inherit what it sets
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=group_timeout),
    )
    store, finished = dist.distributed_c10d._get_default_store(), False
    try:
        result = body(rank, world_size, *args)
        if rank == 0:
            with open(result_path, "wb") as file:
                pickle.dump(result, file)
        # No rank tears its connections down while another still reads from them.
        finished = _count_and_wait(store, "returned", 1, world_size)
    finally:
        from gradcomp import collectives  # the package imports this module

        collectives.release_queues()
        # What the body left in reference cycles (a DDP model and its hook state hold a
        # queue's cloned group) goes now, once the queues have stopped and before the
        # groups are destroyed: a clone alive at the interpreter's exit aborts the process.
        gc.collect()
        if finished and rank == 0:
            # Rank 0 holds the store: it goes last, once the others have torn down.
            _count_and_wait(store, "left", 0, world_size - 1)
        dist.destroy_process_group()
        if finished and rank != 0:
            _count_and_wait(store, "left", 1, 0)


def _count_and_wait(store, name: str, add: int, until: int, limit: float = 30.0) -> bool:
    """Add ``add`` to the store's counter ``name`` and wait (at most ``limit`` seconds)
    until it reaches ``until``. Through the store, not a collective: a body may leave
    its group broken (a timeout it tested). A rank that raised never counts: the
    parent stops the others. Returns False where the store is gone (its host, rank 0,
    leaves only once every rank has counted)."""
    key = f"gradcomp/spawn/{name}"
    deadline = time.monotonic() + limit
    try:
        count = store.add(key, add)
        while count < until and time.monotonic() < deadline:
            time.sleep(0.01)
            count = store.add(key, 0)
    except RuntimeError:  # the store's connection closed: every rank had arrived
        return False
    return True


def run_ranks(
    body: Callable,
    world_size: int,
    *args,
    timeout: float = 600.0,
    group_timeout: float = 60.0,
    threads: int = 1,
    address: str = "127.0.0.1",
    setup: Callable[[int, int], None] | None = None,
):
    """Run ``body(rank, world_size, *args)`` on ``world_size`` spawned processes,
    each a rank of a Gloo group whose default timeout is ``group_timeout``
    seconds, with ``threads`` torch threads; return rank 0's result (picklable).

    The group meets at rank 0 on ``address`` (default 127.0.0.1);
    ``setup(rank, world_size)``, if given (picklable), runs in each process
    before it joins (to enter a network namespace, say).

    Raises:
        RanksFailed: a rank raised (its traceback in the message), died, or was
            still running after ``timeout`` seconds (a hang: the ranks' stacks
            go to stderr before they are killed).
    """
    with tempfile.TemporaryDirectory(prefix="gradcomp-ranks-") as directory:
        result_path = os.path.join(directory, "result.pickle")
        context = mp.start_processes(
            _entry,
            args=(world_size, address, free_port(), setup, group_timeout, threads, result_path, body, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        os.kill(process.pid, signal.SIGUSR1)
                    time.sleep(1.0)
                    for process in context.processes:
                        process.kill()
                    raise RanksFailed(f"ranks still running after {timeout:.0f} s (a hang)")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            raise RanksFailed(str(error)) from None
        if not os.path.exists(result_path):
            return None
        with open(result_path, "rb") as file:
            return pickle.load(file)
