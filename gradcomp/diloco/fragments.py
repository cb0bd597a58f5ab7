"""DiLoCo's fragments: which parameters each holds, when its exchange starts, and an
exchange on its way.

The parameters are ``F`` runs of consecutive indices of about equal size (:func:`split`).
Fragment ``f`` starts its exchange at the inner steps ``t`` with
``t % H == (f + 1) * H // F % H`` (:func:`starting`): every fragment every ``H`` steps,
their turns spread over the ``H``. An :class:`Exchange` is one fragment's
pseudo-gradients in the all-reduce, one part per dtype, until its outer step lands.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from gradcomp.collectives import ReduceStats
from gradcomp.feedback import UndoLog


def split(sizes: list[int], count: int) -> list[list[int]]:
    """``count`` runs of consecutive indices of ``sizes``, none empty, each cut where the
    running total comes closest to its share of the whole."""
    total, cumulative = sum(sizes), list(itertools.accumulate(sizes))
    cuts, first = [], 0
    for k in range(1, count):
        last = len(sizes) - (count - k) - 1  # leaves an index for each run still to come
        cut = min(range(first, last + 1), key=lambda j: (abs(cumulative[j] * count - total * k), j))
        cuts.append(cut)
        first = cut + 1
    bounds = [-1, *cuts, len(sizes) - 1]
    return [list(range(a + 1, b + 1)) for a, b in zip(bounds, bounds[1:], strict=False)]


def starting(step: int, sync_every: int, count: int) -> list[int]:
    """The fragments (of ``count``) whose exchange starts at inner step ``step``."""
    return [f for f in range(count) if step % sync_every == (f + 1) * sync_every // count % sync_every]


def by_dtype(indices: list[int], params: list[torch.Tensor]) -> list[list[int]]:
    """``indices`` in runs of one dtype, in the order of an exchange's parts."""
    dtypes = sorted({params[i].dtype for i in indices}, key=str)
    return [[i for i in indices if params[i].dtype == dtype] for dtype in dtypes]


class Exchange:
    """One fragment's pseudo-gradients on their way: one all-reduce per dtype."""

    def __init__(self, fragment: int, lands: int):
        self.fragment, self.lands = fragment, lands
        self.parts: list[tuple[list[int], torch.Tensor, object]] = []  # (indices, delta, work or None)
        self.snapshot: list[torch.Tensor] | None = None  # the weights it was taken from (overlapped)
        self.lr_sums: list[float] = []  # per inner group, the learning rates of its inner steps
        self.stats: list[ReduceStats] = []  # of the parts waited for
        self.bytes_sent = 0  # by this rank, the parts waited for (kept by a checkpoint)
        self.log: UndoLog | None = None  # the residuals before it (None: restored from a checkpoint)

    def wait(self) -> None:
        """Wait for every part still on its way; keep its statistics."""
        for n, (indices, delta, work) in enumerate(self.parts):
            if work is not None:
                stats = work.get_future().wait()
                self.stats.append(stats)
                self.bytes_sent += stats.bytes_sent
                self.parts[n] = (indices, delta, None)

    def deltas(self) -> list[torch.Tensor]:
        """The parts' flat tensors: each rank's pseudo-gradients, the average once waited for."""
        return [delta for _, delta, _ in self.parts]

    def per_parameter(self, params: list[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
        """``(index, view)`` for each parameter of the fragment: its part of the parts'
        flat tensors, shaped as the parameter."""
        for indices, delta, _ in self.parts:
            offset = 0
            for i in indices:
                numel = params[i].numel()
                yield i, delta[offset : offset + numel].view_as(params[i])
                offset += numel

    def load_weights(
        self, indices: list[int], params: list[torch.Tensor], anchor: list[torch.Tensor]
    ) -> None:
        """The fragment's weights once its anchor moved: the new anchor, plus what this rank
        learnt since the exchange started where it ran beside training."""
        if self.snapshot is None:
            for i in indices:
                params[i].copy_(anchor[i])
        else:
            for i, taken in zip(indices, self.snapshot, strict=True):
                params[i].sub_(taken).add_(anchor[i])
