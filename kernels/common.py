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
    """``out = value`` or ``out += value`` (the sum rounded like torch's ``out += value.to(out.dtype)``)."""
    if ACCUMULATE:
        current = tl.load(out_ptr + offsets, mask=mask, other=0.0)
        value = current.to(tl.float32) + value.to(current.dtype).to(tl.float32)
    tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=mask)


def flat(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` as a flat contiguous view (a copy only if it is not contiguous)."""
    if not tensor.is_floating_point() and tensor.dtype not in (torch.uint8, torch.int32, torch.int64):
        raise TypeError(f"{name}: unsupported dtype {tensor.dtype}")
    return tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def residual_view(residual: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor | None:
    """The residual as a flat view that the kernel updates in place."""
    if residual is None:
        return None
    if not residual.is_contiguous():
        raise ValueError("the residual must be contiguous: the kernel updates it in place")
    if residual.numel() != numel:
        raise ValueError(f"residual has {residual.numel()} elements, the tensor {numel}")
    if residual.device != device:
        raise ValueError(f"residual is on {residual.device}, the tensor on {device}")
    return residual.view(-1)


def block_width(block: int) -> int:
    """Lanes a program uses for one block: the next power of two."""
    return triton.next_power_of_2(block)


def random_seed(seed: int) -> int:
    """A gradcomp seed as Triton's generator takes it: all 63 bits (Philox keys on 64)."""
    return int(seed) & (2**63 - 1)
