"""The CPU backend: every op of :mod:`gradcomp.ops.reference`, fast on CPU tensors.

The same bits as the reference (tested against it), computed in ways that
pay on a CPU and would not elsewhere:

* long tensors are worked through a chunk at a time (:func:`chunks`), so
  that a chunk's temporaries stay in a core's L2 and are reused;
* compare-and-pack and bit tricks run in numpy, where torch's ops into
  bool tensors or one strided op per position cost several times as much;
* a residual of fp32 becomes ``x + residual`` in place, and passes that
  only clean non-finite values are skipped when every value is known
  finite (on a CPU, reading a flag costs nothing);
* random-K's cycle walk runs in numpy, on the few entries still out of
  range.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from gradcomp.ops import index_cache, reference
from gradcomp.ops.cpu_packing import pack_bits, unpack_bits
from gradcomp.ops.reference import blocks_of, compensate, write_out


def is_available(device: torch.device) -> bool:
    """CPU tensors only."""
    return torch.device(device).type == "cpu"


def _compensate_in_residual(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """:func:`compensate`, computed in an fp32 ``residual`` itself (returned flat).

    For ops that rewrite the whole residual afterwards: it saves a
    tensor-sized temporary and a copy.
    """
    if residual is None or residual.dtype != torch.float32:
        return compensate(x, residual)
    flat = residual.view(-1)
    flat += x.reshape(-1)
    return flat


def store_residual(
    residual: torch.Tensor | None,
    y: torch.Tensor,
    decoded: torch.Tensor,
    scratch: torch.Tensor | None = None,
    finite: bool = False,
) -> None:
    """``residual <- y - decoded``, non-finite entries zeroed (a pass skipped
    when the caller knows the difference ``finite``).

    Written straight into an fp32 residual; any other residual dtype gets the
    fp32 error through ``scratch`` (default ``y``), which is overwritten.
    """
    if residual is None:
        return
    flat = residual.view(-1)
    target = flat if flat.dtype == torch.float32 else (y if scratch is None else scratch)
    torch.sub(y, decoded, out=target)
    if not finite:
        target.nan_to_num_(0.0, 0.0, 0.0)
    if target is not flat:
        flat.copy_(target)


def _known(flag: torch.Tensor) -> bool:
    """A 0-d bool tensor's value (on a CPU, reading it costs nothing)."""
    return bool(flag)


# ----------------------------------------------------------------------------- quantization


def quantize_blockwise(
    x: torch.Tensor,
    bits: int,
    block: int,
    stochastic: bool = False,
    seed: int = 0,
    residual: torch.Tensor | None = None,
    *,
    levels: int | None = None,
    scale: str = "absmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: :func:`gradcomp.ops.reference.quantize_blockwise`."""
    x = x.reshape(-1)
    numel = x.numel()
    packed = torch.empty(math.ceil(numel * bits / 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(math.ceil(numel / block), dtype=torch.float32, device=x.device)
    generator = reference.generator(seed, x.device) if stochastic else None
    flat_residual = None if residual is None else residual.view(-1)
    for start, end in chunks(numel, block):
        part_residual = _part(flat_residual, start, end, numel)
        _quantize_part(
            _compensate_in_residual(_part(x, start, end, numel), part_residual),
            part_residual,
            bits,
            block,
            levels,
            scale,
            generator,
            _part(packed, start * bits // 8, math.ceil(end * bits / 8), packed.numel()),
            _part(scales, start // block, math.ceil(end / block), scales.numel()),
        )
    return packed, scales


def _part(flat: torch.Tensor | None, start: int, end: int, numel: int) -> torch.Tensor | None:
    """``flat[start:end]``; ``flat`` itself where that is all of it (a slice costs more
    than a small tensor's kernels)."""
    if flat is None or (start == 0 and end == numel):
        return flat
    return flat[start:end]


# 2**128 - 2**103, halfway between the largest float and 2**128: a float32 product
# whose exact value (computed exactly in float64) lies below it rounds to a finite
# float32, and one at or above it (or NaN) does not.
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


def _quantize_part(
    y: torch.Tensor,
    residual: torch.Tensor | None,
    bits: int,
    block: int,
    levels: int,
    scale: str,
    generator: torch.Generator | None,
    packed: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """:func:`quantize_blockwise` of the compensated ``y`` into ``packed`` and ``scales``."""
    numel = y.numel()
    blocks = blocks_of(y, block)
    if scale == "absmax":
        # amax propagates NaN, so a block holding NaN gets a NaN scale.
        magnitude = blocks.abs().amax(dim=1)
    else:
        # Scale by the absmax first: squaring values above ~1.8e19 overflows fp32.
        peak = blocks.abs().amax(dim=1, keepdim=True)
        safe_peak = torch.where(peak > 0, peak, torch.ones_like(peak))
        magnitude = (blocks / safe_peak).norm(dim=1) * peak.squeeze(1)
    torch.div(magnitude, levels, out=scales)
    # Every scale finite, and far enough below the largest float that
    # level * scale cannot round past it: every element is finite, and so are
    # the levels, the decoded values and the error (a level never has the
    # opposite sign of its element), so two nan_to_num passes go. (amax
    # propagates NaN.) Whether ``scales.amax() * (2 * levels)`` is finite in
    # float32, read from its exact value: one kernel fewer than computing it.
    finite = float(scales.amax()) * (2 * levels) < _FLOAT32_OVERFLOW
    if not finite:
        _keep_top_level_finite(scales, levels)
    # All-zero blocks keep scale 0 and codes of level 0; inf/NaN blocks keep a
    # non-finite scale so that they decode to non-finite values.
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
    level = blocks / divisor
    if generator is not None:
        level += torch.rand(level.shape, generator=generator, device=y.device)
        level.floor_()
    else:
        level.round_()
    if not finite:
        level.nan_to_num_(0.0, 0.0, 0.0)
    level.clamp_(-levels, levels)
    # Codes level + levels, made in bytes: levels <= 127 fits int8 exactly and
    # the uint8 add wraps the negative ones into place.
    if bits == 8:
        packed.view(torch.int8).copy_(level.view(-1)[:numel])
        packed.add_(levels)
    else:
        codes = level.view(-1)[:numel].to(torch.int8).view(torch.uint8).add_(levels)
        packed.copy_(pack_bits(codes, bits))
    if residual is not None:
        # In place (fresh buffers cost page faults): level becomes the decoded value.
        decoded = level.mul_(scales.unsqueeze(1)).view(-1)[:numel]
        store_residual(residual, blocks.view(-1)[:numel], decoded, scratch=decoded, finite=finite)


def _keep_top_level_finite(scales: torch.Tensor, levels: int) -> None:
    """Step a finite scale down one ulp where ``levels * scale`` rounds past the
    largest float (int8: ``127 * (max / 127)`` does), so that every level of
    a finite block decodes to a finite value. One ulp is enough: the scale is
    within half an ulp of ``peak / levels``."""
    over = torch.isfinite(scales) & ~torch.isfinite(scales * levels)
    scales.view(torch.int32)[over] -= 1  # positive floats: the next one down


def dequantize_blockwise(
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    *,
    levels: int | None = None,
) -> torch.Tensor:
    """Reference: :func:`gradcomp.ops.reference.dequantize_blockwise`."""
    target = torch.empty(numel, dtype=torch.float32, device=q.device) if out is None else out
    q, scales, flat = q.reshape(-1), scales.reshape(-1), target.view(-1)
    for start, end in chunks(numel, block):
        codes = unpack_bits(q[start * bits // 8 : math.ceil(end * bits / 8)], bits, end - start)
        # The signed levels, made in bytes (the uint8 subtraction wraps into int8).
        level = blocks_of(torch.sub(codes, levels).view(torch.int8).to(torch.float32), block)
        _scale_out(level, scales[start // block : math.ceil(end / block)], flat[start:end], accumulate)
    return target


def _scale_out(level: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= level * scale`` per block; ``level`` is ``(blocks, block)``, overwritten."""
    column = scales.float().unsqueeze(1)
    numel = out.numel()
    if not accumulate and out.dtype == torch.float32 and level.numel() == numel:
        torch.mul(level, column, out=out.view(level.shape))
        return
    write_out(level.mul_(column).view(-1)[:numel], out, accumulate)


# Long tensors are worked through a chunk at a time: the temporaries of one
# chunk (512 KB each at 2**17 fp32 elements) stay in a core's L2 between the
# passes over them and are reused by the allocator, where tensor-sized ones
# cost a page fault per page (bench/README.md has the measurement). Blocks
# never straddle chunks, so the results are those of one pass over the
# whole tensor.
CHUNK_ELEMENTS = 2**17


def chunks(numel: int, block: int, elements: int | None = None) -> list[tuple[int, int]]:
    """Element ranges covering ``numel``, about ``elements`` each (default
    :data:`CHUNK_ELEMENTS`): whole blocks, whole bytes of codes."""
    unit = math.lcm(block, 8)
    step = max(1, (CHUNK_ELEMENTS if elements is None else elements) // unit) * unit
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


# ----------------------------------------------------------------------------- 1-bit sign


def sign_compress(
    x: torch.Tensor, block: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: :func:`gradcomp.ops.reference.sign_compress`."""
    x = x.reshape(-1)
    numel = x.numel()
    packed = torch.empty(math.ceil(numel / 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(math.ceil(numel / block), dtype=torch.float32, device=x.device)
    for start, end in chunks(numel, block):
        part_residual = None if residual is None else residual.view(-1)[start:end]
        part = end - start
        blocks = blocks_of(compensate(x[start:end], part_residual), block)
        counts = torch.full((blocks.shape[0],), float(block), device=x.device)
        if part % block:
            counts[-1] = part % block
        part_scales = scales[start // block : math.ceil(end / block)]
        torch.div(blocks.abs().sum(dim=1), counts, out=part_scales)
        # NaN has no sign: it must still decode to NaN, which its block's NaN scale ensures.
        positive = _non_negative(blocks)
        packed[start // 8 : math.ceil(end / 8)] = pack_bits(positive.view(-1)[:part].view(torch.uint8), 1)
        if part_residual is not None:
            signs = positive.view(torch.uint8).to(torch.float32).mul_(2).sub_(1)
            decoded = signs.mul_(part_scales.unsqueeze(1)).view(-1)[:part]
            # As in quantization: finite scales, finite error (same signs).
            finite = _known(torch.isfinite(part_scales).all())
            store_residual(part_residual, blocks.view(-1)[:part], decoded, scratch=decoded, finite=finite)
    return packed, scales


def _non_negative(y: torch.Tensor) -> torch.Tensor:
    """``y >= 0`` (False for NaN), through numpy, where torch's comparison
    into a bool tensor is several times slower."""
    return torch.from_numpy(np.greater_equal(y.numpy(), 0))


def sign_decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Reference: :func:`gradcomp.ops.reference.sign_decompress`."""
    target = torch.empty(numel, dtype=torch.float32, device=packed.device) if out is None else out
    packed, scales, flat = packed.reshape(-1), scales.reshape(-1), target.view(-1)
    for start, end in chunks(numel, block):
        signs = unpack_bits(packed[start // 8 : math.ceil(end / 8)], 1, end - start)
        level = blocks_of(signs.to(torch.float32).mul_(2).sub_(1), block)
        _scale_out(level, scales[start // block : math.ceil(end / block)], flat[start:end], accumulate)
    return target


# ----------------------------------------------------------------------------- payload rows


def quantize_rows(
    x, bits, block, chunk, rows, stochastic=False, seed=0, residual=None, *, levels=None, scale="absmax"
):
    """:func:`gradcomp.ops.reference.quantize_rows`, encoded by this backend."""
    codes, scales = quantize_blockwise(x, bits, block, stochastic, seed, residual, levels=levels, scale=scale)
    return reference.write_rows(rows, codes, scales, x.numel(), block, bits, chunk)


def _dequantizer(bits: int, block: int, levels: int):
    def decode(codes, scales, count, into, accumulate):
        dequantize_blockwise(codes, scales, bits, block, count, into, accumulate, levels=levels)

    return decode


def dequantize_rows(rows, bits, block, numel, chunk, out, *, levels=None):
    """:func:`gradcomp.ops.reference.dequantize_rows`, decoded by this backend."""
    reference.decode_rows(rows, block, bits, chunk, out.view(-1)[:numel], _dequantizer(bits, block, levels))
    return out


def _decode_sum(rows, block: int, bits: int, out: torch.Tensor, divisor: int, decode) -> None:
    """:func:`gradcomp.ops.reference.decode_sum`'s bits; an fp32 ``out`` is the
    accumulator itself (tensor-sized temporaries cost a page fault a page)."""
    if out.dtype != torch.float32:
        reference.decode_sum(rows, block, bits, out, divisor, decode)
        return
    numel = out.numel()
    out.zero_()
    for row in rows:
        decode(*reference.read_row(row, block, bits, numel), numel, out, True)
    if divisor != 1:
        out.div_(divisor)


def dequantize_sum(rows, bits, block, numel, out, *, levels=None, divisor=1):
    """:func:`gradcomp.ops.reference.dequantize_sum`, decoded by this backend."""
    flat = _part(out.view(-1), 0, numel, out.numel())
    if flat.dtype == torch.float32:
        _dequantize_rows_sum(rows, bits, block, levels, flat, divisor)
    else:
        _decode_sum(rows, block, bits, flat, divisor, _dequantizer(bits, block, levels))
    return out


def _dequantize_rows_sum(rows, bits: int, block: int, levels: int, out: torch.Tensor, divisor: int) -> None:
    """:func:`dequantize_sum` into an fp32 ``out``: every row's chunk decoded at once
    (a chunk of all of them stays in L2), then added in row order."""
    numel, count = out.numel(), rows.shape[0]
    blocks = math.ceil(numel / block)
    scales = rows[:, : 4 * blocks].view(torch.float32)
    codes = rows[:, 4 * blocks : 4 * blocks + math.ceil(numel * bits / 8)]
    out.zero_()
    if count == 0:  # the sum of no payloads
        return
    for start, end in chunks(numel, block, max(1, CHUNK_ELEMENTS // count)):
        part = codes[:, start * bits // 8 : math.ceil(end * bits / 8)]
        if bits != 8:
            part = unpack_bits(part.reshape(-1), bits, part.numel() * (8 // bits)).view(count, -1)
        # The signed levels, made in bytes (the uint8 subtraction wraps into int8).
        level = torch.sub(part, levels).view(torch.int8).to(torch.float32)
        size, whole = end - start, math.ceil((end - start) / block)
        if level.shape[1] != whole * block:  # the last block's padding, or codes past the end
            level = torch.nn.functional.pad(level[:, :size], (0, whole * block - size))
        first = start // block
        decoded = level.view(count, whole, block).mul_(scales[:, first : first + whole].unsqueeze(2))
        decoded = decoded.view(count, -1)
        target = _part(out, start, end, numel)
        for row in range(count):
            target += _part(decoded[row], 0, size, whole * block)
    if divisor != 1:
        out.div_(divisor)


def sign_compress_rows(x, block, chunk, rows, residual=None):
    """:func:`gradcomp.ops.reference.sign_compress_rows`, encoded by this backend."""
    signs, scales = sign_compress(x, block, residual)
    return reference.write_rows(rows, signs, scales, x.numel(), block, 1, chunk)


def _sign_decoder(block: int):
    def decode(signs, scales, count, into, accumulate):
        sign_decompress(signs, scales, block, count, into, accumulate)

    return decode


def sign_decompress_rows(rows, block, numel, chunk, out):
    """:func:`gradcomp.ops.reference.sign_decompress_rows`, decoded by this backend."""
    reference.decode_rows(rows, block, 1, chunk, out.view(-1)[:numel], _sign_decoder(block))
    return out


def sign_decompress_sum(rows, block, numel, out, *, divisor=1):
    """:func:`gradcomp.ops.reference.sign_decompress_sum`, decoded by this backend."""
    _decode_sum(rows, block, 1, out.view(-1)[:numel], divisor, _sign_decoder(block))
    return out


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
    pieces = chunks(y.numel(), 1)
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
    y = _compensate_in_residual(x, residual)
    picked = y[indices]
    scaled = picked * multiplier
    # No host sync: adds NaN to the first value exactly when y holds inf or NaN.
    # (min and max propagate NaN: both are finite exactly when every entry is.)
    finite = torch.isfinite(torch.stack(torch.aminmax(y))).all()
    scaled[:1] += torch.where(finite, 0.0, math.nan)
    values = scaled.to(value_dtype)
    # Known finite: the residual's nan_to_num pass goes.
    clean = residual is not None and _known(finite)
    _keep_unsent(residual, y, indices, picked - values.float(), finite=clean)
    return values


FUNCTIONS = {
    "quantize_blockwise": quantize_blockwise,
    "dequantize_blockwise": dequantize_blockwise,
    "quantize_rows": quantize_rows,
    "dequantize_rows": dequantize_rows,
    "dequantize_sum": dequantize_sum,
    "sign_compress": sign_compress,
    "sign_decompress": sign_decompress,
    "sign_compress_rows": sign_compress_rows,
    "sign_decompress_rows": sign_decompress_rows,
    "sign_decompress_sum": sign_decompress_sum,
    "topk_select": topk_select,
    "randk_select": randk_select,
    "randk_indices": randk_indices,
    "scatter_add": reference.scatter_add,
    "pack_bits": pack_bits,
    "unpack_bits": unpack_bits,
}
