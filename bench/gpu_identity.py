"""Four ranks on one GPU: does every rank get the same bits from ``gradcomp.all_reduce``?

A decode that sums rows from several ranks gives every rank the same bits only if it
adds them in an order that does not depend on scheduling: atomic adds on a GPU
commit in the order the hardware runs them, which differs from rank to rank. Four
processes share the GPU over Gloo on CUDA tensors (NCCL refuses two ranks on one
GPU); each reduces its own gradient, made from a part every rank shares (the same
seed) and a part of its own (seeded by rank), so that most of the indices Top-K
selects are selected by several ranks. Each backend in turn
(``GRADCOMP_BACKEND``: the default choice, triton, cuda, torch; in the dry run the
default, which is cpu's, and torch), each compressor and algorithm whose decode sums rows:
Top-K (approximate and exact) on ``allgather`` and ``two_phase``, random-K on
``allgather`` and ``dense``, int8 on ``allgather`` and ``two_phase``, a few steps
with error feedback. After every step each rank's result is gathered to every
rank on the host and compared bit for bit with rank 0's.

A backend that has no op a compressor needs (the cuda backend has no quantizer) is
reported as not providing it; a backend that cannot run here, or ranks whose bits
differ, fail the check. Each backend's result is saved as it ends (a crash costs that
backend alone, ``gpu_setup.run_items``). Run by ``bench/gpu_check.sh``
(``--dry-run``: CPU tensors, the same code).

Writes the checks under "identity" in ``<out>/gpu_check.json``; exits 1 if one fails.

    python bench/gpu_identity.py --out bench/results
    python bench/gpu_identity.py --dry-run --out /tmp/gc
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from lib import gpu_setup

import gradcomp
from gradcomp.collectives import c10d

WORLD_SIZE = 4
STEPS = 3
NUMEL = {"cuda": 2**20, "cpu": 2**14}
# On CPU tensors the default is the cpu backend for every op: the dry run forces torch alone.
BACKENDS = {"cuda": ("default", "triton", "cuda", "torch"), "cpu": ("default", "torch")}
# (what, compressor, algorithm): every decode that sums the rows of several ranks.
CASES = (
    ("Top-K, allgather", "topk@0.01", "allgather"),
    ("Top-K, two_phase", "topk@0.01", "two_phase"),
    ("Top-K exact, allgather", "topk:ratio=0.01,exact=true", "allgather"),
    ("random-K, allgather", "randk@0.01", "allgather"),
    ("random-K, dense", "randk@0.01", "dense"),
    ("int8, allgather", "int8", "allgather"),
    ("int8, two_phase", "int8", "two_phase"),
)
# Begin no backend after this; the section's own limit in bench/gpu_check.sh is 45 s.
SECONDS = 35
# What dispatch says of a forced backend without the op (gradcomp/ops/dispatch.py).
NOT_PROVIDED = "requested but it has no"


def gradient(rank: int, step: int, numel: int, device: torch.device) -> torch.Tensor:
    """The part every rank shares plus a smaller part of this rank's own."""
    shared = torch.randn(numel, generator=torch.Generator().manual_seed(step))
    own = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * (step + 1) + rank))
    return (shared + 0.5 * own).to(device)


def ranks_differing_from_rank_0(result: torch.Tensor) -> int:
    """How many elements of ``result`` differ, bit for bit, between rank 0 and another
    rank (the same answer on every rank)."""
    bits = result.detach().cpu().contiguous().view(torch.int32)
    everyone = torch.empty(dist.get_world_size() * bits.numel(), dtype=torch.int32)
    c10d.all_gather_single(everyone, bits)
    rows = everyone.view(dist.get_world_size(), -1)
    return int((rows != rows[0]).any(dim=0).sum())


def run_case(compressor: str, algorithm: str, rank: int, device: torch.device) -> dict:
    """``STEPS`` all-reduces with error feedback; the elements that differ between ranks."""
    feedback, differing = gradcomp.ErrorFeedback(), []
    for step in range(STEPS):
        tensor = gradient(rank, step, NUMEL[device.type], device)
        gradcomp.all_reduce(tensor, compressor, algorithm=algorithm, feedback=feedback, name="g", step=step)
        differing.append(ranks_differing_from_rank_0(tensor))
    return {"identical": not any(differing), "elements differing from rank 0, a step": differing}


def check_backend(backend: str, rank: int, device: torch.device) -> dict:
    """Every case on ``backend`` (``default``: none forced)."""
    results, began = {}, time.perf_counter()
    with gpu_setup.forced_backend(None if backend == "default" else backend):
        for what, compressor, algorithm in CASES:
            try:
                results[what] = run_case(compressor, algorithm, rank, device)
            except RuntimeError as error:  # raised alike on every rank, before any exchange
                if NOT_PROVIDED not in str(error):
                    raise
                results[what] = {"provided": False, "why": str(error).splitlines()[0]}
                gradcomp.collectives.release_queues()  # the failed job failed its queue
    ran = [result for result in results.values() if result.get("provided", True)]
    results["ok"] = bool(ran) and all(result["identical"] for result in ran)
    results["seconds"] = round(time.perf_counter() - began, 3)
    return results


def _backends_on_rank(rank: int, world_size: int, backends: list[str], progress, device_type: str) -> None:
    device = gpu_setup.rank_device(device_type)
    for backend in backends:
        if not progress.begin(backend):
            return
        progress.end(backend, check_backend(backend, rank, device))


def main(argv=None) -> int:
    args = gpu_setup.parser(__doc__).parse_args(argv)
    device = gpu_setup.device_for(args.dry_run)
    backends = list(BACKENDS[device.type])
    settings = {
        "world size": WORLD_SIZE,
        "numel": NUMEL[device.type],
        "steps": STEPS,
        "backends": backends,
        "cases": {what: [compressor, algorithm] for what, compressor, algorithm in CASES},
        "seconds": SECONDS,
    }
    report = gpu_setup.Report(args.out, "identity", device, settings)
    name = f"{WORLD_SIZE} ranks, Gloo on {device.type.upper()} tensors"
    with report.check(name) as entry:
        deadline = time.time() + SECONDS
        saved = gpu_setup.items_on_ranks(
            report, name, deadline, _backends_on_rank, WORLD_SIZE, backends, device.type
        )
        entry["differ"] = [
            f"{backend}: {what}"
            for backend in backends
            for what, result in saved[backend].items()
            if isinstance(result, dict) and result.get("identical") is False
        ]
        entry["ok"] = all(saved[backend].get("ok") for backend in backends)
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
