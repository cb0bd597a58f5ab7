"""Which ranks of a group share a node: from ``node_size`` (consecutive ranks), torchrun's
``LOCAL_WORLD_SIZE`` or the host names, exchanged through the store so that ranks that
disagree raise instead of hanging; the node and between-node groups made once, in one
order on every rank (:class:`~gradcomp.collectives.nodes.Hierarchy`)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket

import torch.distributed as dist

from gradcomp.collectives.groups import new_group_like
from gradcomp.collectives.nodes import Hierarchy, Level
from gradcomp.collectives.waiting import TimedOut, seconds, wait_for_ranks
from gradcomp.collectives.worker import CollectiveQueue

logger = logging.getLogger(__name__)

_NO_LAYOUT = "no usable layout"  # a CollectiveQueue.hierarchies key: auto found none


def check_node_size(node_size, world_size: int | None = None) -> None:
    """``ValueError`` unless ``node_size`` is None or a positive integer dividing ``world_size``."""
    if node_size is None:
        return
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size must be a positive integer (ranks per node), got {node_size!r}")
    if world_size is not None and world_size % node_size:
        sizes = [min(node_size, world_size - start) for start in range(0, world_size, node_size)]
        raise ValueError(
            f"node_size={node_size} does not divide the group's {world_size} ranks "
            f"(nodes would hold {sizes} ranks); the hierarchical all-reduce needs equal nodes"
        )


def hierarchy_for(q: CollectiveQueue, node_size: int | None) -> Hierarchy:
    """``q``'s group cut into nodes (created once per ``node_size`` setting, on
    the caller's thread, in call order: the same order on every rank).

    Raises:
        ValueError: on every rank, if the ranks see different layouts or the
            nodes hold different numbers of ranks.
    """
    check_node_size(node_size, q.world_size)
    with q.lock:
        existing = q.hierarchies.get(node_size)
        if existing is None:
            existing = q.hierarchies[node_size] = _build(q, node_size)
        return existing


def nodes_for_auto(q: CollectiveQueue, node_size: int | None) -> Hierarchy | None:
    """The hierarchy ``auto`` may weigh: :func:`hierarchy_for`, or None where the layout
    found from ``LOCAL_WORLD_SIZE`` or host names cannot serve (nodes of different sizes,
    ranks that disagree; every rank sees the same views, so every rank gets None and
    plans flat). A ``node_size`` the user gave still raises. Call it where
    :func:`hierarchy_for` would be called (the caller's thread, in call order)."""
    if node_size is not None:
        return hierarchy_for(q, node_size)
    if q.hierarchies.get(_NO_LAYOUT):
        return None
    try:
        return hierarchy_for(q, None)
    except ValueError as error:
        logger.info("gradcomp auto: no usable node layout (%s); it plans flat", error)
        q.hierarchies[_NO_LAYOUT] = True
        return None


def _views(q: CollectiveQueue, node_size: int | None) -> list[dict]:
    """Every rank's view of the layout (its node_size, LOCAL_WORLD_SIZE and
    host), exchanged through the store: no collective on a group the worker uses.
    A wait for ranks that do not come warns, naming them, and raises at the group's
    timeout."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    mine = {
        "node_size": node_size,
        "local_world_size": int(local) if local else None,
        "host": socket.gethostname(),
    }
    store = dist.distributed_c10d._get_default_store()
    prefix = f"gradcomp/hierarchy/{q.group.group_name}/{q.layout_exchanges}"
    q.layout_exchanges += 1
    store.set(f"{prefix}/{q.rank}", json.dumps(mine))
    keys = {rank: f"{prefix}/{place}" for place, rank in enumerate(q.ranks)}
    what = f"the exchange of node layouts for the hierarchical all-reduce on group {q.ranks}"
    timeout = datetime.timedelta(seconds=q.timeout_seconds)
    missing = wait_for_ranks(store, keys, what, timeout)
    if missing:
        raise TimedOut(
            f"gradcomp: {what}: ranks {missing} did not come within the group's timeout "
            f"({seconds(q.timeout_seconds)}): every rank of the group makes the same hierarchical calls, "
            "in the same order"
        )
    return [json.loads(store.get(key)) for key in keys.values()]


def _node_ids(q: CollectiveQueue, views: list[dict]) -> tuple[list, str]:
    """The node of every group rank and where the layout came from."""
    described = ", ".join(f"rank {r}: {v['node_size']}" for r, v in enumerate(views))
    if len({v["node_size"] for v in views}) > 1:
        raise ValueError(f"ranks disagree on the hierarchical all-reduce's node_size ({described})")
    node_size = views[0]["node_size"]
    if node_size is not None:
        return [r // node_size for r in range(q.world_size)], f"node_size={node_size}"
    locals_ = {v["local_world_size"] for v in views}
    if None not in locals_:
        if len(locals_) > 1:
            seen = ", ".join(f"rank {r}: {v['local_world_size']}" for r, v in enumerate(views))
            raise ValueError(f"ranks disagree on LOCAL_WORLD_SIZE ({seen}); pass node_size= instead")
        local = locals_.pop()
        ranks = dist.get_process_group_ranks(q.group)
        return [g // local for g in ranks], f"LOCAL_WORLD_SIZE={local}"
    return [v["host"] for v in views], "host names"


def _build(q: CollectiveQueue, node_size: int | None) -> Hierarchy:
    views = _views(q, node_size)
    ids, source = _node_ids(q, views)
    nodes: dict[object, list[int]] = {}
    for rank, node in enumerate(ids):
        nodes.setdefault(node, []).append(rank)
    layout = list(nodes.values())
    sizes = [len(node) for node in layout]
    if len(set(sizes)) > 1:
        raise ValueError(
            f"the hierarchical all-reduce needs the same number of ranks on every node; "
            f"by {source} the group's nodes hold {sizes} ranks"
        )
    here = next(i for i, node in enumerate(layout) if q.rank in node)
    local = layout[here].index(q.rank)
    ranks = dist.get_process_group_ranks(q.group)
    # Every rank creates its node's group, then its local rank's: one global order.
    intra_ranks = [ranks[r] for r in layout[here]]
    inter_ranks = [ranks[node[local]] for node in layout]
    intra = new_group_like(q.group, intra_ranks) if len(intra_ranks) > 1 else None
    inter = new_group_like(q.group, inter_ranks) if len(inter_ranks) > 1 else None
    # torch orders a group's ranks by global rank. A node's ranks are in rank order, so
    # the node's group is in node order; the ranks between nodes need not be (nodes by
    # host name with interleaved ranks: host A ranks 0 and 3, host B 1 and 2): place in
    # that group and node differ there.
    order = sorted(range(len(layout)), key=lambda node: inter_ranks[node])
    one_host = len({views[r]["host"] for r in layout[here]}) == 1
    intra_level = Level(intra, local, len(intra_ranks))
    inter_level = Level(inter, order.index(here), len(layout))
    return Hierarchy(layout, source, intra_level, inter_level, one_host)
