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

Agreement (:mod:`~gradcomp.collectives.agreement`): in step 1 each rank's
fingerprint reaches its node-mates (in the shared memory's slots, or after each
shard in the all-to-all), and the shard's job between nodes carries the node's
fingerprint in its own; a node whose ranks disagreed gives each of its ranks
another, so that every shard's job fails and every rank raises, none left
waiting in a node's stage.

The node layout comes, in this order, from ``node_size`` (consecutive ranks
of the group), from torchrun's ``LOCAL_WORLD_SIZE`` (global rank //
``LOCAL_WORLD_SIZE``), or from the ranks' host names. Ranks exchange their
view through the store before any group is created, so ranks that disagree
raise instead of hanging; every node must hold the same number of ranks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Generator

import torch
import torch.distributed as dist

from gradcomp.collectives.agreement import (
    HEADER_BYTES,
    holds_fingerprint,
    judge,
    nodes_disagree,
    write_fingerprint,
)
from gradcomp.collectives.job import Agreement, Job
from gradcomp.collectives.nodes import Hierarchy, Level
from gradcomp.collectives.policy import default_algorithm
from gradcomp.collectives.shared_memory import map_shared, shared_area
from gradcomp.collectives.stats import ReduceStats, Timer, exchange
from gradcomp.collectives.worker import all_gather_async, drive
from gradcomp.compressors import mix_seed

logger = logging.getLogger(__name__)

# Runs a flat job on one level of the hierarchy, as steps: the dispatcher's
# job_steps, handed in by the dispatcher, which imports this module (so this
# module never imports it back).
FlatSteps = Callable[[Job, Level], Generator[None, None, ReduceStats]]
# Mixed into a job's key for its shard's residual and random streams.
_SHARD_KEY = 0x48494552
# hierarchy.areas' key of the node's shared fingerprint slots.
_FINGERPRINTS = ("fingerprints",)


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
    area = shared_area(hierarchy, shard_len * size, flat.dtype) if flat.device.type == "cpu" else None
    slots = None if area is None or job.agreement is None else _fingerprint_slots(hierarchy)
    if slots is None and job.agreement is not None:
        area = None  # the node could not share the slots: its stages run as collectives
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
        if slots is not None:
            slots[rank].fill_(job.agreement.fingerprint)
        with exchange():
            dist.barrier(group=intra.group)
        # Read before any rank can pass this job's next barrier, so before the next job
        # writes its own.
        agreed = slots is None or all(seen == job.agreement.fingerprint for seen in slots.tolist())
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
        gathered = _between_nodes(job, shard, hierarchy, stats, flat_steps, undecoded, agreed)
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
    # Each node-mate's shard, then this rank's fingerprint, where its bytes are aligned
    # (in elements of the dtype).
    per_header = HEADER_BYTES // flat.element_size()
    at = -(-shard_len // per_header) * per_header
    header = 0 if job.agreement is None else at - shard_len + per_header
    sent = torch.empty(size, shard_len + header, dtype=flat.dtype, device=flat.device)
    _split_into(flat, sent[:, :shard_len])
    if header:
        write_fingerprint(sent[:, at:].view(torch.uint8), job)
    received = torch.empty_like(sent)
    with exchange():
        dist.all_to_all_single(received.view(-1), sent.view(-1), group=intra.group)
    stats.bytes_sent_intra += (size - 1) * header * flat.element_size()
    agreed = not header or holds_fingerprint(received[:, at:].view(torch.uint8), job)
    with Timer(stats):
        shard = received[:, :shard_len].sum(0, dtype=wide)
        if job.op == "avg":
            shard.div_(size)
    del received, sent
    _between_nodes(job, shard, hierarchy, stats, flat_steps, node_agrees=agreed)
    own = shard if shard.dtype == flat.dtype else shard.to(flat.dtype)
    padded = flat if shard_len * size == numel else flat.new_empty(shard_len * size)
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
    node_agrees: bool = True,
) -> tuple[torch.Tensor, dict] | None:
    """The compressed all-reduce of this rank's shard among the ranks with its local rank.

    With ``undecoded`` (an all-gather between nodes), the shard keeps its input and the
    gathered payloads are returned undecoded, ``(rows, meta)``; else None.

    ``node_agrees``: whether this rank's node-mates sent its fingerprint (every rank of
    the node knows alike). The shard's job carries the node's fingerprint, so that
    ranks of nodes with other settings disagree there; a node that disagreed gives each
    of its ranks another one, so that every shard's job fails, on every node: then every
    rank raises, naming its node-mates' settings where its node disagreed."""
    inter = hierarchy.inter
    if inter.world_size == 1:
        if job.agreement is not None and hierarchy.intra.world_size > 1:
            judge(hierarchy.intra, job, node_agrees)  # the node is the group
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
        agreement=_shard_agreement(job, hierarchy, node_agrees),
    )
    try:
        reduced = drive(flat_steps(inner, inter))
    except ValueError as error:
        if node_agrees:
            raise
        raise nodes_disagree(hierarchy.intra, job) from error
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
        mapped = map_shared(intra, intra.world_size * nbytes, torch.uint8)
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


def _shard_agreement(job: Job, hierarchy: Hierarchy, node_agrees: bool) -> Agreement | None:
    """The agreement terms of this rank's shard job: the node's fingerprint as its
    parent, one of this rank's own where the node disagreed."""
    terms = job.agreement
    if terms is None:
        return None
    parent = terms.fingerprint if node_agrees else terms.fingerprint ^ (hierarchy.inter.rank + 1)
    return Agreement(parent=parent, probe=terms.probe, origin=terms.origin or job)


def _fingerprint_slots(hierarchy: Hierarchy) -> torch.Tensor | None:
    """The node's shared slots of fingerprints, one per local rank (made on first use,
    with the node's ranks), or None on every rank of the node where it cannot map them."""
    slots = hierarchy.areas.get(_FINGERPRINTS)
    if slots is None:
        slots = map_shared(hierarchy.intra, hierarchy.intra.world_size, torch.int64)
        if slots is None:
            hierarchy.shared_memory = False  # decided by every rank of the node alike
            return None
        hierarchy.areas[_FINGERPRINTS] = slots
    return slots


def _split_into(flat: torch.Tensor, shards: torch.Tensor) -> None:
    """``flat`` into the rows of ``shards`` (``size`` x ``length``, strided), zero-padded."""
    length = shards.shape[1]
    full, rest = divmod(flat.numel(), length)
    shards[:full].copy_(flat[: full * length].view(full, length))
    if full < shards.shape[0]:
        shards[full:].zero_()
        shards[full, :rest].copy_(flat[full * length :])


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
