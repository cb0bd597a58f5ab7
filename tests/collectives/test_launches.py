"""Host cost per bucket on the GPU code path: one host sync, launches independent of the world size.

The GPU path runs here on CPU tensors through the Triton backend (in Triton's
interpreter); :mod:`counting` counts aten dispatches, kernel launches and
what would be a host sync on a GPU, on the caller's thread and the
collective worker's, for one steady-state all-reduce (after the first one,
which agrees on its plan). The one sync a job makes reads every rank's
fingerprint before it decodes (gradcomp.collectives.agreement): on the
worker's thread, after its first exchange.
"""

from __future__ import annotations

import os

import pytest
import torch

import gradcomp
from tests.utils import run_ranks

pytest.importorskip("triton")

NUMEL = 3 * 2**11 + 77  # odd: a short last chunk, a partial last block
# The target for an int8 two_phase bucket at any world size.
INT8_TWO_PHASE_LAUNCHES = 12
INT8_TWO_PHASE_DISPATCHES = 40
# What a job reads on the host: every rank's fingerprint (or their bits' sums), once.
VERDICT = {"Tensor.tolist": 1}


def _steady_state_counts(compressor, algorithm: str):
    from tests.counting import counted

    gradcomp.collectives.release_queues()
    with counted() as counts:
        x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
        gradcomp.all_reduce(x.clone(), compressor, algorithm=algorithm, name="bucket")
        y = x.clone()
        counts.active = True
        gradcomp.all_reduce(y, compressor, algorithm=algorithm, name="bucket")
        counts.active = False
    gradcomp.collectives.release_queues()
    return counts


CASES = [
    ("int8", "two_phase"),
    ("int4", "two_phase"),
    ("int2", "two_phase"),
    ("ternary", "two_phase"),
    ("qsgd", "two_phase"),
    ("sign", "two_phase"),
    ("int8", "allgather"),
    ("topk", "allgather"),
    ("topk", "two_phase"),
    ("randk", "dense"),
    ("bf16", "dense"),
    ("none", "dense"),
]


def _count_every_compressor(rank: int, world_size: int, results: dict, cases: list) -> None:
    os.environ["GRADCOMP_BACKEND"] = "triton"
    for name, algorithm in cases:
        counts = _steady_state_counts(gradcomp.get_compressor(name), algorithm)
        where = f"{name} {algorithm} at {world_size} ranks"
        assert dict(counts.syncs) == VERDICT, f"{where}: host syncs {dict(counts.syncs)}"
        if name == "int8" and algorithm == "two_phase":
            assert counts.total_launches <= INT8_TWO_PHASE_LAUNCHES, f"{where}:\n{counts.summary()}"
            assert counts.total_dispatches <= INT8_TWO_PHASE_DISPATCHES, f"{where}:\n{counts.summary()}"
        if rank == 0:
            results[name, algorithm] = (counts.total_launches, counts.total_dispatches)


@pytest.fixture(autouse=True)
def interpreted_ranks(monkeypatch):
    """The ranks run the Triton path on CPU tensors, in the interpreter, on any machine."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.slow
def test_one_host_sync_and_launches_independent_of_the_world_size():
    import torch.multiprocessing as mp

    per_world = {}
    # An even and an odd world size for every case (uneven chunks); eight ranks
    # on this machine's cores take long: int8 two_phase only.
    for world_size, cases in ((2, CASES), (3, CASES), (8, CASES[:1])):
        with mp.Manager() as manager:
            results = manager.dict()
            run_ranks(_count_every_compressor, world_size, results, cases, timeout=600)
            per_world[world_size] = dict(results)
    for case in CASES:
        counts = {world_size: found[case] for world_size, found in per_world.items() if case in found}
        assert len(set(counts.values())) == 1, f"{case}: (launches, dispatches) by world size {counts}"


def _hook_makes_one_host_sync_a_bucket(rank: int, world_size: int) -> None:
    from tests.counting import counted
    from tests.ddp.models import DDP, make_model, train

    os.environ["GRADCOMP_BACKEND"] = "triton"
    model = DDP(make_model(), bucket_cap_mb=0.02)
    gradcomp.ddp.register(model, "topk", ratio=0.05, min_numel=0)
    train(model, rank, world_size, 2)  # agreement checks, DDP's bucket rebuild
    gradcomp.collectives.release_queues()
    with counted() as counts:
        train(model, rank, world_size, 1)  # the new worker's agreement checks
        inputs, labels = torch.randn(16, 32), torch.randint(0, 10, (16,))
        counts.active = True
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        counts.active = False
    jobs = sum(counts.collectives.values())  # Top-K on 2 ranks: one all-gather a bucket
    assert jobs > 1 and dict(counts.syncs) == {"Tensor.tolist": jobs}, dict(counts.syncs)


@pytest.mark.slow
def test_ddp_hook_step_makes_one_host_sync_a_bucket():
    run_ranks(_hook_makes_one_host_sync_a_bucket, 2)
