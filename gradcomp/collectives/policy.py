"""Which algorithm a compressor takes: the algorithm policy. It follows from the
compressor's facts (DESIGN.md):

* ``dense``: all-reduce the payload itself (summable compressors,
  :mod:`gradcomp.collectives.dense`);
* ``allgather``: gather every rank's payload, decode and add
  (:mod:`gradcomp.collectives.allgather`);
* ``two_phase``: all-to-all of compressed chunks (reduce-scatter), decode and
  sum the own chunk, recompress it with its own residual, all-gather
  (:mod:`gradcomp.collectives.two_phase`); for Top-K, a sparse reduce-scatter
  and re-selection whose bytes do not grow with the world size
  (:mod:`gradcomp.collectives.sparse_two_phase`);
* ``hierarchical``: dense inside each node, one of the above between nodes
  (:mod:`gradcomp.collectives.hierarchical`).

A low-rank compressor (PowerSGD) takes ``dense``: its factors are summed in
two dense all-reduces (:mod:`gradcomp.collectives.low_rank`).

The policy only names and checks; :mod:`gradcomp.collectives.dispatch` runs a job
with the algorithm it names.
"""

from __future__ import annotations

from gradcomp.collectives import sparse_two_phase as sparse
from gradcomp.compressors import Compressor

# The flat algorithms: one level, every rank alike.
ALGORITHMS = ("dense", "allgather", "two_phase")
HIERARCHICAL = "hierarchical"
# The world size from which Top-K takes two_phase by default. A rank sends
# about (CAPACITY + 1) (W-1)/W k pairs there, (W-1) k in an all-gather: fewer
# bytes from 4 ranks on. But the owner's re-selection reads 1/W of the tensor
# more, which at 4 ranks costs more time than the bytes it saves on a CPU; from
# 8 ranks the bytes saved dominate (bench/allreduce.py measures both).
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
