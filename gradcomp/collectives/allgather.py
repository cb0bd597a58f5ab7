"""The ``allgather`` all-reduce: every rank's payload of the whole tensor
gathered, decoded and added in rank order, so every rank gets the same bits.
The default for payloads that do not add up on 2 ranks, and for Top-K below
:data:`~gradcomp.collectives.policy.SPARSE_TWO_PHASE_FROM` ranks."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator

import torch

from gradcomp.collectives.job import Job
from gradcomp.collectives.stats import (
    COMPRESS,
    DECODE,
    EXCHANGE,
    ReduceStats,
    Timer,
    compress_measured,
    exchange,
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
    """Gather every rank's payload of the whole tensor, decode and add them in
    rank order (every rank gets the same bits); segment by segment
    (:func:`allgather_segments`), each segment's random stream its own."""
    residual = job.residual(job.key, flat)
    width = _lane_of(job, flat, residual, q)
    if width is not None:
        yield from _one_row(job, flat, residual, q, stats, width)
        return
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
    if len(gathers) == 1 and job.gathered is None and not job.measure_error and job.fingerprint is not None:
        # A job of this kind sends one row of this width from now on (a payload's size
        # follows from numel, dtype and settings alone): the one-row lane.
        q.lanes[(job.fingerprint, flat.device)] = gathers[0][1].shape[1]


# The one-row lane of an allgather job whose kind ran before on the queue: the row's
# width known, the compressor encodes straight into the row it sends and decodes the
# gathered rows (Compressor.encode_row, decode_rows): no payload objects, no segment
# plan, no copy into a send buffer, no op-boundary checks (the job's tensors are valid
# by construction). The same bits as the general path (tests/collectives/test_lane.py).


def _lane_of(job: Job, flat: torch.Tensor, residual, q: CollectiveQueue) -> int | None:
    """The width of the job's one row, where its kind has run before and the job may
    take the lane; None: the general path.

    Whether a job takes the lane depends on timing, which differs between ranks: the
    width is noted when a job of its kind finishes, after its pause, so a job started
    while that one is still in flight takes the general path on one rank and may take
    the lane on another. This is safe only because both paths send the same bytes and
    give the same bits (tests/collectives/test_lane.py holds them to it)."""
    if job.gathered is not None or job.measure_error or job.fingerprint is None:
        return None
    if residual is not None and not residual.is_contiguous():
        return None
    return q.lanes.get((job.fingerprint, flat.device))


def _one_row(job: Job, flat: torch.Tensor, residual, q: CollectiveQueue, stats: ReduceStats, width: int):
    compressor = job.compressor
    gathered = torch.empty(q.world_size, width, dtype=torch.uint8, device=flat.device)
    send = torch.empty(width, dtype=torch.uint8, device=flat.device)
    context = Context(residual, job.step, job.key, q.rank)
    began = time.perf_counter()
    meta = _in_range(COMPRESS, compressor.encode_row, flat, send, context)
    stats.compress_seconds += time.perf_counter() - began
    gather = _in_range(EXCHANGE, all_gather_async, gathered.view(-1), send, q.group)
    stats.bytes_sent += width * (q.world_size - 1)
    yield  # every collective of this job is issued: the next job may start
    _in_range(EXCHANGE, gather.wait)
    began = time.perf_counter()
    divisor = q.world_size if job.op == "avg" else 1
    _in_range(DECODE, compressor.decode_rows, gathered, flat, meta, divisor)
    stats.compress_seconds += time.perf_counter() - began


def _in_range(name: str, function, *args):
    """``function(*args)``, inside a profiler range ``name`` while a profile is taken."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return function(*args)
    with profiled(name):
        return function(*args)
