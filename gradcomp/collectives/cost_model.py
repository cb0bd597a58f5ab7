"""The cost model: bytes per rank and predicted time of each algorithm at any world size.

:func:`bytes_sent` gives, without running anything, the bytes one rank
sends in a compressed all-reduce (what :class:`ReduceStats.bytes_sent`
counts, from the same payload layouts and fingerprint headers: the tests
compare them), for one
segment: what a GPU tensor takes. Long CPU tensors (2 W 2**20 elements or
more) go as segments, each padded on its own: a few bytes more.
:func:`predicted_seconds` adds a latency per step of each collective's
ring schedule (alpha-beta): an all-reduce takes ``2 (W-1)`` steps, an
all-gather and an all-to-all ``W-1`` each.
"""

from __future__ import annotations

import dataclasses

import torch

from gradcomp.collectives.agreement import HEADER_BYTES, lane_count
from gradcomp.collectives.policy import ALGORITHMS, check_algorithm, default_algorithm
from gradcomp.collectives.sparse_two_phase import sparse_two_phase_sizes
from gradcomp.collectives.stats import ring_all_reduce_bytes
from gradcomp.collectives.two_phase import chunk_bounds
from gradcomp.compressors import Compressor, get_compressor
from gradcomp.compressors.base import resolve_k
from gradcomp.compressors.low_rank import work_dtype
from gradcomp.payload import buffer_size


@dataclasses.dataclass(frozen=True)
class Link:
    """A link of ``bandwidth`` bytes per second (what one rank can send) and
    ``latency`` seconds per step of a collective; ``cpu_seconds_per_byte``: the
    CPU time the transport takes on the sending rank's host for each byte it
    sends (0: none, as on a GPU's collectives, or not measured). On a CPU
    machine that time is spent on the cores the codecs and the backward
    pass run on: none of it overlaps them, whatever the wire's speed."""

    bandwidth: float
    latency: float
    cpu_seconds_per_byte: float = 0.0


@dataclasses.dataclass(frozen=True)
class Cost:
    """What one compressed all-reduce sends, in how many collective steps; ``phases``:
    the same per collective, ``(name, bytes, steps)`` with name ``"all_reduce"``,
    ``"all_gather"`` or ``"all_to_all"``."""

    bytes_sent: int
    steps: int
    phases: tuple = ()

    def seconds(self, link: Link, links: dict | None = None) -> float:
        """On ``link``; each phase on its collective's own link in ``links``, where it has one."""
        if not links:
            return self.steps * link.latency + self.bytes_sent / link.bandwidth
        total = 0.0
        for name, nbytes, steps in self.phases:
            on = links.get(name, link)
            total += steps * on.latency + nbytes / on.bandwidth
        return total

    def cpu_seconds(self, link: Link, links: dict | None = None) -> float:
        """Of :meth:`seconds`, the transport's CPU time on the host (at most each phase's time)."""
        phases = self.phases if links else (("", self.bytes_sent, self.steps),)
        total = 0.0
        for name, nbytes, steps in phases:
            on = (links or {}).get(name, link)
            whole = steps * on.latency + nbytes / on.bandwidth
            total += min(nbytes * on.cpu_seconds_per_byte, whole)
        return total


def cost(
    compressor: Compressor | str,
    numel: int,
    world_size: int,
    algorithm: str | None = None,
    dtype: torch.dtype = torch.float32,
    shapes=None,
) -> Cost:
    """The :class:`Cost` of an all-reduce of ``numel`` elements over ``world_size``
    ranks; ``shapes``: of the tensors laid end to end in them, for a low-rank
    compressor (default: one vector)."""
    compressor = get_compressor(compressor)
    algorithm = check_algorithm(compressor, algorithm, world_size)
    world = world_size
    if world == 1 or numel == 0:
        return Cost(0, 0)
    if compressor.low_rank:  # P with the dense tensors and the fingerprint's lanes, then Q
        fact = compressor.factorization(shapes or ((numel,),))
        wire = work_dtype(dtype)
        first = fact.p_numel + fact.dense_numel + lane_count(wire, world)
        sizes = [n * wire.itemsize for n in (first, fact.q_numel) if n]
        return _phases(*(("all_reduce", ring_all_reduce_bytes(n, world), 2 * (world - 1)) for n in sizes))
    if algorithm == "dense":  # the payload and the fingerprint's lanes: after it, or apart
        (values,) = compressor.compress(torch.zeros(numel, dtype=dtype)).tensors.values()
        lanes = lane_count(values.dtype, world)
        alone = values.numel() == numel and values.dtype == dtype  # collectives.dense._wires
        sizes = [values.numel(), lanes] if alone else [values.numel() + lanes]
        sizes = [n * values.element_size() for n in sizes]
        return _phases(*(("all_reduce", ring_all_reduce_bytes(n, world), 2 * (world - 1)) for n in sizes))
    if algorithm == "allgather":
        width = buffer_size(compressor.compress(torch.zeros(numel, dtype=dtype)).layout()) + HEADER_BYTES
        return _phases(("all_gather", width * (world - 1), world - 1))
    if compressor.sparse:
        k = resolve_k(numel, compressor.ratio, compressor.k)
        chunk, capacity, kept = sparse_two_phase_sizes(numel, k, world)
        index = torch.int32 if chunk < 2**31 else torch.int64
        rows = buffer_size([("indices", index, capacity), ("values", dtype, capacity)]) + HEADER_BYTES
        keep = buffer_size([("indices", index, kept), ("values", dtype, kept)])
        return _phases(
            ("all_to_all", rows * (world - 1), world - 1), ("all_gather", keep * (world - 1), world - 1)
        )
    # Rank 0's bytes: the chunks it sends to the others, then its own, gathered with its
    # fingerprint.
    align = getattr(compressor, "block", 1)
    sizes = [
        buffer_size(compressor.payload_layout(end - start, dtype, {}))
        for start, end in chunk_bounds(numel, world, align)
        if end > start
    ]
    return _phases(
        ("all_to_all", sum(sizes) - sizes[0], world - 1),
        ("all_gather", (sizes[0] + HEADER_BYTES) * (world - 1), world - 1),
    )


def _phases(*phases: tuple[str, int, int]) -> Cost:
    return Cost(sum(p[1] for p in phases), sum(p[2] for p in phases), tuple(phases))


def table(compressors: list[str], numel: int, world_sizes: list[int], link: Link) -> list[dict]:
    """One record per (world size, compressor, algorithm): bytes, predicted
    seconds, and whether it is the compressor's default there."""
    records = []
    for name in compressors:
        compressor = get_compressor(name)
        for algorithm in ALGORITHMS:
            try:
                check_algorithm(compressor, algorithm)
            except ValueError:
                continue
            for world in world_sizes:
                c = cost(compressor, numel, world, algorithm)
                records.append(
                    {
                        "compressor": name,
                        "algorithm": algorithm,
                        "world_size": world,
                        "bytes_sent": c.bytes_sent,
                        "seconds": c.seconds(link),
                        "default": default_algorithm(compressor, world) == algorithm,
                    }
                )
    return records
