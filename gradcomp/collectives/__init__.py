"""Compressed all-reduce over torch.distributed.

``all_reduce(tensor, compressor)`` mirrors ``torch.distributed.all_reduce``:
in place, ``op`` "avg" or "sum", ``async_op`` returning a handle.

The package, one concern a module, imports pointing down this list:

* :mod:`~gradcomp.collectives.reduce`: :func:`all_reduce` and its :class:`Work`;
* :mod:`~gradcomp.collectives.chooser`: the :class:`Chooser` protocol
  (``compressor="auto"`` and the like) and the registry of named choosers;
* :mod:`~gradcomp.collectives.dispatch`: :func:`job_steps`, which runs a
  :class:`Job` with the algorithm it names (the one module that imports them all);
* the algorithms: :mod:`~gradcomp.collectives.hierarchical` (dense inside a
  node, a flat one between nodes, run by the dispatcher it is handed),
  :mod:`~gradcomp.collectives.low_rank`, :mod:`~gradcomp.collectives.dense`,
  :mod:`~gradcomp.collectives.allgather`,
  :mod:`~gradcomp.collectives.sparse_two_phase`,
  :mod:`~gradcomp.collectives.two_phase`;
* :mod:`~gradcomp.collectives.policy`: which algorithm a compressor takes;
* :mod:`~gradcomp.collectives.scale`: bytes and predicted time of every
  algorithm at any world size;
* :mod:`~gradcomp.collectives.agreement`: ranks with different settings
  raise instead of hanging;
* :mod:`~gradcomp.collectives.worker`: the ordered worker thread that runs a
  group's jobs, over a private clone of the group;
* :mod:`~gradcomp.collectives.shared_names`: a name given to two tensors in
  flight at once, warned of;
* :mod:`~gradcomp.collectives.stats`: what a call cost (:class:`ReduceStats`);
* :mod:`~gradcomp.collectives.job` (:class:`Job`, one call fully described)
  and :mod:`~gradcomp.collectives.nodes` (:class:`Hierarchy`, a group cut into
  nodes): the leaves.
"""

from __future__ import annotations

from gradcomp.collectives.agreement import settings_key, verify_agreement, verify_settings
from gradcomp.collectives.allgather import allgather_segments
from gradcomp.collectives.chooser import (
    Chooser,
    register_chooser,
    shared_chooser,
)
from gradcomp.collectives.dispatch import job_steps
from gradcomp.collectives.hierarchical import hierarchy_for
from gradcomp.collectives.job import Job
from gradcomp.collectives.nodes import Hierarchy
from gradcomp.collectives.policy import ALGORITHMS, HIERARCHICAL, check_algorithm, default_algorithm
from gradcomp.collectives.reduce import Work, all_reduce, check_hierarchy_options, key_of, resolve_op
from gradcomp.collectives.stats import ReduceStats, ring_all_reduce_bytes
from gradcomp.collectives.two_phase import chunk_bounds, chunk_length, owner_ranges, two_phase_segments
from gradcomp.collectives.worker import (
    CollectiveQueue,
    clone_group,
    drive,
    group_timeout,
    queue_for,
    release_queues,
)

__all__ = [
    "ALGORITHMS",
    "HIERARCHICAL",
    "Chooser",
    "CollectiveQueue",
    "Hierarchy",
    "Job",
    "ReduceStats",
    "Work",
    "all_reduce",
    "allgather_segments",
    "check_algorithm",
    "check_hierarchy_options",
    "chunk_bounds",
    "chunk_length",
    "clone_group",
    "default_algorithm",
    "drive",
    "group_timeout",
    "hierarchy_for",
    "job_steps",
    "key_of",
    "owner_ranges",
    "queue_for",
    "register_chooser",
    "release_queues",
    "resolve_op",
    "ring_all_reduce_bytes",
    "settings_key",
    "shared_chooser",
    "two_phase_segments",
    "verify_agreement",
    "verify_settings",
]
