"""``gradcomp.all_reduce`` called in a callback of one of its futures: the callback runs on
the group's worker thread, which a synchronous call would wait on, for ever. It raises
there, saying to pass ``async_op=True``; an asynchronous call runs."""

from __future__ import annotations

import pytest
import torch

import gradcomp
from tests.utils import run_ranks


def _in_a_callback(rank: int, world_size: int, asynchronous: bool) -> None:
    first = gradcomp.all_reduce(torch.randn(1000), "int8", async_op=True)
    inner = torch.full((1000,), float(rank))

    def callback(_):
        return gradcomp.all_reduce(inner, "int8", name="inner", feedback=False, async_op=asynchronous)

    chained = first.get_future().then(callback)
    if not asynchronous:
        with pytest.raises(RuntimeError, match="async_op=True"):
            chained.wait()
        return
    chained.wait().wait()
    torch.testing.assert_close(inner, torch.full((1000,), (world_size - 1) / 2), atol=1e-2, rtol=0)


@pytest.mark.slow
def test_a_synchronous_call_in_a_callback_raises_instead_of_waiting_for_ever():
    run_ranks(_in_a_callback, 2, False, timeout=60)


@pytest.mark.slow
def test_an_asynchronous_call_in_a_callback_runs():
    run_ranks(_in_a_callback, 2, True, timeout=60)
