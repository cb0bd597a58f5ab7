"""Run a test body on N Gloo ranks on this machine, with a deadline.

The body runs in spawned processes; an assertion or error on any rank fails
the test with that rank's traceback, and a rank that hangs fails it after
``timeout`` seconds instead of blocking the suite.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradcomp.demo import free_port


def _entry(rank: int, world_size: int, port: int, group_timeout: float, body, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=group_timeout)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    try:
        body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(body, world_size: int, *args, timeout: float = 240.0, group_timeout: float = 60.0) -> None:
    """Run ``body(rank, world_size, *args)`` on ``world_size`` Gloo ranks whose
    default group has ``group_timeout`` seconds."""
    context = mp.start_processes(
        _entry,
        args=(world_size, free_port(), group_timeout, body, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"ranks still running after {timeout} s (a hang)")


def same_on_all_ranks(tensor: torch.Tensor) -> bool:
    """Whether every rank holds exactly these bits."""
    reference = tensor.detach().clone()
    dist.broadcast(reference, 0)
    mine = torch.tensor([int(torch.equal(reference, tensor))])
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    return bool(mine.item())


def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``tensor`` (same shape on all ranks), in rank order."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor.contiguous())
    return pieces
