"""DiLoCo's outer optimizer: SGD with (Nesterov) momentum on the anchor, and the inner
learning rates it follows.

A pseudo-gradient is the sum of a period's inner steps, each scaled by its learning
rate. With ``follow_inner_lr`` the outer momentum relates to the inner learning rate
as SGD's momentum relates to its own: the buffer sums each period's pseudo-gradient
divided by the sum of its inner learning rates (:class:`LearningRateSums` counts them,
per fragment and inner parameter group), and the momentum's part of a step is scaled
by that sum for the period just ended. Without it the step is ``torch.optim.SGD``'s,
DiLoCo's and torchft's.
"""

from __future__ import annotations

import torch


def outer_step(
    anchor: torch.Tensor,
    buffer: torch.Tensor,
    gradient: torch.Tensor,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    first: bool,
    lr_sum: float | None = None,
) -> None:
    """SGD with (Nesterov) momentum on ``anchor``, as ``torch.optim.SGD`` takes it
    (``first``: the buffer's first step); with ``lr_sum`` (follow_inner_lr) the buffer
    sums ``gradient / lr_sum`` and its part of the step is scaled by ``lr_sum`` (a period
    without learning rate adds nothing)."""
    update, scale = gradient, 1.0 if lr_sum is None else lr_sum
    if momentum:
        if scale == 1.0:
            added = gradient
        else:  # a period without learning rate adds nothing
            added = gradient / scale if scale > 0 else torch.zeros_like(gradient)
        if first:
            buffer.copy_(added)
        else:
            buffer.mul_(momentum).add_(added)
        if nesterov:
            update = gradient.add(buffer, alpha=momentum * scale)
        else:
            update = buffer if scale == 1.0 else buffer.mul(scale)
    anchor.add_(update, alpha=-lr)


class LearningRateSums:
    """Per fragment and inner parameter group, the learning rates of the inner steps
    since the fragment's exchange last started.

    Args:
        inner: the inner optimizer; with ``follow``, a hook before each of its steps
            adds the learning rates it takes.
        params: DiLoCo's trained parameters, in its order.
        fragments: how many fragments there are.
        follow: ``follow_inner_lr``; without it the sums stay at zero and
            :meth:`of` gives None (DiLoCo's outer step).
    """

    def __init__(
        self, inner: torch.optim.Optimizer, params: list[torch.Tensor], fragments: int, follow: bool
    ):
        groups = {id(p): g for g, group in enumerate(inner.param_groups) for p in group["params"]}
        self.group_of = [groups.get(id(p)) for p in params]  # None: the inner optimizer skips it
        self.follow = follow
        self.per_fragment = [[0.0] * len(inner.param_groups) for _ in range(fragments)]
        self.hook = inner.register_step_pre_hook(self._count) if follow else None

    def _count(self, optimizer, args, kwargs) -> None:
        """(before each inner step) Add the learning rate it takes to every fragment's sums
        (a tensor learning rate is added as a tensor: no host sync a step; :meth:`take`
        reads the sums once an exchange)."""
        for sums in self.per_fragment:
            for g, group in enumerate(optimizer.param_groups):
                sums[g] = sums[g] + group["lr"]

    def read(self) -> list[list[float]]:
        """Every fragment's sums, as floats."""
        return [[float(x) for x in sums] for sums in self.per_fragment]

    def load(self, sums: list[list[float]]) -> None:
        self.per_fragment = [[float(x) for x in group_sums] for group_sums in sums]

    def take(self, fragment: int) -> list[float]:
        """``fragment``'s sums, as floats, and zero in their place: its exchange starts."""
        sums = [float(x) for x in self.per_fragment[fragment]]
        self.clear(fragment)
        return sums

    def clear(self, fragment: int) -> None:
        self.per_fragment[fragment] = [0.0] * len(self.per_fragment[fragment])

    def of(self, index: int, sums: list[float]) -> float | None:
        """Parameter ``index``'s sum among an exchange's ``sums`` (0 where the inner
        optimizer does not train it), or None without ``follow``."""
        if not self.follow:
            return None
        group = self.group_of[index]
        return sums[group] if group is not None else 0.0
