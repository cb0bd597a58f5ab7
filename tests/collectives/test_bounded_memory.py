"""Memory that stays bounded: the default state of unnamed tensors (collectives/reduce.py)
and the jobs a group holds pending (collectives/worker.py)."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

import gradcomp
from gradcomp.collectives import queue_for, reduce, worker
from tests.utils import run_ranks

SHAPES = 2000


def _default_entries() -> tuple[int, int]:
    """How many residuals the default memories hold: of unnamed tensors, of named ones."""
    unnamed = sum(len(memory) for memory, _ in reduce._UNNAMED.values())
    named = sum(len(memory) for memory, _ in reduce._DEFAULT_FEEDBACK.values())
    return unnamed, named


def _input(rank: int, numel: int, salt: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(7919 * rank + numel + salt))


def _unnamed_bounded_named_kept(rank: int, world_size: int) -> None:
    # A loop over a few shapes, step after step, keeps each shape's residual and counter
    # however many other shapes come and go between its calls, up to the limit.
    loop = [_input(rank, n) for n in (7, 300, 1001)]
    for _ in range(3):
        for x in loop:
            gradcomp.all_reduce(x.clone(), "int8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for numel in range(2000, 2000 + SHAPES):  # distinct unnamed shapes
            gradcomp.all_reduce(_input(rank, numel), "int8")
            if numel % 100 == 0:  # the loop's shapes stay recent
                for x in loop:
                    gradcomp.all_reduce(x.clone(), "int8")
        for index in range(300):  # named ones are kept, whatever their number
            gradcomp.all_reduce(_input(rank, 16, index), "int8", name=("layer", index))
    unnamed, named = _default_entries()
    assert len(reduce._UNNAMED) <= reduce.UNNAMED_LIMIT
    assert unnamed <= reduce.UNNAMED_LIMIT, unnamed
    assert named == 300
    released = [w for w in caught if "without a name=" in str(w.message)]
    assert len(released) == 1, [str(w.message) for w in caught]
    # The loop's shapes were never released: their counters went on.
    for x in loop:
        (memory, counters), *_ = [v for k, v in reduce._UNNAMED.items() if k[-1][0] == tuple(x.shape)]
        assert counters[(tuple(x.shape), str(x.dtype))] == 3 + SHAPES // 100
        assert len(memory) == 1


@pytest.mark.slow
def test_unnamed_default_state_is_bounded_and_named_state_kept():
    run_ranks(_unnamed_bounded_named_kept, 1)


def _reduce_all(rank: int, count: int, asynchronous: bool) -> list[torch.Tensor]:
    """``count`` reductions of one shape (one residual between them, error feedback on)."""
    results, handles, most = [], [], 0
    q = queue_for(None)
    for i in range(count):
        x = _input(rank, 64, i)
        handle = gradcomp.all_reduce(x, "int8", async_op=asynchronous)
        most = max(most, q.pending)
        results.append(x)
        handles.append(handle)
    for handle in handles if asynchronous else []:
        handle.wait()
    if asynchronous:
        assert most <= worker.MAX_PENDING, most
    return results


def _async_depth(rank: int, world_size: int) -> None:
    count = 5000
    expected = _reduce_all(rank, count, asynchronous=False)
    reduce._UNNAMED.clear()  # the same residual and counters from the start
    if rank == 1:
        time.sleep(2.0)  # rank 0 submits meanwhile, and nothing of it can complete
    got = _reduce_all(rank, count, asynchronous=True)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), i


@pytest.mark.slow
def test_async_submissions_past_the_depth_wait_and_stay_exact():
    run_ranks(_async_depth, 2)


def _worker_never_waits(rank: int, world_size: int) -> None:
    # A job and a future's callback that submit on the worker's thread while the queue is
    # full: waiting there would wait for the worker itself.
    q = queue_for(None)
    cpu = torch.device("cpu")
    full, inside = threading.Event(), []

    def submits_on_the_worker():
        assert full.wait(30)
        inside.append(q.submit(lambda: "from a job", cpu))
        return "first"

    first = q.submit(submits_on_the_worker, cpu)
    first.then(lambda _: inside.append(q.submit(lambda: "from a callback", cpu)))
    fillers = [q.submit(lambda: None, cpu) for _ in range(worker.MAX_PENDING - 1)]
    assert q.pending == worker.MAX_PENDING
    full.set()
    assert first.wait() == "first"
    for future in fillers:
        future.wait()
    assert sorted(future.wait() for future in inside) == ["from a callback", "from a job"]
    # The caller's thread does wait: a full queue lets one more in once one completes.
    gate = threading.Event()
    blocked = [q.submit(gate.wait, cpu) for _ in range(worker.MAX_PENDING)]
    submitted = threading.Event()
    threading.Thread(target=lambda: (q.submit(lambda: None, cpu), submitted.set()), daemon=True).start()
    assert not submitted.wait(0.5) and q.pending == worker.MAX_PENDING
    gate.set()
    assert submitted.wait(30)
    for future in blocked:
        future.wait()


@pytest.mark.slow
def test_the_worker_and_its_callbacks_never_wait_for_room():
    run_ranks(_worker_never_waits, 1)
