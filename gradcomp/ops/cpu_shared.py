"""What the CPU backend's modules share: the chunks long tensors are worked
through, slices that cost nothing where they are whole, and error feedback
computed in an fp32 residual itself."""

from __future__ import annotations

import math

import torch

from gradcomp.ops.reference import compensate

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
    limit = CHUNK_ELEMENTS if elements is None else elements
    if numel <= limit and numel > 0:  # one chunk (a whole tensor is whole blocks and bytes)
        return [(0, numel)]
    unit = math.lcm(block, 8)
    step = max(1, limit // unit) * unit
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


def compensate_in_residual(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
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


def known(flag: torch.Tensor) -> bool:
    """A 0-d bool tensor's value (on a CPU, reading it costs nothing)."""
    return bool(flag)


def sliced(flat: torch.Tensor | None, start: int, end: int, numel: int) -> torch.Tensor | None:
    """``flat[start:end]``; ``flat`` itself where that is all of it (a slice costs more
    than a small tensor's kernels)."""
    if flat is None or (start == 0 and end == numel):
        return flat
    return flat[start:end]
