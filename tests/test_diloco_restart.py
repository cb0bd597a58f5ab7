"""DiLoCo resumed with ``Checkpointable(mismatch="drop")`` from a checkpoint of fewer ranks,
whose saved state this DiLoCo refuses (other settings): the ranks that have an entry
refuse it, and the ranks that have none must raise too, not wait in the broadcast of rank
0's state that the others never reach."""

from __future__ import annotations

import pytest

import gradcomp
from tests.utils import run_ranks, trained_diloco

SAVED_WORLD, LOADED_WORLD = 2, 3


def _save(rank: int, world: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"gradcomp": gradcomp.ddp.Checkpointable(trained_diloco(rank, 3, "int4"))}, checkpoint_id=folder)


def _load_other_settings(rank: int, world: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    outer = trained_diloco(rank, 0, "int8")  # the checkpoint's DiLoCo exchanged int4
    # Rank 2 has no entry: it names the rank that refused, not a timeout of the broadcast.
    with pytest.raises(ValueError, match="settings differ"):
        dcp.load({"gradcomp": gradcomp.ddp.Checkpointable(outer, mismatch="drop")}, checkpoint_id=folder)


@pytest.mark.slow
def test_a_refused_state_dropped_onto_more_ranks_raises_on_every_rank(tmp_path):
    run_ranks(_save, SAVED_WORLD, str(tmp_path))
    run_ranks(_load_other_settings, LOADED_WORLD, str(tmp_path), timeout=120, group_timeout=30)
