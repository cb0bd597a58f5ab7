"""Host cost per bucket in Python steps: the DDP hook's calls per bucket, held as launches are.

On a GPU a 25 MB bucket crosses NVLink in tens of microseconds, and every
Python call on a bucket's path costs host time that no kernel hides. Here
``sys.setprofile`` counts the calls (Python functions and builtins, torch's
ops among them) a bucket costs in steady state, inside the hook on the
training thread and on the collective worker's thread, on 2 Gloo ranks with
many small buckets. The bounds are the counts of today's path with a margin:
a change that adds work per bucket (a signature bound per op call, settings
rebuilt per job) fails here before it shows in a benchmark.
"""

from __future__ import annotations

import collections
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import gradcomp
from gradcomp import collectives
from tests.utils import run_ranks

LAYERS = 16  # a bucket each: 32 x 32 weights and their bias
# Calls per bucket (the hook's on the training thread, and the worker's), with a margin;
# the worker's include the per-call agreement (the fingerprint, its header, the verdict:
# 13 calls) and, for Top-K, the rank-order decode's checks (304 measured on 2 ranks,
# bounded at 5% over it: the margin left for the next change is small on purpose).
BOUNDS = {"int8": (40, 258), "topk": (40, 320)}


class CallCounter:
    """Counts calls per thread: on the training thread only inside the hook."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()
        self._inside = threading.local()

    def __call__(self, frame, event, arg) -> None:
        thread = threading.current_thread().name
        if thread != "gradcomp-collectives":
            if frame.f_code is gradcomp.ddp.hook.__code__ and event in ("call", "return"):
                self._inside.depth = getattr(self._inside, "depth", 0) + (1 if event == "call" else -1)
                if event == "return":
                    return
            if not getattr(self._inside, "depth", 0):
                return
        if event in ("call", "c_call"):
            self.calls[thread] += 1


def _calls_per_bucket(rank: int, world_size: int, compressor: str) -> dict:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 32) for _ in range(LAYERS)]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=0.004)
    state = gradcomp.ddp.register(model, compressor, min_numel=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(8, 32)

    def step() -> None:
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()

    for _ in range(4):  # DDP rebuilds its buckets after the first; agreement checks come first
        step()
    counter, steps = CallCounter(), 3
    q = collectives.queue_for(None)
    q.submit(lambda: sys.setprofile(counter), torch.device("cpu")).wait()
    sys.setprofile(counter)
    for _ in range(steps):
        step()
    sys.setprofile(None)
    q.submit(lambda: sys.setprofile(None), torch.device("cpu")).wait()
    state.flush()
    buckets = steps * state.last_stats.buckets
    mine = {thread: calls / buckets for thread, calls in counter.calls.items()} | {"buckets": buckets}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone


@pytest.mark.slow
@pytest.mark.parametrize("compressor", sorted(BOUNDS))
def test_python_calls_per_bucket_stay_within_their_bounds(compressor):
    hook_bound, worker_bound = BOUNDS[compressor]
    for counts in run_ranks(_calls_per_bucket, 2, compressor):
        assert counts["buckets"] == 3 * LAYERS, counts
        assert counts["MainThread"] <= hook_bound, counts
        assert counts["gradcomp-collectives"] <= worker_bound, counts
