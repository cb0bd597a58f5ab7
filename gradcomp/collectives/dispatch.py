"""The dispatcher: runs a :class:`~gradcomp.collectives.job.Job` with the
algorithm it names, on a queue's worker thread.

The one module that imports every algorithm. The algorithms import none of
it: ``hierarchical`` gets :func:`job_steps` handed in, to reduce its shards
between nodes with a flat algorithm.
"""

from __future__ import annotations

from collections.abc import Generator

from gradcomp.collectives import sparse_two_phase as sparse
from gradcomp.collectives.agreement import settle
from gradcomp.collectives.allgather import allgather
from gradcomp.collectives.dense import dense, local
from gradcomp.collectives.hierarchical import hierarchical
from gradcomp.collectives.job import Job
from gradcomp.collectives.low_rank import low_rank
from gradcomp.collectives.policy import HIERARCHICAL
from gradcomp.collectives.stats import ReduceStats, ring_all_reduce_bytes
from gradcomp.collectives.two_phase import two_phase
from gradcomp.collectives.worker import CollectiveQueue, drive


def job_steps(job: Job, q: CollectiveQueue) -> Generator[None, None, ReduceStats]:
    """Run ``job`` on ``q``'s group, on the queue's worker thread, as steps: it
    pauses (yields) at most once, while an exchange is in flight, so that the
    worker can start the next job meanwhile; its result is the job's
    :class:`ReduceStats`.

    A job pauses only after issuing its last collective: whether the next job
    starts before it finishes depends on timing that differs between ranks,
    and collectives must still be issued in the same order on every rank. So the
    plan of its size is agreed before (:func:`~gradcomp.collectives.agreement.settle`:
    a round trip at a size's first call, or where its plan changed), all of it
    before the job's own collectives."""
    tensor = job.tensor
    dense_bytes = ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), q.world_size)
    stats = ReduceStats(dense_bytes=dense_bytes, algorithm=job.algorithm, tensor=tensor)
    if tensor.numel() == 0:
        return stats
    if q.world_size > 1:
        settle(job, q, _run_to_end)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = work.view(-1)
    if job.algorithm == HIERARCHICAL:
        yield from hierarchical(job, flat, job.hierarchy, stats, job_steps)
    elif job.compressor.low_rank:
        yield from low_rank(job, flat, q, stats)
    elif q.world_size == 1:
        local(job, flat, stats)
    elif job.algorithm == "dense":
        yield from dense(job, flat, q, stats)
    elif job.algorithm == "allgather":
        yield from allgather(job, flat, q, stats)
    elif job.compressor.sparse:
        sparse.sparse_two_phase(job, flat, q, stats)
    else:
        yield from two_phase(job, flat, q, stats)
    if work is not tensor:
        tensor.copy_(work)
    return stats


def _run_to_end(job: Job, q: CollectiveQueue) -> None:
    drive(job_steps(job, q))
