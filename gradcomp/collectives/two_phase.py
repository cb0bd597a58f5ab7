"""The two-phase compressed all-reduce: a reduce-scatter of compressed chunks
(all-to-all), decode and sum, recompress, all-gather."""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Generator

import torch
import torch.distributed as dist

from gradcomp.collectives.agreement import HEADER_BYTES, check_fingerprints, write_fingerprint
from gradcomp.collectives.job import Job
from gradcomp.collectives.stats import COMPRESS, ReduceStats, Timer, exchange, measured, profiled
from gradcomp.collectives.worker import CollectiveQueue, all_gather_async
from gradcomp.compressors import Compressor, Context, mix_seed
from gradcomp.payload import buffer_size

# Two-phase all-reduces of long CPU tensors run as a pipeline of segments,
# so that compressing one segment overlaps the exchange of the one before
# (Gloo moves bytes while the host compresses). A segment holds at least
# SEGMENT_ELEMENTS per rank (about 1 MB of int8 payload, far above a
# collective's latency), and there are at most MAX_SEGMENTS. On a GPU the
# worker queues every kernel of a job without waiting for any, so segments
# would only add launches: it takes one.
SEGMENT_ELEMENTS = 2**20
MAX_SEGMENTS = 16
# Random streams of the two compressions of a two-phase segment.
_SENDER, _OWNER = 0, 1


def chunk_length(numel: int, parts: int, align: int) -> int:
    """The length of :func:`chunk_bounds`' ranges (but the last non-empty one)."""
    return math.ceil(math.ceil(numel / align) / parts) * align


def chunk_bounds(numel: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``numel``, each ``chunk_length`` long
    (a multiple of ``align``) except the last non-empty one; trailing ranges may be empty."""
    chunk = chunk_length(numel, parts, align)
    return [(min(j * chunk, numel), min((j + 1) * chunk, numel)) for j in range(parts)]


def two_phase_segments(
    numel: int, world_size: int, align: int, device: torch.device
) -> list[tuple[int, int]]:
    """The segments of a two-phase all-reduce: whole multiples of ``world_size * align``
    elements but the last."""
    parts = 1 if device.type != "cpu" else max(1, min(MAX_SEGMENTS, numel // (world_size * SEGMENT_ELEMENTS)))
    return [(start, end) for start, end in chunk_bounds(numel, parts, world_size * align) if end > start]


def owner_key(key) -> tuple:
    """Where a ``two_phase`` owner keeps the residual of the chunks it owns of tensor
    ``key`` (the sender's residual is under ``key`` itself)."""
    return ("two_phase", key)


def owner_ranges(
    compressor: Compressor, algorithm: str, numel: int, world_size: int, rank: int, device: torch.device
) -> list[tuple[int, int]]:
    """Where a ``two_phase`` owner's residual (:func:`owner_key`) sits in
    the tensor, in the residual's order: the chunks ``rank`` owns (Top-K's sparse
    two-phase: one range, unaligned). Empty for the other algorithms, which keep no
    owner's residual."""
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


def two_phase(job: Job, flat: torch.Tensor, q: CollectiveQueue, stats: ReduceStats) -> Generator:
    """Reduce-scatter of compressed chunks, decode, recompress, all-gather.

    Each segment (:func:`two_phase_segments`) is cut into ``world_size``
    block-aligned chunks (:func:`chunk_bounds`); rank ``j`` owns chunk ``j``
    of every segment and keeps the owner's residual of what it owns. The
    payloads of a segment travel as rows of one buffer (one payload a chunk):
    an all-to-all gives each rank every rank's payload of its chunk, which
    it decodes and adds in rank order, recompresses with its owner's residual
    and all-gathers, its fingerprint after it; every rank then judges every rank's
    fingerprint (:mod:`~gradcomp.collectives.agreement`) and decodes the gathered
    rows into place. A chunk decoded before the judgement holds quantized codes of an
    agreed size, which any bytes decode to without reading out of place.
    Collectives are issued asynchronously, so that one segment's exchange
    overlaps the next one's compression; the job pauses while the all-gathers
    are in flight. Blocks never straddle a chunk: the decoded values do not
    depend on the segments.
    """
    compressor, world, rank = job.compressor, q.world_size, q.rank
    align = getattr(compressor, "block", 1)

    def size(count: int) -> int:
        return buffer_size(compressor.payload_layout(count, flat.dtype, {})) if count else 0

    segments = []
    for start, end in two_phase_segments(flat.numel(), world, align, flat.device):
        chunk = chunk_length(end - start, world, align)
        own_start, own_end = chunk_bounds(end - start, world, align)[rank]
        sizes = [size(b - a) for a, b in chunk_bounds(end - start, world, align)]
        segments.append(_Segment(start, end, chunk, own_end - own_start, sizes))
    residual = job.residual(job.key, flat)
    owner_residual = job.residual(owner_key(job.key), flat[: sum(seg.owned for seg in segments)])
    # Phase 1: every chunk of a segment compressed into a row of its own; the
    # all-to-all gives rank j every rank's row j.
    exchanges = []
    for s, seg in enumerate(segments):
        sent = torch.empty(world, seg.sizes[0], dtype=torch.uint8, device=flat.device)  # alive until sent
        part, part_residual = (
            flat[seg.start : seg.end],
            None if residual is None else residual[seg.start : seg.end],
        )
        context = Context(part_residual, job.step, mix_seed(job.key, s, _SENDER), rank)
        encode = functools.partial(compressor.compress_rows, part, seg.chunk, sent, context)
        decode = functools.partial(_decoded_rows, compressor, sent, part, seg.chunk)
        measured(stats, job.measure_error, part, part_residual, encode, decode)
        received = torch.empty(world, seg.sizes[rank], dtype=torch.uint8, device=flat.device)
        splits = ([seg.sizes[rank]] * world, seg.sizes)
        with exchange():
            sent_off = dist.all_to_all_single(
                received.view(-1), sent.view(-1)[: sum(seg.sizes)], *splits, group=q.group, async_op=True
            )
        exchanges.append((sent_off, received, sent))
        stats.bytes_sent += sum(seg.sizes) - seg.sizes[rank]
    # Phase 2: the own chunk of every segment: every rank's payload decoded and
    # added, recompressed with the owner's residual, all-gathered.
    gathers, owned = [], 0
    header = 0 if job.agreement is None else HEADER_BYTES
    for s, (seg, (sent_off, received, _)) in enumerate(zip(segments, exchanges, strict=True)):
        with exchange():
            sent_off.wait()
        width = seg.sizes[0]
        own = torch.empty(1, width + header, dtype=torch.uint8, device=flat.device)
        if seg.sizes[rank] < width:
            own[:, :width].zero_()  # the all-gather sends the whole width
        if seg.owned:
            with Timer(stats):
                reduced = torch.empty(seg.owned, dtype=flat.dtype, device=flat.device)
                divisor = world if job.op == "avg" else 1
                compressor.decompress_sum(received, flat.dtype, reduced, divisor=divisor)
                own_residual = None if owner_residual is None else owner_residual[owned : owned + seg.owned]
                context = Context(own_residual, job.step, mix_seed(job.key, s, _OWNER), rank)
                with profiled(COMPRESS):
                    compressor.compress_rows(reduced, seg.chunk, own, context)
            owned += seg.owned
        if header:
            write_fingerprint(own[0, width:], job)
        gathered = torch.empty(world, width + header, dtype=torch.uint8, device=flat.device)
        with exchange():
            gathers.append((all_gather_async(gathered.view(-1), own.view(-1), q.group), gathered, own))
        stats.bytes_sent += (width + header) * (world - 1)
    yield  # every collective of this job is issued: the next job may start
    # Phase 3: every rank's chunk decoded into place, once every rank's fingerprint is
    # judged (each rank's all-gathered row carries it: every rank is an owner).
    for s, (seg, (gather, gathered, _)) in enumerate(zip(segments, gathers, strict=True)):
        with exchange():
            gather.wait()
        if header and s == 0:  # every segment's rows hold the same fingerprints
            check_fingerprints(q, job, gathered[:, seg.sizes[0] :], [later[0] for later in gathers[1:]])
        with Timer(stats):
            compressor.decompress_rows(gathered, flat.dtype, seg.chunk, flat[seg.start : seg.end])


class _Segment(typing.NamedTuple):
    """One segment of a two-phase all-reduce: its elements, the chunk length,
    how many this rank owns, and each chunk's payload size in bytes."""

    start: int
    end: int
    chunk: int
    owned: int
    sizes: list[int]


def _decoded_rows(compressor: Compressor, rows: torch.Tensor, like: torch.Tensor, chunk: int) -> torch.Tensor:
    decoded = torch.empty_like(like)
    compressor.decompress_rows(rows, like.dtype, chunk, decoded)
    return decoded
