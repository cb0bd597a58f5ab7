"""The compressed reduce-scatter: two_phase's first half, for a caller that wants
only its shard (FSDP2's gradient reduce-scatter).

The input is ``world`` rows of ``shard`` elements, row ``r`` for rank ``r``.
Every row is encoded with its slice of the sender's residual (one payload a
row), one all-to-all gives each rank every rank's payload of its row, and the
rows are decoded and summed in fp32, in rank order, into the output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradcomp.collectives.nodes import Hierarchy
from gradcomp.collectives.stats import COMPRESS, ReduceStats, Timer, exchange
from gradcomp.compressors import Compressor, Context, mix_seed
from gradcomp.payload import buffer_size


def check_reduce_scatter_compressor(compressor: Compressor) -> None:
    """``ValueError`` for a compressor whose payloads cannot be summed row by row."""
    if compressor.sparse or compressor.low_rank:
        raise ValueError(
            f"the compressed reduce-scatter takes the quantizers and 16-bit casts, not {compressor.name!r}: "
            "its payloads are summed row by row (use it for the all-reduce between replicas)"
        )


def padded_row(compressor: Compressor, shard: int) -> int:
    """The row length the reduce-scatter encodes for a shard of ``shard`` elements: whole
    blocks, so that one launch encodes (and one decodes) every row at any world size.
    The sender's residual has ``world`` such rows."""
    align = getattr(compressor, "block", 1)
    return -(-shard // align) * align


def reduce_scatter_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter of ``nbytes`` (its whole input)."""
    return (world_size - 1) * nbytes // world_size


def compressed_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    compressor: Compressor,
    group: dist.ProcessGroup,
    *,
    divisor: int = 1,
    residual: torch.Tensor | None = None,
    step: int = 0,
    key: int = 0,
) -> ReduceStats:
    """``output`` = the sum over ranks of row ``rank`` of ``input`` (``world`` rows of
    ``output.numel()`` elements), each rank's row sent compressed, divided by
    ``divisor``. ``residual`` (``world`` rows of :func:`padded_row` elements, any
    float dtype, or None) is the sender's error feedback, updated in place. Runs
    on the caller's stream; no host sync.

    Rows are encoded as whole blocks: a shard that is not a multiple of the block
    is padded with zeros (which encode to zeros and leave the residual's padding
    zero), costing at most a block's bytes a row."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = output.numel()
    if input.numel() != world * shard:
        raise ValueError(f"reduce-scatter input has {input.numel()} elements, not {world} x {shard}")
    if input.dtype != output.dtype or input.device != output.device:
        raise ValueError("reduce-scatter input and output differ in dtype or device")
    nbytes = input.numel() * input.element_size()
    stats = ReduceStats(dense_bytes=reduce_scatter_bytes(nbytes, world), algorithm="reduce_scatter")
    if shard == 0:
        return stats
    row = padded_row(compressor, shard)
    if residual is not None and residual.numel() != world * row:
        raise ValueError(f"the residual has {residual.numel()} elements, not {world} x {row}")
    flat = input.view(-1)
    width = buffer_size(compressor.payload_layout(row, flat.dtype, {}))
    sent = torch.empty(world, width, dtype=torch.uint8, device=flat.device)
    with Timer(stats, COMPRESS):
        if row != shard:
            padded = torch.zeros(world, row, dtype=flat.dtype, device=flat.device)
            padded[:, :shard].copy_(flat.view(world, shard))
            flat = padded.view(-1)
        compressor.compress_rows(flat, row, sent, Context(residual, step, mix_seed(key, 0), rank))
    received = torch.empty(world, width, dtype=torch.uint8, device=flat.device)
    with exchange():
        dist.all_to_all_single(received.view(-1), sent.view(-1), group=group)
    stats.bytes_sent = width * (world - 1)
    with Timer(stats):
        total = output.view(-1) if row == shard else torch.empty(row, dtype=flat.dtype, device=flat.device)
        compressor.decompress_sum(received, flat.dtype, total, divisor=divisor)
        if row != shard:
            output.view(-1).copy_(total[:shard])
    return stats


def hierarchical_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    compressor: Compressor,
    hierarchy: Hierarchy,
    *,
    intra_dtype: torch.dtype | None = None,
    divisor: int = 1,
    residual: torch.Tensor | None = None,
    step: int = 0,
    key: int = 0,
) -> ReduceStats:
    """The reduce-scatter of :func:`compressed_reduce_scatter` over a group cut into
    nodes: dense inside a node, compressed between nodes.

    Inside its node, each rank gathers from every node-mate the rows meant for the
    ranks of its own local rank on every node (an all-to-all, in ``intra_dtype``,
    default the input's) and sums them in fp32: one row per node, the node's part of
    that rank's shard. Those rows go between nodes through
    :func:`compressed_reduce_scatter` over the ranks of this local rank, one a node,
    with the sender's ``residual`` (``nodes`` rows of :func:`padded_row` elements).
    A rank sends ``nodes - 1`` compressed rows between nodes, where the flat
    reduce-scatter sends one to every rank of the other nodes."""
    nodes, intra, inter = hierarchy.nodes, hierarchy.intra, hierarchy.inter
    count, size, shard = len(nodes), intra.world_size, output.numel()
    world = count * size
    if input.numel() != world * shard:
        raise ValueError(f"reduce-scatter input has {input.numel()} elements, not {world} x {shard}")
    rows = input.view(world, shard)
    order = _node_order(hierarchy, input.device)
    wire = intra_dtype or input.dtype
    stats = ReduceStats(algorithm="hierarchical_reduce_scatter")
    nbytes = input.numel() * input.element_size()
    stats.dense_bytes = reduce_scatter_bytes(nbytes, world)
    if size > 1:
        with Timer(stats, COMPRESS):
            sent = _by_local_rank(rows, order, count, size).to(wire)
        received = torch.empty_like(sent)
        with exchange():
            dist.all_to_all_single(received, sent, group=intra.group)
        stats.bytes_sent_intra = (size - 1) * count * shard * sent.element_size()
        with Timer(stats):
            partial = received.view(size, count, shard).sum(0, dtype=torch.float32)
    else:
        partial = _by_local_rank(rows, order, count, size).float()
    if count == 1:
        output.copy_(partial.view(-1).div_(divisor) if divisor != 1 else partial.view(-1))
        stats.bytes_sent = stats.bytes_sent_intra
        return stats
    between = output if output.dtype == torch.float32 else torch.empty(shard, device=output.device)
    options = {"divisor": divisor, "residual": residual, "step": step, "key": key}
    inner = compressed_reduce_scatter(between, partial.view(-1), compressor, inter.group, **options)
    if between is not output:
        output.copy_(between)
    stats.bytes_sent_inter = inner.bytes_sent
    stats.bytes_sent = stats.bytes_sent_intra + stats.bytes_sent_inter
    stats.compress_seconds += inner.compress_seconds
    return stats


def _node_order(hierarchy: Hierarchy, device: torch.device) -> torch.Tensor | None:
    """For node-mate ``j``, the group ranks of local rank ``j`` on every node, in the
    order of their group between nodes (``size`` x ``nodes``): row ``r`` of the
    compressed reduce-scatter goes to that group's rank ``r``, and torch orders a
    group's ranks by rank, which need not be node order (nodes by host name with
    interleaved ranks). None where it is rank ``node * size + j`` (a view serves)."""
    nodes = hierarchy.nodes
    size, count = len(nodes[0]), len(nodes)
    ranks = [sorted(node[j] for node in nodes) for j in range(size)]
    if ranks == [[n * size + j for n in range(count)] for j in range(size)]:
        return None
    key = ("reduce_scatter_order", device)
    if key not in hierarchy.areas:  # made once: a host-to-device copy
        hierarchy.areas[key] = torch.tensor(ranks, device=device).view(-1)
    return hierarchy.areas[key]


def _by_local_rank(rows: torch.Tensor, order: torch.Tensor | None, count: int, size: int) -> torch.Tensor:
    """``rows`` (one per group rank) regrouped for the node's all-to-all: node-mate ``j``'s
    part holds the rows of local rank ``j`` on every node, in node order (a copy)."""
    if order is None:
        return rows.view(count, size, -1).transpose(0, 1).contiguous()
    return rows[order]
