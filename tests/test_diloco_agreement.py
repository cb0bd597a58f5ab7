"""DiLoCo's ranks must reach each exchange at the same inner step: one that took a step
more (an uneven data shard) makes every rank raise, naming both steps, at no extra
round trip (the step travels with the exchange's settings)."""

from __future__ import annotations

import pytest
import torch

import gradcomp
from tests.utils import run_ranks

STEPS = {0: 13, 1: 14}  # inner steps before synchronize(), per rank


def _uneven(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = gradcomp.DiLoCo(model, inner, sync_every=50, compressor="int8")
    for step in range(STEPS[rank]):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 2, generator=generator)
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        outer.step()
    with pytest.raises(ValueError) as raised:
        outer.synchronize()
    message = str(raised.value)
    assert all(str(count) in message for count in STEPS.values()), message


@pytest.mark.slow
def test_ranks_that_synchronize_at_different_inner_steps_raise_on_every_rank():
    run_ranks(_uneven, 2, timeout=120, group_timeout=30)
