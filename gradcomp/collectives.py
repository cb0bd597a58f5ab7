"""Compressed all-reduce over torch.distributed.

``all_reduce(tensor, compressor)`` mirrors ``torch.distributed.all_reduce``:
in place, ``op`` "avg" or "sum", ``async_op`` returning a handle. The
algorithm follows from the compressor's facts (DESIGN.md):

* ``dense``: all-reduce the payload itself (summable compressors);
* ``allgather``: gather every rank's payload, decode and add;
* ``two_phase``: all-to-all of compressed chunks (reduce-scatter), decode and
  sum the own chunk, recompress it with its own residual, all-gather.

Ordering. Every collective of gradcomp on a process group runs on one worker
thread per group, in submission order, over a private clone of the group.
Callers (DDP bucket hooks, user code) submit in the same order on every rank,
so the collectives match across ranks even though the multi-step algorithms
issue their later steps after earlier ones finish. A ``Future.then`` chain
cannot promise that: callbacks run in completion order, which differs
between ranks. The clone keeps these collectives apart from whatever the
caller's thread issues on the group meanwhile.

Overlap. An all-gather job pauses once its last collective is issued: if
the next job is already queued and writes into other storage, the worker
starts it (compressing it overlaps the transfer) and then finishes the
paused one. Collectives are still issued, and futures completed, in
submission order; a job with nothing queued behind it finishes at once.

Agreement. The first time a (compressor settings, numel, dtype, algorithm,
op) combination meets a group, the ranks compare fingerprints; a rank with
different settings makes every rank raise ``ValueError`` instead of hanging
or decoding garbage.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import datetime
import functools
import inspect
import logging
import math
import queue
import threading
import time
import typing
import zlib
from collections.abc import Callable, Generator, Hashable

import torch
import torch.distributed as dist

from gradcomp import ops, streams
from gradcomp.compressors import Compressor, Context, get_compressor, mix_seed
from gradcomp.compressors.base import check_tensor
from gradcomp.feedback import ErrorFeedback
from gradcomp.payload import Payload, buffer_size

logger = logging.getLogger(__name__)

ALGORITHMS = ("dense", "allgather", "two_phase")
_OPS = {"avg": "avg", "mean": "avg", "sum": "sum"}


# ----------------------------------------------------------------------------- results


@dataclasses.dataclass
class ReduceStats:
    """What one compressed all-reduce cost and how exact it was (this rank).

    Bytes are counted as nccl-tests counts bus bandwidth: what this rank
    sends under the bandwidth-optimal (ring) schedule of each collective,
    from the payload buffers' real sizes. A ring all-reduce of ``n`` bytes
    sends ``2 (W-1)/W n``, an all-gather of ``n`` bytes per rank ``(W-1) n``,
    an all-to-all the chunks meant for other ranks.

    Attributes:
        bytes_sent: bytes this rank sends.
        dense_bytes: bytes it would send in a dense ring all-reduce of the
            tensor (``2 (W-1)/W * numel * itemsize``).
        compress_seconds: wall time spent compressing and decoding.
        error_sq, input_sq: squared norms of (decoded - input) and of the
            input (input + residual), summed; NaN when not measured.
        algorithm: the algorithm that ran.
    """

    bytes_sent: int = 0
    dense_bytes: int = 0
    compress_seconds: float = 0.0
    error_sq: float = math.nan
    input_sq: float = math.nan
    algorithm: str = ""

    @property
    def ratio(self) -> float:
        """dense_bytes / bytes_sent (NaN when nothing is sent, e.g. one rank)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.nan

    @property
    def relative_error(self) -> float:
        return math.sqrt(self.error_sq / self.input_sq) if self.input_sq > 0 else 0.0


class Work:
    """Handle of an asynchronous :func:`all_reduce`, like ``dist.Work``."""

    __slots__ = ("_future",)

    def __init__(self, future: torch.futures.Future):
        self._future = future

    def wait(self) -> bool:
        """Block until done; re-raises the collective's error."""
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        """Future holding the :class:`ReduceStats` of the call."""
        return self._future


# ----------------------------------------------------------------------------- ordered queue


class CollectiveQueue:
    """One worker thread that runs a group's gradcomp collectives in FIFO order.

    ``submit(fn)`` returns a Future set to ``fn()``'s result (or its error);
    when ``fn()`` returns a generator (:func:`job_steps`), to the generator's
    return value, and the worker may overlap it with the next job where it
    yields. CUDA work runs on the worker's own stream, after the work the
    submitting stream had queued (:mod:`gradcomp.streams`).

    After a job fails, every later job fails at once without touching the
    network: the ranks may no longer agree on what comes next, and a rank
    that goes on issuing collectives would hang its peers (or race a
    ``destroy_process_group`` after the error). This includes a job that had
    started while the failed one was paused: whether it had started depends
    on timing, which differs between ranks, so every rank fails it alike.
    :func:`release_queues` starts afresh.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = clone_group(group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.verified: set[tuple] = set()
        self.failure: BaseException | None = None
        self.streams = streams.WorkerStreams()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="gradcomp-collectives", daemon=True)
        self._thread.start()

    def submit(
        self, fn: Callable[[], object], device: torch.device, writes: torch.Tensor | None = None
    ) -> torch.futures.Future:
        """Queue ``fn``; ``writes``: the caller's tensor it writes its result into, if any.

        A job starts while the one before is paused only if their ``writes``
        share no storage: it must see the result of the one before it.
        """
        future = streams.new_future(device)
        self._jobs.put(_Started(fn, future, device, streams.submitted(device), writes))
        return future

    def close(self) -> None:
        """Stop the worker after the jobs already submitted."""
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        paused = None  # a started job waiting on its exchange
        while True:
            if paused is not None and self._jobs.empty():
                self._finish(paused)  # nothing to overlap it with
                paused = None
            job = self._jobs.get()
            if job is None:
                if paused is not None:
                    self._finish(paused)
                return
            if paused is not None and _may_share(paused.writes, job.writes):
                self._finish(paused)  # the next job reads what this one writes
                paused = None
            self._start(job)
            if paused is not None:
                self._finish(paused)
            if job.steps is None:
                self._finish(job)  # after the one before: futures complete in order
                paused = None
            else:
                paused = job

    def _earlier_failure(self) -> RuntimeError:
        return RuntimeError(
            f"an earlier gradcomp collective on this group failed ({self.failure!r}); "
            "call gradcomp.collectives.release_queues() on every rank to start afresh"
        )

    def _start(self, job: _Started) -> None:
        """Run ``job`` up to its pause or to its end."""
        if self.failure is not None:
            job.error = self._earlier_failure()
            return
        try:
            with self.streams.running(job.device, job.ready, job.writes):
                result = job.fn()
                if inspect.isgenerator(result):
                    try:
                        next(result)
                    except StopIteration as done:
                        result = done.value
                    else:
                        job.steps = result
        except BaseException as error:  # noqa: BLE001 - handed to the waiter
            self.failure = job.error = error
        else:
            job.result = result

    def _finish(self, job: _Started) -> None:
        """Run a paused job to its end; complete its future."""
        if job.error is None and self.failure is not None:
            # It started while the failed job was paused, a timing that differs
            # between ranks: fail it as every rank fails the jobs behind a failure.
            job.error = self._earlier_failure()
        elif job.steps is not None:
            try:
                with self.streams.running(job.device):
                    job.result = drive(job.steps)
            except BaseException as error:  # noqa: BLE001 - handed to the waiter
                self.failure = job.error = error
        job.steps = None
        if job.error is not None:
            job.future.set_exception(job.error)
            return
        with self.streams.running(job.device):
            job.future.set_result(job.result)


@dataclasses.dataclass
class _Started:
    """A submitted job; once started, run up to its pause (``steps`` to resume) or to its end."""

    fn: Callable[[], object]
    future: torch.futures.Future
    device: torch.device
    ready: object  # the submitting stream's event (None on CPU)
    writes: torch.Tensor | None
    steps: Generator | None = None
    result: object = None
    error: BaseException | None = None


def _may_share(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two jobs' outputs may overlap (unknown counts as yes)."""
    if a is None or b is None:
        return True
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def clone_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A private group of ``group``'s ranks with its backends, timeout and options.

    Created by the group's ranks only (``use_local_synchronization``). With a
    device-bound default group (``init_process_group(device_id=...)``),
    torch would create it by splitting the default group's communicator, a
    collective over every rank of the job, which the ranks outside ``group``
    never join: for a group smaller than the job the binding is lifted for
    the call, and the clone connects on its own, among its ranks.
    """
    ranks = dist.get_process_group_ranks(group)
    options = {"timeout": group_timeout(group), "backend": dist.get_backend_config(group)}
    nccl = _backend_of(group, "cuda")
    if nccl is not None and type(nccl).__name__ == "ProcessGroupNCCL":
        options["pg_options"] = copy.deepcopy(nccl.options)
    default = dist.distributed_c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    if bound is None or len(ranks) == dist.get_world_size():
        return dist.new_group(ranks=ranks, use_local_synchronization=True, **options)
    default.bound_device_id = None
    try:
        return dist.new_group(ranks=ranks, use_local_synchronization=True, **options)
    finally:
        default.bound_device_id = bound


def _backend_of(group: dist.ProcessGroup, device_type: str):
    """``group``'s backend object for ``device_type``, or None."""
    try:
        return group._get_backend(torch.device(device_type))
    except (RuntimeError, ValueError):
        return None


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``group`` was created with (None where torch does not say:
    the clone then gets torch's default)."""
    for device_type in ("cuda", "cpu"):
        options = getattr(_backend_of(group, device_type), "options", None)
        timeout = getattr(options, "_timeout", None)
        if timeout is not None:
            return timeout
    logger.warning("gradcomp: cannot read the timeout of process group %s; its clone gets the default", group)
    return None


def drive(steps: Generator):
    """Run a job's steps to the end, without pausing; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


_QUEUES: dict[object, CollectiveQueue] = {}
_QUEUES_LOCK = threading.Lock()


def release_queues() -> None:
    """Drop every collective queue (and its cloned group), after their pending jobs.

    Runs at interpreter exit: a cloned Gloo group still alive when the
    interpreter tears down after ``destroy_process_group`` aborts the process.
    Call it yourself (on every rank) before re-initializing torch.distributed
    in one process, or to go on after a failed gradcomp collective.
    """
    with _QUEUES_LOCK:
        queues = list(_QUEUES.values())
        _QUEUES.clear()
    for q in queues:
        q.close()


atexit.register(release_queues)


def queue_for(group: dist.ProcessGroup | None) -> CollectiveQueue:
    """The collective queue of ``group`` (WORLD when None), created on first use.

    Creating it is a collective: every rank of the group must reach the first
    gradcomp collective on it, as with any collective.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first")
    group = group or dist.group.WORLD
    with _QUEUES_LOCK:
        existing = _QUEUES.get(group)
        if existing is None:
            existing = _QUEUES[group] = CollectiveQueue(group)
        return existing


# ----------------------------------------------------------------------------- helpers


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world_size - 1) * nbytes // world_size


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    _all_gather_async(output, tensor, group).wait()


def _all_gather_async(output: torch.Tensor, tensor: torch.Tensor, group):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=True)


def resolve_op(op) -> str:
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    if isinstance(op, str) and op.lower() in _OPS:
        return _OPS[op.lower()]
    raise ValueError(f"op must be 'avg' or 'sum' (or dist.ReduceOp.AVG / SUM), got {op!r}")


def default_algorithm(compressor: Compressor) -> str:
    """``dense`` for summable payloads, ``allgather`` for sparse ones, ``two_phase`` otherwise."""
    if compressor.summable:
        return "dense"
    if compressor.sparse:
        return "allgather"
    return "two_phase"


def check_algorithm(compressor: Compressor, algorithm: str | None) -> str:
    algorithm = algorithm or default_algorithm(compressor)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "dense" and not compressor.summable:
        raise ValueError(f"algorithm 'dense' needs a summable compressor; {compressor.name!r} is not")
    if algorithm == "two_phase" and compressor.sparse:
        raise ValueError(
            f"algorithm 'two_phase' needs a dense payload (quantizers, sign, casts); "
            f"{compressor.name!r} is sparse: use 'allgather'{' or dense' if compressor.summable else ''}"
        )
    return algorithm


def key_of(name: Hashable) -> int:
    """A stable integer for a residual/random-stream name (same on every rank)."""
    if isinstance(name, int):
        return name
    return zlib.crc32(repr(name).encode())


def chunk_length(numel: int, parts: int, align: int) -> int:
    """The length of :func:`chunk_bounds`' ranges (but the last non-empty one)."""
    return math.ceil(math.ceil(numel / align) / parts) * align


def chunk_bounds(numel: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``numel``, each ``chunk_length`` long
    (a multiple of ``align``) except the last non-empty one; trailing ranges may be empty."""
    chunk = chunk_length(numel, parts, align)
    return [(min(j * chunk, numel), min((j + 1) * chunk, numel)) for j in range(parts)]


def settings_key(compressor: Compressor) -> str:
    """The compressor's settings as one stable string (equal settings, equal key)."""
    return repr(sorted(compressor.settings().items()))


def _fingerprint(compressor: Compressor, tensor: torch.Tensor, algorithm: str, op: str) -> tuple:
    return (settings_key(compressor), tensor.numel(), str(tensor.dtype), algorithm, op)


def verify_agreement(q: CollectiveQueue, fingerprint: tuple, device: torch.device) -> None:
    """Raise ValueError on every rank if ranks disagree on ``fingerprint``.

    The check travels on ``device`` (NCCL groups take CUDA tensors only).
    """
    if q.world_size == 1 or fingerprint in q.verified:
        return
    digest = zlib.crc32(repr(fingerprint).encode())
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = torch.empty(q.world_size, dtype=torch.int64, device=device)
    _all_gather(everyone, mine, q.group)
    if bool((everyone != digest).any()):
        described = [None] * q.world_size
        dist.all_gather_object(described, fingerprint, group=q.group)
        lines = "\n".join(
            f"  rank {r}: compressor {d[0]}, numel {d[1]}, dtype {d[2]}, algorithm {d[3]}, op {d[4]}"
            for r, d in enumerate(described)
        )
        raise ValueError(f"ranks disagree on the compressed all-reduce settings:\n{lines}")
    q.verified.add(fingerprint)


# ----------------------------------------------------------------------------- algorithms


@dataclasses.dataclass
class Job:
    """One compressed all-reduce, fully described (run by :func:`run_job`)."""

    tensor: torch.Tensor
    compressor: Compressor
    op: str
    algorithm: str
    memory: ErrorFeedback | None
    key: int
    step: int
    measure_error: bool = False


class _Timer:
    def __init__(self, stats: ReduceStats):
        self.stats = stats

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.stats.compress_seconds += time.perf_counter() - self.start


def _measured(job: Job, stats: ReduceStats, flat: torch.Tensor, residual, encode, decode):
    """``encode()`` of ``flat`` (with ``residual``), its time and, with
    ``measure_error``, its error added to ``stats``; ``decode()`` gives the
    decoded tensor, needed only to measure a compression without feedback."""
    with _Timer(stats):
        reference_sq = _square_sum(flat, residual) if job.measure_error and residual is not None else None
        encoded = encode()
        if job.measure_error:
            if residual is not None:
                error_sq = _square_sum(residual)
            else:
                error_sq, reference_sq = _square_sum(decode(), flat, subtract=True), _square_sum(flat)
            stats.error_sq = (0.0 if math.isnan(stats.error_sq) else stats.error_sq) + error_sq
            stats.input_sq = (0.0 if math.isnan(stats.input_sq) else stats.input_sq) + reference_sq
    return encoded


def _compress_measured(job: Job, flat: torch.Tensor, residual, rank: int, stats: ReduceStats) -> Payload:
    """The payload of ``flat`` (with ``residual``), time and error added to ``stats``."""
    compressor, context = job.compressor, Context(residual, job.step, job.key, rank)
    holder = []

    def encode():
        holder.append(compressor.compress(flat, context))
        return holder[0]

    return _measured(job, stats, flat, residual, encode, lambda: compressor.decompress(holder[0]))


# Error measurement reads its operands a slice at a time: no tensor-sized temporaries.
_MEASURE_SLICE = 2**20


def _square_sum(a: torch.Tensor, b: torch.Tensor | None = None, subtract: bool = False) -> float:
    """``||a + b||^2`` (or ``||a - b||^2``) in fp32, summed in fp64."""
    a, b = a.reshape(-1), None if b is None else b.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, a.numel(), _MEASURE_SLICE):
        part = a[start : start + _MEASURE_SLICE].float()
        if b is not None:
            other = b[start : start + _MEASURE_SLICE].float()
            part = part - other if subtract else part + other
        total += torch.dot(part, part)
    return float(total)


def _residual(job: Job, name: Hashable, like: torch.Tensor) -> torch.Tensor | None:
    if job.memory is None or not job.compressor.needs_feedback:
        return None
    return job.memory.residual(name, like)


def run_job(job: Job, q: CollectiveQueue) -> ReduceStats:
    """Run ``job`` on ``q``'s group, blocking; called on the queue's worker thread."""
    return drive(job_steps(job, q))


def job_steps(job: Job, q: CollectiveQueue) -> Generator[None, None, ReduceStats]:
    """:func:`run_job` as steps: pauses (yields) at most once, while an exchange
    is in flight, so that the worker can start the next job meanwhile.

    A job pauses only after issuing its last collective: whether the next job
    starts before it finishes depends on timing that differs between ranks,
    and collectives must still be issued in the same order on every rank."""
    tensor = job.tensor
    dense = ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), q.world_size)
    stats = ReduceStats(dense_bytes=dense, algorithm=job.algorithm)
    if tensor.numel() == 0:
        return stats
    verify_agreement(q, _fingerprint(job.compressor, tensor, job.algorithm, job.op), tensor.device)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = work.view(-1)
    if q.world_size == 1:
        _local(job, flat, stats)
    elif job.algorithm == "dense":
        _dense(job, flat, q, stats)
    elif job.algorithm == "allgather":
        yield from _allgather(job, flat, q, stats)
    else:
        _two_phase(job, flat, q, stats)
    if work is not tensor:
        tensor.copy_(work)
    return stats


def _local(job: Job, flat: torch.Tensor, stats: ReduceStats) -> None:
    payload = _compress_measured(job, flat, _residual(job, job.key, flat), 0, stats)
    with _Timer(stats):
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
    residual = _residual(job, job.key, flat)
    first = 1 if at_decode else divide
    if first > 1:
        flat.div_(first)
        if residual is not None:
            residual.div_(first)
    payload = _compress_measured(job, flat, residual, q.rank, stats)
    if residual is not None and first > 1:
        residual.mul_(first)
    for wire in payload.tensors.values():
        dist.all_reduce(wire, group=q.group)
        stats.bytes_sent += ring_all_reduce_bytes(wire.numel() * wire.element_size(), q.world_size)
    with _Timer(stats):
        job.compressor.decompress(payload, out=flat, divisor=divide if at_decode else 1)


def _allgather(job: Job, flat: torch.Tensor, q: CollectiveQueue, stats: ReduceStats) -> Generator:
    """Gather every rank's payload of the whole tensor, decode and add them in
    rank order (every rank gets the same bits)."""
    payload = _compress_measured(job, flat, _residual(job, job.key, flat), q.rank, stats)
    # Every payload's size follows from numel, dtype and settings: no size exchange.
    width = buffer_size(payload.layout())
    gathered = torch.empty(q.world_size, width, dtype=torch.uint8, device=flat.device)
    exchange = _all_gather_async(gathered.view(-1), payload.to_buffer(width), q.group)
    stats.bytes_sent += width * (q.world_size - 1)
    yield  # every collective of this job is issued: the next job may start
    exchange.wait()
    with _Timer(stats):
        divisor = q.world_size if job.op == "avg" else 1
        job.compressor.decompress_sum(gathered, flat.dtype, flat, meta=payload.meta, divisor=divisor)


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


def two_phase_segments(
    numel: int, world_size: int, align: int, device: torch.device
) -> list[tuple[int, int]]:
    """The segments of a two-phase all-reduce: whole multiples of ``world_size * align``
    elements but the last."""
    parts = 1 if device.type != "cpu" else max(1, min(MAX_SEGMENTS, numel // (world_size * SEGMENT_ELEMENTS)))
    return [(start, end) for start, end in chunk_bounds(numel, parts, world_size * align) if end > start]


def _two_phase(job: Job, flat: torch.Tensor, q: CollectiveQueue, stats: ReduceStats) -> None:
    """Reduce-scatter of compressed chunks, decode, recompress, all-gather.

    Each segment (:func:`two_phase_segments`) is cut into ``world_size``
    block-aligned chunks (:func:`chunk_bounds`); rank ``j`` owns chunk ``j``
    of every segment and keeps the owner's residual of what it owns. The
    payloads of a segment travel as rows of one buffer (one payload a chunk):
    an all-to-all gives each rank every rank's payload of its chunk, which
    it decodes and adds in rank order, recompresses with its owner's residual
    and all-gathers; every rank then decodes the gathered rows into place.
    Collectives are issued asynchronously, so that one segment's exchange
    overlaps the next one's compression. Blocks never straddle a chunk: the
    decoded values do not depend on the segments.
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
    residual = _residual(job, job.key, flat)
    owner_residual = _residual(job, ("two_phase", job.key), flat[: sum(seg.owned for seg in segments)])
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
        _measured(job, stats, part, part_residual, encode, decode)
        received = torch.empty(world, seg.sizes[rank], dtype=torch.uint8, device=flat.device)
        splits = ([seg.sizes[rank]] * world, seg.sizes)
        exchange = dist.all_to_all_single(
            received.view(-1), sent.view(-1)[: sum(seg.sizes)], *splits, group=q.group, async_op=True
        )
        exchanges.append((exchange, received, sent))
        stats.bytes_sent += sum(seg.sizes) - seg.sizes[rank]
    # Phase 2: the own chunk of every segment: every rank's payload decoded and
    # added, recompressed with the owner's residual, all-gathered.
    gathers, owned = [], 0
    for s, (seg, (exchange, received, _)) in enumerate(zip(segments, exchanges, strict=True)):
        exchange.wait()
        width = seg.sizes[0]
        own = torch.empty(1, width, dtype=torch.uint8, device=flat.device)
        if seg.sizes[rank] < width:
            own.zero_()  # the all-gather sends the whole width
        if seg.owned:
            with _Timer(stats):
                reduced = torch.empty(seg.owned, dtype=flat.dtype, device=flat.device)
                divisor = world if job.op == "avg" else 1
                compressor.decompress_sum(received, flat.dtype, reduced, divisor=divisor)
                own_residual = None if owner_residual is None else owner_residual[owned : owned + seg.owned]
                context = Context(own_residual, job.step, mix_seed(job.key, s, _OWNER), rank)
                compressor.compress_rows(reduced, seg.chunk, own, context)
            owned += seg.owned
        gathered = torch.empty(world, width, dtype=torch.uint8, device=flat.device)
        gathers.append((_all_gather_async(gathered.view(-1), own.view(-1), q.group), gathered, own))
        stats.bytes_sent += width * (world - 1)
    # Phase 3: every rank's chunk decoded into place.
    for seg, (gather, gathered, _) in zip(segments, gathers, strict=True):
        gather.wait()
        with _Timer(stats):
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


# ----------------------------------------------------------------------------- public API

# Residuals and call counters of all_reduce calls that pass no ErrorFeedback,
# per compressor settings: a compressor given by name is a new object on every
# call, but the same settings must find the same residuals (and not pile up).
_DEFAULT_MEMORY: dict[str, tuple[ErrorFeedback, dict]] = {}


def _default_memory(compressor: Compressor) -> tuple[ErrorFeedback, dict]:
    key = settings_key(compressor)
    entry = _DEFAULT_MEMORY.get(key)
    if entry is None:
        entry = _DEFAULT_MEMORY[key] = (ErrorFeedback(), {})
    return entry


def all_reduce(
    tensor: torch.Tensor,
    compressor: Compressor | str,
    group: dist.ProcessGroup | None = None,
    op="avg",
    async_op: bool = False,
    *,
    algorithm: str | None = None,
    feedback: ErrorFeedback | bool | None = None,
    name: Hashable | None = None,
    step: int | None = None,
    measure_error: bool = False,
):
    """Compressed, in-place all-reduce of ``tensor`` across ``group``.

    Args:
        tensor: floating tensor (fp32, fp16, bf16, fp64), same shape on every rank.
        compressor: a :class:`Compressor` or a name for :func:`get_compressor`.
        group: process group (default WORLD).
        op: ``"avg"`` (default, what gradients need) or ``"sum"``.
        async_op: return a :class:`Work` at once instead of waiting.
        algorithm: ``"dense"``, ``"allgather"`` or ``"two_phase"``; default
            from the compressor (:func:`default_algorithm`).
        feedback: an :class:`ErrorFeedback` to keep residuals in, ``False``
            for none, or None for the compressor's default (a memory kept per
            compressor object).
        name: residual and random-stream key; give distinct names to distinct
            tensors of one shape (default: the tensor's shape and dtype).
        step: step number for random streams (default: a per-name call counter).
        measure_error: fill ``error_sq`` / ``input_sq`` of the stats. Off by
            default: it reads the tensor and the residual once more (or
            decodes once more, without feedback) and waits for the result.

    Returns:
        ``ReduceStats`` if ``async_op`` is False, else a :class:`Work` whose
        future holds them.

    Example:
        >>> c = gradcomp.get_compressor("int8")
        >>> for p in model.parameters():
        ...     gradcomp.all_reduce(p.grad, c, name=p_name)
    """
    compressor = get_compressor(compressor)
    check_tensor(tensor)
    ops.check_forced_backend()
    op = resolve_op(op)
    algorithm = check_algorithm(compressor, algorithm)
    memory, counters = _default_memory(compressor)
    if feedback is False:
        memory = None
    elif isinstance(feedback, ErrorFeedback):
        memory = feedback
    elif feedback not in (None, True):
        raise TypeError(f"feedback must be an ErrorFeedback, True, False or None, got {feedback!r}")
    name = (tuple(tensor.shape), str(tensor.dtype)) if name is None else name
    if step is None:
        step = counters.get(name, 0)
        counters[name] = step + 1
    q = queue_for(group)
    job = Job(tensor, compressor, op, algorithm, memory, key_of(name), step, measure_error)
    future = q.submit(lambda: job_steps(job, q), tensor.device, writes=tensor)
    if async_op:
        return Work(future)
    return future.wait()
