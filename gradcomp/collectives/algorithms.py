"""The compressed all-reduce algorithms; which one a compressor takes follows
from its facts (DESIGN.md):

* ``dense``: all-reduce the payload itself (summable compressors);
* ``allgather``: gather every rank's payload, decode and add;
* ``two_phase``: all-to-all of compressed chunks (reduce-scatter), decode and
  sum the own chunk, recompress it with its own residual, all-gather
  (:mod:`gradcomp.collectives.two_phase`); for Top-K, a sparse reduce-scatter
  and re-selection whose bytes do not grow with the world size
  (:mod:`gradcomp.collectives.sparse_two_phase`);
* ``hierarchical``: dense inside each node, one of the above between nodes
  (:mod:`gradcomp.collectives.hierarchical`).

A low-rank compressor (PowerSGD) takes ``dense``: its factors are summed in
two dense all-reduces (:mod:`gradcomp.collectives.low_rank`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Hashable

import torch
import torch.distributed as dist

from gradcomp.collectives import sparse_two_phase as sparse
from gradcomp.collectives.agreement import fingerprint_of, verify_agreement
from gradcomp.collectives.hierarchical import Hierarchy, hierarchical
from gradcomp.collectives.low_rank import low_rank
from gradcomp.collectives.stats import ReduceStats, Timer, compress_measured, exchange, ring_all_reduce_bytes
from gradcomp.collectives.two_phase import chunk_bounds, two_phase, two_phase_segments
from gradcomp.collectives.worker import CollectiveQueue, all_gather_async
from gradcomp.compressors import Compressor, mix_seed
from gradcomp.feedback import ErrorFeedback
from gradcomp.payload import buffer_size

# The flat algorithms: one level, every rank alike.
ALGORITHMS = ("dense", "allgather", "two_phase")
HIERARCHICAL = "hierarchical"
# The world size from which Top-K takes two_phase by default. A rank sends
# about (CAPACITY + 1) (W-1)/W k pairs there, (W-1) k in an all-gather: fewer
# bytes from 4 ranks on. But the owner's re-selection reads 1/W of the tensor
# more: at 4 ranks on a 2-core CPU two_phase took 2.1x the all-gather's time
# with 25% fewer bytes (bench/README.md). From 8 ranks it sends 2.7x fewer.
SPARSE_TWO_PHASE_FROM = 8


def default_algorithm(compressor: Compressor, world_size: int | None = None) -> str:
    """``dense`` for summable payloads; for Top-K ``allgather`` on fewer than
    ``SPARSE_TWO_PHASE_FROM`` ranks (or an unknown number), ``two_phase`` from
    there on; for other payloads ``allgather`` on 2 ranks (the bytes of
    two_phase, one quantization and one collective instead of two, a third
    fewer encodes), ``two_phase`` on more (or an unknown number)."""
    if compressor.summable or compressor.low_rank:
        return "dense"
    if compressor.sparse:
        wide = world_size is not None and world_size >= SPARSE_TWO_PHASE_FROM
        return "two_phase" if wide and sparse.accepts(compressor) else "allgather"
    return "allgather" if world_size == 2 else "two_phase"


def check_algorithm(compressor: Compressor, algorithm: str | None, world_size: int | None = None) -> str:
    """``algorithm`` if ``compressor`` can take it, else ``ValueError``; None
    gives :func:`default_algorithm`."""
    algorithm = algorithm or default_algorithm(compressor, world_size)
    if compressor.low_rank and algorithm != "dense":
        raise ValueError(
            f"{compressor.name!r} factorises the tensor's matrices and sums the factors in two dense "
            f"all-reduces: it takes algorithm 'dense', not {algorithm!r}"
        )
    if algorithm == HIERARCHICAL:
        return algorithm  # any compressor: its inner algorithm is checked on its own
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {(*ALGORITHMS, HIERARCHICAL)}, got {algorithm!r}")
    if algorithm == "dense" and not (compressor.summable or compressor.low_rank):
        raise ValueError(f"algorithm 'dense' needs a summable compressor; {compressor.name!r} is not")
    if algorithm == "two_phase" and compressor.sparse and not sparse.accepts(compressor):
        raise ValueError(
            f"algorithm 'two_phase' takes dense payloads (quantizers, sign, casts) and Top-K's; "
            f"{compressor.name!r} shares its indices: use 'dense' or 'allgather'"
        )
    return algorithm


@dataclasses.dataclass
class Job:
    """One compressed all-reduce, fully described (run by :func:`job_steps`).

    Attributes:
        feedback: where the residuals live (None: no error feedback).
        key: residual and random-stream key (the same on every rank).
        step: step number of the random streams.
        hierarchy: the nodes of a ``hierarchical`` job; ``inter_algorithm``
            the algorithm between nodes (None: the compressor's default).
        shapes: the shapes of the tensors laid end to end in ``tensor``
            (a DDP bucket's parameters), for a low-rank compressor; None:
            the tensor's own shape.
        gathered: a list: an ``allgather`` leaves its gathered payloads there,
            ``(rows, meta)`` a segment, for the caller to decode (the
            hierarchical algorithm's node stage), instead of decoding them.
    """

    tensor: torch.Tensor
    compressor: Compressor
    op: str
    algorithm: str
    feedback: ErrorFeedback | None
    key: int
    step: int
    measure_error: bool = False
    hierarchy: Hierarchy | None = None
    inter_algorithm: str | None = None
    shapes: tuple[tuple[int, ...], ...] | None = None
    gathered: list | None = None

    def residual(self, name: Hashable, like: torch.Tensor) -> torch.Tensor | None:
        """The residual kept under ``name`` (shaped like ``like``), or None without feedback."""
        if self.feedback is None or not self.compressor.needs_feedback:
            return None
        return self.feedback.residual(name, like)


def job_steps(job: Job, q: CollectiveQueue) -> Generator[None, None, ReduceStats]:
    """Run ``job`` on ``q``'s group, on the queue's worker thread, as steps: it
    pauses (yields) at most once, while an exchange is in flight, so that the
    worker can start the next job meanwhile; its result is the job's
    :class:`ReduceStats`.

    A job pauses only after issuing its last collective: whether the next job
    starts before it finishes depends on timing that differs between ranks,
    and collectives must still be issued in the same order on every rank."""
    tensor = job.tensor
    dense = ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), q.world_size)
    stats = ReduceStats(dense_bytes=dense, algorithm=job.algorithm, tensor=tensor)
    if tensor.numel() == 0:
        return stats
    algorithm = job.algorithm
    if algorithm == HIERARCHICAL:
        algorithm = f"{algorithm}/{job.inter_algorithm or 'default'}"
    if job.compressor.low_rank:  # the matrices decide the factors' sizes
        algorithm = f"{algorithm}/shapes {job.shapes or tuple(tensor.shape)}"
    verify_agreement(q, fingerprint_of(job.compressor, tensor, algorithm, job.op), tensor.device)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = work.view(-1)
    if job.algorithm == HIERARCHICAL:
        yield from hierarchical(job, flat, job.hierarchy, stats)
    elif job.compressor.low_rank:
        yield from low_rank(job, flat, q, stats)
    elif q.world_size == 1:
        _local(job, flat, stats)
    elif job.algorithm == "dense":
        _dense(job, flat, q, stats)
    elif job.algorithm == "allgather":
        yield from _allgather(job, flat, q, stats)
    elif job.compressor.sparse:
        sparse.sparse_two_phase(job, flat, q, stats)
    else:
        two_phase(job, flat, q, stats)
    if work is not tensor:
        tensor.copy_(work)
    return stats


def owner_ranges(
    compressor: Compressor, algorithm: str, numel: int, world_size: int, rank: int, device: torch.device
) -> list[tuple[int, int]]:
    """Where a ``two_phase`` owner's residual (key ``("two_phase", key)``) sits in
    the tensor, in the residual's order: the chunks ``rank`` owns. Empty for the
    other algorithms, which keep no owner's residual."""
    if algorithm != "two_phase" or world_size == 1 or compressor.low_rank:
        return []
    if compressor.sparse:
        start, end = chunk_bounds(numel, world_size, 1)[rank]
        return [(start, end)] if end > start else []
    align = getattr(compressor, "block", 1)
    ranges = []
    for start, end in two_phase_segments(numel, world_size, align, device):
        own_start, own_end = chunk_bounds(end - start, world_size, align)[rank]
        if own_end > own_start:
            ranges.append((start + own_start, start + own_end))
    return ranges


def _local(job: Job, flat: torch.Tensor, stats: ReduceStats) -> None:
    payload = compress_measured(job, flat, job.residual(job.key, flat), 0, stats)
    with Timer(stats):
        job.compressor.decompress(payload, out=flat)


def _divides_values(compressor: Compressor, sum_dtype: torch.dtype) -> bool:
    """Whether a mean divides each decoded payload's values (sparse payloads
    summed in fp32 or fp64: k values, no pass over the tensor) rather than
    the tensor; 16-bit sums are divided before, so that they cannot overflow."""
    return compressor.sparse and sum_dtype in (torch.float32, torch.float64)


def _dense(job: Job, flat: torch.Tensor, q: CollectiveQueue, stats: ReduceStats) -> None:
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
    for wire in payload.tensors.values():
        with exchange():
            dist.all_reduce(wire, group=q.group)
        stats.bytes_sent += ring_all_reduce_bytes(wire.numel() * wire.element_size(), q.world_size)
    with Timer(stats):
        job.compressor.decompress(payload, out=flat, divisor=divide if at_decode else 1)


def allgather_segments(compressor: Compressor, numel: int, device: torch.device) -> list[tuple[int, int]]:
    """The segments of an ``allgather`` all-reduce: on CPUs a long dense payload goes as a
    pipeline (:func:`two_phase_segments` of one rank: each at least ``SEGMENT_ELEMENTS``,
    whole blocks), so that compressing one segment overlaps the exchange of the one
    before; sparse payloads (a selection over the whole tensor) and GPUs take one."""
    if compressor.sparse:
        return [(0, numel)] if numel else []
    return two_phase_segments(numel, 1, getattr(compressor, "block", 1), device)


def _allgather(job: Job, flat: torch.Tensor, q: CollectiveQueue, stats: ReduceStats) -> Generator:
    """Gather every rank's payload of the whole tensor, decode and add them in
    rank order (every rank gets the same bits); segment by segment
    (:func:`allgather_segments`), each segment's random stream its own."""
    residual = job.residual(job.key, flat)
    gathers = []
    for s, (start, end) in enumerate(allgather_segments(job.compressor, flat.numel(), flat.device)):
        part = None if residual is None else residual.view(-1)[start:end]
        segment_job = job if s == 0 else dataclasses.replace(job, key=mix_seed(job.key, s))
        payload = compress_measured(segment_job, flat[start:end], part, q.rank, stats)
        # Every payload's size follows from numel, dtype and settings: no size exchange.
        width = buffer_size(payload.layout())
        gathered = torch.empty(q.world_size, width, dtype=torch.uint8, device=flat.device)
        with exchange():
            gather = all_gather_async(gathered.view(-1), payload.to_buffer(width), q.group)
        gathers.append((gather, gathered, payload.meta, start, end))
        stats.bytes_sent += width * (q.world_size - 1)
    yield  # every collective of this job is issued: the next job may start
    divisor = q.world_size if job.op == "avg" else 1
    for gather, gathered, meta, start, end in gathers:
        with exchange():
            gather.wait()
        if job.gathered is not None:
            job.gathered.append((gathered, meta))
            continue
        with Timer(stats):
            job.compressor.decompress_sum(gathered, flat.dtype, flat[start:end], meta=meta, divisor=divisor)
