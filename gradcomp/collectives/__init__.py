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
* :mod:`~gradcomp.collectives.cost_model`: bytes and predicted time of every
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

from gradcomp.collectives.agreement import settings_key as settings_key
from gradcomp.collectives.agreement import verify_settings as verify_settings
from gradcomp.collectives.allgather import allgather_segments as allgather_segments
from gradcomp.collectives.chooser import (
    Chooser,
    register_chooser,
)
from gradcomp.collectives.chooser import (
    shared_chooser as shared_chooser,
)
from gradcomp.collectives.dispatch import job_steps as job_steps
from gradcomp.collectives.groups import clone_group as clone_group
from gradcomp.collectives.groups import group_timeout as group_timeout
from gradcomp.collectives.job import Job as Job
from gradcomp.collectives.node_layout import hierarchy_for as hierarchy_for
from gradcomp.collectives.nodes import Hierarchy as Hierarchy
from gradcomp.collectives.policy import ALGORITHMS, HIERARCHICAL
from gradcomp.collectives.policy import check_algorithm as check_algorithm
from gradcomp.collectives.policy import default_algorithm as default_algorithm
from gradcomp.collectives.reduce import Work, all_reduce
from gradcomp.collectives.reduce import check_hierarchy_options as check_hierarchy_options
from gradcomp.collectives.reduce import key_of as key_of
from gradcomp.collectives.reduce import resolve_op as resolve_op
from gradcomp.collectives.stats import ReduceStats, ring_all_reduce_bytes
from gradcomp.collectives.two_phase import chunk_bounds as chunk_bounds
from gradcomp.collectives.two_phase import chunk_length as chunk_length
from gradcomp.collectives.two_phase import owner_ranges as owner_ranges
from gradcomp.collectives.two_phase import two_phase_segments as two_phase_segments
from gradcomp.collectives.worker import CollectiveQueue as CollectiveQueue
from gradcomp.collectives.worker import drive as drive
from gradcomp.collectives.worker import queue_for as queue_for
from gradcomp.collectives.worker import release_queues

__all__ = [
    "ALGORITHMS",
    "HIERARCHICAL",
    "Chooser",
    "ReduceStats",
    "Work",
    "all_reduce",
    "register_chooser",
    "release_queues",
    "ring_all_reduce_bytes",
]
