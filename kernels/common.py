"""Helpers shared by the Triton kernels."""

import torch
import triton
import triton.language as tl

# 1.5 * 2**23: adding and subtracting it rounds an fp32 of magnitude below
# 2**22 to the nearest integer, ties to even -- exactly what torch.round does.
# A constexpr: the compiler refuses any other module-level value in a kernel.
ROUNDING_MAGIC = tl.constexpr(12582912.0)


# Launch option for kernels whose results must match torch bit for bit: without
# it the compiler contracts a * b + c into one fused multiply-add (one rounding
# where torch rounds twice).
EXACT = {"enable_fp_fusion": False}


@triton.jit
def round_half_even(value):
    return (value + ROUNDING_MAGIC) - ROUNDING_MAGIC


@triton.jit
def floor(value):
    """``floor`` for ``|value| < 2**22`` without flushing subnormals (``tl.floor``
    compiles to ``cvt.rmi.ftz``: a negative subnormal would floor to 0, not -1)."""
    rounded = round_half_even(value)
    return tl.where(rounded > value, rounded - 1.0, rounded)


@triton.jit
def is_finite(value):
    # inf - inf and nan - nan are nan, which is unequal to 0.
    return (value - value) == 0.0


@triton.jit
def finite_or_zero(value):
    return tl.where(is_finite(value), value, 0.0)


@triton.jit
def block_lanes(numel, block, WIDTH: tl.constexpr):
    """This program's block: ``(pid, offsets, mask)`` over ``WIDTH`` lanes (int64 offsets)."""
    pid = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, WIDTH)
    offsets = pid * block + lane
    return pid, offsets, (lane < block) & (offsets < numel)


@triton.jit
def load_compensated(x_ptr, residual_ptr, offsets, mask, HAS_RESIDUAL: tl.constexpr):
    """``x + residual`` in fp32 (masked lanes 0)."""
    y = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        y += tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def store_decoded(out_ptr, offsets, mask, value, ACCUMULATE: tl.constexpr):
    """``out = value`` or ``out += value``, the sum as torch's: in fp64 into an fp64
    ``out``, else in fp32 of ``value`` rounded to ``out``'s dtype."""
    if ACCUMULATE:
        current = tl.load(out_ptr + offsets, mask=mask, other=0.0)
        if current.dtype == tl.float64:
            value = current + value.to(tl.float64)
        else:
            value = current.to(tl.float32) + value.to(current.dtype).to(tl.float32)
    tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def block_place(pid, chunk_blocks, total_blocks, row_stride, ROWS: tl.constexpr):
    """Where block ``pid``'s scale and codes lie: ``(scale index, codes base,
    block within its row)``. Scales are fp32 elements, the codes base a byte
    offset; the block's first code is at ``codes base + block within row *
    block bytes``. Without ``ROWS`` scales and codes are two arrays over the
    whole tensor; with it, row ``j`` of a buffer ``row_stride`` bytes a row
    holds chunk ``j`` (``chunk_blocks`` blocks) as a payload: its scales,
    then its codes."""
    if ROWS:
        row = pid // chunk_blocks
        local = pid - row * chunk_blocks
        row_blocks = tl.minimum(chunk_blocks, total_blocks - row * chunk_blocks)
        return row * (row_stride // 4) + local, row * row_stride + 4 * row_blocks, local
    else:
        return pid, pid * 0, pid


@triton.jit
def pad_row(codes_ptr, pid, numel, block, chunk_blocks, total_blocks, row_stride, BITS: tl.constexpr):
    """Zeros from the end of block ``pid``'s row payload to the next multiple of
    8 bytes, written by the row's last block (a no-op for the others)."""
    row = pid // chunk_blocks
    row_blocks = tl.minimum(chunk_blocks, total_blocks - row * chunk_blocks)
    row_elements = tl.minimum(chunk_blocks * block, numel - row * chunk_blocks * block)
    used = 4 * row_blocks + (row_elements * BITS + 7) // 8
    padding = tl.arange(0, 8)
    last = pid - row * chunk_blocks == row_blocks - 1
    mask = last & (used + padding < (used + 7) // 8 * 8)
    tl.store(codes_ptr + row * row_stride + used + padding, tl.zeros((8,), tl.uint8), mask=mask)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a flat contiguous view (a copy only if it is not contiguous)."""
    return tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def residual_view(residual: torch.Tensor | None) -> torch.Tensor | None:
    """The (contiguous) residual as the flat view the kernel updates in place."""
    return None if residual is None else residual.view(-1)


def block_width(block: int) -> int:
    """Lanes a program uses for one block: the next power of two."""
    return triton.next_power_of_2(block)


def random_seed(seed: int) -> int:
    """A gradcomp seed as Triton's generator takes it: all 63 bits (Philox keys on 64)."""
    return int(seed) & (2**63 - 1)
