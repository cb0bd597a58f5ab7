"""What each step cost: :class:`StepStats`, summed over its buckets as the worker finishes them."""

from __future__ import annotations

import dataclasses
import math

from gradcomp.collectives import ReduceStats


@dataclasses.dataclass
class StepStats:
    """Per-step statistics of one rank, summed over the step's buckets.

    Attributes:
        step: hook step (one per synchronised backward pass).
        bytes_sent: bytes this rank sent (ring model, see ``ReduceStats``).
        bytes_sent_intra, bytes_sent_inter: of those, the bytes inside a node
            and between nodes (``hierarchical`` only; 0 for the flat algorithms).
        dense_bytes: bytes a dense ring all-reduce of the same buckets sends.
        compress_seconds: wall time compressing and decoding.
        relative_error: ``||decoded - input|| / ||input||`` of this rank's own
            compression over the compressed buckets (NaN when not measured,
            0 for a fully dense step).
        buckets, compressed_buckets: buckets seen, and how many were compressed.
        compressors: bucket index -> the compressor and algorithm it went
            through (``"int4 two_phase"``, ``"int8 hierarchical(allgather)"``;
            ``"none dense"`` when dense).
    """

    step: int
    bytes_sent: int = 0
    dense_bytes: int = 0
    compress_seconds: float = 0.0
    relative_error: float = math.nan
    bytes_sent_intra: int = 0
    bytes_sent_inter: int = 0
    buckets: int = 0
    compressed_buckets: int = 0
    compressors: dict = dataclasses.field(default_factory=dict)
    _error_sq: float = dataclasses.field(default=0.0, repr=False)
    _input_sq: float = dataclasses.field(default=0.0, repr=False)

    @property
    def ratio(self) -> float:
        """Compression ratio: dense bytes / bytes sent (NaN on a single rank)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.nan

    def add(self, reduced: ReduceStats, compressed: bool) -> None:
        self.bytes_sent += reduced.bytes_sent
        self.bytes_sent_intra += reduced.bytes_sent_intra
        self.bytes_sent_inter += reduced.bytes_sent_inter
        self.dense_bytes += reduced.dense_bytes
        self.compress_seconds += reduced.compress_seconds
        self.buckets += 1
        self.compressed_buckets += int(compressed)
        if compressed and not math.isnan(reduced.error_sq):
            self._error_sq += reduced.error_sq
            self._input_sq += reduced.input_sq
            self.relative_error = math.sqrt(self._error_sq / self._input_sq) if self._input_sq > 0 else 0.0
        elif self.compressed_buckets == 0:
            self.relative_error = 0.0


class StepLedger:
    """The steps' statistics as the worker finishes their buckets (on the worker's thread).

    Jobs start in submission order but may finish out of it (a dense bucket can
    finish while an earlier one waits on its exchange): a step's statistics close
    when as many buckets finished as had started by its last.
    """

    def __init__(self, history: int):
        self.history = history
        self.closed: list[StepStats] = []  # oldest first, at most ``history``
        self._open: dict[int, StepStats] = {}
        self._started: dict[int, list] = {}  # step -> [buckets started, buckets in the step once known]

    def start(self, step: int, last: bool) -> list:
        """A bucket of ``step`` starts (``last``: the step's last); the token :meth:`finish` takes."""
        started = self._started.setdefault(step, [0, None])
        started[0] += 1
        if last:
            started[1] = started[0]
        return started

    def finish(self, step: int, index: int, reduced: ReduceStats, how: str, started: list) -> None:
        """Bucket ``index`` of ``step`` is done: ``reduced`` went through ``how`` (``"int8 two_phase"``)."""
        current = self._open.setdefault(step, StepStats(step))
        current.add(reduced, compressed=not how.startswith("none "))
        current.compressors[index] = how
        if current.buckets == started[1]:
            del self._started[step]
            self.closed.append(self._open.pop(step))
            del self.closed[: max(0, len(self.closed) - self.history)]
