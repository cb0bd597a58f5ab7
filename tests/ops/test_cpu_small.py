"""The CPU backend's numpy paths for small tensors (gradcomp.ops.cpu_small) give the
bits of its torch paths and of the reference, edge values included."""

from __future__ import annotations

import math

import pytest
import torch

from gradcomp.ops import cpu_backend, cpu_small, reference


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes: signed zeros and NaN payloads compared too."""
    return t.contiguous().view(torch.uint8)


def _gradient(numel: int, seed: int) -> torch.Tensor:
    """Normal values, then edge blocks where they fit: an all-zero block, one of
    negative zeros, one whose absmax is so small that its scale underflows to 0,
    one of subnormals whose scale does not, and values halfway between levels."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    edges = [
        torch.zeros(64),
        torch.full((64,), -0.0),
        torch.full((64,), 1e-44) * torch.tensor([1.0, -1.0]).repeat(32),
        torch.linspace(-1e-39, 1e-39, 64),
        (torch.arange(64) - 32.0) / 2,  # halves: round half to even
    ]
    offset = 0
    for edge in edges:
        if offset + 64 <= numel:
            x[offset : offset + 64] = edge
        offset += 64
    return x


def _quantize(x, residual, bits, block, small: bool, monkeypatch):
    monkeypatch.setattr(cpu_small, "SMALL", cpu_small.SMALL if small else 0)
    calls = []
    original = cpu_small.quantize
    monkeypatch.setattr(cpu_small, "quantize", lambda *a: calls.append(original(*a)) or calls[-1])
    residual = None if residual is None else residual.clone()
    codes, scales = cpu_backend.quantize_blockwise(
        x, bits, block, residual=residual, levels=2 ** (bits - 1) - 1
    )
    return (codes, scales, residual), any(calls)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("numel, block", [(1, 64), (320, 64), (1000, 64), (1024, 256), (4097, 256)])
@pytest.mark.parametrize("residual_dtype", [None, torch.float32, torch.float16], ids=str)
def test_small_quantize_is_the_torch_path_and_the_reference(monkeypatch, bits, numel, block, residual_dtype):
    x = _gradient(numel, seed=numel + bits)
    residual = None
    if residual_dtype is not None:
        residual = (torch.randn(numel, generator=torch.Generator().manual_seed(5)) * 0.01).to(residual_dtype)
    small, took = _quantize(x, residual, bits, block, True, monkeypatch)
    assert took == (residual_dtype != torch.float16)  # 16-bit residuals are the torch path's
    torch_path, took = _quantize(x, residual, bits, block, False, monkeypatch)
    assert not took
    expected = reference.quantize_blockwise(
        x, bits, block, residual=None if residual is None else residual.clone(), levels=2 ** (bits - 1) - 1
    )
    for got, want in zip(small[:2], torch_path[:2], strict=True):
        assert torch.equal(_bits(got), _bits(want))
    for got, want in zip(small[:2], expected, strict=True):
        assert torch.equal(_bits(got), _bits(want))
    if residual is not None:
        assert torch.equal(_bits(small[2]), _bits(torch_path[2]))


@pytest.mark.parametrize("planted", [math.nan, math.inf, 3e38])
def test_small_quantize_leaves_non_finite_and_huge_blocks_to_the_torch_path(monkeypatch, planted):
    x = _gradient(1000, seed=3)
    x[700] = planted
    residual = torch.zeros(1000)
    small, took = _quantize(x, residual, 8, 64, True, monkeypatch)
    assert not took  # the torch path keeps the top level finite and cleans non-finite values
    expected = reference.quantize_blockwise(x, 8, 64, residual=torch.zeros(1000), levels=127)
    for got, want in zip(small[:2], expected, strict=True):
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("numel, block", [(1, 64), (1000, 64), (1024, 256)])
@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("divisor", [1, 3])
def test_small_dequantize_sum_is_the_torch_path_and_the_reference(
    monkeypatch, bits, numel, block, count, divisor
):
    levels = 2 ** (bits - 1) - 1
    blocks = math.ceil(numel / block)
    width = -(-(4 * blocks + math.ceil(numel * bits / 8)) // reference.ALIGN) * reference.ALIGN
    rows = torch.empty(count, width, dtype=torch.uint8)
    for r in range(count):
        x = _gradient(numel, seed=100 * r + bits)
        reference.quantize_rows(x, bits, block, -(-numel // block) * block, rows[r : r + 1], levels=levels)

    def decoded(small: bool) -> torch.Tensor:
        monkeypatch.setattr(cpu_small, "SMALL", cpu_small.SMALL if small else 0)
        out = torch.full((numel,), 7.0)
        cpu_backend.dequantize_sum(rows, bits, block, numel, out, levels=levels, divisor=divisor)
        return out

    took = []
    original = cpu_small.dequantize_sum
    monkeypatch.setattr(cpu_small, "dequantize_sum", lambda *a: took.append(original(*a)) or took[-1])
    small = decoded(True)
    assert took == [True]
    expected = reference.dequantize_sum(
        rows, bits, block, numel, torch.empty(numel), levels=levels, divisor=divisor
    )
    assert torch.equal(_bits(small), _bits(decoded(False)))
    assert torch.equal(_bits(small), _bits(expected))


def _sparse_gradient(numel: int, case: str, seed: int) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    if case == "few non-zeros":  # fewer than k: all sent, then padding
        x[3:] = 0.0
        x[5:9] = -0.0
    elif case == "ties":  # the k-th magnitude shared far beyond k
        x = torch.round(x * 2) / 2
    elif case == "non-finite":  # more NaN and inf than k: some stay unsent
        x[::7] = math.nan
        x[1::11] = -math.inf
    return x


@pytest.mark.parametrize("numel, k", [(64, 1), (1000, 10), (1000, 13), (5000, 50), (5000, 900)])
@pytest.mark.parametrize("case", ["normal", "few non-zeros", "ties", "non-finite"])
@pytest.mark.parametrize("residual_dtype", [None, torch.float32, torch.float16], ids=str)
def test_small_top_k_is_the_torch_path_and_the_reference(monkeypatch, numel, k, case, residual_dtype):
    x = _sparse_gradient(numel, case, seed=numel + k)
    residual = None
    if residual_dtype is not None:
        residual = (torch.randn(numel, generator=torch.Generator().manual_seed(9)) * 0.1).to(residual_dtype)
    took = []
    original = cpu_small.top_k

    def spied(*args):
        result = original(*args)
        took.append(result is not None)
        return result

    monkeypatch.setattr(cpu_small, "top_k", spied)

    def select(small: bool, backend=cpu_backend):
        monkeypatch.setattr(cpu_small, "SMALL", cpu_small.SMALL if small else 0)
        kept = None if residual is None else residual.clone()
        values, indices = backend.topk_select(x, k, kept, seed=5, index_dtype=torch.int32)
        return values, indices, kept

    small = select(True)
    # The whole tensor is the sample up to 4096 elements, or up to 800 picks.
    assert took[0] == (residual_dtype != torch.float16 and (numel <= 4096 or k <= 800))
    for got, want in zip(small, select(False), strict=True):
        assert got is None or torch.equal(_bits(got), _bits(want))
    for got, want in zip(small, select(True, reference), strict=True):
        assert got is None or torch.equal(_bits(got), _bits(want))


def test_small_top_k_takes_tensors_of_any_shape():
    # The op takes any shape, and a residual of as many elements in another shape.
    x, residual = _sparse_gradient(64, "normal", seed=1), torch.randn(64) * 0.1
    cases = [(x.view(8, 8), None), (x, residual.view(8, 8)), (x.view(8, 8), residual.view(4, 16))]
    for tensor, kept in cases:
        mine = None if kept is None else kept.clone()
        got = cpu_backend.topk_select(tensor, 5, mine, seed=3, index_dtype=torch.int32)
        theirs = None if kept is None else kept.clone()
        want = reference.topk_select(tensor, 5, theirs, seed=3, index_dtype=torch.int32)
        for a, b in zip((*got, mine), (*want, theirs), strict=True):
            assert a is None or torch.equal(_bits(a), _bits(b))


@pytest.mark.filterwarnings("error")  # numpy warns on inf and NaN where torch is silent
def test_small_paths_take_non_finite_values_without_warnings(monkeypatch):
    x = torch.tensor([3e38, 3e38, -math.inf, math.nan] + [1.0] * 60)
    residual = torch.tensor([3e38] + [0.0] * 63)
    cpu_backend.topk_select(x, 2, residual.clone(), index_dtype=torch.int32)  # x + residual overflows
    cpu_backend.quantize_blockwise(x, 8, 32, residual=residual.clone(), levels=127)
    # Rows whose sum overflows (3e38 twice), and a block of inf alone (0 * inf decodes NaN).
    rows = torch.zeros(2, 4 * 2 + 64, dtype=torch.uint8)
    finite = torch.tensor([3e38] * 32 + [1.0] * 32)
    infinite = torch.tensor([3e38] * 32 + [math.inf] * 32)
    for r, row in enumerate((finite, infinite)):
        reference.quantize_rows(row, 8, 32, 64, rows[r : r + 1], levels=127)
    taken = []
    original = cpu_small.dequantize_sum
    monkeypatch.setattr(cpu_small, "dequantize_sum", lambda *a: taken.append(original(*a)) or taken[-1])
    out = cpu_backend.dequantize_sum(rows, 8, 32, 64, torch.empty(64), levels=127)
    assert taken == [True] and out[:32].isinf().all() and out[32:].isnan().all()


@pytest.mark.parametrize("order", ["inf first", "NaN first"])
def test_small_dequantize_sum_keeps_the_nan_torch_keeps(order):
    # A block holding inf decodes 0 * inf: a NaN of one sign; one holding NaN, another.
    infinite, nan = torch.ones(64), torch.ones(64)
    infinite[5], nan[7] = math.inf, math.nan
    rows = torch.zeros(2, 4 + 64, dtype=torch.uint8)
    pair = (infinite, nan) if order == "inf first" else (nan, infinite)
    for r, x in enumerate(pair):
        reference.quantize_rows(x, 8, 64, 64, rows[r : r + 1], levels=127)
    got = cpu_backend.dequantize_sum(rows, 8, 64, 64, torch.empty(64), levels=127)
    want = reference.dequantize_sum(rows, 8, 64, 64, torch.empty(64), levels=127)
    assert got.isnan().all()
    assert torch.equal(_bits(got), _bits(want))
