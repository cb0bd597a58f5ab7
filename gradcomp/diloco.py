"""DiLoCo: local steps, then a compressed average of the weights' change and an outer step.

Each rank trains on its own for ``sync_every`` inner steps. Then the ranks
average their pseudo-gradients (the anchor, the weights every rank held after
the last synchronisation, minus this rank's weights) through gradcomp's
compressed all-reduce with error feedback, and an outer optimizer (SGD with
Nesterov momentum) moves the anchor; every rank takes the new anchor as its
weights. Replicas are identical after every synchronisation: every rank decodes
the same average and applies the same outer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradcomp.collectives import Chooser, ReduceStats, all_reduce, verify_settings
from gradcomp.collectives.chooser import as_chooser
from gradcomp.collectives.inline import InlineGroup
from gradcomp.compressors import Compressor, get_compressor
from gradcomp.feedback import ErrorFeedback

SCHEMA_VERSION = 1


class DiLoCo:
    """The outer loop of DiLoCo over ``model``'s trained parameters.

    Args:
        model: the module each rank trains (no DDP: each rank trains on its own
            between synchronisations). Rank 0's parameters and buffers are
            broadcast over ``group`` when this is made.
        inner: the inner optimizer (its state stays each rank's own).
        sync_every: inner steps between synchronisations (H).
        compressor: how the pseudo-gradients travel (any compressor, ``"auto"``).
        outer_lr, outer_momentum, nesterov: the outer SGD (DiLoCo's: 0.7, 0.9,
            Nesterov).
        group: the ranks that average (default the world).
        algorithm: the all-reduce's (default from the compressor and the group).
        compressor_options: the compressor's own options (``ratio``, ``block``...).

    Example:
        >>> outer = gradcomp.DiLoCo(model, inner, sync_every=50, compressor="int4")
        >>> for x, y in loader:
        ...     loss_fn(model(x), y).backward()
        ...     inner.step(); inner.zero_grad()
        ...     outer.step()  # every 50th call: exchange and outer step
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer,
        sync_every: int,
        compressor: Compressor | Chooser | str = "int4",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        group: dist.ProcessGroup | None = None,
        algorithm: str | None = None,
        **compressor_options,
    ):
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(
                f"sync_every must be an int >= 1 (inner steps between synchronisations), got {sync_every!r}"
            )
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr!r}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(
                "DiLoCo averages the weights itself: pass the module, not a DistributedDataParallel"
            )
        chooser = as_chooser(compressor)
        if chooser is not None and compressor_options:
            raise ValueError(
                f"a chooser ({compressor!r}) takes no compressor options, got {sorted(compressor_options)}"
            )
        compressor = chooser or get_compressor(compressor, **compressor_options)
        self.model, self.inner, self.sync_every = model, inner, sync_every
        self.compressor, self.algorithm, self.group = compressor, algorithm, group
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trained parameters")
        self.local_step = 0  # inner steps taken (step() calls)
        self.outer_step = 0  # synchronisations done
        self.feedback = ErrorFeedback()
        self.last_stats: ReduceStats | None = None
        ranks = InlineGroup(group)
        device = self.params[0].device
        verify_settings(ranks, "gradcomp.DiLoCo's settings", self.settings(), device)
        source = dist.get_global_rank(ranks.group, 0) if group is not None else 0
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=source, group=group)
        self.anchor = [p.detach().clone() for p in self.params]
        self.momentum = [torch.zeros_like(p) for p in self.params]

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group that averages (for :class:`gradcomp.ddp.Checkpointable`)."""
        return self.group

    def settings(self) -> dict:
        """What every rank must agree on."""
        return {
            "sync_every": self.sync_every,
            "compressor": repr(sorted(self.compressor.settings().items())),
            "algorithm": self.algorithm,
            "outer": (self.outer_lr, self.outer_momentum, self.nesterov),
            "shapes": [(tuple(p.shape), str(p.dtype)) for p in self.params],
        }

    @torch.no_grad()
    def step(self) -> ReduceStats | None:
        """Count an inner step; every ``sync_every``-th: average the pseudo-gradients
        (compressed), take the outer step and load its weights. Its statistics, or None."""
        self.local_step += 1
        if self.local_step % self.sync_every:
            return None
        for dtype in sorted({p.dtype for p in self.params}, key=str):
            indices = [i for i, p in enumerate(self.params) if p.dtype == dtype]
            delta = torch.cat([(self.anchor[i] - self.params[i]).reshape(-1) for i in indices])
            options = {"algorithm": self.algorithm} if self.algorithm is not None else {}
            self.last_stats = all_reduce(
                delta,
                self.compressor,
                self.group,
                feedback=self.feedback,
                name=("diloco", str(dtype)),
                step=self.outer_step,
                **options,
            )
            offset = 0
            for i in indices:
                numel = self.params[i].numel()
                self._outer(i, delta[offset : offset + numel].view_as(self.params[i]))
                offset += numel
        self.outer_step += 1
        return self.last_stats

    def _outer(self, i: int, gradient: torch.Tensor) -> None:
        """SGD with (Nesterov) momentum on the anchor, as ``torch.optim.SGD`` takes it."""
        update = gradient
        if self.outer_momentum:
            buffer = self.momentum[i]
            if self.outer_step == 0:
                buffer.copy_(gradient)
            else:
                buffer.mul_(self.outer_momentum).add_(gradient)
            update = gradient.add(buffer, alpha=self.outer_momentum) if self.nesterov else buffer
        self.anchor[i].add_(update, alpha=-self.outer_lr)
        self.params[i].copy_(self.anchor[i])

    def state_dict(self) -> dict:
        """The anchor, the outer momentum, the residuals and the steps: with the model's
        and the inner optimizer's own, a run resumes bit for bit, mid-way too
        (``gradcomp.ddp.Checkpointable(outer)`` for ``torch.distributed.checkpoint``)."""
        return {
            "version": SCHEMA_VERSION,
            "settings": self.settings(),
            "local_step": self.local_step,
            "outer_step": self.outer_step,
            "anchor": [t.clone() for t in self.anchor],
            "momentum": [t.clone() for t in self.momentum],
            "feedback": self.feedback.state_dict(),
        }

    def load_state_dict(self, saved: dict) -> None:
        if saved.get("version") != SCHEMA_VERSION:
            raise ValueError(
                f"DiLoCo state of schema {saved.get('version')!r}; this version reads {SCHEMA_VERSION}"
            )
        if saved["settings"] != self.settings():
            differ = sorted(k for k, v in self.settings().items() if saved["settings"].get(k) != v)
            raise ValueError(f"the checkpoint's DiLoCo settings differ in {differ}")
        self.local_step, self.outer_step = int(saved["local_step"]), int(saved["outer_step"])
        with torch.no_grad():
            for mine, theirs in zip(
                [*self.anchor, *self.momentum], [*saved["anchor"], *saved["momentum"]], strict=True
            ):
                mine.copy_(theirs)
        self.feedback.load_state_dict(saved["feedback"])
