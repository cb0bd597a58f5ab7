"""DiLoCo resumed with ``Checkpointable(mismatch="drop")`` from a checkpoint of fewer ranks,
whose saved state this DiLoCo refuses (other settings): the ranks that have an entry
refuse it, and the ranks that have none must raise too, not wait in the broadcast of rank
0's state that the others never reach."""

from __future__ import annotations

import pytest
import torch

import gradcomp
from tests.utils import run_ranks

SAVED_WORLD, LOADED_WORLD = 2, 3


def _diloco(compressor: str, rank: int, steps: int) -> gradcomp.DiLoCo:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    inner = torch.optim.SGD(model.parameters(), lr=1e-2)
    outer = gradcomp.DiLoCo(model, inner, sync_every=2, compressor=compressor)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 2, generator=generator)
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        outer.step()
    return outer


def _save(rank: int, world: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"gradcomp": gradcomp.ddp.Checkpointable(_diloco("int4", rank, 3))}, checkpoint_id=folder)


def _load_other_settings(rank: int, world: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    outer = _diloco("int8", rank, 0)  # the checkpoint's DiLoCo exchanged int4
    # Rank 2 has no entry: it names the rank that refused, not a timeout of the broadcast.
    with pytest.raises(ValueError, match="settings differ"):
        dcp.load({"gradcomp": gradcomp.ddp.Checkpointable(outer, mismatch="drop")}, checkpoint_id=folder)


@pytest.mark.slow
def test_a_refused_state_dropped_onto_more_ranks_raises_on_every_rank(tmp_path):
    run_ranks(_save, SAVED_WORLD, str(tmp_path))
    run_ranks(_load_other_settings, LOADED_WORLD, str(tmp_path), timeout=120, group_timeout=30)
