"""Jobs in flight together give the bits of jobs run one at a time (collectives/worker.py).

The worker starts a job while earlier ones are paused, their exchanges in flight.
Whatever two jobs share (the tensor they write, the residuals and PowerSGD's warm start
kept under one key, whatever else a compressor or algorithm keeps between calls) must
then read what it would read with one job at a time. Every compressor, with every
algorithm it takes on 2 ranks and with "auto", reduces four tensors a round for two
rounds, asynchronously and back to back, then one call at a time; the results and the
residuals must agree bit for bit, at every in-flight depth the worker can use, with the
four tensors named alike (one residual between them) or apart. One rank issues every
collective a few milliseconds late, so that the other's jobs start while those before
them are really in flight.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings

import pytest
import torch

import gradcomp
from gradcomp.collectives import worker
from gradcomp.collectives.policy import ALGORITHMS, HIERARCHICAL
from tests.utils import run_ranks

TENSORS, ROUNDS = 4, 2
SHAPE = (64, 48)  # a matrix for PowerSGD; one segment and one lane for the others
DELAY = 0.002  # seconds rank 1 waits before issuing each collective


def _cases(world_size: int) -> list[tuple[str, str | None]]:
    """Every compressor with every algorithm it takes on ``world_size`` ranks, and "auto"."""
    cases = []
    for name in gradcomp.COMPRESSORS:
        compressor = gradcomp.get_compressor(name)
        for algorithm in (*ALGORITHMS, HIERARCHICAL):
            try:
                gradcomp.collectives.check_algorithm(compressor, algorithm, world_size)
            except ValueError:
                continue
            cases.append((name, algorithm))
    return [*cases, ("auto", None)]


def _compressor(name: str):
    if name == "auto":  # planned from the stored profile at a slow link: compressed, nothing measured
        profile = gradcomp.planner.Profile.load().with_link(1e6)
        return gradcomp.planner.Auto(allow=("bf16", "int8", "int4", "topk@0.01"), profile=profile)
    return gradcomp.get_compressor(name)


def _keeps_state(name: str) -> bool:
    """Whether calls under one name share state: a chooser's compressor is not known
    when the call is made, so its calls are taken to."""
    return name == "auto" or _compressor(name).keeps_state


def _input(rank: int, round_: int, i: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * rank + 100 * round_ + i)
    return torch.randn(SHAPE, generator=generator)


@contextlib.contextmanager
def _late_exchanges(seconds: float):
    """Within: every collective the algorithms issue waits ``seconds`` first (torch's
    all-reduce and all-to-all, and the all-gather they import from the worker)."""
    places = [(torch.distributed, "all_reduce"), (torch.distributed, "all_to_all_single")]
    for name, module in list(sys.modules.items()):
        if name.startswith("gradcomp.collectives") and "all_gather_async" in vars(module):
            places.append((module, "all_gather_async"))
    originals = [getattr(module, function) for module, function in places]
    for (module, function), original in zip(places, originals, strict=True):

        def late(*args, _original=original, **kwargs):
            time.sleep(seconds)
            return _original(*args, **kwargs)

        setattr(module, function, late)
    try:
        yield
    finally:
        for (module, function), original in zip(places, originals, strict=True):
            setattr(module, function, original)


@contextlib.contextmanager
def _overlaps_counted():
    """Within: how many jobs paused, and how many started while another was paused."""
    counts, paused = {"paused": 0, "overlapped": 0}, set()
    start, finish = worker.CollectiveQueue._start, worker.CollectiveQueue._finish

    def counted_start(self, job):
        counts["overlapped"] += bool(paused)
        start(self, job)
        if job.steps is not None:
            counts["paused"] += 1
            paused.add(job.number)

    def counted_finish(self, job):
        paused.discard(job.number)
        finish(self, job)

    worker.CollectiveQueue._start, worker.CollectiveQueue._finish = counted_start, counted_finish
    try:
        yield counts
    finally:
        worker.CollectiveQueue._start, worker.CollectiveQueue._finish = start, finish


def _reduce(rank: int, case: tuple, names: list, asynchronous: bool):
    """Two rounds of four tensors; every result, and the residuals left. Asynchronously,
    tensors named alike go back to back; named apart, each round waits for the one
    before (a new tensor under a name whose job is in flight is warned of)."""
    name, algorithm = case
    compressor, memory = _compressor(name), gradcomp.ErrorFeedback()
    options = {} if algorithm is None else {"algorithm": algorithm}
    if algorithm == HIERARCHICAL:
        options["node_size"] = 1
    results, handles = [], []
    for round_ in range(ROUNDS):
        for i in range(TENSORS):
            x = _input(rank, round_, i)
            step = round_ * TENSORS + i  # the same random streams in both runs
            handle = gradcomp.all_reduce(
                x, compressor, feedback=memory, name=names[i], step=step, async_op=asynchronous, **options
            )
            handles.append(handle)
            results.append(x)
        if asynchronous and len(set(names)) > 1:
            for handle in handles:
                handle.wait()
    for handle in handles if asynchronous else []:
        handle.wait()
    return results, {key: memory.get(key).clone() for key in memory.keys()}


def _assert_same_bits(got, expected, what: str) -> None:
    (results, residuals), (expected_results, expected_residuals) = got, expected
    for i, (a, b) in enumerate(zip(results, expected_results, strict=True)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{what}: tensor {i} differs"
    assert sorted(residuals, key=repr) == sorted(expected_residuals, key=repr), what
    for key, value in expected_residuals.items():
        assert torch.equal(residuals[key].view(torch.uint8), value.view(torch.uint8)), f"{what}: {key}"


def _in_flight_is_one_at_a_time(rank: int, world_size: int, cases: list, depths: tuple) -> None:
    for same_name in (True, False):
        for case in cases:
            names = ["shared"] * TENSORS if same_name else [f"tensor {i}" for i in range(TENSORS)]
            expected = _reduce(rank, case, names, asynchronous=False)
            for depth in depths:
                worker.IN_FLIGHT = depth
                late = _late_exchanges(DELAY) if rank == 1 else contextlib.nullcontext()
                with late, _overlaps_counted() as counts, warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = _reduce(rank, case, names, asynchronous=True)
                what = f"{case}, in flight {depth}, {'one name' if same_name else 'four names'}"
                _assert_same_bits(got, expected, what)
                # Jobs that pause, under other names, really overlapped from two in flight (one
                # rank issues late); under one name they share state, each waits for the one
                # before, and the sharing is warned of once (a memory and a name).
                sharing = same_name and _keeps_state(case[0])
                if sharing:
                    assert counts["overlapped"] == 0, what
                elif depth > 1 and rank == 0 and counts["paused"]:
                    assert counts["overlapped"], what
                warned = [str(w.message) for w in caught if "share one residual" in str(w.message)]
                assert len(warned) == sharing, (what, warned)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_jobs_in_flight_give_the_bits_of_jobs_run_one_at_a_time(world_size):
    depths = tuple(range(1, worker.IN_FLIGHT + 1))
    run_ranks(_in_flight_is_one_at_a_time, world_size, _cases(world_size), depths, timeout=900)


@pytest.mark.slow
def test_powersgd_warm_start_in_flight_is_the_one_at_a_time_warm_start():
    # The fast tier's case: PowerSGD keeps its warm start under the tensor's name.
    run_ranks(_in_flight_is_one_at_a_time, 2, [("powersgd", "dense")], (worker.IN_FLIGHT,))


def _same_tensor_twice(rank: int, world_size: int) -> None:
    # The second call reduces the first one's result, in flight as one at a time; one
    # tensor under one name is not two tensors sharing a residual: no warning.
    x = _input(rank, 0, 0)
    one, two = x.clone(), x.clone()
    memories = gradcomp.ErrorFeedback(), gradcomp.ErrorFeedback()
    for step in range(2):
        gradcomp.all_reduce(one, "int8", feedback=memories[0], name="same", step=step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options = dict(feedback=memories[1], name="same", async_op=True)
        handles = [gradcomp.all_reduce(two, "int8", step=step, **options) for step in range(2)]
    for handle in handles:
        handle.wait()
    assert torch.equal(one, two)
    key = gradcomp.collectives.key_of("same")
    assert torch.equal(memories[0].get(key), memories[1].get(key))


@pytest.mark.slow
def test_the_same_tensor_twice_in_flight_reduces_the_first_result():
    run_ranks(_same_tensor_twice, 2)


def _groups_keep_residuals_apart(rank: int, world_size: int) -> None:
    # Each group runs its jobs on a worker of its own: nothing orders two groups' jobs, so
    # the default residuals (and warm starts) are one set a group.
    other = torch.distributed.new_group(list(range(world_size)))
    groups = (None, other)

    def reduce(asynchronous: bool):
        results, handles = [], []
        for i in range(TENSORS):
            x = _input(rank, 0, i)
            handle = gradcomp.all_reduce(x, "powersgd", groups[i % 2], step=i, async_op=asynchronous)
            handles.append(handle)
            results.append(x)
        for handle in handles if asynchronous else []:
            handle.wait()
        return results

    gradcomp.collectives.reduce._DEFAULT_FEEDBACK.clear()
    gradcomp.collectives.reduce._UNNAMED.clear()
    expected = reduce(asynchronous=False)
    gradcomp.collectives.reduce._DEFAULT_FEEDBACK.clear()
    gradcomp.collectives.reduce._UNNAMED.clear()
    late = _late_exchanges(DELAY) if rank == 1 else contextlib.nullcontext()
    with late, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = reduce(asynchronous=True)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    # One ErrorFeedback of the caller's on both groups at once: warned of.
    memory = gradcomp.ErrorFeedback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handles = [
            gradcomp.all_reduce(
                _input(rank, 1, i), "int8", groups[i % 2], feedback=memory, name="g", async_op=True
            )
            for i in range(TENSORS)
        ]
        for handle in handles:
            handle.wait()
    if rank == 0:  # submitted back to back: the other group's job is still in flight
        assert any("two process groups at once" in str(w.message) for w in caught), caught


@pytest.mark.slow
def test_default_residuals_are_a_groups_own():
    run_ranks(_groups_keep_residuals_apart, 2)
