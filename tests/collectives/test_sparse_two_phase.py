"""Top-K's two-phase all-reduce: a sparse reduce-scatter whose bytes do not grow with the world size."""

from __future__ import annotations

import math

import pytest
import torch

import gradcomp
from gradcomp.collectives import chunk_bounds, key_of
from gradcomp.collectives.agreement import HEADER_BYTES
from gradcomp.collectives.sparse_two_phase import CAPACITY, sparse_two_phase_sizes, split_by_range
from gradcomp.payload import buffer_size
from tests.utils import gather, run_ranks, same_on_all_ranks

# Relative error against the exact mean may exceed the all-gather's (each
# owner keeps k / W of up to W k pairs) by at most this factor on Gaussian inputs.
ERROR_FACTOR = 1.25


def _rows(world: int, capacity: int):
    return {
        "indices": torch.full((world, capacity), -1, dtype=torch.int32),
        "values": torch.full((world, capacity), math.nan),
    }


def test_split_by_range_keeps_the_largest_of_each_range_and_returns_the_rest():
    # Ranges of 4 elements; capacity 2. Range 0 holds three pairs, range 2 one, range 1 none.
    indices = torch.tensor([0, 1, 3, 9], dtype=torch.int32)
    values = torch.tensor([-5.0, 2.0, 2.0, 7.0])
    rows, residual = _rows(3, 2), torch.zeros(12)
    split_by_range(indices, values, 4, rows, residual)
    # Range 0: |-5| first, then the tie 2.0 / 2.0 to the lower index (1); index 3 returns.
    assert rows["indices"].tolist() == [[0, 1], [0, 0], [1, 0]]
    assert rows["values"].tolist() == [[-5.0, 2.0], [0.0, 0.0], [7.0, 0.0]]
    expected = torch.zeros(12)
    expected[3] = 2.0
    assert torch.equal(residual, expected)


def test_split_by_range_keeps_nan_and_never_returns_it():
    indices = torch.tensor([0, 1, 2], dtype=torch.int64)
    values = torch.tensor([1.0, math.nan, math.inf])
    rows, residual = _rows(1, 2), torch.zeros(3)
    split_by_range(indices, values, 4, rows, residual)
    assert rows["indices"].tolist() == [[1, 2]]
    assert torch.isnan(rows["values"][0, 0]) and rows["values"][0, 1] == math.inf
    assert torch.equal(residual, torch.tensor([1.0, 0.0, 0.0]))


def test_split_by_range_ranks_inf_above_the_largest_float():
    largest = torch.finfo(torch.float32).max
    rows, residual = _rows(1, 1), torch.zeros(4)
    split_by_range(torch.tensor([0, 3]), torch.tensor([largest, math.inf]), 4, rows, residual)
    assert rows["indices"].tolist() == [[3]] and rows["values"][0, 0] == math.inf
    assert residual[0] == largest and torch.isfinite(residual).all()


def test_bytes_per_rank_follow_the_ring_model_and_stay_flat_with_the_world_size():
    numel, k = 2**20, 2**20 // 100

    def sent(world: int) -> int:
        chunk, capacity, kept = sparse_two_phase_sizes(numel, k, world)
        index = torch.int32
        send = buffer_size([("indices", index, capacity), ("values", torch.float32, capacity)])
        keep = buffer_size([("indices", index, kept), ("values", torch.float32, kept)])
        return (send + keep) * (world - 1)

    allgather = {w: 8 * k * (w - 1) for w in (2, 8, 1024)}
    # (CAPACITY + 1) (W-1)/W k pairs: 1.5 k at 2 ranks (CAPACITY k / W is k there), 2.6 k at 8.
    assert sent(2) == pytest.approx(8 * 1.5 * k, rel=1e-3)
    assert sent(8) == pytest.approx(8 * (CAPACITY + 1) * 7 / 8 * k, rel=1e-3)
    # (W-1)/W grows 1.75x from 2 ranks to 8, as a dense ring all-reduce's does; all-gather's 7x.
    assert sent(8) / sent(2) <= 1.75 * 1.001 and allgather[8] / allgather[2] == 7
    assert sent(1024) < 1.1 * 8 * (CAPACITY + 1) * k and sent(1024) < allgather[1024] / 300


def _input(rank: int, numel: int, salt: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + salt))


def _matches_allgather_and_conserves(rank: int, world_size: int) -> None:
    numel, key = 20_011, key_of("g")
    topk = gradcomp.get_compressor("topk", ratio=0.02)
    memories = {"two_phase": gradcomp.ErrorFeedback(), "allgather": gradcomp.ErrorFeedback()}
    errors = {"two_phase": 0.0, "allgather": 0.0}
    start, end = chunk_bounds(numel, world_size, 1)[rank]
    for step in range(4):
        x = _input(rank, numel, salt=step)
        exact = torch.stack([t.double() for t in gather(x)]).mean(0)
        for algorithm, memory in memories.items():
            before = {name: memory.get(name).clone() for name in memory.keys()}
            result = x.clone()
            stats = gradcomp.all_reduce(
                result, topk, algorithm=algorithm, feedback=memory, name="g", step=step
            )
            assert stats.algorithm == algorithm
            assert same_on_all_ranks(result), f"{algorithm} step {step}: ranks differ"
            errors[algorithm] += float((result.double() - exact).norm() / exact.norm())
            # What every rank put in (input + old residual) = W * result + what stayed behind.
            put_in = x.double() + before.get(key, torch.zeros(numel)).double()
            stayed = memory.get(key).double()
            balance = torch.stack(gather(put_in - stayed)).sum(0)
            if algorithm == "two_phase":
                owner = torch.zeros(numel, dtype=torch.float64)
                old = before.get(("two_phase", key), torch.zeros(end - start))
                owner[start:end] = (memory.get(("two_phase", key)) - old).double()
                balance -= world_size * torch.stack(gather(owner)).sum(0)
            torch.testing.assert_close(result.double() * world_size, balance, rtol=0, atol=1e-5)
        if step == 0:
            # Bytes: the all-to-all's rows (each with the sender's fingerprint) and the
            # all-gather's, (W-1) of each.
            chunk, capacity, kept = sparse_two_phase_sizes(numel, round(0.02 * numel), world_size)
            index = torch.int32
            rows = buffer_size([("indices", index, capacity), ("values", torch.float32, capacity)])
            keep = buffer_size([("indices", index, kept), ("values", torch.float32, kept)])
            check = x.clone()
            stats = gradcomp.all_reduce(check, topk, algorithm="two_phase", feedback=False)
            assert stats.bytes_sent == (rows + HEADER_BYTES + keep) * (world_size - 1)
    assert errors["two_phase"] <= ERROR_FACTOR * errors["allgather"], errors


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_two_phase_top_k_is_identical_on_ranks_conserves_and_is_close_to_allgather(world_size):
    run_ranks(_matches_allgather_and_conserves, world_size)


def _imbalanced_and_non_finite(rank: int, world_size: int) -> None:
    numel, key = 4096, key_of("skew")
    topk = gradcomp.get_compressor("topk", ratio=0.05)
    memory = gradcomp.ErrorFeedback()
    # Every large value in the first range: most pairs overflow their row.
    x = _input(rank, numel) * 1e-3
    x[: numel // world_size] *= 1e4
    result = x.clone()
    gradcomp.all_reduce(result, topk, algorithm="two_phase", feedback=memory, name="skew")
    assert same_on_all_ranks(result)
    kept = memory.get(key)
    assert torch.isfinite(kept).all()
    balance = torch.stack(gather(x.double() - kept.double())).sum(0)
    start, end = chunk_bounds(numel, world_size, 1)[rank]
    owner = torch.zeros(numel, dtype=torch.float64)
    owner[start:end] = memory.get(("two_phase", key)).double()
    balance -= world_size * torch.stack(gather(owner)).sum(0)
    torch.testing.assert_close(result.double() * world_size, balance, rtol=0, atol=1e-3)
    # The overflow stayed in the senders' residuals, in the first range only.
    assert kept[: numel // world_size].abs().max() > 1.0 and kept[numel // world_size :].abs().max() < 1.0
    # A non-finite gradient on one rank reaches every rank's result; no residual takes it.
    y = _input(rank, numel)
    if rank == 1:
        y[77] = math.nan
    gradcomp.all_reduce(y, topk, algorithm="two_phase", feedback=memory, name="skew")
    assert torch.isnan(y[77]) and same_on_all_ranks(torch.nan_to_num(y, nan=123.0))
    assert all(torch.isfinite(memory.get(name)).all() for name in memory.keys())


@pytest.mark.slow
def test_two_phase_top_k_conserves_when_one_range_holds_every_large_value():
    run_ranks(_imbalanced_and_non_finite, 4)
