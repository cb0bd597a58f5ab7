"""The CPU backend's small-tensor paths, in numpy.

Below :data:`SMALL` elements a torch op costs more to dispatch than to run
(several microseconds each, and a blockwise quantization is some twenty of
them), where a numpy operation costs a fraction of that. These paths do the
same IEEE float32 operations, element by element, in the same order as the
CPU backend's torch ones (divisions, round half to even, clamps, products,
the rows added in rank order), so they give the same bits (tested against
the reference); where a case is not theirs (a non-finite scale, stochastic
rounding, 16-bit residuals, a tensor that records gradients) they say so and
the torch path runs.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gradcomp.ops.cpu_packing import pack_bits, unpack_bits

# At most this many elements take the numpy paths: dispatch dominates below it, and
# above it torch's ops may run on several threads.
SMALL = 2**14


def _numpy(tensor: torch.Tensor) -> np.ndarray | None:
    """The float32 array ``tensor`` is (no copy), or None where it cannot be one."""
    if tensor.dtype != torch.float32 or tensor.requires_grad or not tensor.is_contiguous():
        return None
    return tensor.numpy()


# numpy warns where torch is silent (an overflowing sum, 0 * inf): the results are the same.
# (quantize never computes with a non-finite value: it leaves those to the torch path.)
_QUIET = np.errstate(over="ignore", invalid="ignore")


def quantize(y, residual, bits: int, block: int, levels: int, overflow: float, packed, scales) -> bool:
    """Round-to-nearest absmax quantization of the compensated ``y`` (1-D) into
    ``packed`` and ``scales``, ``residual`` (or None) set to ``y`` minus what the
    codes decode to; False, with nothing written, where the torch path must run
    (``overflow``: the bound the largest scale times ``2 levels`` stays under when
    every decoded value is finite)."""
    numel = y.numel()
    values = _numpy(y)
    kept = None if residual is None else _numpy(residual)
    if numel > SMALL or values is None or (residual is not None and kept is None):
        return False
    pad = (-numel) % block
    if pad:
        values = np.concatenate((values, np.zeros(pad, dtype=np.float32)))
    blocks = values.reshape(-1, block)
    # The ufuncs themselves: ndarray.max and np.clip go through Python wrappers first.
    scale = np.maximum.reduce(np.abs(blocks), axis=1)
    np.divide(scale, np.float32(levels), out=scale)
    if not float(np.maximum.reduce(scale)) * (2 * levels) < overflow:  # non-finite (NaN fails too)
        return False
    scales.numpy()[:] = scale
    column = np.where(scale > 0, scale, np.float32(1.0))[:, None]
    level = blocks / column
    np.rint(level, out=level)
    np.minimum(level, levels, out=level)
    np.maximum(level, -levels, out=level)
    flat = level.reshape(-1)[:numel]
    codes = flat.astype(np.int8).view(np.uint8)
    codes += np.uint8(levels)  # wraps the negative levels into place, as the torch path does
    if bits == 8:
        packed.numpy()[:] = codes
    else:
        packed.copy_(pack_bits(torch.from_numpy(codes), bits))
    if kept is not None:
        level *= scale[:, None]
        np.subtract(blocks.reshape(-1)[:numel], flat, out=kept)
    return True


@_QUIET
def dequantize_sum(
    rows: torch.Tensor, bits: int, block: int, levels: int, out: torch.Tensor, divisor: int
) -> bool:
    """``out`` (fp32, 1-D) = the sum, row by row in order, of the payloads in
    ``rows``, divided by ``divisor``; False, with nothing written, where the torch
    path must run."""
    numel, count = out.numel(), rows.shape[0]
    total = _numpy(out)
    if numel > SMALL or total is None or count == 0 or rows.stride(1) != 1:
        return False
    whole = math.ceil(numel / block)
    grid = rows.numpy()
    scale = grid[:, : 4 * whole].view(np.float32)
    codes = rows[:, 4 * whole : 4 * whole + math.ceil(numel * bits / 8)]
    if bits == 8:
        codes = grid[:, 4 * whole : 4 * whole + numel]
    else:
        codes = unpack_bits(codes.reshape(-1), bits, codes.numel() * (8 // bits)).view(count, -1).numpy()
    level = (codes - np.uint8(levels)).view(np.int8)[:, :numel].astype(np.float32)
    if level.shape[1] != whole * block:  # the last block's padding
        level = np.concatenate((level, np.zeros((count, whole * block - numel), dtype=np.float32)), axis=1)
    decoded = level.reshape(count, whole, block)
    decoded *= scale[:, :, None]
    decoded = decoded.reshape(count, -1)
    total[:] = 0.0
    for row in range(count):
        np.add(decoded[row, :numel], total, out=total)  # as torch's +=: the row's NaN where both are
    if divisor != 1:
        np.divide(total, np.float32(divisor), out=total)
    return True


@_QUIET
def top_k(x, k: int, residual, sample_whole: bool):
    """:func:`gradcomp.ops.reference.topk_select`'s sampling path where the sample is
    the whole tensor (``sample_whole``): the threshold then lets every entry that
    can be picked through, and the picks are the ``k`` largest non-zero magnitudes
    (NaN as inf), ties to the lowest index, in ascending order. ``(indices, values)``
    before padding, ``residual`` (or None) updated; None, with nothing written,
    where the torch path must run."""
    numel = x.numel()
    given = _numpy(x)
    kept = None if residual is None else _numpy(residual)
    if not sample_whole or numel > SMALL or given is None or (residual is not None and kept is None):
        return None
    if kept is not None:
        np.add(given, kept, out=kept)  # as torch's residual += x: x's NaN where both are NaN
        y = kept
    else:
        y = given
    magnitude = np.abs(y)
    finite = bool(np.isfinite(magnitude).all())
    if not finite:
        magnitude[np.isnan(magnitude)] = np.inf
    kth = np.partition(magnitude, numel - k)[numel - k]
    chosen = magnitude > kth
    if kth > 0:  # zero is never picked
        tied = np.flatnonzero(magnitude == kth)
        chosen[tied[: k - int(np.count_nonzero(chosen))]] = True
    indices = np.flatnonzero(chosen)
    values = y[indices]
    if kept is not None:
        if not finite:
            kept[~np.isfinite(kept)] = 0.0
        kept[indices] = 0.0  # what an fp32 value loses: nothing (NaN and inf: nothing kept)
    return torch.from_numpy(indices), torch.from_numpy(values)
