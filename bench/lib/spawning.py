"""Ranks for a bench run: spawned Gloo processes on this machine with their logs, or torchrun's.

A spawned rank's output goes to a log of its own, shown when the run fails;
its progress bar keeps the terminal. A failure raises
:class:`gradcomp.spawn.RanksFailed` whose first line says in a line how
(:func:`reason`), and the last lines of every rank's log follow.

Example:
    >>> records = spawn(body, 2, settings)  # body(rank, world_size, settings) on 2 ranks
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from gradcomp.spawn import RanksFailed, run_ranks
from lib import cluster, machine, progress, results


def threads_per_rank(world_size: int) -> int:
    """The CPU cores each rank of this machine may use."""
    return max(1, (os.cpu_count() or 1) // world_size)


def spawn(body: Callable, world_size: int, *args, timeout: float = 600.0):
    """Run ``body(rank, world_size, *args)`` on ``world_size`` spawned Gloo ranks
    (:func:`gradcomp.spawn.run_ranks`, the machine's cores split between them, each rank
    in its node of the current emulated cluster if there is one); rank 0's return
    value is returned here.

    Raises:
        RanksFailed: a rank raised, was killed (a native abort included) or
            was still running after ``timeout`` seconds; its log is attached.
    """
    if world_size < 2:
        raise ValueError(f"spawn at least 2 ranks (one rank has nothing to communicate), got {world_size}")
    with tempfile.TemporaryDirectory(prefix="gradcomp-bench-") as directory:
        try:
            return run_ranks(
                _logged,
                world_size,
                directory,
                body,
                *args,
                timeout=timeout + 60,
                group_timeout=timeout,
                threads=threads_per_rank(world_size),
                **cluster.spawn_options(),
            )
        except RanksFailed as error:
            logs = _logs(directory)
            raise RanksFailed(f"{_ending(error, logs)}\n{logs}") from None


def reason(error: RanksFailed) -> str:
    """How the ranks failed, in a line (the first of the message)."""
    return str(error).partition("\n")[0]


def _logged(rank, world_size, directory, body, *args):
    """``body`` with this rank's output in a log (shown if the run fails); progress keeps the terminal."""
    progress.keep_terminal()
    log = os.open(os.path.join(directory, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        return body(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise


def _logs(directory: str) -> str:
    parts = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".log"):
            with open(os.path.join(directory, name), errors="replace") as file:
                lines = [line for line in file.read().splitlines() if "hostname of the client" not in line]
            parts.append(f"--- {name} (last lines)\n" + "\n".join(lines[-25:]))
    return "\n".join(parts)


def _ending(error: Exception, logs: str) -> str:
    """One line: the native error or the exception of the failing rank, and how it ended."""
    lines = logs.splitlines()
    native = [line.split("what():", 1)[1].strip() for line in lines if "what():" in line]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    detail = (native[:1] or raised[-1:] or [""])[0]
    # Native messages start with the enforce location; the explanation follows it.
    detail = re.sub(r"^\[enforce fail at [^\]]*\]\s*", "", detail)
    ending = next((line.strip(" -") for line in str(error).splitlines() if line.strip()), "")
    ending = ending.removesuffix(" with the following error:") or type(error).__name__
    return f"{ending}: {detail}" if detail else ending


def torchrun_world() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def init_torchrun(timeout: float = 600.0) -> tuple[str, torch.device]:
    """``init_process_group`` from torchrun's environment: NCCL on GPUs, else Gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(threads_per_rank(int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return backend, device


def on_cluster(name: str, args, settings: dict, run: Callable):
    """``run()`` in the cluster ``--nodes`` emulates (if it does), its machine written into
    the results of benchmark ``name``: ``(results, outcome)``, the outcome None (the
    failure written) if a rank failed."""
    facts = machine.machine(args.spawn, "gloo")
    suffix = f"-{args.nodes}x{args.ranks_per_node}-{args.inter_bandwidth}" if args.nodes else None
    found = results.Results(name, facts, settings, args.out, suffix=suffix)
    print(f"machine: {found.machine['machine']}", flush=True)
    try:
        with cluster.described_cluster(args, facts):
            return found, run()
    except RanksFailed as error:
        sys.stderr.write(f"{name} failed: {error}\n")
        return found, None


def spawn_on_cluster(name: str, body: Callable, args, settings: dict):
    """:func:`on_cluster` of ``body`` on ``args.spawn`` spawned Gloo ranks."""
    return on_cluster(name, args, settings, lambda: spawn(body, args.spawn, settings, timeout=3600))
