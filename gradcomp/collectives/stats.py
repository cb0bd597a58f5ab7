"""What a compressed all-reduce cost, and how its time and error are measured.

The work is also marked for the PyTorch profiler: ranges ``gradcomp.compress``,
``gradcomp.exchange`` (issuing collectives and waiting on them) and
``gradcomp.decode`` (decoding, summing, re-selecting), inside one range per
job (``gradcomp.bucket <i>`` for a DDP bucket, ``gradcomp.all_reduce``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import torch

from gradcomp.collectives.job import Job
from gradcomp.compressors import Context
from gradcomp.payload import Payload


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
        bytes_sent_intra, bytes_sent_inter: of ``bytes_sent``, those that
            stay inside a node and those that cross between nodes; counted by
            the ``hierarchical`` algorithm (the flat ones do not know the
            nodes and leave both 0).
        inter_algorithm: the algorithm between nodes of a ``hierarchical`` one.
        compressor: the compressor the call used, in the planner's format
            (``"int8"``, ``"topk:ratio=0.05"``, ``"dense"``); with ``"auto"``,
            the one it chose.
        tensor: the reduced tensor itself. A ``torch.futures.Future`` made
            for a CUDA device orders its waiters' streams only after the
            tensors it finds in its value (c10's ``Future::markCompleted``
            records events for their devices alone): holding the tensor, a
            future of these statistics makes ``wait()`` and ``then()``
            callbacks run after the reduction, as torch's own ``Work``
            futures, which hold their output tensors, do.
    """

    bytes_sent: int = 0
    dense_bytes: int = 0
    compress_seconds: float = 0.0
    error_sq: float = math.nan
    input_sq: float = math.nan
    algorithm: str = ""
    bytes_sent_intra: int = 0
    bytes_sent_inter: int = 0
    inter_algorithm: str = ""
    compressor: str = ""
    tensor: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def ratio(self) -> float:
        """dense_bytes / bytes_sent (NaN when nothing is sent, e.g. one rank)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.nan

    @property
    def relative_error(self) -> float:
        return math.sqrt(self.error_sq / self.input_sq) if self.input_sq > 0 else 0.0


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world_size - 1) * nbytes // world_size


COMPRESS, EXCHANGE, DECODE = "gradcomp.compress", "gradcomp.exchange", "gradcomp.decode"


class Timer:
    """Adds the wall time of its ``with`` block to ``stats.compress_seconds``,
    and marks it as a profiler range named ``what``."""

    def __init__(self, stats: ReduceStats, what: str = DECODE):
        self.stats = stats
        self.range = profiled(what)

    def __enter__(self):
        self.range.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.stats.compress_seconds += time.perf_counter() - self.start
        self.range.__exit__(*exc)


def exchange():
    """A profiler range around issuing collectives or waiting on them."""
    return profiled(EXCHANGE)


def profiled(name: str):
    """A profiler range named ``name`` while a profile is being taken; nothing
    (no dispatch, no cost) otherwise."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NOTHING


_NOTHING = contextlib.nullcontext()


def measured(stats: ReduceStats, measure_error: bool, flat: torch.Tensor, residual, encode, decode):
    """``encode()`` of ``flat`` (with ``residual``), its time and, with
    ``measure_error``, its error added to ``stats``; ``decode()`` gives the
    decoded tensor, needed only to measure a compression without feedback."""
    with Timer(stats, COMPRESS):
        reference_sq = square_sum(flat, residual) if measure_error and residual is not None else None
        encoded = encode()
        if measure_error:
            if residual is not None:
                error_sq = square_sum(residual)
            else:
                error_sq, reference_sq = square_sum(decode(), flat, subtract=True), square_sum(flat)
            stats.error_sq = (0.0 if math.isnan(stats.error_sq) else stats.error_sq) + error_sq
            stats.input_sq = (0.0 if math.isnan(stats.input_sq) else stats.input_sq) + reference_sq
    return encoded


def compress_measured(job: Job, flat: torch.Tensor, residual, rank: int, stats: ReduceStats) -> Payload:
    """The payload of ``flat`` (with ``residual``), time and error added to ``stats``."""
    compressor, context = job.compressor, Context(residual, job.step, job.key, rank)
    holder = []

    def encode():
        holder.append(compressor.compress(flat, context))
        return holder[0]

    def decode():
        return compressor.decompress(holder[0])

    return measured(stats, job.measure_error, flat, residual, encode, decode)


# Error measurement reads its operands a slice at a time: no tensor-sized temporaries.
MEASURE_SLICE = 2**20


def square_sum(a: torch.Tensor, b: torch.Tensor | None = None, subtract: bool = False) -> float:
    """``||a + b||^2`` (or ``||a - b||^2``) in fp32, summed in fp64."""
    a, b = a.reshape(-1), None if b is None else b.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, a.numel(), MEASURE_SLICE):
        part = a[start : start + MEASURE_SLICE].float()
        if b is not None:
            other = b[start : start + MEASURE_SLICE].float()
            part = part - other if subtract else part + other
        total += torch.dot(part, part)
    return float(total)
