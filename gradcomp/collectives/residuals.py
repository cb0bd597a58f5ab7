"""Residuals that move when a tensor changes how it is reduced.

The algorithms keep error feedback under keys of their own: a sender's
residual under the tensor's key (a hierarchical shard's under
:func:`~gradcomp.collectives.hierarchical.shard_key`), and a two_phase
owner's under :func:`~gradcomp.collectives.two_phase.owner_key`. When a tensor (a DDP bucket) goes
through another compressor or algorithm from one call to the next, what the
last one held back must be sent by the next, or it is lost: :func:`carry`
adds it to this rank's input. A route is ``(compressor, algorithm,
algorithm between nodes)``.
"""

from __future__ import annotations

import torch

from gradcomp.collectives.hierarchical import shard_bounds, shard_key
from gradcomp.collectives.node_layout import hierarchy_for
from gradcomp.collectives.policy import HIERARCHICAL
from gradcomp.collectives.two_phase import owner_key, owner_ranges
from gradcomp.collectives.worker import CollectiveQueue
from gradcomp.compressors import Compressor
from gradcomp.feedback import ErrorFeedback

Route = tuple[Compressor, str, "str | None"]


def carry(
    feedback: ErrorFeedback,
    q: CollectiveQueue,
    key: int,
    tensor: torch.Tensor,
    previous: Route,
    now: Route,
    node_size: int | None,
) -> None:
    """Before tensor ``key`` goes through ``now`` instead of ``previous``: what ``previous``
    held back is added to this rank's input ``tensor``, so that the next reduction sends it.

    The owner's residual of a two_phase reduction where it owned (times the ranks: the
    reduction averages); the sender's where ``now`` keeps it under another key or keeps
    none (a hierarchical shard's where the shard lies, times the node's ranks: the node
    averages before the stage between nodes)."""
    compressor, algorithm, _ = now
    flat = tensor.view(-1)
    keeps = compressor.name != "none" and compressor.needs_feedback
    if previous[1] == HIERARCHICAL:
        hierarchy = hierarchy_for(q, node_size)
        start, own, length = shard_bounds(flat.numel(), hierarchy)
        kept, inter = shard_key(key, hierarchy), hierarchy.inter
        shard, scale = flat[start : start + own], hierarchy.node_size
        owner = owner_ranges(previous[0], previous[2], length, inter.world_size, inter.rank, flat.device)
        same_key = algorithm == HIERARCHICAL
    else:
        kept, shard, scale = key, flat, 1
        owner = owner_ranges(*previous[:2], flat.numel(), q.world_size, q.rank, flat.device)
        same_key = algorithm != HIERARCHICAL
    held = feedback.pop(owner_key(kept))
    if held is not None:
        at = 0
        for begin, end in owner:
            end_ = min(end, shard.numel())  # a shard's padding holds nothing of the input
            if end_ > begin:
                shard[begin:end_].add_(held[at : at + end_ - begin].to(flat.dtype), alpha=q.world_size)
            at += end - begin
    if not (same_key and keeps):
        sender = feedback.pop(kept)
        if sender is not None:
            shard.add_(sender[: shard.numel()].to(flat.dtype), alpha=scale)


def owners_route(
    feedback: ErrorFeedback, q: CollectiveQueue, key: int, now: Route, node_size: int | None
) -> Route | None:
    """The two_phase route whose owner's residual ``feedback`` still holds for tensor ``key``
    where ``now`` keeps none (a checkpoint of a run that reduced it so: two_phase was also
    the default on 2 ranks and between 2 nodes), to :func:`carry` from; None otherwise."""
    compressor, algorithm, inter = now
    hierarchical = algorithm == HIERARCHICAL
    if compressor.name == "none" or (inter if hierarchical else algorithm) == "two_phase":
        return None
    kept = shard_key(key, hierarchy_for(q, node_size)) if hierarchical else key
    if owner_key(kept) not in feedback:
        return None
    return (compressor, HIERARCHICAL, "two_phase") if hierarchical else (compressor, "two_phase", None)
