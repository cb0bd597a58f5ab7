"""CompressedAdam's buckets: the trained parameters of one group, device and dtype,
exchanged as one flat tensor, and the views and gradients a step reads through them."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, eq=False)
class Bucket:
    """Parameters of one group, device and dtype, exchanged as one flat tensor."""

    index: int
    group: int
    params: tuple[torch.Tensor, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def make_buckets(param_groups: list[dict], cap: int) -> list[Bucket]:
    """Trained parameters (``requires_grad``) in runs of at most ``cap`` bytes per
    (group, device, dtype); the same on every rank that was given the same model."""
    buckets: list[Bucket] = []
    for gi, g in enumerate(param_groups):
        by_kind: dict[tuple, list[list[torch.Tensor]]] = {}
        sizes: dict[tuple, int] = {}
        for p in g["params"]:
            if not p.requires_grad:  # frozen: AdamW would not touch it either
                continue
            kind, nbytes = (p.device, p.dtype), p.numel() * p.element_size()
            runs = by_kind.setdefault(kind, [[]])
            if runs[-1] and sizes[kind] + nbytes > cap:
                runs.append([])
                sizes[kind] = 0
            runs[-1].append(p)
            sizes[kind] = sizes.get(kind, 0) + nbytes
        for runs in by_kind.values():
            for run in runs:
                if run:
                    buckets.append(Bucket(len(buckets), gi, tuple(run)))
    return buckets


def views(flat: torch.Tensor, bucket: Bucket) -> list[torch.Tensor]:
    """``flat`` (a bucket's exchanged tensor) as one view per parameter, shaped as it."""
    return [
        part.view_as(p)
        for part, p in zip(flat.split([p.numel() for p in bucket.params]), bucket.params, strict=True)
    ]


def gradients(bucket: Bucket) -> list[torch.Tensor]:
    """The bucket's gradients, zeros where a parameter has none."""
    grads = []
    for p in bucket.params:
        if p.grad is None:  # every rank exchanges every bucket: a missing gradient is zero
            grads.append(torch.zeros_like(p))
        elif p.grad.is_sparse:
            raise RuntimeError("CompressedAdam does not take sparse gradients")
        else:
            grads.append(p.grad)
    return grads
