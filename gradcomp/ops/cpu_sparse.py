"""The CPU backend's sparse ops: Top-K (its sampled threshold read on bit
patterns in numpy, small tensors through :mod:`gradcomp.ops.cpu_small`) and
random-K (the Feistel cycle walk in numpy, on the few entries still out of
range). The same bits as :mod:`gradcomp.ops.reference_sparse` (tested)."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from gradcomp.ops import cpu_shared, cpu_small, index_cache, reference
from gradcomp.ops.cpu_shared import compensate_in_residual, known
from gradcomp.ops.reference import compensate

# ----------------------------------------------------------------------------- Top-K


def _sampled_top_k(x, residual, y, pending, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (ascending) and values in ``y`` of the sampling path's picks, before padding.

    ``y`` is ``x + residual``, or will be once ``pending`` is added."""
    # Read before the residual is touched: the same bits as y's samples.
    threshold = reference.sample_threshold(x, residual, k, seed)
    candidates = _reaching(y, threshold, pending)
    picked = y.index_select(0, candidates)  # on CPU much faster than y[candidates]
    magnitude = reference.selection_magnitude(picked)
    capacity = reference.candidate_capacity(k)
    if candidates.numel() > capacity:
        ranked = reference.within_capacity(magnitude > threshold, capacity)
        candidates, picked, magnitude = candidates[ranked], picked[ranked], magnitude[ranked]
    if candidates.numel() <= k:
        return candidates, picked
    kept = reference.keep_largest(magnitude, k)
    return candidates[kept], picked[kept]


def topk_select(
    x: torch.Tensor,
    k: int,
    residual: torch.Tensor | None = None,
    exact: bool = False,
    *,
    seed: int = 0,
    index_dtype: torch.dtype | None = None,
    value_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: :func:`gradcomp.ops.reference.topk_select`."""
    numel = x.numel()
    if not exact and k != numel and value_dtype == torch.float32:
        whole = reference.sample_size(numel, k) >= numel
        flat_residual = None if residual is None else residual.view(-1)
        small = cpu_small.top_k(x.reshape(-1), k, flat_residual, whole)
        if small is not None:
            return _padded(*small, k, index_dtype)
    # y = x + residual. An fp32 residual becomes y in place, lazily: the
    # sampling path adds x a chunk at a time inside the selection loop.
    if residual is not None and residual.dtype == torch.float32:
        y, pending = residual.view(-1), x.reshape(-1)
    else:
        y, pending = compensate(x, residual), None
    if exact or k == numel:
        if pending is not None:
            y += pending
        indices = torch.topk(reference.selection_magnitude(y), k, sorted=False).indices
        picked = y.index_select(0, indices)
    else:
        indices, picked = _sampled_top_k(x, residual, y, pending, k, seed)
    values = picked.to(value_dtype)
    # Every selection takes inf and NaN first (up to k of them), so y has a
    # non-finite entry outside the picks only if a pick is non-finite.
    clean = residual is not None and bool(torch.isfinite(picked).all())
    _keep_unsent(residual, y, indices, picked - values.float(), finite=clean)
    return _padded(indices, values, k, index_dtype)


def _padded(indices: torch.Tensor, values: torch.Tensor, k: int, index_dtype: torch.dtype):
    """``(values, indices)`` of ``k`` entries: fewer picks padded with index 0, value 0."""
    if indices.numel() < k:
        padding = k - indices.numel()
        values = torch.cat([values, values.new_zeros(padding)])
        indices = torch.cat([indices, indices.new_zeros(padding)])
    return values, indices.to(index_dtype)


def _reaching(y: torch.Tensor, threshold: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor:
    """Ascending indices (int64) where :func:`selection_magnitude` of ``y`` reaches ``threshold``.

    With ``pending``, ``y += pending`` first (in the same chunk loop). A
    chunk at a time, in numpy, on the bit patterns: for floats of
    either sign, ``bits & 0x7FFFFFFF`` orders as ``|y|`` does, inf included,
    and NaN's patterns lie above inf's, so NaN reaches every threshold, as
    in :func:`selection_magnitude`. Two integer passes and no temporaries
    instead of abs, nan_to_num and a float compare.
    """
    bound = int(np.float32(threshold.item()).view(np.int32))
    pieces = cpu_shared.chunks(y.numel(), 1)
    size = max(end - start for start, end in pieces)
    bits, mask = np.empty(size, np.int32), np.empty(size, np.bool_)
    patterns = y.numpy().view(np.int32)
    found = []
    for start, end in pieces:
        if pending is not None:
            y[start:end] += pending[start:end]
        n = end - start
        np.bitwise_and(patterns[start:end], 0x7FFFFFFF, out=bits[:n])
        np.greater_equal(bits[:n], bound, out=mask[:n])
        found.append(np.flatnonzero(mask[:n]) + start)
    return torch.from_numpy(found[0] if len(found) == 1 else np.concatenate(found))


def _keep_unsent(
    residual: torch.Tensor | None,
    y: torch.Tensor,
    indices: torch.Tensor,
    lost: torch.Tensor,
    finite: bool = False,
) -> None:
    """Residual of a sparse send: ``y`` where nothing was sent, ``lost`` at ``indices``.
    Consumes ``y`` (non-finite entries zeroed in place, a pass skipped when
    the caller knows them ``finite``)."""
    if residual is None:
        return
    flat = residual.view(-1)
    if not finite:
        y.nan_to_num_(0.0, 0.0, 0.0)
    if y.data_ptr() != flat.data_ptr():  # else y is the residual already
        flat.copy_(y)
    flat[indices] = lost.nan_to_num(0.0, 0.0, 0.0).to(flat.dtype)


# ----------------------------------------------------------------------------- random-K


def _feistel_permute_numpy(x: np.ndarray, half_bits: int, keys: list[int]) -> np.ndarray:
    """:func:`feistel_permute` on uint64 arrays, the halves in uint32, whose
    products wrap modulo 2**32 as ``& 0xFFFFFFFF`` makes them there."""
    mask = np.uint32((1 << half_bits) - 1)
    left = (x >> np.uint64(half_bits)).astype(np.uint32)
    right = (x & np.uint64(mask)).astype(np.uint32)
    for key in keys:
        value = right ^ np.uint32(key)
        value ^= value >> np.uint32(16)
        value *= np.uint32(reference.HASH_MULTIPLIERS[0])
        value ^= value >> np.uint32(15)
        value *= np.uint32(reference.HASH_MULTIPLIERS[1])
        value ^= value >> np.uint32(16)
        value &= mask
        value ^= left
        left, right = right, value
    return (left.astype(np.uint64) << np.uint64(half_bits)) | right


def _walk_numpy(numel: int, k: int, half_bits: int, keys: list[int]) -> torch.Tensor:
    """:func:`_walk_torch` on CPU: each walk takes only the entries still out
    of range, in numpy, where an op on a few elements costs a microsecond, not
    the ten of a torch op (the walk takes about 20 rounds)."""
    chosen = _feistel_permute_numpy(np.arange(k, dtype=np.uint64), half_bits, keys)
    pending = np.flatnonzero(chosen >= numel)
    while pending.size:
        moved = _feistel_permute_numpy(chosen[pending], half_bits, keys)
        chosen[pending] = moved
        pending = pending[moved >= numel]
    chosen = chosen.astype(np.int64)
    chosen.sort()
    return torch.from_numpy(chosen)


def randk_indices(numel: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`gradcomp.ops.reference.randk_indices`, walked in numpy, the last few remembered."""
    half_bits, keys = reference.feistel_half_bits(numel), reference.feistel_keys(seed)
    walk = functools.partial(_walk_numpy, numel, k, half_bits, keys)
    return index_cache.remembered("cpu", numel, k, seed, torch.device(device), walk)


def randk_select(
    x: torch.Tensor,
    k: int,
    seed: int,
    residual: torch.Tensor | None = None,
    *,
    multiplier: float = 1.0,
    value_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reference: :func:`gradcomp.ops.reference.randk_select`."""
    indices = randk_indices(x.numel(), k, seed, x.device)
    y = compensate_in_residual(x, residual)
    picked = y[indices]
    scaled = picked * multiplier
    # No host sync: adds NaN to the first value exactly when y holds inf or NaN.
    # (min and max propagate NaN: both are finite exactly when every entry is.)
    finite = torch.isfinite(torch.stack(torch.aminmax(y))).all()
    scaled[:1] += torch.where(finite, 0.0, math.nan)
    values = scaled.to(value_dtype)
    # Known finite: the residual's nan_to_num pass goes.
    clean = residual is not None and known(finite)
    _keep_unsent(residual, y, indices, picked - values.float(), finite=clean)
    return values
