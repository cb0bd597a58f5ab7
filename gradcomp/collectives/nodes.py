"""A group cut into nodes: the two levels a ``hierarchical`` job runs over.

Data only: :mod:`gradcomp.collectives.hierarchical` finds the layout and
creates the groups (:func:`~gradcomp.collectives.node_layout.hierarchy_for`);
a :class:`~gradcomp.collectives.job.Job` carries the result.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist


@dataclasses.dataclass
class Level:
    """One level of a hierarchy, shaped like a :class:`CollectiveQueue` for
    the flat algorithms: its group, this rank's place in it, its checked settings,
    allgather's lanes, the plans its ranks agreed on."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    verified: set = dataclasses.field(default_factory=set)
    lanes: dict = dataclasses.field(default_factory=dict)
    plans: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Hierarchy:
    """A group's nodes and this rank's two levels.

    Attributes:
        nodes: group ranks of each node (node order, rank order inside).
        source: where the layout came from (``node_size=2``, ``LOCAL_WORLD_SIZE=2``, ``host names``).
        intra: this rank's node (its local rank, the node size).
        inter: the ranks with this local rank, one a node (this rank's place in their
            group, which torch orders by rank, not always node order; the node count).
        shared_memory: whether the node's stages of CPU tensors go through
            shared memory: True where the node's ranks share a host name; it
            turns False by itself where they cannot share memory. Set it on
            every rank of the node alike, or not at all.
    """

    nodes: list[list[int]]
    source: str
    intra: Level
    inter: Level
    shared_memory: bool = True  # CPU tensors: the node's stages through shared memory, while it works
    # (length, dtype) -> SharedArea; ("payloads", nbytes) -> the node's rows of gathered payloads
    areas: dict = dataclasses.field(default_factory=dict)

    @property
    def node_size(self) -> int:
        return len(self.nodes[0])
