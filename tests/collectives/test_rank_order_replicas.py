"""Replicas agree bit for bit after a sparse all-reduce, whatever order each rank's
GPU would run its adds in: on Gloo ranks, each rank's ``index_add_`` commits in an
order of its own (:func:`tests.scheduling.atomic_index_add`), as atomic adds on
separate GPUs may. Inputs whose Top-K picks are mostly the same positions on every
rank, of mixed magnitudes: a sum of three ranks' values depends on its order."""

from __future__ import annotations

import pytest
import torch

import gradcomp
from gradcomp.compressors import Context
from tests.scheduling import atomic_index_add, differing, overlapping_input
from tests.utils import gather, run_ranks, same_on_all_ranks

NUMEL = 20_000


def _reduced(rank: int, spec: str, algorithm: str) -> torch.Tensor:
    result = overlapping_input(rank, NUMEL, seed=51)
    gradcomp.all_reduce(result, spec, algorithm=algorithm, feedback=False, name=99, step=0)
    return result


def _replicas_agree(rank: int, world_size: int, spec: str) -> None:
    with atomic_index_add(seed=rank):
        result = _reduced(rank, spec, "allgather")
    assert same_on_all_ranks(result), f"{spec}: the ranks' results differ"
    # Every rank's own decoding, added in rank order.
    compressor = gradcomp.get_compressor(spec)
    expected = torch.zeros(NUMEL)
    for r, tensor in enumerate(gather(overlapping_input(rank, NUMEL, seed=51))):
        expected += compressor.decompress(
            compressor.compress(tensor, Context(step=0, key=99, rank=r)), divisor=world_size
        )
    assert differing(expected, result) == 0


@pytest.mark.slow
def test_topk_allgather_replicas_agree_under_any_schedule():
    run_ranks(_replicas_agree, 3, "topk@0.08")


@pytest.mark.slow
def test_randk_allgather_replicas_agree_under_any_schedule():
    run_ranks(_replicas_agree, 3, "randk@0.08")


def _two_phase_is_reproducible(rank: int, world_size: int) -> None:
    # The owner of each range adds every rank's pairs of it: a schedule of another
    # order would change its sum, and so what it keeps and sends to every rank.
    results = []
    for schedule in (rank, rank + 100):
        with atomic_index_add(seed=schedule):
            results.append(_reduced(rank, "topk@0.08", "two_phase"))
    assert same_on_all_ranks(results[0])
    assert differing(results[0], results[1]) == 0


@pytest.mark.slow
def test_topk_two_phase_is_the_same_under_any_schedule():
    run_ranks(_two_phase_is_reproducible, 3)


def _hook_replicas_agree(rank: int, world_size: int) -> None:
    from tests.ddp.models import DDP, flat_parameters, make_model, train

    model = DDP(make_model())
    gradcomp.ddp.register(model, "topk", ratio=0.3, warmup_steps=0, min_numel=0)
    with atomic_index_add(seed=rank):
        train(model, rank, world_size, 3)
    assert same_on_all_ranks(flat_parameters(model)), "the replicas' parameters differ"


@pytest.mark.slow
def test_ddp_hook_replicas_agree_under_any_schedule():
    run_ranks(_hook_replicas_agree, 3)
