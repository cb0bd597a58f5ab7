"""What CompressedAdam's ranks check at their first step: the same settings and step
(else they would switch phases at different steps, and their collectives would not
match), and gradients that nothing reduced already."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradcomp.optim.layout import Bucket, gradients

ALREADY_REDUCED = (
    "CompressedAdam: the gradients are the same on every rank before it exchanges them: a "
    "DistributedDataParallel model all-reduced them already, dense, in its backward pass "
    "(or every rank computed the same ones). CompressedAdam exchanges them itself: give it the "
    "module's parameters and train the module unwrapped, or run each backward under "
    "model.no_sync(); last_bytes_sent counts CompressedAdam's bytes alone"
)


def compare(
    described: tuple, buckets: list[Bucket], group: dist.ProcessGroup | None
) -> tuple[bool, str | None]:
    """Gather every rank's ``described`` (step, warm-up, algorithm, bucket sizes, each
    group's compressors) and gradient sums: whether the gradients are the same nonzero
    ones on every rank of several (:data:`ALREADY_REDUCED`), and the refusal to raise on
    every rank where the ranks differ (None where they agree)."""
    # The gradients' sums, to tell whether something reduced them already: summed in fp64
    # without a copy, read back in one transfer.
    totals = [torch.stack([g.sum(dtype=torch.float64) for g in gradients(b)]).sum() for b in buckets]
    one_device = len({t.device for t in totals}) == 1
    sums = torch.stack(totals).tolist() if one_device else [float(t) for t in totals]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (*described, sums), group=group)
    everyone, all_sums = [d[:-1] for d in everyone], [d[-1] for d in everyone]
    reduced = len(everyone) > 1 and any(sums) and all(other == sums for other in all_sums)
    if all(d == described for d in everyone):
        return reduced, None
    lines = "\n".join(
        f"  rank {r}: step {d[0]}, warmup_steps {d[1]}, algorithm {d[2]}, bucket sizes {d[3]}, "
        f"(compressor, gradient_compressor) per group {d[4]}"
        for r, d in enumerate(everyone)
    )
    return reduced, f"ranks disagree on the CompressedAdam settings:\n{lines}"
