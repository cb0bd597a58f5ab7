"""The ``dense`` all-reduce: the payload of a summable compressor (none, the 16-bit
casts, random-K with its shared indices) all-reduced as it is, with the lanes of its
fingerprint (:mod:`~gradcomp.collectives.agreement`), then decoded; and a job on one
rank, which only compresses and decodes."""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.distributed as dist

from gradcomp.collectives.agreement import check_lanes, lane_count, write_lanes
from gradcomp.collectives.job import Job
from gradcomp.collectives.stats import ReduceStats, Timer, compress_measured, exchange, ring_all_reduce_bytes
from gradcomp.collectives.worker import CollectiveQueue
from gradcomp.compressors import Compressor


def local(job: Job, flat: torch.Tensor, stats: ReduceStats) -> None:
    """One rank: compress and decode ``flat`` in place (error feedback as on many)."""
    payload = compress_measured(job, flat, job.residual(job.key, flat), 0, stats)
    with Timer(stats):
        job.compressor.decompress(payload, out=flat)


def _divides_values(compressor: Compressor, sum_dtype: torch.dtype) -> bool:
    """Whether a mean divides each decoded payload's values (sparse payloads
    summed in fp32 or fp64: k values, no pass over the tensor) rather than
    the tensor; 16-bit sums are divided before, so that they cannot overflow."""
    return compressor.sparse and sum_dtype in (torch.float32, torch.float64)


def dense(job: Job, flat: torch.Tensor, q: CollectiveQueue, stats: ReduceStats) -> Generator:
    """All-reduce the payload itself (payloads add up) and the lanes of its fingerprint,
    judge the lanes, then decode into ``flat``; the job pauses while they are in flight."""
    # Where the mean is not taken when decoding, it is taken before the
    # reduction: the tensor in place (the result overwrites it anyway) and
    # the residual there and back, which stays in the input's units.
    divide = q.world_size if job.op == "avg" else 1
    at_decode = _divides_values(job.compressor, flat.dtype)
    residual = job.residual(job.key, flat)
    first = 1 if at_decode else divide
    if first > 1:
        flat.div_(first)
        if residual is not None:
            residual.div_(first)
    payload = compress_measured(job, flat, residual, q.rank, stats)
    if residual is not None and first > 1:
        residual.mul_(first)
    ((name, values),) = payload.tensors.items()  # a summable payload is one tensor
    wires, lanes = _wires(job, values, flat, q)
    works = []
    for wire in wires:
        with exchange():
            works.append(dist.all_reduce(wire, group=q.group, async_op=True))
        stats.bytes_sent += ring_all_reduce_bytes(wire.numel() * wire.element_size(), q.world_size)
    yield  # every collective of this job is issued: the next job may start
    # What the synchronous call does right after issuing (torch/distributed/distributed_c10d.py,
    # all_reduce: ``work.wait()`` unless async_op): on NCCL the current stream waits for it.
    for work in works:
        with exchange():
            work.wait()
    if lanes is not None:
        check_lanes(q, job, lanes)
    with Timer(stats):
        summed = payload.with_tensors({name: wires[0][: values.numel()]})
        job.compressor.decompress(summed, out=flat, divisor=divide if at_decode else 1)


def _wires(
    job: Job, values: torch.Tensor, flat: torch.Tensor, q: CollectiveQueue
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """What the job all-reduces, and the lanes of its fingerprint among it (None for a
    job without headers). A payload that is the tensor as it is (``none``, a cast to the
    tensor's own dtype) is summed alone, as ``torch.distributed.all_reduce`` sums it
    (the order a backend adds ranks' values in follows the buffer's length), its lanes
    in an all-reduce of their own; others carry the lanes after their values."""
    if job.agreement is None:
        return [values], None
    count = lane_count(values.dtype, q.world_size)
    if values.numel() == flat.numel() and values.dtype == flat.dtype:
        lanes = values.new_empty(count)
        write_lanes(lanes, job, q)
        return [values, lanes], lanes
    wire = values.new_empty(values.numel() + count)
    wire[: values.numel()].copy_(values)
    lanes = wire[values.numel() :]
    write_lanes(lanes, job, q)
    return [wire], lanes
