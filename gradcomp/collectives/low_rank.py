"""The all-reduce of a low-rank compressor (PowerSGD): two dense all-reduces.

For the matrices of a tensor (the shapes of a DDP bucket's parameters, or
the tensor's own shape), each rank computes ``P_i = M_i Q`` from the shared
``Q``; the ``P_i`` are summed (first all-reduce, with the tensors sent as
they are and the lanes of the job's fingerprint, judged before the result is
written: :mod:`~gradcomp.collectives.agreement`), ``P`` is orthonormalised,
the same bits on every rank; each rank computes ``Q_i = M_i^T P`` and keeps
``M_i - P Q_i^T`` as its residual; the ``Q_i`` are summed (second all-reduce),
and the result is ``P Q^T``, the sum of every rank's projection onto ``P``. The summed ``Q`` starts the next
step's iteration (warm start), kept with the residuals.
"""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.distributed as dist

from gradcomp.collectives.agreement import check_lanes, lane_count, write_lanes
from gradcomp.collectives.job import Job
from gradcomp.collectives.stats import (
    COMPRESS,
    ReduceStats,
    Timer,
    exchange,
    ring_all_reduce_bytes,
    square_sum,
)
from gradcomp.collectives.worker import CollectiveQueue
from gradcomp.compressors import low_rank as lr


def warm_start_key(key: int) -> tuple[str, int]:
    """The key the warm-start ``Q`` of residual ``key`` is kept under."""
    return ("powersgd.q", key)


def low_rank(job: Job, flat: torch.Tensor, q: CollectiveQueue, stats: ReduceStats) -> Generator:
    """Reduce ``flat`` (the job's tensor) in place: see the module's docstring."""
    compressor = job.compressor
    fact = compressor.factorization(job.shapes or (tuple(job.tensor.shape),))
    if fact.numel != flat.numel():
        raise ValueError(f"the shapes hold {fact.numel} elements, the tensor {flat.numel()}: {job.shapes}")
    dtype = lr.work_dtype(flat.dtype)
    residual = job.residual(job.key, flat)
    sums = fact.p_numel + fact.dense_numel
    lanes = 0 if job.agreement is None else lane_count(dtype, q.world_size)
    with Timer(stats, COMPRESS):
        stacks = lr.gather_matrices(flat, residual, fact, dtype)
        first = torch.empty(sums + lanes, dtype=dtype, device=flat.device)
        p, packed = first[: fact.p_numel], first[fact.p_numel : sums]
        if lanes:
            write_lanes(first[sums:], job, q)
        lr.gather_dense(flat, residual, fact, packed)
        lr.project(stacks, _warm_start(job, fact, flat.device, dtype), p, fact)
        if job.measure_error:  # the dense slices are sent exactly: only the matrices lose
            stats.input_sq = sum(square_sum(stack) for stack in stacks) + square_sum(packed)
    _all_reduce(first, q, stats)
    with Timer(stats, COMPRESS):
        lr.orthonormalize(p, fact)
        second = torch.empty(fact.q_numel, dtype=dtype, device=flat.device)
        lr.project_back(stacks, p, second, fact)
        if residual is not None or job.measure_error:
            # This rank's residual is what its own projection onto P lost.
            differences = lr.residual_differences(stacks, p, second, fact)
            if residual is not None:
                lr.store_residuals(differences, residual, fact)
            if job.measure_error:
                stats.error_sq = sum(square_sum(difference) for difference in differences)
    work = _all_reduce(second, q, stats, async_op=True)
    if compressor.warm_start and job.feedback is not None:
        # Kept now, not after the wait: whether a re-bucketing that starts
        # meanwhile drops it must not depend on timing. Gloo is still summing it
        # and the mean divides it below: a job under this key, which would read
        # it, waits for this one (the worker's rule, by Job.state).
        job.feedback.set(warm_start_key(job.key), second)
    yield  # every collective of this job is issued: the next job may start
    if work is not None:
        with exchange():
            work.wait()
    if lanes:  # judged after the pause: nothing before it writes into the tensor
        check_lanes(q, job, first[sums:])
    with Timer(stats):
        if job.op == "avg" and q.world_size > 1:
            second /= q.world_size  # the factor, not the product: fewer values to divide
            packed /= q.world_size
        lr.scatter_matrices(lr.reconstruct(p, second, fact), flat, fact)
        lr.scatter_dense(packed, flat, fact)


def _warm_start(job: Job, fact: lr.Factorization, device, dtype) -> torch.Tensor:
    """Last step's summed ``Q`` of this key, else a seeded random one. A step
    with a NaN or infinity leaves a non-finite Q: its entries restart at zero
    (a zero Q makes P the first unit vectors, and the step after recovers),
    or one bad step would make every later one NaN."""
    if job.compressor.warm_start and job.feedback is not None:
        kept = job.feedback.get(warm_start_key(job.key))
        if kept is not None and kept.numel() == fact.q_numel:
            return kept.to(device, dtype).nan_to_num(0.0, 0.0, 0.0)
    return job.compressor.initial_q(fact, job.key, job.step, device).to(dtype)


def _all_reduce(tensor: torch.Tensor, q: CollectiveQueue, stats: ReduceStats, async_op: bool = False):
    if q.world_size == 1 or tensor.numel() == 0:
        return None
    with exchange():
        work = dist.all_reduce(tensor, group=q.group, async_op=async_op)
    stats.bytes_sent += ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), q.world_size)
    return work
