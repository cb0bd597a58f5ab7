"""Every rank of a group at one call before anything collective, or a clear error in time.

A call that some ranks make and others do not (``if rank == 0:
gradcomp.ddp.register(...)``) would pair its first collective with another of
the ranks that did not make it (DDP's own all-reduce in the backward pass):
both wait until the group's timeout and fail with a message about neither.
:func:`wait_for_every_rank` meets the group's ranks in the store first, which
no collective reads, warns while some have not come (naming them, from
:data:`~gradcomp.collectives.waiting.WARN_AFTER_SECONDS` on), and names them in
its error at the group's timeout.

Example:
    >>> wait_for_every_rank(model.process_group, "gradcomp.ddp.register")
"""

from __future__ import annotations

import hashlib
import threading

import torch.distributed as dist

from gradcomp.collectives.groups import group_timeout
from gradcomp.collectives.waiting import TimedOut, seconds, wait_for_ranks

_LOCK = threading.Lock()
_CALLS: dict[str, int] = {}  # (what, ranks) -> calls made so far in this process


def wait_for_every_rank(group: dist.ProcessGroup | None, what: str) -> None:
    """Return once every rank of ``group`` (None: the world) has called this with ``what``
    as many times as this rank has.

    Logs a warning :data:`~gradcomp.collectives.waiting.WARN_AFTER_SECONDS` into the
    wait and periodically after, naming the ranks that have not called it yet.

    Raises:
        RuntimeError: after the group's timeout, naming the ranks that did not call it.
    """
    group = group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return
    key = hashlib.sha1(repr((what, ranks)).encode()).hexdigest()[:16]
    with _LOCK:
        calls = _CALLS[key] = _CALLS.get(key, 0) + 1
    prefix = f"gradcomp/arrival/{key}/{calls}"
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{prefix}/{dist.get_rank()}", b"1")
    timeout = group_timeout(group) or dist.constants.default_pg_timeout
    missing = wait_for_ranks(store, {rank: f"{prefix}/{rank}" for rank in ranks}, what, timeout)
    if missing:
        raise TimedOut(
            f"{what} was called on this rank, but ranks {missing} of the group {ranks} did not call it "
            f"within the group's timeout ({seconds(timeout.total_seconds())}): every rank of the group "
            "makes this call, with the same settings (under `if rank == 0:` the other ranks go on into "
            "collectives of their own, and both sides wait)"
        )
