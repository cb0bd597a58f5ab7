"""Schedules a GPU may take, played on CPU: for tests that a decode's bits do not depend on them.

On a GPU, the adds of one ``index_add_`` (torch's) or of one atomic scatter
kernel land in whatever order the hardware runs them, and a kernel's programs
run in any order. On CPU both are sequential, which hides any dependence on
that order. Here:

* :func:`atomic_index_add` makes ``Tensor.index_add_`` commit its entries in a
  random order, as atomic adds may (the entries of one call are permuted, then
  added in that order);
* :func:`shuffled_programs` makes Triton's interpreter run a launch's programs
  in a random order;
* :func:`perturbed` applies what fits a backend.

The inputs: :func:`overlapping_rows`, rows of distinct indices that many
ranks share, with values of mixed magnitude (a sum of them depends on its
order); :func:`rank_order_sum`, the sum the decode must give, written out entry
by entry in rank order.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def atomic_index_add(seed: int) -> Iterator[None]:
    """Within: each ``index_add_`` on a 1-D tensor adds its entries in a random order
    (seeded, a new order at every call)."""
    original = torch.Tensor.index_add_
    generator = torch.Generator().manual_seed(seed)

    def index_add_(self, dim, index, source, *, alpha=1):
        if self.dim() != 1 or index.numel() < 2:
            return original(self, dim, index, source, alpha=alpha)
        order = torch.randperm(index.numel(), generator=generator).to(index.device)
        return original(self, dim, index.reshape(-1)[order], source.reshape(-1)[order], alpha=alpha)

    torch.Tensor.index_add_ = index_add_
    try:
        yield
    finally:
        torch.Tensor.index_add_ = original


@contextlib.contextmanager
def shuffled_programs(seed: int) -> Iterator[None]:
    """Within: Triton's interpreter runs the programs of every launch in a random order
    (seeded), where it runs them in order of their id."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    generator = random.Random(seed)
    order: list[int] = []

    def set_grid_dim(nx, ny, nz):
        order[:] = generator.sample(range(nx), nx)
        type(builder).set_grid_dim(builder, nx, ny, nz)

    def set_grid_idx(x, y, z):
        type(builder).set_grid_idx(builder, order[x], y, z)

    builder.set_grid_dim, builder.set_grid_idx = set_grid_dim, set_grid_idx
    try:
        yield
    finally:
        del builder.set_grid_dim, builder.set_grid_idx


@contextlib.contextmanager
def perturbed(backend: str, seed: int) -> Iterator[None]:
    """The orders ``backend`` leaves open, shuffled: torch's ``index_add_`` for every
    backend, a launch's programs as well for Triton's in its interpreter."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(atomic_index_add(seed))
        if backend == "triton" and not torch.cuda.is_available():
            stack.enter_context(shuffled_programs(seed))
        yield


def overlapping_rows(world: int, k: int, numel: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices int64, values fp32)``, each ``(world, k)``: row ``r`` is rank ``r``'s
    ``k`` distinct indices (in a random order), drawn from ``k + k // 4`` shared ones,
    so most indices are chosen by three ranks or more; values of either sign and of
    magnitudes from ``1e-6`` to ``1e6``, so that their sum depends on its order."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randperm(numel, generator=generator)[: k + k // 4]
    indices = torch.stack(
        [shared[torch.randperm(shared.numel(), generator=generator)[:k]] for _ in range(world)]
    )
    magnitude = 10.0 ** torch.randint(-6, 7, (world, k), generator=generator).float()
    values = torch.randn(world, k, generator=generator) * magnitude
    return indices, values


def overlapping_input(rank: int, numel: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s tensor: values of either sign and of magnitudes from ``1e-3`` to
    ``1e3``, ten thousand times larger at a tenth of the positions, the same on every
    rank. Top-K at a ratio below 0.1 picks mostly those positions on every rank, and a
    sum of any ranks' values depends on its order."""
    positions = torch.randperm(numel, generator=torch.Generator().manual_seed(seed))[: numel // 10]
    generator = torch.Generator().manual_seed(seed * 1009 + rank + 1)
    x = torch.randn(numel, generator=generator) * 10.0 ** (6 * torch.rand(numel, generator=generator) - 3)
    x[positions] *= 1e4
    return x


def rank_order_sum(indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32) plus every ``(index, value)`` of the rows, added one at a time
    in fp32: row 0's entries first, each row in its order; zero values skipped."""
    total = out.detach().cpu().numpy().astype(np.float32).copy()
    pairs = zip(indices.reshape(-1).tolist(), values.reshape(-1).float().cpu().numpy(), strict=True)
    for index, value in pairs:
        if value != 0:
            total[index] = np.float32(total[index] + value)
    return torch.from_numpy(total)


def differing(expected: torch.Tensor, actual: torch.Tensor) -> int:
    """How many elements differ in their bits (NaN equal to NaN)."""
    expected, actual = expected.cpu().float(), actual.cpu().float()
    both_nan = expected.isnan() & actual.isnan()
    return int(((expected.view(torch.int32) != actual.view(torch.int32)) & ~both_nan).sum())
