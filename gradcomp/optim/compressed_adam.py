"""CompressedAdam: AdamW whose ranks exchange compressed updates once the second moment is
frozen; the step, each bucket's exchange and the skip of a non-finite step.

The phases' arithmetic is in :mod:`gradcomp.optim.phases`, the buckets in
:mod:`gradcomp.optim.layout`, the ranks' first check in :mod:`gradcomp.optim.agreement`,
the saved state's checks in :mod:`gradcomp.optim.checkpoint`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist

from gradcomp.collectives import all_reduce, check_algorithm, key_of
from gradcomp.collectives.arrival import wait_for_every_rank
from gradcomp.compressors import Compressor, NoCompression, get_compressor, split_options
from gradcomp.feedback import ErrorFeedback, UndoLog, all_finite
from gradcomp.optim import agreement, checkpoint, phases
from gradcomp.optim.checkpoint import COMPRESSOR_KEYS, saved_settings
from gradcomp.optim.layout import Bucket, gradients, make_buckets, views

__all__ = ["CompressedAdam"]

_DENSE = NoCompression()

_NOT_OPTIONS = ("self", "params", "compressor_options")


def _compressor(spec) -> Compressor | None:
    return None if spec is None else get_compressor(spec)


class CompressedAdam(torch.optim.Optimizer):
    """AdamW whose ranks exchange compressed updates once the second moment is frozen.

    Args:
        params: parameters or parameter groups (a group may set any of
            ``lr``, ``betas``, ``eps``, ``weight_decay``, ``compressor``,
            ``gradient_compressor``).
        lr, betas, eps, weight_decay: AdamW's (weight decay decoupled).
        compressor: how the updates (momentum over the frozen denominator)
            are exchanged after the warm-up (a spec such as ``"sign"`` or
            ``"topk@0.01"``, or a :class:`~gradcomp.Compressor`); ``None`` keeps
            the group AdamW throughout, its gradients averaged at every step.
        gradient_compressor: how gradients are exchanged while they are (the
            warm-up, and every step of a ``compressor=None`` group); default
            ``None``, dense.
        warmup_steps: steps of AdamW before the second moment is frozen;
            frozen too early, it costs loss (bench/reports/convergence-cpu2-2026.md
            holds the runs): give it about a fifth of the run.
        group: process group (default WORLD).
        algorithm: the compressed all-reduce's algorithm (default from the
            compressor and the group's size).
        bucket_mb: parameters are exchanged in flat buckets of about this size.
        broadcast: copy rank 0's parameters to every rank at construction
            (as DDP does), so replicas start identical.
        compressor_options: ``compressor``'s options (``ratio=0.01``), as in its spec.

    Example:
        >>> opt = gradcomp.optim.CompressedAdam(model.parameters(), lr=3e-4, compressor="sign",
        ...                                     warmup_steps=100)
        >>> loss_fn(model(x), y).backward()      # no DDP all-reduce: step() communicates
        >>> opt.step(); opt.zero_grad()
        >>> opt.last_bytes_sent                   # this rank's bytes in the last step

    The state (moments, step, this rank's error-feedback residuals) is in
    ``state_dict()``; each rank saves and loads its own, and a resumed run
    continues bit for bit. Parameters that do not require gradients are
    left alone; a trained parameter whose gradient is None counts as a zero
    gradient (every rank exchanges every bucket at every step). Groups are
    fixed at construction (``add_param_group`` raises).

    A step whose exchanged average holds NaN or Inf (a non-finite gradient on any
    rank reaches every rank's average: no compressor hides one) is skipped on every
    rank with a warning, as ``torch.amp.GradScaler`` skips one: parameters, moments,
    step count and residuals stay as they were, and the run goes on as if the batch
    had not been (``skipped_steps`` counts them). Until a step ends, it keeps a copy
    of each residual it changes.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        compressor: str | Compressor | None = "sign",
        gradient_compressor: str | Compressor | None = None,
        warmup_steps: int = 100,
        group: dist.ProcessGroup | None = None,
        algorithm: str | None = None,
        bucket_mb: float = 25.0,
        broadcast: bool = True,
        **compressor_options,
    ):
        if compressor_options:  # for compressor=, as DiLoCo takes them; a typo: the nearest name said
            own = [n for n in inspect.signature(CompressedAdam.__init__).parameters if n not in _NOT_OPTIONS]
            split_options(compressor, compressor_options, own, "gradcomp.optim.CompressedAdam")
            compressor = get_compressor(compressor, **compressor_options)
        _check_arguments(lr, betas, eps, warmup_steps, bucket_mb)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            compressor=_compressor(compressor),
            gradient_compressor=_compressor(gradient_compressor),
        )
        super().__init__(params, defaults)
        for g in self.param_groups:
            g["compressor"] = _compressor(g["compressor"])
            g["gradient_compressor"] = _compressor(g["gradient_compressor"])
            for p in g["params"]:
                if not p.dtype.is_floating_point:
                    raise TypeError(f"CompressedAdam needs floating parameters, got {p.dtype}")
        if warmup_steps == 0 and any(g["compressor"] is not None for g in self.param_groups):
            raise ValueError(
                "warmup_steps must be >= 1 when a group has a compressor: it freezes the second moment"
            )
        if algorithm is not None:  # refused now, not when the warm-up ends
            for g in self.param_groups:
                for name in COMPRESSOR_KEYS:
                    if g[name] is not None:
                        check_algorithm(g[name], algorithm)
        self.warmup_steps = warmup_steps
        self.process_group = group
        self.algorithm = algorithm
        self.feedback = ErrorFeedback()
        self.steps_done = 0
        self.last_bytes_sent = 0
        self.skipped_steps = 0  # steps whose average was not finite (not saved: a statistic)
        self._buckets = make_buckets(self.param_groups, int(bucket_mb * 2**20))
        self._agreed = False
        wait_for_every_rank(group, "CompressedAdam")  # a rank that never makes one: said, not hung
        if broadcast:
            self._broadcast()

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_buckets"):  # the buckets, and the ranks' agreement, are fixed at construction
            raise RuntimeError("CompressedAdam takes its parameter groups at construction only")
        super().add_param_group(param_group)

    @torch.no_grad()
    def _broadcast(self) -> None:
        source = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for g in self.param_groups:
            for p in g["params"]:
                dist.broadcast(p.data, source, group=self.process_group)

    def _moments(self, bucket: Bucket) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        averages, squares = [], []
        for p in bucket.params:
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            averages.append(state["exp_avg"])
            squares.append(state["exp_avg_sq"])
        return averages, squares

    # ------------------------------------------------------------------ step

    def frozen(self, group_index: int, step: int | None = None) -> bool:
        """Whether parameter group ``group_index`` exchanges momentum at ``step`` (default: the next)."""
        step = self.steps_done + 1 if step is None else step
        return self.param_groups[group_index]["compressor"] is not None and step > self.warmup_steps

    @torch.no_grad()
    def step(self, closure=None):
        """Exchange and update; every rank must call it at every step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._agreed:
            self._check_agreement()
        step = self.steps_done + 1
        if step == self.warmup_steps + 1:  # again after a skipped step: it changes nothing then
            squares = [v for b in self._buckets if self.frozen(b.group, step) for v in self._moments(b)[1]]
            if squares:
                phases.fill_unseen(squares)
        pending, log = [], UndoLog(self.feedback)
        with log.recording():  # the residuals as they were, should the step be skipped
            for bucket in self._buckets:
                pending.append(self._exchange(bucket, step))
        sent = sum(work.get_future().wait().bytes_sent for _, _, work, _ in pending)
        self.last_bytes_sent = sent
        if not all_finite([flat for _, flat, _, _ in pending]):
            log.undo()
            self.skipped_steps += 1
            warnings.warn(
                f"CompressedAdam: step {step} skipped on every rank: the averaged gradients (or updates) "
                "hold NaN or Inf, from a non-finite gradient on some rank; the moments, the step count "
                "and the residuals are as they were before it",
                stacklevel=3,
            )
            return loss
        for bucket, flat, _, denominators in pending:
            self._update(bucket, flat, step, denominators)
        self.steps_done = step
        return loss

    def _exchange(self, bucket: Bucket, step: int) -> tuple:
        """Start bucket's exchange at ``step``: ``(bucket, flat, work, denominators)``, the
        flat tensor the average lands in, its work, and the frozen denominators (None in
        the warm-up and for a group without a compressor)."""
        g = self.param_groups[bucket.group]
        averages, squares = self._moments(bucket)
        denominators = None
        if self.frozen(bucket.group, step):
            # Exchanged: each rank's momentum over the frozen denominator, the update itself,
            # with what the warm-up's exchange still owed.
            denominators = phases.denominators(squares, g, self.warmup_steps)
            owed = self.feedback.pop(key_of(("gradient", bucket.index)))
            flat = phases.scaled_momentum(averages, gradients(bucket), denominators, g["betas"][0], owed)
            compressor, key = g["compressor"], ("momentum", bucket.index)
        else:
            flat = torch.cat([x.reshape(-1) for x in gradients(bucket)])
            compressor, key = g["gradient_compressor"] or _DENSE, ("gradient", bucket.index)
        work = all_reduce(
            flat,
            compressor,
            self.process_group,
            async_op=True,
            algorithm=self.algorithm if compressor is not _DENSE else None,
            feedback=self.feedback,
            name=key,
            step=step,
        )
        return bucket, flat, work, denominators

    def _check_agreement(self) -> None:
        """Raise on every rank if ranks differ in settings or step: they would switch
        phases at different steps, and their collectives would not match."""
        described = (
            self.steps_done,
            self.warmup_steps,
            self.algorithm,
            [b.numel for b in self._buckets],
            [tuple(saved_settings(g[k]) for k in COMPRESSOR_KEYS) for g in self.param_groups],
        )
        reduced, refusal = agreement.compare(described, self._buckets, self.process_group)
        if reduced:
            warnings.warn(agreement.ALREADY_REDUCED, stacklevel=3)
        if refusal is not None:
            raise ValueError(refusal)
        self._agreed = True

    def _update(self, bucket: Bucket, flat: torch.Tensor, step: int, denominators) -> None:
        """AdamW's update from the averaged gradient ``flat``; with the frozen
        ``denominators``, the update from the averaged scaled momentum ``flat``."""
        g = self.param_groups[bucket.group]
        averages, squares = self._moments(bucket)
        exchanged = views(flat, bucket)
        if denominators is not None:
            phases.frozen_step(list(bucket.params), averages, exchanged, denominators, g, step)
        else:
            phases.adamw_step(list(bucket.params), averages, squares, exchanged, g, step)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """torch's optimizer state (compressors saved as their settings, so that
        ``torch.load`` reads it with ``weights_only``) and a ``gradcomp`` entry:
        the step, the warm-up, the bucket sizes and this rank's residuals."""
        state = super().state_dict()
        checkpoint.save_compressors(state["param_groups"])
        state["gradcomp"] = dict(
            steps_done=self.steps_done,
            warmup_steps=self.warmup_steps,
            buckets=[b.numel for b in self._buckets],
            feedback=self.feedback.state_dict(),
        )
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume from :meth:`state_dict`, saved by an optimizer of the same buckets,
        warm-up and compressors; the live compressors stay."""
        buckets = [b.numel for b in self._buckets]
        extra = checkpoint.check_loadable(state_dict, buckets, self.warmup_steps, self.param_groups)
        live = [{name: g[name] for name in COMPRESSOR_KEYS} for g in self.param_groups]
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "gradcomp"})
        for g, compressors in zip(self.param_groups, live, strict=True):
            g.update(compressors)
        self.steps_done = extra["steps_done"]
        self._agreed = False
        self.feedback.load_state_dict(extra["feedback"])


def _check_arguments(lr: float, betas: tuple, eps: float, warmup_steps: int, bucket_mb: float) -> None:
    if not 0.0 <= lr:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"betas must be in [0, 1), got {betas}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "CompressedAdam exchanges gradients: call torch.distributed.init_process_group first"
        )
