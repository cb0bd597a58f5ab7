"""``scatter_add`` adds its pairs in the order given, rows in rank order, on every
backend and whatever order a GPU runs the adds in (played on CPU:
:mod:`tests.scheduling`).

Several ranks' Top-K or random-K rows share indices; where three or more
ranks chose one, the float sum depends on the order of its terms, and a GPU's
atomic adds take them in no fixed order. Each backend here must give the
rank-order sum bit for bit under shuffled schedules.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from gradcomp import ops
from tests.scheduling import differing, overlapping_rows, perturbed, rank_order_sum
from tests.utils import DTYPES, INTERPRETED, REFERENCE, assert_same, backend_device, backend_params

WORLDS = (3, 4, 5, 6, 7)
NUMEL, K = 20_000, 3_000
BACKENDS = [pytest.param("torch", id="torch"), *backend_params()]


def _device(backend: str) -> torch.device:
    return torch.device("cpu") if backend == "torch" else backend_device(backend)


def _decoded(backend: str, indices, values, out, seed: int | None) -> torch.Tensor:
    """``scatter_add`` on ``backend`` under schedule ``seed`` (None: as it runs)."""
    device = _device(backend)
    out = out.to(device)
    with perturbed(backend, seed) if seed is not None else contextlib.nullcontext():
        ops.backend(backend).scatter_add(indices.to(device), values.to(device), out)
    return out.cpu()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_are_added_in_rank_order_whatever_the_schedule(backend, world):
    indices, values = overlapping_rows(world, K, NUMEL, seed=world)
    expected = rank_order_sum(indices, values, torch.zeros(NUMEL))
    # The order matters for these rows: the ranks taken the other way round give other bits.
    assert differing(expected, rank_order_sum(indices.flip(0), values.flip(0), torch.zeros(NUMEL))) > 10
    for seed in (1, 2):
        got = _decoded(backend, indices.to(torch.int32), values, torch.zeros(NUMEL), seed)
        assert differing(expected, got) == 0, f"schedule {seed}: {differing(expected, got)} elements differ"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shared_index_row_set_is_added_in_rank_order(backend):
    """Random-K's rows: every rank's row holds the same indices."""
    world, k = 5, 4000
    indices = ops.randk_indices(NUMEL, k, 11).expand(world, k)
    _, values = overlapping_rows(world, k, NUMEL, seed=12)
    expected = rank_order_sum(indices, values, torch.zeros(NUMEL))
    assert differing(expected, rank_order_sum(indices, values.flip(0), torch.zeros(NUMEL))) > 10
    assert differing(expected, _decoded(backend, indices, values, torch.zeros(NUMEL), 3)) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_values_add_nothing(backend):
    """Top-K pads a row with (index 0, value 0) where fewer than k entries reached its
    threshold: the pads add nothing, however many, not even -0.0 + 0.0 = +0.0, and
    leave a real value at index 0 in its row as it is."""
    world, k = 4, 2000
    indices, values = overlapping_rows(world, k, NUMEL, seed=5)
    values[indices == 0] = 0.0
    indices[:, k // 2 :], values[:, k // 2 :] = 0, 0.0  # every row padded from its middle on
    values[1, k // 2] = -0.0
    out = torch.zeros(NUMEL)
    out[0] = -0.0
    expected = rank_order_sum(indices, values, out)
    assert torch.signbit(expected[0]) and expected[0] == 0
    assert_same(expected, _decoded(backend, indices, values, out, 4))
    indices[2, 0] = 0  # and a real value among the pads
    expected = rank_order_sum(indices, values, out)
    assert expected[0] == values[2, 0]
    assert_same(expected, _decoded(backend, indices, values, out, 5))


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] != "torch"])
def test_repeats_within_a_row_are_added_in_position_order(backend):
    """A row that repeats an index (no payload does but for zero pads) is added in its
    order too (on CPU, where torch's index_add_ is sequential, as it runs)."""
    generator = torch.Generator().manual_seed(6)
    indices = torch.randint(0, 50, (3, 1500), generator=generator)
    values = torch.randn(3, 1500, generator=generator) * 10.0 ** torch.randint(-5, 6, (3, 1500)).float()
    expected = rank_order_sum(indices, values, torch.zeros(50))
    seed = None if backend == "cpu" else 7
    assert_same(expected, _decoded(backend, indices, values, torch.zeros(50), seed))


@pytest.mark.parametrize("out_dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("backend", backend_params())
def test_rows_into_every_dtype_match_the_reference(backend, out_dtype):
    world = 3
    indices, values = overlapping_rows(world, K, NUMEL, seed=8)
    values /= 100  # within fp16's range; the smallest round to fp16 subnormals or to zero
    base = torch.randn(NUMEL, generator=torch.Generator().manual_seed(9)).to(out_dtype)
    expected = REFERENCE.scatter_add(indices, values, base.clone())
    got = _decoded(backend, indices, values, base.clone(), 10)
    bf16 = out_dtype == torch.bfloat16 and backend == "triton" and INTERPRETED
    # The interpreter truncates each of a sum's roundings to bfloat16: up to a step an add.
    operands = rank_order_sum(indices, values.abs(), base.abs().float()) * (world + 1)
    assert_same(expected, got, bf16_stored=bf16, magnitude=operands)


@pytest.mark.parametrize("backend", [p for p in backend_params() if p.values[0] != "cpu"])
def test_an_index_outside_any_row_makes_element_0_nan(backend):
    indices, values = overlapping_rows(3, 100, 1000, seed=13)
    indices[1, 50] = 1000
    out = _decoded(backend, indices, values, torch.zeros(1000), 14)
    assert out[0].isnan() and out[1:].isfinite().all()
