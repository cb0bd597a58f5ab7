"""The allgather one-row lane (gradcomp.collectives.allgather): a job whose kind ran
before encodes straight into the row it sends and decodes the gathered rows; it must
give the general path's bits, residuals and bytes, and never be taken where the
general path differs (segments, error measurement, changed settings)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import gradcomp
from gradcomp.collectives import allgather as allgather_module
from tests.utils import run_ranks, same_on_all_ranks

# Every compressor the allgather algorithm takes, with settings that reach each codec's
# paths: small tensors (numpy on CPU), Top-K's sampled threshold, bit widths, stochastic.
COMPRESSORS = {
    "int8": {},
    "int4": {"block": 64},
    "int2": {},
    "ternary": {},
    "qsgd": {},
    "sign": {},
    "topk": {"ratio": 0.01},
    "topk@exact": {"ratio": 0.02, "exact": True},
    "topk@many": {"ratio": 0.3},
    "randk": {"ratio": 0.05},
    "bf16": {},
}
SIZES = (1, 1000, 5000, 40_000)


def _input(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + numel + salt)
    return torch.randn(numel, generator=generator).to(dtype)


@contextlib.contextmanager
def _lanes_taken(lane: bool = True, wire: list | None = None):
    """Within: a list that counts the jobs that take the lane (none where not ``lane``);
    ``wire``, where given, gets a copy of every row this rank sends."""
    taken = []
    original_lane_of, original_one_row = allgather_module._lane_of, allgather_module._one_row
    original_gather = allgather_module.all_gather_async

    def one_row(*args):
        taken.append(1)
        return original_one_row(*args)

    def gather(output, sent, group):
        wire.append(sent.clone())
        return original_gather(output, sent, group)

    allgather_module._one_row = one_row
    if not lane:
        allgather_module._lane_of = lambda *args: None
    if wire is not None:
        allgather_module.all_gather_async = gather
    try:
        yield taken
    finally:
        allgather_module._lane_of, allgather_module._one_row = original_lane_of, original_one_row
        allgather_module.all_gather_async = original_gather


def _run(rank: int, lane: bool, dtype: torch.dtype):
    """Three steps of every compressor and size, with error feedback; the results,
    the residuals, the bytes counted, the rows sent and how many jobs took the lane."""
    gradcomp.collectives.release_queues()  # a new group: no plan agreed before
    wire = []
    with _lanes_taken(lane, wire) as taken:
        memory, results, sent = gradcomp.ErrorFeedback(), [], []
        for step in range(3):
            for c, (label, options) in enumerate(COMPRESSORS.items()):
                compressor = gradcomp.get_compressor(label.split("@")[0], **options)
                for numel in SIZES:
                    x = _input(rank, numel, dtype, salt=100 * step + c)
                    name = (label, numel)
                    stats = gradcomp.all_reduce(
                        x, compressor, algorithm="allgather", feedback=memory, name=name, step=step
                    )
                    results.append(x)
                    sent.append(stats.bytes_sent)
        return results, memory, sent, wire, len(taken)


def _lane_is_the_general_path(rank: int, world_size: int) -> None:
    # A job takes the lane or not by timing, differently on each rank (allgather._lane_of):
    # the two paths must put the same bytes on the wire, not only give the same result.
    for dtype in (torch.float32, torch.bfloat16):
        results, memory, sent, wire, taken = _run(rank, lane=True, dtype=dtype)
        expected, expected_memory, expected_sent, expected_wire, none = _run(rank, lane=False, dtype=dtype)
        # The calls' rows, and a probe's where a size's plan changed (the compressors
        # take turns at each size): the same on both paths.
        assert len(wire) == len(expected_wire) > len(results)
        for row, expected_row in zip(wire, expected_wire, strict=True):
            assert torch.equal(row, expected_row)
        # Every kind takes the lane from its second step (the first finds its width).
        assert none == 0 and taken == 2 * len(COMPRESSORS) * len(SIZES), taken
        for got, want in zip(results, expected, strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # NaN and -0.0 too
        assert sent == expected_sent
        assert sorted(memory.keys(), key=repr) == sorted(expected_memory.keys(), key=repr)
        for key in memory.keys():
            assert torch.equal(memory.get(key), expected_memory.get(key)), key


@pytest.mark.slow
def test_lane_gives_the_general_paths_bits_residuals_and_bytes():
    run_ranks(_lane_is_the_general_path, 2)


def _lane_not_taken(rank: int, world_size: int) -> None:
    with _lanes_taken() as taken:
        # Long CPU tensors go in segments (a pipeline): never the lane.
        long = _input(rank, 2**21 + 5, torch.float32, salt=1)
        for step in range(2):
            gradcomp.all_reduce(long.clone(), "int8", algorithm="allgather", name="long", step=step)
        # Measuring the error needs the payload: never the lane.
        for step in range(2):
            stats = gradcomp.all_reduce(
                _input(rank, 1000, torch.float32, salt=2),
                "int8",
                algorithm="allgather",
                measure_error=True,
                name="measured",
                step=step,
            )
            assert stats.relative_error > 0
        assert not taken
        # Settings changed in place: a new kind, whose width the old lane does not know.
        compressor = gradcomp.get_compressor("topk", ratio=0.01)
        x = _input(rank, 5000, torch.float32, salt=3)
        for step in range(2):
            gradcomp.all_reduce(
                x.clone(), compressor, algorithm="allgather", feedback=False, name="k", step=step
            )
        compressor.ratio = 0.05
        got = x.clone()
        gradcomp.all_reduce(got, compressor, algorithm="allgather", feedback=False, name="k", step=2)
        assert len(taken) == 1  # the second step at ratio 0.01 only
        fresh = x.clone()
        kind = gradcomp.get_compressor("topk", ratio=0.05)
        gradcomp.all_reduce(fresh, kind, algorithm="allgather", feedback=False, name="k", step=2)
        assert len(taken) == 2  # the kind ran once, at the changed settings
        assert torch.equal(got, fresh)


@pytest.mark.slow
def test_lane_is_not_taken_for_segments_error_measurement_or_changed_settings():
    run_ranks(_lane_not_taken, 2)


def _every_queue_kind(rank: int, world_size: int) -> None:
    # What allgather runs on: the worker's queue, a hierarchy's level between nodes, and a
    # group the caller's thread runs jobs on (FSDP2's, DiLoCo's); each keeps its own lanes.
    from gradcomp.collectives.inline import InlineGroup

    with _lanes_taken() as taken:
        inline = InlineGroup(None)
        runs = {
            "queue": lambda x, step: gradcomp.all_reduce(
                x, "int8", algorithm="allgather", name="q", step=step
            ),
            "level": lambda x, step: gradcomp.all_reduce(
                x,
                "int8",
                algorithm="hierarchical",
                node_size=1,
                inter_algorithm="allgather",
                name="h",
                step=step,
            ),
            "inline": lambda x, step: inline.run(
                gradcomp.collectives.Job(
                    x, gradcomp.get_compressor("int8"), "avg", "allgather", None, key=3, step=step
                )
            ),
        }
        for kind, run in runs.items():
            before = len(taken)
            results = []
            for step in range(2):
                x = _input(rank, 3000, torch.float32, salt=step)
                run(x, step)
                results.append(x)
            assert len(taken) == before + 1, kind  # the second step
            assert all(same_on_all_ranks(x) for x in results), kind


@pytest.mark.slow
def test_lane_runs_on_every_kind_of_queue():
    run_ranks(_every_queue_kind, 2)
