"""gradcomp's work shows in a PyTorch profile taken with gradcomp.profiling.all_threads()."""

from __future__ import annotations

import pytest
import torch

import gradcomp
from tests.utils import run_ranks

pytestmark = pytest.mark.slow


def _profiled_step(rank: int, world_size: int, compressor: str, algorithm: str | None) -> list[list[str]]:
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp.collectives import allgather

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model = DistributedDataParallel(net, bucket_cap_mb=0.01)
    gradcomp.ddp.register(model, compressor, min_numel=0, algorithm=algorithm)
    inputs = torch.randn(16, 64)
    for _ in range(2):  # DDP rebuilds its buckets after the first; allgather's lane from the next
        model(inputs).sum().backward()
    seen = []
    lane_of = allgather._lane_of
    for lane in (False, True):  # a step through the general path, then one through the lane
        allgather._lane_of = lane_of if lane else (lambda *args: None)
        try:
            with torch.profiler.profile(experimental_config=gradcomp.profiling.all_threads()) as prof:
                model(inputs).sum().backward()
        finally:
            allgather._lane_of = lane_of
        names = {event.name for event in prof.events()}
        seen.append(sorted(name for name in names if name.startswith("gradcomp.")))
    return seen


@pytest.mark.parametrize(
    "compressor,algorithm", [("int8", "two_phase"), ("topk", "allgather"), ("int8", "dense")]
)
def test_a_hooked_step_shows_compress_exchange_and_decode(compressor, algorithm):
    if algorithm == "dense":
        compressor = "bf16"  # summable: its payload is all-reduced as it is
    for names in run_ranks(_profiled_step, 2, compressor, algorithm):
        assert {"gradcomp.compress", "gradcomp.exchange", "gradcomp.decode"} <= set(names), names
        buckets = [name for name in names if name.startswith("gradcomp.bucket ")]
        assert len(buckets) >= 2, names  # one range per bucket, named by its index
