"""Jobs run in the caller's thread, on the caller's CUDA stream, over the group itself.

The worker (:mod:`~gradcomp.collectives.worker`) exists for callers that must
not wait (DDP's bucket hooks). A caller that runs its communication in
program order on a stream of its own choosing (FSDP2 calls its reduce-scatter
and all-reduce hooks on its own streams, one unit after another, in the same
order on every rank) runs a job where it stands: no thread, no clone of the
group, no event between streams; the collectives go on ``group`` in the
caller's order, which is the same on every rank.
"""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist

from gradcomp.collectives.dispatch import job_steps
from gradcomp.collectives.groups import group_timeout
from gradcomp.collectives.job import Job
from gradcomp.collectives.stats import ReduceStats
from gradcomp.collectives.worker import drive


class InlineGroup:
    """What the algorithms read of a :class:`~gradcomp.collectives.worker.CollectiveQueue`
    (``group``, ``rank``, ``world_size``, ``ranks``, the group's timeout, the settings
    verified so far, allgather's lanes, the plans agreed), for jobs run in the caller's
    thread on ``group`` itself."""

    __slots__ = (
        "group",
        "rank",
        "world_size",
        "ranks",
        "timeout_seconds",
        "verified",
        "hierarchies",
        "lanes",
        "plans",
        "layout_exchanges",
        "lock",
    )

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        ranks: list[int] | None = None,
        timeout: datetime.timedelta | None = None,
    ):
        """``rank``, ``world_size``, ``ranks`` and ``timeout`` default to what torch says of
        ``group``; a group outside torch.distributed's world (torchft's) gives them."""
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group) if rank is None else rank
        self.world_size = dist.get_world_size(self.group) if world_size is None else world_size
        self.ranks = dist.get_process_group_ranks(self.group) if ranks is None else ranks
        timeout = timeout or group_timeout(self.group) or dist.constants.default_pg_timeout
        self.timeout_seconds = timeout.total_seconds()
        self.verified: set[tuple] = set()
        self.hierarchies: dict = {}
        self.lanes: dict = {}
        self.plans: dict = {}
        self.layout_exchanges = 0
        self.lock = threading.Lock()

    def run(self, job: Job) -> ReduceStats:
        """Run ``job`` to its end here, now: its statistics."""
        return drive(job_steps(job, self))
