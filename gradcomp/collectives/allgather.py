"""The ``allgather`` all-reduce: every rank's payload of the whole tensor
gathered, decoded and added in rank order, so every rank gets the same bits.
The default for payloads that do not add up on 2 ranks, and for Top-K below
:data:`~gradcomp.collectives.policy.SPARSE_TWO_PHASE_FROM` ranks."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator

import torch

from gradcomp.collectives.agreement import HEADER_BYTES, MAX_PLANS, check_fingerprints, write_fingerprint
from gradcomp.collectives.job import Job
from gradcomp.collectives.stats import (
    COMPRESS,
    DECODE,
    EXCHANGE,
    ReduceStats,
    Timer,
    compress_measured,
    profiled,
)
from gradcomp.collectives.two_phase import two_phase_segments
from gradcomp.collectives.worker import CollectiveQueue, all_gather_async
from gradcomp.compressors import Compressor, Context, mix_seed
from gradcomp.payload import buffer_size


def allgather_segments(compressor: Compressor, numel: int, device: torch.device) -> list[tuple[int, int]]:
    """The segments of an ``allgather`` all-reduce: on CPUs a long dense payload goes as a
    pipeline (:func:`two_phase_segments` of one rank: each at least ``SEGMENT_ELEMENTS``,
    whole blocks), so that compressing one segment overlaps the exchange of the one
    before; sparse payloads (a selection over the whole tensor) and GPUs take one."""
    if compressor.sparse:
        return [(0, numel)] if numel else []
    return two_phase_segments(numel, 1, getattr(compressor, "block", 1), device)


def allgather(job: Job, flat: torch.Tensor, q: CollectiveQueue, stats: ReduceStats) -> Generator:
    """Gather every rank's payload of the whole tensor, its fingerprint after it, judge the
    fingerprints, decode and add the payloads in rank order (every rank gets the same
    bits); segment by segment (:func:`allgather_segments`), each segment's random stream
    its own."""
    residual = job.residual(job.key, flat)
    width = _lane_of(job, residual, q)
    if width is not None:
        yield from _one_row(job, flat, residual, q, stats, width)
        return
    gathers, header = [], 0 if job.agreement is None else HEADER_BYTES
    for s, (start, end) in enumerate(allgather_segments(job.compressor, flat.numel(), flat.device)):
        part = None if residual is None else residual.view(-1)[start:end]
        segment_job = job if s == 0 else dataclasses.replace(job, key=mix_seed(job.key, s))
        payload = compress_measured(segment_job, flat[start:end], part, q.rank, stats)
        # Every payload's size follows from numel, dtype and settings: no size exchange.
        width = buffer_size(payload.layout())
        row = torch.empty(width + header, dtype=torch.uint8, device=flat.device)
        payload.to_buffer(out=row[:width])
        gathers.append((*_gather(job, row, width, q, stats), payload.meta, start, end))
    yield  # every collective of this job is issued: the next job may start
    divisor = q.world_size if job.op == "avg" else 1
    for s, (work, rows, meta, start, end) in enumerate(gathers):
        _in_range(EXCHANGE, work.wait)
        if s == 0 and header:  # every segment's rows hold the same fingerprints: the first's are judged
            check_fingerprints(q, job, rows[:, rows.shape[1] - header :], [later[0] for later in gathers[1:]])
        if job.gathered is not None:
            job.gathered.append((rows, meta))
            continue
        with Timer(stats):
            job.compressor.decompress_sum(rows, flat.dtype, flat[start:end], meta=meta, divisor=divisor)
    if len(gathers) == 1 and job.gathered is None and not job.measure_error and job.agreement is not None:
        # A job of this kind sends one row of this width from now on (a payload's size
        # follows from numel, dtype and settings alone): the one-row lane.
        _remember_lane(q, job.agreement.plan, width)


# The one-row lane of an allgather job whose kind ran before on the queue: the row's
# width known, the compressor encodes straight into the row it sends and decodes the
# gathered rows (Compressor.encode_row, decode_rows): no payload objects, no segment
# plan, no copy into a send buffer, no op-boundary checks (the job's tensors are valid
# by construction). The same bits as the general path (tests/collectives/test_lane.py).


def _lane_of(job: Job, residual, q: CollectiveQueue) -> int | None:
    """The width of the job's one row, where its plan has run before and the job may
    take the lane; None: the general path.

    Whether a job takes the lane depends on timing, which differs between ranks: the
    width is noted when a job of its plan finishes, after its pause, so a job started
    while that one is still in flight takes the general path on one rank and may take
    the lane on another. This is safe only because both paths send the same bytes and
    give the same bits (tests/collectives/test_lane.py holds them to it)."""
    if job.gathered is not None or job.measure_error or job.agreement is None or job.agreement.probe:
        return None
    if residual is not None and not residual.is_contiguous():
        return None
    return q.lanes.get(job.agreement.plan)


def _remember_lane(q: CollectiveQueue, plan: tuple, width: int) -> None:
    """Note a plan's row width, keeping the last ``MAX_PLANS`` plans' (noted after a
    pause, so in an order that may differ between ranks: it decides only how a job runs)."""
    q.lanes.pop(plan, None)
    q.lanes[plan] = width
    while len(q.lanes) > MAX_PLANS:
        del q.lanes[next(iter(q.lanes))]


def _one_row(job: Job, flat: torch.Tensor, residual, q: CollectiveQueue, stats: ReduceStats, width: int):
    compressor = job.compressor
    row = torch.empty(width + HEADER_BYTES, dtype=torch.uint8, device=flat.device)
    context = Context(residual, job.step, job.key, q.rank)
    began = time.perf_counter()
    meta = _in_range(COMPRESS, compressor.encode_row, flat, row[:width], context)
    stats.compress_seconds += time.perf_counter() - began
    work, rows = _gather(job, row, width, q, stats)
    yield  # every collective of this job is issued: the next job may start
    _in_range(EXCHANGE, work.wait)
    check_fingerprints(q, job, rows[:, width:])
    began = time.perf_counter()
    divisor = q.world_size if job.op == "avg" else 1
    _in_range(DECODE, compressor.decode_rows, rows, flat, meta, divisor)
    stats.compress_seconds += time.perf_counter() - began


def _gather(job: Job, row: torch.Tensor, width: int, q: CollectiveQueue, stats: ReduceStats) -> tuple:
    """Issue the all-gather of ``row``: a payload of ``width`` bytes, then room for the
    job's fingerprint, written here; ``(the pending work, the rows it fills)``, every
    rank's payload from the start of its row."""
    if job.agreement is not None:
        write_fingerprint(row[width:], job)
    nbytes = row.numel()
    rows = torch.empty(q.world_size, nbytes, dtype=torch.uint8, device=row.device)
    work = _in_range(EXCHANGE, all_gather_async, rows.view(-1), row, q.group)
    stats.bytes_sent += nbytes * (q.world_size - 1)
    return work, rows


def _in_range(name: str, function, *args):
    """``function(*args)``, inside a profiler range ``name`` while a profile is taken."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return function(*args)
    with profiled(name):
        return function(*args)
