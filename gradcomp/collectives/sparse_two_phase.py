"""Top-K's two-phase all-reduce: a sparse reduce-scatter, re-selection and an
all-gather, whose bytes per rank do not grow with the number of ranks.

Rank ``j`` owns range ``j`` of the tensor (:func:`chunk_bounds` with no
alignment). Every rank selects its ``k`` pairs with the compressor (error
feedback on its own residual, exactly as ``allgather`` does) and splits them
by range into rows of a fixed capacity, ``ceil(CAPACITY * k / W)`` pairs,
with indices local to the range. Where a range holds more pairs than that,
the largest magnitudes go (ties to the lowest index) and the rest return to
the sender's residual: nothing is lost, and the rows' size is known in
advance, so no size is exchanged. One all-to-all gives each owner every
rank's row of its range. The owner adds them in rank order into an fp32 copy
of its range (divided by ``W`` for a mean), adds its own residual and keeps
the ``ceil(k / W)`` largest (the rest stays in the owner's residual). An
all-gather of the owners' rows gives every rank the same result.

A rank sends ``(W-1)/W`` of its ``CAPACITY * k`` row pairs in the all-to-all
and ``(W-1) * ceil(k / W)`` pairs in the all-gather: about
``(CAPACITY + 1) (W-1)/W * k`` pairs, where ``allgather`` sends ``(W-1) k``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gradcomp import ops
from gradcomp.collectives.agreement import HEADER_BYTES, check_fingerprints, write_fingerprint
from gradcomp.collectives.job import Job
from gradcomp.collectives.stats import ReduceStats, Timer, compress_measured, exchange
from gradcomp.collectives.two_phase import chunk_bounds, chunk_length, owner_key
from gradcomp.collectives.worker import CollectiveQueue, all_gather_async
from gradcomp.compressors import Compressor, Context, TopK, mix_seed
from gradcomp.compressors.base import resolve_k
from gradcomp.payload import Layout, buffer_size, row_views

# Row capacity of the all-to-all, in multiples of k / W: room for ranges that
# hold twice their share of a rank's largest values.
CAPACITY = 2.0
# The random stream of the owner's re-selection (its sample).
_OWNER = 1


def sparse_two_phase_sizes(numel: int, k: int, world_size: int) -> tuple[int, int, int]:
    """``(range length, pairs a row of the all-to-all holds, pairs an owner keeps)``."""
    chunk = chunk_length(numel, world_size, 1)
    capacity = max(1, min(math.ceil(CAPACITY * k / world_size), k, chunk))
    kept = max(1, min(math.ceil(k / world_size), chunk))
    return chunk, capacity, kept


def _row_layout(pairs: int, chunk: int, dtype: torch.dtype) -> Layout:
    return [("indices", ops.index_dtype_for(chunk), pairs), ("values", dtype, pairs)]


def sparse_two_phase(job: Job, flat: torch.Tensor, q: CollectiveQueue, stats: ReduceStats) -> None:
    compressor, world, rank = job.compressor, q.world_size, q.rank
    numel = flat.numel()
    k = resolve_k(numel, compressor.ratio, compressor.k)
    chunk, capacity, kept = sparse_two_phase_sizes(numel, k, world)
    send_layout, keep_layout = _row_layout(capacity, chunk, flat.dtype), _row_layout(kept, chunk, flat.dtype)

    # Phase 1: this rank's k pairs, split by range into rows of fixed capacity.
    residual = job.residual(job.key, flat)
    pairs = compress_measured(job, flat, residual, rank, stats).tensors
    width, header = buffer_size(send_layout), 0 if job.agreement is None else HEADER_BYTES
    sent = torch.empty(world, width + header, dtype=torch.uint8, device=flat.device)
    with Timer(stats):
        split_by_range(pairs["indices"], pairs["values"], chunk, row_views(sent, send_layout), residual)
    if header:  # every row: every owner sees every rank's fingerprint
        write_fingerprint(sent[:, width:], job)
    received = torch.empty_like(sent)
    with exchange():
        sent_off = dist.all_to_all_single(received.view(-1), sent.view(-1), group=q.group, async_op=True)
    stats.bytes_sent += (width + header) * (world - 1)

    # Phase 2: the own range: every rank's pairs added, the largest kept; judged first
    # (another rank's bytes may not hold indices into this range).
    with exchange():
        sent_off.wait()
    if header:
        check_fingerprints(q, job, received[:, width:])
    start, end = chunk_bounds(numel, world, 1)[rank]
    own = torch.zeros(1, buffer_size(keep_layout), dtype=torch.uint8, device=flat.device)
    if end > start:
        with Timer(stats):
            total = torch.zeros(end - start, dtype=torch.float32, device=flat.device)
            fields = row_views(received, send_layout)
            values = fields["values"].float()
            if job.op == "avg":
                values = values / world
            # Rank order, on a GPU too; empty slots hold (0, 0.0): they add nothing.
            ops.scatter_add(fields["indices"], values, total)
            owner_residual = job.residual(owner_key(job.key), total)
            seed = compressor._private_seed(Context(None, job.step, mix_seed(job.key, _OWNER), rank))
            values, indices = ops.topk_select(
                total,
                min(kept, end - start),
                owner_residual,
                compressor.exact,
                seed=seed,
                index_dtype=keep_layout[0][1],
                value_dtype=flat.dtype,
            )
            row = row_views(own, keep_layout)
            row["indices"][0, : indices.numel()] = indices
            row["values"][0, : values.numel()] = values
    gathered = torch.empty(world, own.shape[1], dtype=torch.uint8, device=flat.device)
    with exchange():
        gather = all_gather_async(gathered.view(-1), own.view(-1), q.group)
    stats.bytes_sent += own.shape[1] * (world - 1)

    # Phase 3: every owner's pairs decoded into place.
    with exchange():
        gather.wait()
    with Timer(stats):
        fields = row_views(gathered, keep_layout)
        starts = torch.arange(world, device=flat.device).mul_(chunk).unsqueeze(1)
        indices = fields["indices"].long() + starts
        # The empty slots of an empty range would point past the end; their 0.0 adds nothing.
        indices = torch.where(indices < numel, indices, 0)
        total = torch.zeros(numel, dtype=torch.float32, device=flat.device)
        ops.scatter_add(indices, fields["values"].float(), total)
        flat.copy_(total)


def split_by_range(
    indices: torch.Tensor,
    values: torch.Tensor,
    chunk: int,
    rows: dict[str, torch.Tensor],
    residual: torch.Tensor | None,
) -> None:
    """Write the pairs ``(indices, values)`` into ``rows`` (``indices`` and
    ``values`` views ``(W, capacity)``): pair ``i`` into row ``indices[i] // chunk``
    with its index local to the range, the largest magnitudes first (NaN as
    inf, ties to the lowest index), empty slots ``(0, 0.0)``. Pairs beyond a
    row's capacity return to ``residual`` (where the selection left zero) if
    finite. No host sync."""
    world, capacity = rows["values"].shape
    device = values.device
    global_indices = indices.long()
    # Ordered by magnitude (stable on index order), then stably by range.
    magnitude = ops.reference.selection_magnitude(values.float())
    by_index = torch.argsort(global_indices, stable=True)
    order = by_index[torch.argsort(magnitude[by_index], descending=True, stable=True)]
    ranges = torch.div(global_indices[order], chunk, rounding_mode="floor")
    order = order[torch.argsort(ranges, stable=True)]
    ranges = torch.div(global_indices[order], chunk, rounding_mode="floor")
    # Not bincount: on a GPU it reads the largest value back to size its output.
    counts = torch.zeros(world, dtype=torch.int64, device=device).scatter_add_(
        0, ranges, torch.ones_like(ranges)
    )
    first = torch.cumsum(counts, 0) - counts
    position = torch.arange(order.numel(), device=device) - first[ranges]
    taken = position < capacity
    # Pairs over capacity go to a spare slot at the end, which is dropped.
    slot = torch.where(taken, ranges * capacity + position, world * capacity)
    local = torch.zeros(world * capacity + 1, dtype=rows["indices"].dtype, device=device)
    local[slot] = (global_indices[order] - ranges * chunk).to(local.dtype)
    kept_values = torch.zeros(world * capacity + 1, dtype=values.dtype, device=device)
    kept_values[slot] = values[order]
    rows["indices"].copy_(local[:-1].view(world, capacity))
    rows["values"].copy_(kept_values[:-1].view(world, capacity))
    if residual is not None:
        back = values[order]
        back = torch.where(taken | ~torch.isfinite(back), torch.zeros_like(back), back)
        residual.index_add_(0, global_indices[order], back.to(residual.dtype))


def accepts(compressor: Compressor) -> bool:
    """Whether ``compressor``'s payloads go through :func:`sparse_two_phase` (Top-K's, its
    values as they are)."""
    return isinstance(compressor, TopK) and compressor.value_bits is None
