"""The compressed all-gather of FSDP2's parameters (not the ``allgather`` all-reduce):
each rank's shard encoded once, the payloads gathered, every rank decoding every
shard (its own too), so that every rank computes with the same unsharded weights."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradcomp.collectives import c10d
from gradcomp.collectives.reduce_scatter import padded_row
from gradcomp.collectives.stats import COMPRESS, ReduceStats, Timer, exchange
from gradcomp.compressors import Compressor, Context, mix_seed
from gradcomp.payload import buffer_size


def parameter_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    compressor: Compressor,
    group: dist.ProcessGroup,
    *,
    key: int = 0,
) -> ReduceStats:
    """``output`` (``world`` rows of ``input.numel()`` elements) = every rank's ``input``
    encoded by ``compressor`` (no error feedback: weights are not accumulated) and
    decoded, row ``r`` rank ``r``'s. ``input`` may be a view of ``output`` (FSDP's
    all-gather writes its input in place): it is encoded before anything is written."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = input.numel()
    if output.numel() != world * shard:
        raise ValueError(f"all-gather output has {output.numel()} elements, not {world} x {shard}")
    nbytes = shard * input.element_size()
    stats = ReduceStats(dense_bytes=(world - 1) * nbytes, algorithm="parameter_gather")
    if shard == 0:
        return stats
    row = padded_row(compressor, shard)
    flat = input.reshape(-1)
    width = buffer_size(compressor.payload_layout(row, flat.dtype, {}))
    sent = torch.empty(1, width, dtype=torch.uint8, device=flat.device)
    with Timer(stats, COMPRESS):
        if row != shard:
            padded = torch.zeros(row, dtype=flat.dtype, device=flat.device)
            padded[:shard].copy_(flat)
            flat = padded
        compressor.compress_rows(flat, row, sent, Context(None, 0, mix_seed(key, 1), rank))
    gathered = torch.empty(world, width, dtype=torch.uint8, device=flat.device)
    with exchange():
        c10d.all_gather_single(gathered.view(-1), sent.view(-1), group=group)
    stats.bytes_sent = (world - 1) * width
    with Timer(stats):
        if row == shard:
            compressor.decompress_rows(gathered, output.dtype, row, output.view(-1))
        else:
            decoded = torch.empty(world * row, dtype=output.dtype, device=output.device)
            compressor.decompress_rows(gathered, output.dtype, row, decoded)
            output.view(world, shard).copy_(decoded.view(world, row)[:, :shard])
    return stats
