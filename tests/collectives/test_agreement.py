"""Agreement on every call (gradcomp.collectives.agreement): ranks whose settings differ
raise on every rank, with each rank's settings, whatever ran before; never a wrong
result, never an aborted process; settings that change on every rank at once still
work; the steady state issues the collectives it issued before; the plans kept are
bounded."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import gradcomp
from gradcomp.collectives import agreement, queue_for
from gradcomp.collectives.job import Agreement, Job
from tests.utils import run_ranks, same_on_all_ranks

NUMEL = 4097


def _input(rank: int, salt: int = 0, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + salt))


def _refused(named: tuple[str, ...], tensor: torch.Tensor, compressor: str, **options) -> None:
    """``all_reduce(tensor, compressor, **options)`` raises ValueError on this rank, naming
    each of ``named``; then the group starts afresh."""
    with pytest.raises(ValueError, match="ranks disagree") as raised:
        gradcomp.all_reduce(tensor, compressor, **options)
    for name in named:
        assert name in str(raised.value), (name, str(raised.value))
    gradcomp.collectives.release_queues()


# (what ran before on every rank, then each rank's own call, what the error must name):
# every call an all_reduce(x, compressor, **options) of NUMEL elements.
CASES = {
    "int4 and qsgd, both used before": (
        [("int4", {}), ("qsgd", {})],
        [("int4", {}), ("qsgd", {})],
        ("Int4(", "QSGD("),
    ),
    "int8 and int4 (other wire sizes), both used before": (
        [("int8", {}), ("int4", {})],
        [("int8", {}), ("int4", {})],
        ("Int8(", "Int4("),
    ),
    "int8 and int4 at first use": ([], [("int8", {}), ("int4", {})], ("Int8(", "Int4(")),
    "random-K step per rank": (
        [("randk@0.1", {"step": 0})],
        [("randk@0.1", {"step": 0}), ("randk@0.1", {"step": 1})],
        ("step=0", "step=1"),
    ),
    "random-K name per rank": (
        [("randk@0.1", {"name": "a"}), ("randk@0.1", {"name": "b"})],
        [("randk@0.1", {"name": "a"}), ("randk@0.1", {"name": "b"})],
        ("key=",),
    ),
    "op per rank": ([("bf16", {})], [("bf16", {"op": "avg"}), ("bf16", {"op": "sum"})], ("'avg'", "'sum'")),
    "algorithm per rank, both used before": (
        [("int8", {"algorithm": "two_phase"}), ("topk@0.05", {"algorithm": "allgather"})],
        [("int8", {"algorithm": "two_phase"}), ("topk@0.05", {"algorithm": "allgather"})],
        ("'two_phase'", "'allgather'"),
    ),
}


def _disagreeing_ranks(rank: int, world_size: int, labels: list[str]) -> None:
    # Steps given: the default one counts calls per name and settings, which the failed
    # calls before left different on each rank.
    for label in labels:
        before, mine, named = CASES[label]
        for name, options in before:
            gradcomp.all_reduce(_input(rank), name, **{"step": 0, **options})
        name, options = mine[min(rank, len(mine) - 1)]  # the ranks past the list as its last
        _refused(named, _input(rank, salt=1), name, **{"step": 0, **options})
        # Nothing hung, nothing aborted: the group goes on.
        x = _input(rank, salt=2)
        gradcomp.all_reduce(x, "int8")
        assert same_on_all_ranks(x), label


@pytest.mark.slow
def test_ranks_that_disagree_raise_on_every_rank_whatever_ran_before():
    run_ranks(_disagreeing_ranks, 2, list(CASES), timeout=300)


@pytest.mark.slow
def test_ranks_that_disagree_raise_on_every_rank_at_three_ranks():
    run_ranks(_disagreeing_ranks, 3, list(CASES), timeout=300)


# Each exchange algorithm, the same plan used before on every rank, then one rank's
# step, and one rank's settings (a wire size of its own), differ.
ALGORITHMS = {
    "dense": ("bf16", {}, ("none", {})),
    "dense random-K": ("randk@0.1", {}, ("randk@0.2", {})),
    "allgather": ("int8", {"algorithm": "allgather"}, ("int4", {"algorithm": "allgather"})),
    "allgather Top-K": ("topk@0.05", {"algorithm": "allgather"}, ("topk@0.1", {"algorithm": "allgather"})),
    "two_phase": ("int8", {"algorithm": "two_phase"}, ("int4", {"algorithm": "two_phase"})),
    "sparse two_phase": ("topk@0.05", {"algorithm": "two_phase"}, ("topk@0.1", {"algorithm": "two_phase"})),
    "low rank": ("powersgd", {}, ("powersgd@2", {})),
    "hierarchical, a node each": (
        "int8",
        {"algorithm": "hierarchical", "node_size": 1},
        ("int4", {"algorithm": "hierarchical", "node_size": 1}),
    ),
    "hierarchical, one node": (
        "int8",
        {"algorithm": "hierarchical", "node_size": 2},
        ("int4", {"algorithm": "hierarchical", "node_size": 2}),
    ),
}


def _every_algorithm(rank: int, world_size: int, labels: list[str]) -> None:
    for label in labels:
        name, options, (other, other_options) = ALGORITHMS[label]
        shape = (64, 64) if name.startswith("powersgd") else (NUMEL,)
        for step in range(2):  # the plan agreed, then its steady state
            x = _input(rank, step, math.prod(shape)).view(shape)
            gradcomp.all_reduce(x, name, step=step, **options)
            assert same_on_all_ranks(x), label
        x = _input(rank, 3, math.prod(shape)).view(shape)
        _refused(("step=",), x.clone(), name, step=2 + rank, **options)
        for step in range(2):
            gradcomp.all_reduce(x.clone(), name, step=step, **options)
        mine = (name, options) if rank == 0 else (other, other_options)
        _refused(("compressor=",), x.clone(), mine[0], **mine[1])


@pytest.mark.parametrize("label", ["two_phase"])
@pytest.mark.slow
def test_every_algorithm_judges_every_call(label):
    run_ranks(_every_algorithm, 2, [label])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_algorithm_judges_every_call_at_two_and_three_ranks(world_size):
    labels = [label for label in ALGORITHMS if "hierarchical" not in label or world_size == 2]
    run_ranks(_every_algorithm, world_size, labels, timeout=400)


def _node_mates_disagree(rank: int, world_size: int) -> None:
    # Two nodes of two: rank 1 alone differs from its node-mate, rank 0; the ranks of
    # the other node agree, and every rank must still raise (none waits for a peer).
    for shared in (True, False):
        hierarchy = gradcomp.collectives.hierarchy_for(queue_for(None), 2)
        hierarchy.shared_memory = shared
        options = {"algorithm": "hierarchical", "node_size": 2}
        for step in range(2):
            gradcomp.all_reduce(_input(rank, step), "int8", step=step, **options)
        _refused(("step=",), _input(rank), "int8", step=5 if rank == 1 else 2, **options)


@pytest.mark.slow
def test_node_mates_that_disagree_make_every_rank_raise():
    run_ranks(_node_mates_disagree, 4, timeout=300)


# ------------------------------------------------------------------ settings changed together


def _changes_together(rank: int, world_size: int, fresh: bool) -> list[torch.Tensor]:
    """A sequence of calls of one size whose settings change at every call, on every rank
    alike, with residuals; the results. ``fresh``: no plan kept between the calls, each
    the first of its size."""
    results = []
    plans = [
        ("int8", {}),
        ("int4", {}),
        ("int8", {}),
        ("topk@0.05", {}),
        ("randk@0.1", {}),
        ("bf16", {}),
        ("int8", {"algorithm": "allgather"}),
        ("int8", {"algorithm": "two_phase"}),
        ("powersgd", {}),
        ("int8", {"op": "sum"}),
    ]
    memory = gradcomp.ErrorFeedback()
    for salt, (name, options) in enumerate(plans):
        if fresh:
            queue_for(None).plans.clear()  # between calls: the worker is idle
        x = _input(rank, salt)
        gradcomp.all_reduce(x, name, feedback=memory, name="t", step=salt, **options)
        results.append(x)
    return results


def _together_as_if_fresh(rank: int, world_size: int) -> None:
    changed = _changes_together(rank, world_size, fresh=False)
    gradcomp.collectives.release_queues()
    expected = _changes_together(rank, world_size, fresh=True)
    for got, want in zip(changed, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert same_on_all_ranks(got)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_settings_changed_on_every_rank_at_once_give_the_bits_of_a_first_call(world_size):
    run_ranks(_together_as_if_fresh, world_size)


# ------------------------------------------------------------------ collectives issued


def _collectives_per_call(rank: int, world_size: int, results: dict) -> None:
    from tests.counting import counted

    cases = [
        ("int8", {"algorithm": "allgather"}),
        ("int8", {"algorithm": "two_phase"}),
        ("topk@0.05", {"algorithm": "two_phase"}),
        ("bf16", {}),
        ("powersgd", {}),
        ("int8", {"algorithm": "hierarchical", "node_size": 1}),
        ("int4", {"algorithm": "allgather"}),  # int8 two_phase's size: the plan changes
        ("none", {}),
    ]
    sizes = [NUMEL, NUMEL + 1, NUMEL + 2, NUMEL + 3, None, NUMEL + 5, NUMEL + 1, NUMEL + 7]
    gradcomp.collectives.release_queues()
    with counted() as counts:
        for (name, options), numel in zip(cases, sizes, strict=True):
            shape = (64, 64) if name == "powersgd" else (numel,)
            x = _input(rank, numel=math.prod(shape)).view(shape)
            counts.reset()
            counts.active = True
            gradcomp.all_reduce(x.clone(), name, **options)  # the first of its plan and size
            first = dict(counts.collectives)
            counts.reset()
            gradcomp.all_reduce(x.clone(), name, **options)
            steady = dict(counts.collectives)
            counts.active = False
            results[rank, name, options.get("algorithm")] = (first, steady)
    gradcomp.collectives.release_queues()


@pytest.mark.slow
def test_steady_state_issues_the_collectives_it_did_before():
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_collectives_per_call, 2, results)
        results = dict(results)
    gather, to_all, reduce = "c10d._allgather_base_", "c10d.alltoall_base_", "c10d.allreduce_"
    steady = {
        ("int8", "allgather"): {gather: 1},
        ("int8", "two_phase"): {to_all: 1, gather: 1},
        ("topk@0.05", "two_phase"): {to_all: 1, gather: 1},
        ("bf16", None): {reduce: 1},
        ("powersgd", None): {reduce: 2},
        ("int8", "hierarchical"): {gather: 1},
        ("int4", "allgather"): {gather: 1},
        # The tensor itself is summed alone, as torch sums it; its fingerprint's lanes apart.
        ("none", None): {reduce: 2},
    }
    for (rank, name, algorithm), (first, counted) in results.items():
        assert counted == steady[name, algorithm], (rank, name, algorithm, counted)
        if name == "int4":  # a plan that changed: the old plan's collectives once more (a probe)
            expected = {to_all: 1, gather: 2}
        else:  # a size's first call agrees on its plan: an all-gather of fingerprints a level
            levels = 2 if algorithm == "hierarchical" else 1
            expected = {**counted, gather: counted.get(gather, 0) + levels}
        assert first == expected, (rank, name, algorithm, first)


# ------------------------------------------------------------------ bounds


def _many_shapes(rank: int, world_size: int) -> None:
    from tests.counting import counted

    gradcomp.collectives.release_queues()
    with counted() as counts:
        q = queue_for(None)
        for numel in range(1, 2001):
            gradcomp.all_reduce(torch.ones(numel), "int8", algorithm="allgather", feedback=False, step=0)
        assert len(q.plans) == agreement.MAX_PLANS < 2000
        assert len(q.lanes) <= agreement.MAX_PLANS and not q.verified
        # The least recently used sizes went first, in call order on every rank alike: the
        # last one is still agreed (one all-gather), the first agrees again (two).
        for numel, collectives in ((2000, 1), (1, 2)):
            counts.reset()
            counts.active = True
            x = torch.ones(numel) * (rank + 1)
            gradcomp.all_reduce(x, "int8", algorithm="allgather", feedback=False, step=0)
            counts.active = False
            assert sum(counts.collectives.values()) == collectives, (numel, dict(counts.collectives))
            assert same_on_all_ranks(x)
        assert len(q.plans) == agreement.MAX_PLANS
    gradcomp.collectives.release_queues()


@pytest.mark.slow
def test_plans_kept_are_bounded():
    run_ranks(_many_shapes, 2, timeout=400)


# ------------------------------------------------------------------ summed headers


class _Ranks:
    """What the lanes read of a queue."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


def _lanes_summed(fingerprints: list[int], dtype: torch.dtype, order: list[int]) -> torch.Tensor:
    """Every rank's lanes, summed in ``dtype`` one rank after another in ``order``."""
    world = len(fingerprints)
    count = agreement.lane_count(dtype, world)
    total = torch.zeros(count, dtype=dtype)
    for rank in order:
        lanes = torch.empty(count, dtype=dtype)
        job = Job(torch.zeros(1), None, "avg", "dense", None, 0, 0, agreement=Agreement(fingerprints[rank]))
        agreement.write_lanes(lanes, job, _Ranks(rank, world))
        total += lanes
    return total


@pytest.mark.parametrize(
    ("dtype", "world"),
    [(torch.bfloat16, 2), (torch.bfloat16, 300), (torch.float16, 3000), (torch.float32, 7)],
)
def test_summed_lanes_judge_exactly_in_any_order(dtype, world):
    generator = random.Random(world)
    base = generator.getrandbits(64) - 2**63
    for odd in (None, 0, world - 1, world // 2):
        fingerprints = [base] * world
        if odd is not None:
            fingerprints[odd] = base ^ (1 << generator.randrange(64))
        order = list(range(world))
        generator.shuffle(order)
        total = _lanes_summed(fingerprints, dtype, order)
        for rank in {0, world - 1, odd or 0}:
            job = Job(
                torch.zeros(1), None, "avg", "dense", None, 0, 0, agreement=Agreement(fingerprints[rank])
            )
            if odd is None:
                agreement.check_lanes(_Ranks(rank, world), job, total)
            else:
                with pytest.raises(AssertionError, match="disagreed"):
                    _judged(agreement.check_lanes, _Ranks(rank, world), job, total)


def _judged(check, q, job, lanes) -> None:
    """``check`` with the error path replaced: it needs no group here."""
    original = agreement._disagreement

    def disagreement(*args, **kwargs):
        raise AssertionError("disagreed")

    agreement._disagreement = disagreement
    try:
        check(q, job, lanes)
    finally:
        agreement._disagreement = original


def test_lane_counts_keep_sums_exact():
    assert agreement.lane_count(torch.bfloat16, 256) == 64
    assert agreement.lane_count(torch.bfloat16, 257) == 128
    assert agreement.lane_count(torch.float16, 2048) == 64
    assert agreement.lane_count(torch.float16, 4097) == 192
    assert agreement.lane_count(torch.float32, 2**20) == agreement.lane_count(torch.float64, 2**20) == 64
    assert list(itertools.accumulate([1] * 256, initial=0))[-1] == torch.tensor(256, dtype=torch.bfloat16)
