"""The node's shared memory (collectives/shared_memory.py) leaves no file behind: a rank
killed (SIGKILL) at any point of the set-up, the survivor raises and nothing remains in
/dev/shm; a file whose creator died with its node goes at the next set-up."""

from __future__ import annotations

import datetime
import fcntl
import glob
import json
import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradcomp.collectives import shared_memory
from gradcomp.spawn import free_port

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_at(point: str) -> None:
    """Make this process die at ``point`` of the set-up (a patch of what it calls there)."""
    if point == "made":  # local rank 0, its file made, before any peer knows of it
        fallocate = os.posix_fallocate
        os.posix_fallocate = lambda *args: (fallocate(*args), _die())
    elif point == "mapped":  # the file mapped here, before the ranks agree it is mapped
        from_file = torch.from_file
        torch.from_file = lambda *args, **kwargs: (from_file(*args, **kwargs), _die())[0]
    elif point == "agreed":  # every rank mapped it, before this one unlinks it
        unlink = os.unlink
        mine = f"gradcomp-{os.getpid()}-"
        os.unlink = lambda path, *args, **kwargs: (
            _die() if mine in str(path) else unlink(path, *args, **kwargs)
        )


def _rank(rank: int, port: int, victim: int, point: str, directory: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=20),
    )
    import gradcomp

    if rank == victim:
        _kill_at(point)
    try:
        for _ in range(3):  # one node of both ranks: its stages in shared memory
            gradcomp.all_reduce(torch.ones(4096), "none", algorithm="hierarchical", node_size=2)
        ending = "returned"
    except Exception as error:  # noqa: BLE001 - the survivor's ending is the record
        ending = f"raised {type(error).__name__}"
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as file:
        json.dump({"ending": ending, "pid": os.getpid()}, file)
    os._exit(0)  # no teardown: the peer is dead


def _files_of(pids: list[int]) -> list[str]:
    return [p for pid in pids for p in glob.glob(os.path.join("/dev/shm", f"gradcomp-{pid}-*"))]


@pytest.mark.parametrize(
    "victim, point",
    [
        pytest.param(1, "mapped", id="rank1-mapped"),
        pytest.param(0, "made", id="rank0-made", marks=pytest.mark.slow),
        pytest.param(0, "mapped", id="rank0-mapped", marks=pytest.mark.slow),
        pytest.param(0, "agreed", id="rank0-agreed", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_a_rank_killed_during_the_set_up_leaves_no_shared_file(tmp_path, victim, point):
    context = mp.get_context("spawn")
    port = free_port()
    ranks = [
        context.Process(target=_rank, args=(rank, port, victim, point, str(tmp_path))) for rank in range(2)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    pids = [process.pid for process in ranks]
    for process in ranks:
        if process.is_alive():
            process.kill()
    survivor = 1 - victim
    assert ranks[victim].exitcode == -signal.SIGKILL, "the rank was not killed where the case says"
    assert ranks[survivor].exitcode == 0, ranks[survivor].exitcode
    ending = json.loads((tmp_path / f"rank{survivor}.json").read_text())["ending"]
    assert ending.startswith("raised"), ending
    assert _files_of(pids) == []


def test_files_of_dead_creators_go_at_the_next_set_up(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_memory, "SHARED_MEMORY_DIR", str(tmp_path))
    stale = tmp_path / "gradcomp-4242-0123456789abcdef"  # its creator died: no lock held
    live = tmp_path / "gradcomp-4243-fedcba9876543210"  # its creator holds the lock
    other = tmp_path / "gradcomp-notes"  # not a name the set-up makes
    for path in (stale, live, other):
        path.write_bytes(b"x" * 64)
    holder = os.open(live, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        shared_memory.remove_stale()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
    finally:
        os.close(holder)
