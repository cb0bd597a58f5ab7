"""The ops on the Triton kernels of :mod:`gradcomp.kernels`.

Quantization, sign, packing and scatter-add map one to one onto kernel
launchers. Random-K and Top-K combine kernels with the reference's
seed-derived choices (the permutation keys, the Top-K sample), so that they
select exactly what :mod:`gradcomp.ops.reference` selects.
"""

from __future__ import annotations

import math

import torch

from gradcomp import kernels
from gradcomp.kernels.common import residual_view
from gradcomp.ops import reference


def randk_indices(numel: int, k: int, seed: int, device) -> torch.Tensor:
    """:func:`gradcomp.ops.reference.randk_indices` on the Triton kernel."""
    if not 0 < k <= numel:
        raise ValueError(f"k must be in [1, {numel}], got {k}")
    device = torch.device(device)
    half_bits, keys = reference.feistel_half_bits(numel), reference.feistel_keys(seed)
    return reference.remembered_indices(
        "triton", numel, k, seed, device, lambda: kernels.randk_indices(numel, k, half_bits, keys, device)
    )


def randk_select(
    x: torch.Tensor,
    k: int,
    seed: int,
    residual: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    value_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """:func:`gradcomp.ops.reference.randk_select` on Triton kernels."""
    x = x.reshape(-1)
    residual = residual_view(residual, x.numel(), x.device)
    indices = randk_indices(x.numel(), k, seed, x.device)
    # Gather before the pass that overwrites the residual with x + residual.
    values, lost = kernels.gather_compensated(x, residual, indices, scale, value_dtype)
    flags = kernels.compensate(x, residual)
    if residual is not None:
        residual[indices] = lost.to(residual.dtype)
    # No host sync: NaN joins the first value exactly when the input holds inf or NaN.
    values[:1] += torch.where(flags.any(), math.nan, 0.0).to(value_dtype)
    return values


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
    """:func:`gradcomp.ops.reference.topk_select` with the sampling path on Triton
    kernels (``exact=True`` stays on ``torch.topk``)."""
    x = x.reshape(-1)
    numel = x.numel()
    if not 0 < k <= numel:
        raise ValueError(f"k must be in [1, {numel}], got {k}")
    residual = residual_view(residual, x.numel(), x.device)
    options = {"seed": seed, "index_dtype": index_dtype, "value_dtype": value_dtype}
    if exact or k == numel:
        return reference.topk_select(x, k, residual, True, **options)
    fewest, most = reference.count_band(k)
    threshold = reference.sample_threshold(x, residual, k, seed).reshape(1)
    values, indices = kernels.select_candidates(x, residual, threshold)
    if values.numel() < fewest:
        # Rare: the sample misjudged the threshold. As the reference does,
        # select again at a lower threshold from the same sample, then
        # take the exact path.
        y = _rebuild(x, residual, values, indices)
        lower = reference.sample_threshold(y, None, k, seed, reach=reference.RESCAN_REACH)
        values, indices = kernels.select_candidates(y, residual, lower.reshape(1))
        if values.numel() < fewest:
            return reference.topk_select(_rebuild(y, residual, values, indices), k, residual, True, **options)
    if values.numel() > most:
        keep = torch.topk(reference.selection_magnitude(values), k, sorted=False).indices.sort().values
        if residual is not None:
            dropped = torch.ones(values.numel(), dtype=torch.bool, device=x.device)
            dropped[keep] = False
            residual[indices[dropped]] = values[dropped].nan_to_num(0.0, 0.0, 0.0).to(residual.dtype)
        values, indices = values[keep], indices[keep]
    sent = values.to(value_dtype)
    if residual is not None:
        residual[indices] = (values - sent.float()).nan_to_num(0.0, 0.0, 0.0).to(residual.dtype)
    return sent, indices.to(index_dtype or reference.index_dtype_for(numel))


def _rebuild(x, residual, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x + residual`` (fp32) after a selection, which left it in the residual
    with the candidates aside (or left ``x`` alone); the residual is zeroed."""
    y = (x if residual is None else residual).to(torch.float32, copy=True)
    y[indices] = values
    if residual is not None:
        residual.zero_()
    return y


FUNCTIONS = {
    "quantize_blockwise": kernels.quantize_blockwise,
    "dequantize_blockwise": kernels.dequantize_blockwise,
    "sign_compress": kernels.sign_compress,
    "sign_decompress": kernels.sign_decompress,
    "topk_select": topk_select,
    "randk_select": randk_select,
    "randk_indices": randk_indices,
    "scatter_add": kernels.scatter_add,
    "pack_bits": kernels.pack_bits,
    "unpack_bits": kernels.unpack_bits,
}
is_available = kernels.is_available
