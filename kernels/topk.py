"""Kernels of the sampling Top-K with fused error feedback: one pass over the tensor.

The op (:func:`gradcomp.ops.triton_backend.topk_select`) reads a sample of
``y = x + residual`` for a threshold that about 1.25 k magnitudes reach (800 n / k
elements: for k below 800 the sample is the whole tensor), then:

* :func:`select_candidates` -- the only pass over the whole tensor, and a
  sparse one over the candidates:

  1. ``_mark_candidates_kernel`` reads ``x`` and ``residual`` once and writes the
     residual once, whole: ``finite(y)`` at every element below the threshold,
     the old residual again at the candidates (which the gather reads back). It
     writes one bit per element (candidate or not) and, per block, how many
     magnitudes lie above the threshold and how many equal it;
  2. a prefix sum over those per-block counts (a few hundred thousand at 256M
     elements) places every block's candidates;
  3. ``_gather_candidates_kernel`` reads the bits and, in the lanes of the
     candidates only, ``x`` and the residual, and writes the candidates the
     capacity takes, in index order; where it leaves one out, its residual
     becomes ``finite(y)``.

  For fp32 ``x`` and residual that is 12 bytes an element (one read of each, one
  write of the residual: what any fused error-feedback op moves; a copy moves 8),
  a quarter byte for the bits (written, read), and the 32-byte sectors that hold
  a candidate, read twice: about 0.8 bytes an element at k = 1%, 5 at 10%. A
  count pass and a compaction pass that both read the whole input moved 20.

* :func:`keep_largest` -- the ``k`` largest of the ~1.25 k candidates, ties at the
  k-th to the first, by a radix select on their magnitudes' bit patterns
  (three digits, each a histogram pass over the candidates and a one-program
  kernel that picks the digit): no sort, no host sync.

* :func:`write_back` -- the taken candidates' residual: what their value
  loses in the payload's dtype where kept, the value itself where not; a
  store at each, none at the padding.
"""

import torch
import triton
import triton.language as tl

from .common import EXACT, block_lanes, finite_or_zero

BLOCK = 1024  # elements a program of the passes over the tensor; a multiple of 32 (the bits' words)
WORD = 32
# The radix select's digits, most significant first: bits 30..20, 19..10, 9..0 of
# a magnitude's fp32 pattern (bit 31, the sign, is clear).
DIGIT_SHIFTS = (20, 10, 0)
DIGIT_BINS = (2048, 1024, 1024)
KEY_BLOCK = 4096  # candidates a program of the histogram passes
INFINITY_BITS = 0x7F800000


@triton.jit
def _magnitude(y):
    return tl.where(y != y, float("inf"), tl.abs(y))


@triton.jit
def _mark_candidates_kernel(
    x_ptr,
    residual_ptr,
    threshold_ptr,
    counts_ptr,
    bits_ptr,
    numel,
    blocks,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    WORD: tl.constexpr,
):
    pid, offsets, mask = block_lanes(numel, BLOCK, BLOCK)
    y = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        old = tl.load(residual_ptr + offsets, mask=mask, other=0.0)
        y += old.to(tl.float32)
    magnitude = _magnitude(y)
    threshold = tl.load(threshold_ptr)
    above = (magnitude > threshold) & mask
    equal = (magnitude == threshold) & mask
    candidate = above | equal
    tl.store(counts_ptr + pid, tl.sum(above.to(tl.int64), axis=0))
    tl.store(counts_ptr + blocks + pid, tl.sum(equal.to(tl.int64), axis=0))
    # One bit an element, element w * WORD + b at bit b of word w (distinct bits: the sum is their or).
    flags = tl.reshape(candidate.to(tl.int32), (BLOCK // WORD, WORD))
    words = tl.sum(flags << tl.arange(0, WORD)[None, :], axis=1)
    tl.store(bits_ptr + pid * (BLOCK // WORD) + tl.arange(0, BLOCK // WORD), words)
    if HAS_RESIDUAL:
        # The candidates keep their old residual for the gather to read: written back as it
        # was (its dtype holds it exactly), so that every sector is written whole.
        tl.store(residual_ptr + offsets, tl.where(candidate, old, finite_or_zero(y)), mask=mask)


@triton.jit
def _gather_candidates_kernel(
    x_ptr,
    residual_ptr,
    threshold_ptr,
    starts_ptr,
    bits_ptr,
    values_ptr,
    indices_ptr,
    numel,
    blocks,
    capacity,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    WORD: tl.constexpr,
):
    pid, offsets, mask = block_lanes(numel, BLOCK, BLOCK)
    words = tl.load(bits_ptr + pid * (BLOCK // WORD) + tl.arange(0, BLOCK // WORD))
    flags = (words[:, None] >> tl.arange(0, WORD)[None, :]) & 1
    candidate = (tl.reshape(flags, (BLOCK,)) != 0) & mask
    # Only the candidates' lanes load: the memory of the other elements is not read.
    y = tl.load(x_ptr + offsets, mask=candidate, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        y += tl.load(residual_ptr + offsets, mask=candidate, other=0.0).to(tl.float32)
    magnitude = _magnitude(y)
    threshold = tl.load(threshold_ptr)
    # The block's own counts fit 32 bits: its scans run in int32, the bases are int64.
    above = ((magnitude > threshold) & candidate).to(tl.int32)
    equal = ((magnitude == threshold) & candidate).to(tl.int32)
    # Taken: the first `capacity` above the threshold, then as many equal to it
    # as there is room for, each in index order; written in index order.
    above_total = tl.load(starts_ptr + blocks)
    room = capacity - tl.minimum(above_total, capacity)
    above_before = tl.load(starts_ptr + pid) + (tl.cumsum(above, axis=0) - above).to(tl.int64)
    equal_base = tl.load(starts_ptr + blocks + pid) - above_total
    equal_before = equal_base + (tl.cumsum(equal, axis=0) - equal).to(tl.int64)
    taken = ((above > 0) & (above_before < capacity)) | ((equal > 0) & (equal_before < room))
    position = tl.minimum(above_before, capacity) + tl.minimum(equal_before, room)
    tl.store(values_ptr + position, y, mask=taken)
    tl.store(indices_ptr + position, offsets, mask=taken)
    if HAS_RESIDUAL:
        # A candidate the capacity leaves out keeps y; a taken one's residual is
        # written once it is known whether it is sent (write_back).
        tl.store(residual_ptr + offsets, finite_or_zero(y), mask=candidate & ~taken)


@triton.jit
def _key_histogram_kernel(
    values_ptr,
    count_ptr,
    keys_ptr,
    state_ptr,
    histogram_ptr,
    capacity,
    SHIFT: tl.constexpr,
    BINS: tl.constexpr,
    FIRST: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
):
    """The histogram of one digit of the candidates' keys whose higher digits are the
    k-th largest key's so far. The first pass makes the keys: a magnitude's fp32 bit
    pattern (NaN as inf's), 0 for the slots past the candidates' count."""
    offsets = tl.program_id(0).to(tl.int64) * KEY_BLOCK + tl.arange(0, KEY_BLOCK)
    inside = offsets < capacity
    if FIRST:
        y = tl.load(values_ptr + offsets, mask=inside, other=0.0)
        key = tl.minimum(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x7F800000)  # NaN as inf
        key = tl.where(offsets < tl.load(count_ptr), key, 0)
        tl.store(keys_ptr + offsets, key, mask=inside)
        counted = inside
    else:
        key = tl.load(keys_ptr + offsets, mask=inside, other=0)
        counted = inside & ((key >> (SHIFT + 10)) == (tl.load(state_ptr) >> (SHIFT + 10)))
    digit = (key >> SHIFT) & (BINS - 1)
    histogram = tl.histogram(digit, BINS, mask=counted)
    tl.atomic_add(histogram_ptr + tl.arange(0, BINS), histogram, mask=histogram > 0, sem="relaxed")


@triton.jit
def _choose_digit_kernel(
    histogram_ptr, state_ptr, k, SHIFT: tl.constexpr, BINS: tl.constexpr, FIRST: tl.constexpr
):
    """(one program) The digit where the k-th largest key falls: ``state`` holds the key's
    digits found so far and how many keys equal to them are still to be taken."""
    if FIRST:
        prefix = tl.zeros((), tl.int32)
        need = tl.zeros((), tl.int64) + k
    else:
        prefix = tl.load(state_ptr).to(tl.int32)
        need = tl.load(state_ptr + 1)
    digits = tl.arange(0, BINS)
    histogram = tl.load(histogram_ptr + digits).to(tl.int64)
    at_or_above = tl.sum(histogram, axis=0) - tl.cumsum(histogram, axis=0) + histogram
    chosen = tl.max(tl.where(at_or_above >= need, digits, -1), axis=0)
    above = tl.sum(tl.where(digits > chosen, histogram, 0), axis=0)
    tl.store(state_ptr, (prefix | (chosen << SHIFT)).to(tl.int64))
    tl.store(state_ptr + 1, need - above)


@triton.jit
def _write_back_kernel(
    values_ptr,
    sent_ptr,
    indices_ptr,
    kept_ptr,
    count_ptr,
    residual_ptr,
    capacity,
    KEY_BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * KEY_BLOCK + tl.arange(0, KEY_BLOCK)
    filled = (offsets < capacity) & (offsets < tl.load(count_ptr))
    y = tl.load(values_ptr + offsets, mask=filled, other=0.0)
    sent = tl.load(sent_ptr + offsets, mask=filled, other=0.0).to(tl.float32)
    kept = tl.load(kept_ptr + offsets, mask=filled, other=0) != 0
    unsent = finite_or_zero(tl.where(kept, y - sent, y))
    index = tl.load(indices_ptr + offsets, mask=filled, other=0)
    tl.store(residual_ptr + index, unsent.to(residual_ptr.dtype.element_ty), mask=filled)


def select_candidates(
    x, residual, threshold: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values fp32, indices int64, count)``: the candidates whose
    ``|x + residual|`` (NaN as inf) reaches ``threshold``, at most ``capacity``
    of them (those above it first, then those equal to it, each in index
    order), written in index order; ``count`` (a 0-d int64 tensor) is how many
    reach it. Slots past the count hold garbage. Taken candidates leave the
    residual; the rest of it becomes ``finite(x + residual)``. No host sync:
    every size is known in advance."""
    numel = x.numel()
    blocks = triton.cdiv(numel, BLOCK)
    has_residual = residual is not None
    source = residual if has_residual else x
    counts = torch.empty(2 * blocks, dtype=torch.int64, device=x.device)
    bits = torch.empty(blocks * (BLOCK // WORD), dtype=torch.int32, device=x.device)
    options = {"HAS_RESIDUAL": has_residual, "BLOCK": BLOCK, "WORD": WORD}
    _mark_candidates_kernel[(blocks,)](x, source, threshold, counts, bits, numel, blocks, **options, **EXACT)
    # One prefix sum over (above per block, equal per block): where each block's
    # candidates start among those above, and among those equal after all those above.
    ends = torch.cumsum(counts, 0)
    values = torch.empty(capacity, dtype=torch.float32, device=x.device)
    indices = torch.empty(capacity, dtype=torch.int64, device=x.device)
    _gather_candidates_kernel[(blocks,)](
        x,
        source,
        threshold,
        ends - counts,
        bits,
        values,
        indices,
        numel,
        blocks,
        capacity,
        **options,
        **EXACT,
    )
    return values, indices, ends[-1]


def keep_largest(values: torch.Tensor, count: torch.Tensor, k: int) -> torch.Tensor:
    """Which of the candidate slots ``values`` (the first ``count`` filled, the rest
    padding) are the ``k`` largest magnitudes (NaN as inf), of those tied at the k-th
    the first; padding counts as smaller than any candidate (zero is never one), so
    with fewer than ``k`` candidates all are kept, then the first padding slots."""
    capacity = values.numel()
    keys = torch.empty(capacity, dtype=torch.int32, device=values.device)
    state = torch.empty(2, dtype=torch.int64, device=values.device)  # the k-th key's digits, ties to take
    histograms = torch.zeros(sum(DIGIT_BINS), dtype=torch.int32, device=values.device)
    grid = (triton.cdiv(capacity, KEY_BLOCK),)
    start = 0
    for n, (shift, bins) in enumerate(zip(DIGIT_SHIFTS, DIGIT_BINS, strict=True)):
        histogram = histograms[start : start + bins]
        start += bins
        digit = {"SHIFT": shift, "BINS": bins, "FIRST": n == 0}
        _key_histogram_kernel[grid](
            values, count, keys, state, histogram, capacity, **digit, KEY_BLOCK=KEY_BLOCK
        )
        _choose_digit_kernel[(1,)](histogram, state, k, **digit)
    kth, ties = state[0], state[1]
    tied = keys == kth
    return (keys > kth) | (tied & (tied.cumsum(0) <= ties))


def write_back(
    values: torch.Tensor, sent: torch.Tensor, indices: torch.Tensor, kept: torch.Tensor, count, residual
) -> None:
    """``residual[indices] = finite(values - sent)`` where ``kept``, ``finite(values)``
    elsewhere, at the first ``count`` slots (the candidates; the padding writes nothing)."""
    capacity = values.numel()
    grid = (triton.cdiv(capacity, KEY_BLOCK),)
    _write_back_kernel[grid](
        values, sent, indices, kept, count, residual, capacity, KEY_BLOCK=KEY_BLOCK, **EXACT
    )
