"""The ops on the Triton kernels of :mod:`gradcomp.kernels`.

Quantization, sign, the block-scaled formats, packing and scatter-add map one
to one onto kernel launchers. Random-K and Top-K combine kernels with the reference's
seed-derived choices (the permutation keys, the Top-K sample), so that they
select exactly what :mod:`gradcomp.ops.reference` selects.
"""

from __future__ import annotations

import math

import torch

from gradcomp import kernels
from gradcomp.kernels.common import residual_view
from gradcomp.ops import index_cache, reference


def randk_indices(numel: int, k: int, seed: int, device) -> torch.Tensor:
    """:func:`gradcomp.ops.reference.randk_indices` on the Triton kernel."""
    device = torch.device(device)
    half_bits, keys = reference.feistel_half_bits(numel), reference.feistel_keys(seed)
    return index_cache.remembered(
        "triton", numel, k, seed, device, lambda: kernels.randk_indices(numel, k, half_bits, keys, device)
    )


def randk_select(
    x: torch.Tensor,
    k: int,
    seed: int,
    residual: torch.Tensor | None = None,
    *,
    multiplier: float = 1.0,
    value_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """:func:`gradcomp.ops.reference.randk_select` on Triton kernels."""
    x = x.reshape(-1)
    residual = residual_view(residual)
    indices = randk_indices(x.numel(), k, seed, x.device)
    # Gather before the pass that overwrites the residual with x + residual.
    values, lost = kernels.gather_compensated(x, residual, indices, multiplier, value_dtype)
    flags = kernels.fold_into_residual(x, residual)
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
    kernels and fixed-size device ops: no host sync (``exact=True`` stays on
    ``torch.topk``). One pass over the tensor (:mod:`gradcomp.kernels.topk` counts
    the bytes); the rest works on the sample and the ~1.25 k candidates."""
    x = x.reshape(-1)
    numel = x.numel()
    residual = residual_view(residual)
    if exact or k == numel:
        exact_select = _exact_topk(x.device)
        return exact_select(x, k, residual, True, index_dtype=index_dtype, value_dtype=value_dtype)
    capacity = reference.candidate_capacity(k)
    threshold = reference.sample_threshold(x, residual, k, seed).reshape(1)
    values, indices, count = kernels.select_candidates(x, residual, threshold, capacity)
    kept = kernels.keep_largest(values, count, k)
    # Slots past the count are padding: index 0 and value 0, kept last where fewer than
    # k candidates reached the threshold.
    filled = torch.arange(capacity, device=x.device) < count
    values = torch.where(filled, values, 0.0)
    indices = torch.where(filled, indices, 0)
    sent = values.to(value_dtype)
    if residual is not None:
        kernels.write_back(values, sent, indices, kept, count, residual)
    # Slots are in index order, padding last: the k kept ones go to outputs
    # 0..k-1 in order, the others to a slot k that is dropped.
    target = torch.where(kept, kept.cumsum(0) - 1, k)
    out_values = sent.new_zeros(k + 1).scatter_(0, target, sent)
    out_indices = indices.new_zeros(k + 1).scatter_(0, target, indices)
    return out_values[:k], out_indices[:k].to(index_dtype)


def _exact_topk(device: torch.device):
    """The exact top-k for tensors on ``device``: the CUDA radix select where the cuda
    backend runs (dispatch picks this backend's sampling path first, ops.OP_PREFERENCE,
    and no one asked for Triton alone), else the reference's ``torch.topk``."""
    from gradcomp import ops  # the package loads this module: imported at the call

    if ops.forced_backend() is None and device.type == "cuda" and ops.runs_on("cuda", device):
        return ops.functions("cuda")["topk_select"]
    return reference.topk_select


FUNCTIONS = {
    "quantize_blockwise": kernels.quantize_blockwise,
    "dequantize_blockwise": kernels.dequantize_blockwise,
    "sign_compress": kernels.sign_compress,
    "sign_decompress": kernels.sign_decompress,
    "quantize_rows": kernels.quantize_rows,
    "dequantize_rows": kernels.dequantize_rows,
    "dequantize_sum": kernels.dequantize_sum,
    "sign_compress_rows": kernels.sign_compress_rows,
    "sign_decompress_rows": kernels.sign_decompress_rows,
    "sign_decompress_sum": kernels.sign_decompress_sum,
    "topk_select": topk_select,
    "randk_select": randk_select,
    "randk_indices": randk_indices,
    "scatter_add": kernels.scatter_add,
    "pack_bits": kernels.pack_bits,
    "unpack_bits": kernels.unpack_bits,
    "mx_quantize": kernels.mx_quantize,
    "mx_dequantize": kernels.mx_dequantize,
    "mx_dequantize_sum": kernels.mx_dequantize_sum,
    "nvfp4_quantize": kernels.nvfp4_quantize,
    "nvfp4_dequantize": kernels.nvfp4_dequantize,
    "nvfp4_dequantize_sum": kernels.nvfp4_dequantize_sum,
}
is_available = kernels.is_available
