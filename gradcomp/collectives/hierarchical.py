"""The two-level compressed all-reduce: dense inside a node, compressed between nodes.

Inside a node ranks share fast links (NVLink, PCIe, shared memory); between
nodes they share a NIC. So ``algorithm="hierarchical"`` compresses only the
traffic between nodes:

1. inside each node, a dense reduce-scatter leaves local rank ``i`` the
   node's sum of shard ``i`` (in fp32 for 16-bit tensors): CPU tensors
   through the node's shared memory (each rank writes its tensor into a row
   and sums its shard of every row), other tensors, or where the node
   cannot share memory, as an all-to-all of shards summed in rank order;
2. between nodes, the ranks with the same local rank all-reduce their shard
   with the compressor and an inner algorithm (``inter_algorithm``, default
   from the compressor and the number of nodes), with error feedback on the
   shard: the node stage is exact, so this is the only residual;
3. inside each node, an all-gather of the shards (through shared memory:
   each rank writes its shard into the result row and reads the row). A
   Top-K result gathered between nodes is shared as its payloads instead:
   every rank decodes every shard's into the tensor.

Every rank ends with the same bits: each shard is computed by one rank of a
node and identical across nodes (the inner algorithms give every rank the
same bits), then gathered. On one node nothing is compressed: the result is
the dense all-reduce.

The node layout comes, in this order, from ``node_size`` (consecutive ranks
of the group), from torchrun's ``LOCAL_WORLD_SIZE`` (global rank //
``LOCAL_WORLD_SIZE``), or from the ranks' host names. Ranks exchange their
view through the store before any group is created, so ranks that disagree
raise instead of hanging; every node must hold the same number of ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
from collections.abc import Callable, Generator

import torch
import torch.distributed as dist

from gradcomp.collectives.groups import new_group_like
from gradcomp.collectives.job import Job
from gradcomp.collectives.nodes import Hierarchy, Level
from gradcomp.collectives.policy import default_algorithm
from gradcomp.collectives.stats import ReduceStats, Timer, exchange
from gradcomp.collectives.worker import CollectiveQueue, all_gather_async, drive
from gradcomp.compressors import mix_seed

logger = logging.getLogger(__name__)

# Runs a flat job on one level of the hierarchy, as steps: the dispatcher's
# job_steps, handed in by the dispatcher, which imports this module (so this
# module never imports it back).
FlatSteps = Callable[[Job, Level], Generator[None, None, ReduceStats]]
# Mixed into a job's key for its shard's residual and random streams.
_SHARD_KEY = 0x48494552
# Where a node's ranks share memory for CPU tensors.
SHARED_MEMORY_DIR = "/dev/shm"
_OFFER_BYTES = 512  # the shared file's path and token, as local rank 0 broadcasts them
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
    host), exchanged through the store: no collective on a group the worker uses."""
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
    return [json.loads(store.get(f"{prefix}/{r}")) for r in range(q.world_size)]


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


def hierarchical(
    job: Job,
    flat: torch.Tensor,
    hierarchy: Hierarchy,
    stats: ReduceStats,
    flat_steps: FlatSteps | None = None,
) -> Generator:
    """Reduce ``flat`` in place over ``hierarchy`` (see the module's description).

    ``flat_steps`` runs the shard's all-reduce between nodes
    (:func:`gradcomp.collectives.dispatch.job_steps`); a hierarchy without that
    stage (one node, :func:`node_stages_only`) needs none."""
    intra = hierarchy.intra
    size, numel, itemsize = intra.world_size, flat.numel(), flat.element_size()
    shard_len = -(-numel // size)
    lo, hi = intra.rank * shard_len, (intra.rank + 1) * shard_len
    wide = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else flat.dtype
    # A reduce-scatter and an all-gather of shards: what a ring sends inside the node.
    stats.bytes_sent_intra = 2 * (size - 1) * shard_len * itemsize
    area = _shared_area(hierarchy, shard_len * size, flat.dtype) if flat.device.type == "cpu" else None
    if size == 1:
        shard = flat if flat.dtype == wide else flat.to(wide)
        _between_nodes(job, shard, hierarchy, stats, flat_steps)
        if shard is not flat:
            flat.copy_(shard)
    elif area is not None:
        # Through the node's shared memory: each rank writes its tensor but its
        # own shard into its row, sums its shard of every rank's (in rank
        # order) into the result row (a private fp32 shard for 16-bit
        # tensors), reduces it between nodes there and reads the others'.
        rows, rank, own = area.rows, intra.rank, max(0, min(hi, numel) - lo)
        before = min(lo, numel)  # elements ahead of the own shard (the last shards may be padding)
        rows[rank, :before].copy_(flat[:before])
        rows[rank, hi:numel].copy_(flat[hi:])
        with exchange():
            dist.barrier(group=intra.group)
        # Nobody reads the result row before the second barrier, and a rank
        # writes its next job's shard there only after every rank has read
        # this one's (the next job's first barrier). Sparse payloads gathered
        # between nodes are shared and decoded by every rank instead.
        shard = area.shard if area.shard is not None else rows[size, lo:hi]
        with Timer(stats):
            parts = [flat[lo : lo + own] if j == rank else rows[j, lo : lo + own] for j in range(size)]
            if shard.dtype == flat.dtype:
                torch.add(parts[0], parts[1], out=shard[:own])
            else:
                shard[:own].copy_(parts[0]).add_(parts[1])
            for part in parts[2:]:
                shard[:own].add_(part)
            shard[own:].zero_()
            if job.op == "avg":
                shard.div_(size)  # the node's mean; the inner "avg" makes it the group's
        undecoded = _sparse_gather(job, hierarchy)
        gathered = _between_nodes(job, shard, hierarchy, stats, flat_steps, undecoded)
        if gathered is not None and _decode_every_shard(job, flat, shard, gathered, hierarchy, stats):
            stats.bytes_sent = stats.bytes_sent_intra + stats.bytes_sent_inter
            return
        if area.shard is not None:
            rows[size, lo:hi].copy_(shard)
        flat[lo : lo + own].copy_(shard[:own])
        with exchange():
            dist.barrier(group=intra.group)
        flat[:before].copy_(rows[size, :before])
        flat[hi:].copy_(rows[size, hi:numel])
    else:
        yield from _through_collectives(job, flat, hierarchy, stats, flat_steps, shard_len, wide)
    stats.bytes_sent = stats.bytes_sent_intra + stats.bytes_sent_inter


def _through_collectives(
    job: Job,
    flat: torch.Tensor,
    hierarchy: Hierarchy,
    stats: ReduceStats,
    flat_steps: FlatSteps | None,
    shard_len: int,
    wide: torch.dtype,
) -> Generator:
    """The node's stages as collectives: an all-to-all of shards, summed, and an all-gather."""
    intra, numel = hierarchy.intra, flat.numel()
    size = intra.world_size
    padded = flat
    if shard_len * size != numel:
        padded = torch.zeros(shard_len * size, dtype=flat.dtype, device=flat.device)
        padded[:numel].copy_(flat)
    received = torch.empty(size, shard_len, dtype=flat.dtype, device=flat.device)
    with exchange():
        dist.all_to_all_single(received.view(-1), padded, group=intra.group)
    with Timer(stats):
        shard = received.sum(0, dtype=wide)
        if job.op == "avg":
            shard.div_(size)
    del received
    _between_nodes(job, shard, hierarchy, stats, flat_steps)
    own = shard if shard.dtype == flat.dtype else shard.to(flat.dtype)
    with exchange():
        gather = all_gather_async(padded, own, intra.group)
    yield  # every collective of this job is issued: the next job may start
    with exchange():
        gather.wait()
    if padded is not flat:
        flat.copy_(padded[:numel])


def _inner_algorithm(job: Job, hierarchy: Hierarchy) -> str:
    return job.inter_algorithm or default_algorithm(job.compressor, hierarchy.inter.world_size)


def _sparse_gather(job: Job, hierarchy: Hierarchy) -> bool:
    """Whether the shard's payloads go between nodes by all-gather and are sparse, carrying
    their own indices: then the node can share the gathered payloads instead of the decoded
    dense shards (any rank decodes any shard's). Not random-K's: their indices follow
    each shard's own seed."""
    return (
        job.compressor.sparse
        and not job.compressor.summable
        and hierarchy.inter.world_size > 1
        and _inner_algorithm(job, hierarchy) == "allgather"
    )


def _between_nodes(
    job: Job,
    shard: torch.Tensor,
    hierarchy: Hierarchy,
    stats: ReduceStats,
    flat_steps: FlatSteps | None,
    undecoded: bool = False,
) -> tuple[torch.Tensor, dict] | None:
    """The compressed all-reduce of this rank's shard among the ranks with its local rank.

    With ``undecoded`` (an all-gather between nodes), the shard keeps its input and the
    gathered payloads are returned undecoded, ``(rows, meta)``; else None."""
    inter = hierarchy.inter
    if inter.world_size == 1:
        return None
    if flat_steps is None:
        raise ValueError("a hierarchy of several nodes needs flat_steps to reduce its shards between nodes")
    inner = Job(
        shard,
        job.compressor,
        job.op,
        _inner_algorithm(job, hierarchy),
        job.feedback,
        key=shard_key(job.key, hierarchy),
        step=job.step,
        measure_error=job.measure_error,
        gathered=[] if undecoded else None,
    )
    reduced = drive(flat_steps(inner, inter))
    stats.bytes_sent_inter += reduced.bytes_sent
    stats.compress_seconds += reduced.compress_seconds
    stats.error_sq, stats.input_sq = reduced.error_sq, reduced.input_sq
    stats.inter_algorithm = reduced.algorithm
    if not undecoded:
        return None
    (gathered,) = inner.gathered  # sparse payloads: one segment
    return gathered


def _decode_every_shard(
    job: Job,
    flat: torch.Tensor,
    shard: torch.Tensor,
    gathered: tuple[torch.Tensor, dict],
    hierarchy: Hierarchy,
    stats: ReduceStats,
) -> bool:
    """The node's all-gather of a sparse result, in shared memory: each rank writes its
    shard's gathered payloads (k indices and values a node) and decodes every shard's
    straight into the tensor, as the shard's rank would (the same bits on every rank):
    a few k entries a shard cross the node instead of dense shards, and the dense
    result is written once. False, on every rank of the node, where it cannot map
    the memory for them: then it decodes its own shard into ``shard``, for the
    caller to gather densely.

    No barrier after the decoding: a rank writes these payloads, or any shard into
    the result row (``shard`` here for 32- and 64-bit tensors, scratch now), only
    after its next job's first barrier, when every rank has decoded this job's."""
    intra, inter = hierarchy.intra, hierarchy.inter
    rows_in, meta = gathered
    divisor = inter.world_size if job.op == "avg" else 1
    nbytes = rows_in.numel()  # every node's payload of this shard
    key = ("payloads", nbytes)
    payloads = hierarchy.areas.get(key)
    if payloads is None:
        mapped = _map_shared(intra, intra.world_size * nbytes, torch.uint8)
        if mapped is None:
            hierarchy.shared_memory = False  # decided by every rank of the node alike
            with Timer(stats):
                job.compressor.decompress_sum(rows_in, shard.dtype, shard, meta=meta, divisor=divisor)
            return False
        payloads = hierarchy.areas[key] = mapped.view(intra.world_size, nbytes)
    payloads[intra.rank].copy_(rows_in.view(-1))
    stats.bytes_sent_intra = (intra.world_size - 1) * (shard.numel() * flat.element_size() + nbytes)
    with exchange():
        dist.barrier(group=intra.group)
    length, numel = shard.numel(), flat.numel()
    with Timer(stats):
        for j in range(intra.world_size):
            start = j * length
            own = max(0, min(start + length, numel) - start)
            if own == 0:
                continue
            # The payloads index a whole shard in the summing dtype: a shorter last
            # shard or a 16-bit tensor decodes into the scratch shard first.
            direct = own == length and flat.dtype == shard.dtype
            out = flat[start : start + own] if direct else shard
            rows = payloads[j].view(inter.world_size, -1)
            job.compressor.decompress_sum(rows, shard.dtype, out, meta=meta, divisor=divisor)
            if not direct:
                flat[start : start + own].copy_(shard[:own])
    return True


def shard_key(key: int, hierarchy: Hierarchy) -> int:
    """The key of this rank's shard of job ``key``: its residuals are kept under it
    (and, for a two_phase between nodes, the owner's under ``owner_key(it)``)."""
    return mix_seed(key, _SHARD_KEY, hierarchy.intra.rank)


def shard_bounds(numel: int, hierarchy: Hierarchy) -> tuple[int, int, int]:
    """Where this rank's shard of ``numel`` elements starts, how many of them it holds
    (the last shards may be padding) and its padded length."""
    size = hierarchy.intra.world_size
    length = -(-numel // size)
    start = hierarchy.intra.rank * length
    return min(start, numel), max(0, min(start + length, numel) - start), length


def node_stages_only(hierarchy: Hierarchy) -> Hierarchy:
    """``hierarchy`` without the stage between nodes (to time the node's stages), with
    shared areas of its own (freed with it)."""
    inter = Level(None, hierarchy.inter.rank, 1)
    return dataclasses.replace(hierarchy, inter=inter, areas={})


@dataclasses.dataclass
class SharedArea:
    """A node's shared memory for tensors of one length and dtype: a row per
    local rank and one for the result (``rows``), and for 16-bit tensors this
    rank's shard in fp32 (``shard``, private; None for the others, whose
    shard is summed in the result row)."""

    rows: torch.Tensor
    shard: torch.Tensor | None


def _shared_area(hierarchy: Hierarchy, length: int, dtype: torch.dtype) -> SharedArea | None:
    """The node's shared area for CPU tensors of ``length`` (made on first
    use, with the node's ranks), or None where the node cannot share memory
    (its ranks on different hosts, no ``/dev/shm``, not enough room there):
    then the node's stages run as collectives."""
    intra = hierarchy.intra
    if intra.world_size == 1 or not hierarchy.shared_memory:
        return None
    key = (length, dtype)
    area = hierarchy.areas.get(key)
    if area is None:
        rows = _map_shared(intra, (intra.world_size + 1) * length, dtype)
        if rows is None:
            hierarchy.shared_memory = False  # decided by every rank of the node alike
            return None
        narrow = dtype in (torch.float16, torch.bfloat16)
        shard = torch.empty(length // intra.world_size, dtype=torch.float32) if narrow else None
        area = hierarchy.areas[key] = SharedArea(rows.view(intra.world_size + 1, length), shard)
    return area


def _map_shared(intra: Level, count: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``count`` elements of ``dtype`` mapped by every rank of the node, or
    None on every rank if any cannot. Local rank 0 makes a file in
    ``/dev/shm`` (space reserved up front: a full tmpfs fails here, not with
    a bus error later) ending in a random token; the others open it by name
    without creating it and check the token (a rank with another ``/dev/shm``
    must not map a file of its own), and it is unlinked once all agree."""
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    offer = ""
    if intra.rank == 0:
        token = secrets.token_hex(8)
        path = os.path.join(SHARED_MEMORY_DIR, f"gradcomp-{os.getpid()}-{token}")
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(descriptor, 0, nbytes + len(token))
                os.pwrite(descriptor, token.encode(), nbytes)
            finally:
                os.close(descriptor)
            offer = f"{path}\n{token}"
        except Exception as error:  # noqa: BLE001 - any failure: every rank takes collectives
            logger.info("gradcomp: no shared memory for the node's stages (%s); using collectives", error)
            with contextlib.suppress(OSError):
                os.unlink(path)
    encoded = torch.zeros(_OFFER_BYTES, dtype=torch.uint8)
    if len(offer.encode()) <= _OFFER_BYTES:
        encoded[: len(offer.encode())] = torch.tensor(list(offer.encode()), dtype=torch.uint8)
    dist.broadcast(encoded, src=dist.get_global_rank(intra.group, 0), group=intra.group)
    offer = bytes(encoded[encoded != 0].tolist()).decode()
    name, _, token = offer.partition("\n")
    mapped = None
    if name:
        try:
            descriptor = os.open(name, os.O_RDONLY)  # never created here
            try:
                seen = os.pread(descriptor, len(token), nbytes).decode()
            finally:
                os.close(descriptor)
            if seen != token:
                raise OSError(f"{name} is not the file local rank 0 made (another /dev/shm?)")
            mapped = torch.from_file(name, shared=True, size=count, dtype=dtype)
        except (RuntimeError, OSError, UnicodeDecodeError) as error:
            logger.info(
                "gradcomp: cannot map the node's shared memory %s (%s); using collectives", name, error
            )
    agreed = torch.tensor([int(mapped is not None)], dtype=torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=intra.group)
    if intra.rank == 0 and name:
        os.unlink(name)  # the mappings stay; the memory goes with the last of them
    return mapped if int(agreed) else None
