"""Kernels for random-K selection with fused error feedback, and scatter-add.

The ops layer (:mod:`gradcomp.ops.triton_backend`) strings them together:

* random-K: :func:`randk_indices` (a keyed permutation, cycle-walked into
  range), :func:`gather_compensated` (values at the picks and what sending
  them loses), :func:`fold_into_residual` (one pass: ``residual <- x + residual``,
  non-finite flags per block);
* :func:`scatter_add`, the sparse decode: pairs added in their order (rows in
  rank order), with no atomic add;
* Top-K's kernels are in :mod:`.topk`.
"""

import torch
import triton
import triton.language as tl

from .common import EXACT, block_lanes, finite_or_zero, flat, is_finite, load_compensated

ELEMENTS_PER_PROGRAM = 1024


# ----------------------------------------------------------------------------- random-K


@triton.jit
def _hash32(value):
    value = value ^ (value >> 16)
    value = (value * 0x7FEB352D) & 0xFFFFFFFF
    value = value ^ (value >> 15)
    value = (value * 0x2C1B3C6D) & 0xFFFFFFFF
    return value ^ (value >> 16)


@triton.jit
def _permute(x, half_bits, key0, key1, key2, key3):
    mask = (tl.full(x.shape, 1, tl.int64) << half_bits) - 1
    left = x >> half_bits
    right = x & mask
    left, right = right, left ^ (_hash32(right ^ key0) & mask)
    left, right = right, left ^ (_hash32(right ^ key1) & mask)
    left, right = right, left ^ (_hash32(right ^ key2) & mask)
    left, right = right, left ^ (_hash32(right ^ key3) & mask)
    return (left << half_bits) | right


# The keys change with every step's seed: one type (a 32-bit key is an i32 or an
# i64 by its value) and no specialisation, or each new kind of key compiles again.
@triton.jit(do_not_specialize=["key0", "key1", "key2", "key3"])
def _randk_indices_kernel(
    out_ptr,
    k,
    numel,
    half_bits,
    key0: tl.int64,
    key1: tl.int64,
    key2: tl.int64,
    key3: tl.int64,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < k
    chosen = _permute(offsets, half_bits, key0, key1, key2, key3)
    outside = (chosen >= numel) & mask
    while tl.max(outside.to(tl.int32), axis=0) > 0:
        chosen = tl.where(outside, _permute(chosen, half_bits, key0, key1, key2, key3), chosen)
        outside = (chosen >= numel) & mask
    tl.store(out_ptr + offsets, chosen, mask=mask)


@triton.jit
def _gather_kernel(
    x_ptr,
    residual_ptr,
    indices_ptr,
    values_ptr,
    lost_ptr,
    k,
    multiplier,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < k
    index = tl.load(indices_ptr + offsets, mask=mask, other=0).to(tl.int64)
    y = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        y += tl.load(residual_ptr + index, mask=mask, other=0.0).to(tl.float32)
    sent = (y * multiplier).to(values_ptr.dtype.element_ty)
    tl.store(values_ptr + offsets, sent, mask=mask)
    tl.store(lost_ptr + offsets, finite_or_zero(y - sent.to(tl.float32)), mask=mask)


@triton.jit
def _fold_kernel(x_ptr, residual_ptr, flags_ptr, numel, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    pid, offsets, mask = block_lanes(numel, BLOCK, BLOCK)
    y = load_compensated(x_ptr, residual_ptr, offsets, mask, HAS_RESIDUAL)
    if HAS_RESIDUAL:
        tl.store(residual_ptr + offsets, finite_or_zero(y), mask=mask)
    tl.store(flags_ptr + pid, tl.max((~is_finite(y)).to(tl.int32), axis=0))


def randk_indices(numel: int, k: int, half_bits: int, keys: list[int], device) -> torch.Tensor:
    """The first ``k`` outputs of the keyed permutation of ``[0, numel)``, ascending (int64)."""
    chosen = torch.empty(k, dtype=torch.int64, device=device)
    if k:
        grid = (triton.cdiv(k, ELEMENTS_PER_PROGRAM),)
        _randk_indices_kernel[grid](chosen, k, numel, half_bits, *keys, BLOCK=ELEMENTS_PER_PROGRAM)
    return chosen.sort().values


def gather_compensated(
    x, residual, indices, multiplier: float, value_dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, lost)``: ``(x + residual)[indices] * multiplier`` in ``value_dtype``, and
    ``y - sent`` there in fp32 (zero where not finite)."""
    count = indices.numel()
    values = torch.empty(count, dtype=value_dtype, device=x.device)
    lost = torch.empty(count, dtype=torch.float32, device=x.device)
    if count:
        _gather_kernel[(triton.cdiv(count, ELEMENTS_PER_PROGRAM),)](
            x,
            residual if residual is not None else x,
            indices,
            values,
            lost,
            count,
            float(multiplier),
            HAS_RESIDUAL=residual is not None,
            BLOCK=ELEMENTS_PER_PROGRAM,
            **EXACT,
        )
    return values, lost


def fold_into_residual(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``residual <- finite(x + residual)`` in one pass (when given); returns a
    per-block flag (int32) of inf or NaN in ``x + residual``."""
    numel = x.numel()
    flags = torch.zeros(max(1, triton.cdiv(numel, ELEMENTS_PER_PROGRAM)), dtype=torch.int32, device=x.device)
    if numel:
        _fold_kernel[(triton.cdiv(numel, ELEMENTS_PER_PROGRAM),)](
            x,
            residual if residual is not None else x,
            flags,
            numel,
            HAS_RESIDUAL=residual is not None,
            BLOCK=ELEMENTS_PER_PROGRAM,
            **EXACT,
        )
    return flags


# ----------------------------------------------------------------------------- scatter-add
#
# The pairs are added in the order given (rows in rank order), as the reference adds
# them, with no atomic add, whose order a GPU leaves open: a stable sort of the pairs
# by index puts each element's pairs next to each other, in their order; the first
# pair of each run reads the element, adds the run's values one after another and
# writes it, the only lane that touches it. A zero value adds nothing: its pair sorts
# past every run (the key numel), so Top-K's pads do not make one long run at index 0.
# An index outside the output joins element 0's run as a NaN: the step reads as
# non-finite, without a trap (which would end the CUDA context and leave the peers
# waiting) or a write out of bounds.


@triton.jit
def _run_keys_kernel(indices_ptr, values_ptr, out_ptr, keys_ptr, count, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < count
    index = tl.load(indices_ptr + offsets, mask=mask, other=0).to(tl.int64)
    value = tl.load(values_ptr + offsets, mask=mask, other=0.0).to(out_ptr.dtype.element_ty)
    inside = (index >= 0) & (index < numel)
    key = tl.where(inside, tl.where(value == 0, numel, index), 0)
    tl.store(keys_ptr + offsets, key.to(keys_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _addend(indices_ptr, values_ptr, pair, mask, numel, dtype: tl.constexpr):
    """Pair ``pair``'s value rounded to ``dtype`` (the output's), in the dtype torch adds
    it in (fp64 for fp64, else fp32); NaN where its index lies outside the output."""
    value = tl.load(values_ptr + pair, mask=mask, other=0.0).to(dtype)
    if dtype != tl.float64:
        value = value.to(tl.float32)
    index = tl.load(indices_ptr + pair, mask=mask, other=0).to(tl.int64)
    return tl.where((index >= 0) & (index < numel), value, float("nan"))


@triton.jit
def _added(total, addend):
    """``total + addend`` in ``addend``'s dtype, rounded to ``total``'s."""
    return (total.to(addend.dtype) + addend).to(total.dtype)


@triton.jit
def _add_runs_kernel(
    keys_ptr, order_ptr, indices_ptr, values_ptr, out_ptr, count, numel, BLOCK: tl.constexpr
):
    positions = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + positions, mask=positions < count, other=numel).to(tl.int64)
    before = tl.load(keys_ptr + positions - 1, mask=(positions > 0) & (positions < count), other=-1)
    first = (key != before.to(tl.int64)) & (key < numel)
    dtype = out_ptr.dtype.element_ty
    total = tl.load(out_ptr + key, mask=first)  # no `other`: the interpreter has no bfloat16 constant
    position, running = positions, first
    while tl.max(running.to(tl.int32), axis=0) > 0:
        pair = tl.load(order_ptr + position, mask=running, other=0)
        addend = _addend(indices_ptr, values_ptr, pair, running, numel, dtype)
        total = tl.where(running, _added(total, addend), total)
        position += 1
        running = running & (position < count)
        running = running & (tl.load(keys_ptr + position, mask=running, other=-1).to(tl.int64) == key)
    tl.store(out_ptr + key, total, mask=first)


def scatter_add(indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`gradcomp.ops.reference.scatter_add`: the pairs added in
    their order (rows in rank order) whatever the GPU's schedule; an index outside
    ``out`` is dropped and makes element 0 NaN."""
    indices, values = flat(indices), flat(values)
    target = out.view(-1)
    count, numel = indices.numel(), target.numel()
    if count:
        # Keys run up to numel (a zero value's).
        keys = torch.empty(count, dtype=torch.int32 if numel < 2**31 else torch.int64, device=out.device)
        grid = (triton.cdiv(count, ELEMENTS_PER_PROGRAM),)
        _run_keys_kernel[grid](
            indices, values, target, keys, count, numel, BLOCK=ELEMENTS_PER_PROGRAM, **EXACT
        )
        keys, order = torch.sort(keys, stable=True)
        _add_runs_kernel[grid](
            keys, order, indices, values, target, count, numel, BLOCK=ELEMENTS_PER_PROGRAM, **EXACT
        )
    return out
