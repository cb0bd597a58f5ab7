"""The arithmetic of CompressedAdam's two phases, operation for operation.

In the warm-up a step is AdamW's from the averaged gradient (:func:`adamw_step`). At
its end the second moment freezes (elements no gradient reached take their tensor's
mean: :func:`fill_unseen`), and with it the denominator ``sqrt(v / (1 - b2^warmup)) +
eps`` (:func:`denominators`). After it each rank sends its update, its momentum over
that denominator (:func:`scaled_momentum`), and every rank steps by the average and
keeps ``m = average * d`` (:func:`frozen_step`).
"""

from __future__ import annotations

import math

import torch


def fill_unseen(squares: list[torch.Tensor]) -> None:
    """Give elements whose second moment is still zero when it freezes their
    tensor's mean (the mean over every frozen tensor for a tensor of zeros).

    Zero means no gradient reached the element in the warm-up (a row never
    looked up, a value a compressed warm-up rounded to zero every time):
    frozen, it would divide every later step by ``eps``. Once, without a host sync.
    """
    counts = [(v > 0).sum() for v in squares]
    sums = [v.sum() for v in squares]
    overall = torch.stack(sums).sum() / torch.stack(counts).sum().clamp_min(1)
    for v, total, count in zip(squares, sums, counts, strict=True):
        fill = torch.where(count > 0, total / count.clamp_min(1), overall).to(v.dtype)
        v.copy_(torch.where(v > 0, v, fill))


def denominators(squares: list[torch.Tensor], group: dict, second_step: int) -> list[torch.Tensor]:
    """AdamW's ``sqrt(v / (1 - beta2^t)) + eps``, as torch computes it."""
    found = torch._foreach_sqrt(squares)
    torch._foreach_div_(found, math.sqrt(1 - group["betas"][1] ** second_step))
    torch._foreach_add_(found, group["eps"])
    return found


def scaled_momentum(
    averages: list[torch.Tensor],
    grads: list[torch.Tensor],
    frozen: list[torch.Tensor],
    beta1: float,
    owed: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's update, flat: its momentum ``b1 m + (1 - b1) g`` over the ``frozen``
    denominators, plus ``owed`` (what the warm-up's last exchange still owed, a flat
    gradient) taken into the momentum likewise.

    Exchanged as the update itself, the compressor's error weighs alike on every element
    (unscaled, an element with a small second moment would take the error its block's
    large ones bring, magnified)."""
    local = torch._foreach_lerp(averages, grads, 1 - beta1)
    torch._foreach_div_(local, frozen)
    flat = torch.cat([u.reshape(-1) for u in local])
    if owed is not None:
        if owed.is_cuda:  # allocated on the worker's stream, freed after this read
            owed.record_stream(torch.cuda.current_stream(owed.device))
        flat.add_(owed.to(flat) / torch.cat([d.reshape(-1) for d in frozen]), alpha=1 - beta1)
    return flat


def adamw_step(
    params: list[torch.Tensor],
    averages: list[torch.Tensor],
    squares: list[torch.Tensor],
    gradient: list[torch.Tensor],
    group: dict,
    step: int,
) -> None:
    """AdamW's update from the averaged ``gradient`` (decoupled weight decay)."""
    lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
    torch._foreach_lerp_(averages, gradient, 1 - beta1)
    torch._foreach_mul_(squares, beta2)
    torch._foreach_addcmul_(squares, gradient, gradient, 1 - beta2)
    if decay != 0:
        torch._foreach_mul_(params, 1 - lr * decay)
    torch._foreach_addcdiv_(params, averages, denominators(squares, group, step), -(lr / (1 - beta1**step)))


def frozen_step(
    params: list[torch.Tensor],
    averages: list[torch.Tensor],
    update: list[torch.Tensor],
    frozen: list[torch.Tensor],
    group: dict,
    step: int,
) -> None:
    """The step by the ranks' average ``update`` (momentum over the ``frozen``
    denominators); the momentum becomes ``update * frozen`` (``update`` is spent)."""
    lr, beta1, decay = group["lr"], group["betas"][0], group["weight_decay"]
    if decay != 0:
        torch._foreach_mul_(params, 1 - lr * decay)
    torch._foreach_add_(params, update, alpha=-(lr / (1 - beta1**step)))
    torch._foreach_mul_(update, frozen)
    torch._foreach_copy_(averages, update)
