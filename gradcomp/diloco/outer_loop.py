"""DiLoCo's outer loop: inner steps counted, each fragment's exchange started in its turn,
landed, and the outer step taken on the anchor.

The fragments' schedule and the exchanges in flight are in
:mod:`gradcomp.diloco.fragments`, the outer step's arithmetic in
:mod:`gradcomp.diloco.outer_sgd`, the saved state and a restart on another world size in
:mod:`gradcomp.diloco.checkpoint`.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from gradcomp.collectives import Chooser, ReduceStats, all_reduce, check_hierarchy_options, verify_settings
from gradcomp.collectives.arrival import wait_for_every_rank
from gradcomp.collectives.chooser import as_chooser
from gradcomp.collectives.inline import InlineGroup
from gradcomp.compressors import Compressor, get_compressor, split_options
from gradcomp.diloco import checkpoint, replicas
from gradcomp.diloco.fragments import Exchange, by_dtype, split, starting
from gradcomp.diloco.outer_sgd import LearningRateSums, outer_step
from gradcomp.feedback import ErrorFeedback, UndoLog, all_finite


class DiLoCo:
    """The outer loop of DiLoCo over ``model``'s trained parameters.

    Start it from a model trained synchronously for a while (DDP, or gradcomp's
    hook), as DiLoCo's paper does: from scratch, local steps cost more of the loss
    (bench/reports/diloco-cpu2-2026-12-04.md).

    The outer step and the inner schedule: a pseudo-gradient is the sum of a
    period's inner steps, each scaled by its learning rate, so DiLoCo's outer
    momentum carries the large steps of a high learning rate into the periods
    after it has decayed, and keeps pushing once the schedule has annealed.
    ``follow_inner_lr=True`` relates the outer momentum to the inner learning
    rate as SGD's momentum relates to its own: the buffer sums each period's
    pseudo-gradient divided by the sum of its inner learning rates, and an
    outer step is ``outer_lr * (delta + momentum * S * buffer)`` (Nesterov)
    with ``S`` that sum for the period just ended. A constant learning rate
    gives DiLoCo's step; a period at no learning rate adds nothing and moves
    nothing. It is the default: on three tasks (two byte-level GPTs on other
    corpora, a CNN), from a trained start at 2 ranks, it ended closer to DDP's
    loss than DiLoCo's step at H = 25 and 75 on both transformers
    (bench/reports/diloco-defaults-cpu2-2026-12-05.md); ``False`` gives
    DiLoCo's (and torchft's) outer step exactly.

    The outer step's size: at ``outer_lr=1.0`` a step is the replicas' average
    plus the momentum's part (Nesterov, 0.8). Below 1 a step keeps only part of
    what the period learnt (0.55 and 0.4 ended 2 to 8 points further from DDP
    at H = 75); above it, it overshoots (1.2 and 1.4 ended 5 to 31 points
    further). Chosen on the two transformers at 2 and 4 ranks and checked on
    the CNN. With ``total_steps``, against DiLoCo's 0.7 and 0.9, it ended 0.6
    to 2.8 points closer to DDP on the transformers at H = 50 and 75, and from
    0.8 points further to 1.1 closer at H = 25.

    The end of a run: with ``total_steps`` (the run's inner steps) the last step
    exchanges every fragment and loads the replicas' average, without an outer
    step. The momentum's part of a step looks ahead to a next period, and at
    the end there is none: at H = 75 it ended 1.3 points closer to DDP on both
    transformers. Give it where the run's length is known.

    Ranks that reach an exchange at different inner steps (an uneven data shard, a
    rank that stepped once more before :meth:`synchronize`) raise on every rank: each
    exchange carries its inner step. An exchange whose average holds NaN or Inf (a
    rank's weights went non-finite in its inner steps) raises ``FloatingPointError``
    on every rank, with DiLoCo's state as before the exchange and the fragment's
    weights set back to the anchor: DiLoCo cannot repair the inner optimizer's
    state, which may hold NaN too.

    Args:
        model: the module each rank trains (not under DDP over ``group``: each
            replica trains on its own between synchronisations; see
            ``node_size`` for DDP inside a node). Rank 0's parameters and buffers are
            broadcast over ``group`` when this is made.
        inner: the inner optimizer (its state stays each rank's own).
        sync_every: inner steps between synchronisations (H).
        compressor: how the pseudo-gradients travel (any compressor, ``"auto"``).
        outer_lr, outer_momentum, nesterov: the outer SGD (DiLoCo's paper: 0.7,
            0.9, Nesterov; here 1.0, 0.8, see above).
        group: the ranks that average (default the world).
        algorithm: the all-reduce's (default from the compressor and the group).
        node_size: with ``algorithm="hierarchical"``, the ranks a node holds
            (default torchrun's ``LOCAL_WORLD_SIZE`` or the host names). A
            node can be one replica: its ranks train ``model`` under DDP over
            the node's group, and their identical pseudo-gradients cross
            between nodes once, compressed, a shard from each rank.
        fragments: parts of the parameters (consecutive, of about equal size)
            synchronised in turn, fragment f at the steps ``t`` with
            ``t % sync_every == (f + 1) * sync_every // fragments % sync_every``.
        overlap_steps: inner steps a fragment's exchange runs beside training
            before its outer step lands (0: at once, training waits); below
            ``sync_every``.
        follow_inner_lr: the outer momentum sums pseudo-gradients per unit of inner
            learning rate, and each outer step scales it by the learning rates of
            the period that just ended: the relation of SGD's momentum to its own
            schedule (see above; default True). At a constant inner learning rate
            it is DiLoCo's outer step (equal up to rounding).
        total_steps: the run's inner steps: the last loads the replicas' average
            (see above), and a step past it raises. Ranks must agree on it; a
            checkpoint resumes under another (a longer run). None: no end.
        manager: a :class:`torchft.Manager` (synchronous quorum): average over its replica
            groups, each exchange one torchft step, committed or discarded together, a
            restarted group healed into its peers' next exchange
            (:mod:`gradcomp.diloco.replicas`). No ``group``, ``node_size`` or
            ``overlap_steps`` then; made on every replica group at its start.
        compressor_options: the compressor's own options (``ratio``, ``block``...).

    Example:
        >>> outer = gradcomp.DiLoCo(model, inner, sync_every=50, compressor="int4", total_steps=len(loader))
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
        outer_lr: float = 1.0,
        outer_momentum: float = 0.8,
        nesterov: bool = True,
        group: dist.ProcessGroup | None = None,
        algorithm: str | None = None,
        node_size: int | None = None,
        fragments: int = 1,
        overlap_steps: int = 0,
        follow_inner_lr: bool = True,
        total_steps: int | None = None,
        manager=None,
        **compressor_options,
    ):
        _check_arguments(model, sync_every, fragments, overlap_steps, total_steps, outer_lr, outer_momentum)
        compressor = _compressor(compressor, algorithm, node_size, compressor_options)
        self.model, self.inner, self.sync_every = model, inner, sync_every
        self.compressor, self.algorithm, self.group = compressor, algorithm, group
        self.node_size = node_size
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trained parameters")
        if fragments > len(self.params):
            raise ValueError(
                f"fragments={fragments} is more than the model's {len(self.params)} trained parameters"
            )
        self.fragments = split([p.numel() for p in self.params], fragments)
        self.overlap_steps = overlap_steps
        self.local_step = 0  # inner steps taken (step() calls)
        self.outer_steps = [0] * fragments  # synchronisations done, per fragment
        self.in_flight: list[Exchange] = []
        self.bytes_sent = 0  # by this rank, every exchange landed so far
        self.feedback = ErrorFeedback()
        self.last_stats: ReduceStats | None = None
        self.follow_inner_lr = bool(follow_inner_lr)
        self.total_steps = total_steps
        self.lr_sums = LearningRateSums(inner, self.params, fragments, self.follow_inner_lr)
        # total_steps may change between a checkpoint and its resume, not between ranks
        self.replicas: replicas.Replicas | None = None
        if manager is None:
            agreed = {**self.settings(), "total_steps": total_steps}
            _agree_and_copy_rank_0(model, group, agreed, self.params[0].device)
        else:
            replicas.check(manager, self, group, node_size, overlap_steps)
        self.anchor = [p.detach().clone() for p in self.params]
        self.momentum = [torch.zeros_like(p) for p in self.params]
        if manager is not None:  # the first quorum: healed from a peer where it is behind
            self.replicas = replicas.Replicas(self, manager)
            self.replicas.join()

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group that averages (for :class:`gradcomp.ddp.Checkpointable`)."""
        return self.group

    def settings(self) -> dict:
        """What every rank must agree on, and a checkpoint with the run that loads it."""
        return {
            "sync_every": self.sync_every,
            "compressor": repr(sorted(self.compressor.settings().items())),
            "algorithm": self.algorithm,
            "outer": (self.outer_lr, self.outer_momentum, self.nesterov),
            "shapes": [(tuple(p.shape), str(p.dtype)) for p in self.params],
            "fragments": len(self.fragments),
            "overlap_steps": self.overlap_steps,
            "follow_inner_lr": self.follow_inner_lr,
            "node_size": self.node_size,
        }

    @property
    def outer_step(self) -> int:
        """Synchronisations of the whole model done (of its last fragment)."""
        return self.outer_steps[-1]

    @torch.no_grad()
    def step(self) -> ReduceStats | None:
        """Count an inner step; land the exchanges due now, then start those of the
        fragments whose turn it is (with ``overlap_steps=0`` they land at once: the
        outer step is taken and its weights loaded). The last landing's statistics, or None.

        At inner step ``total_steps`` (if given) the run ends: every exchange in flight
        lands, then every fragment is exchanged and its replicas' average loaded, without
        an outer step; stepping past it raises."""
        if self.total_steps is not None and self.local_step >= self.total_steps:
            raise ValueError(
                f"DiLoCo.step() past total_steps={self.total_steps}: the run ended with the replicas' "
                "average (make DiLoCo with a larger total_steps to train on)"
            )
        self.local_step += 1
        if self.replicas is not None:
            return self.replicas.step()
        if self.local_step == self.total_steps:
            return self._land_everything(average=True)
        stats = None
        for exchange in [e for e in self.in_flight if e.lands == self.local_step]:
            stats = self._land(exchange)
        for fragment in starting(self.local_step, self.sync_every, len(self.fragments)):
            exchange = self._start(fragment, self.local_step + self.overlap_steps)
            if not self.overlap_steps:
                stats = self._land(exchange)
        return stats

    @torch.no_grad()
    def synchronize(self) -> ReduceStats | None:
        """Land every exchange in flight, then exchange every fragment at once and
        land it: the weights are then identical on every rank (for an evaluation, or
        the end of a run of unknown length; ``total_steps`` ends on the replicas'
        average instead). It is an outer step of every fragment (momentum and step
        counts move) outside the schedule, which goes on as before. Every rank calls
        it at the same step."""
        if self.replicas is not None:
            return self.replicas.synchronize()
        return self._land_everything(average=False)

    def _land_everything(self, average: bool) -> ReduceStats | None:
        """Land every exchange in flight, then exchange every fragment and land it: with
        an outer step (:meth:`synchronize`), or (``average``, the run's last step) as the
        replicas' average, ``anchor - mean(anchor - weights)``, the weights they trained
        to: an outer step would add its momentum's lookahead, which serves a next period,
        and at the end there is none."""
        stats = None
        for exchange in list(self.in_flight):
            stats = self._land(exchange)
        for fragment in range(len(self.fragments)):
            stats = self._land(self._start(fragment, self.local_step), average=average)
        return stats

    def _start(self, fragment: int, lands: int) -> Exchange:
        """Send fragment's pseudo-gradients (anchor - weights) into the all-reduce."""
        exchange = Exchange(fragment, lands)
        exchange.lr_sums = self.lr_sums.take(fragment)
        indices = self.fragments[fragment]
        if lands > self.local_step:  # training goes on: what it learns meanwhile is kept
            exchange.snapshot = [self.params[i].detach().clone() for i in indices]
        options = {"algorithm": self.algorithm} if self.algorithm is not None else {}
        if self.node_size is not None:
            options["node_size"] = self.node_size
        exchange.log = UndoLog(self.feedback)
        for typed in by_dtype(indices, self.params):
            dtype = str(self.params[typed[0]].dtype)
            delta = torch.cat([(self.anchor[i] - self.params[i]).reshape(-1) for i in typed])
            name = ("diloco", dtype) if len(self.fragments) == 1 else ("diloco", fragment, dtype)
            if self.replicas is not None:  # torchft's step: synchronous, its residuals settled at the commit
                self.replicas.reduce(exchange, typed, delta, name)
                continue
            with exchange.log.recording():
                work = all_reduce(
                    delta,
                    self.compressor,
                    self.group,
                    async_op=True,
                    feedback=self.feedback,
                    name=name,
                    # The inner step: ranks that reach an exchange at different steps (an
                    # uneven shard) disagree on it, and the all-reduce's agreement refuses them.
                    step=self.local_step,
                    **options,
                )
            exchange.parts.append((typed, delta, work))
        self.in_flight.append(exchange)
        return exchange

    def _land(self, exchange: Exchange, average: bool = False) -> ReduceStats | None:
        """Wait for the average, take the outer step on the anchor (``average``: subtract
        the average, no outer step), load the weights."""
        exchange.wait()
        stats = exchange.stats[-1] if exchange.stats else None  # none restored from a checkpoint
        if stats is not None:
            self.last_stats = stats
        self.bytes_sent += exchange.bytes_sent
        if not all_finite(exchange.deltas()):
            self._refuse(exchange)
        first = self.outer_steps[exchange.fragment] == 0
        for i, part in exchange.per_parameter(self.params):
            if average:
                self.anchor[i].sub_(part)
            else:
                lr_sum = self.lr_sums.of(i, exchange.lr_sums)
                outer_step(
                    self.anchor[i],
                    self.momentum[i],
                    part,
                    lr=self.outer_lr,
                    momentum=self.outer_momentum,
                    nesterov=self.nesterov,
                    first=first,
                    lr_sum=lr_sum,
                )
        exchange.load_weights(self.fragments[exchange.fragment], self.params, self.anchor)
        self.outer_steps[exchange.fragment] += 1
        self.in_flight.remove(exchange)
        return stats

    def _refuse(self, exchange: Exchange) -> None:
        """Raise ``FloatingPointError`` for an exchange whose average is not finite (on every
        rank: a non-finite pseudo-gradient on any rank reaches every rank's average), its
        fragment set back to the anchor first: DiLoCo's state as before the exchange, the
        weights identical and finite on every rank."""
        if exchange.log is not None:
            exchange.log.undo()
        indices = self.fragments[exchange.fragment]
        for i in indices:
            self.params[i].copy_(self.anchor[i])
        self.lr_sums.clear(exchange.fragment)
        self.in_flight.remove(exchange)
        raise FloatingPointError(
            f"DiLoCo: the replicas' average pseudo-gradient of fragment {exchange.fragment} holds NaN or "
            f"Inf at inner step {self.local_step}: some rank's weights went non-finite in its inner "
            "steps (a NaN or Inf gradient or loss). Raised on every rank, with DiLoCo's anchor, outer "
            "momentum, residuals and step counts as before the exchange and the fragment's weights "
            "set back to the anchor on every rank; the inner optimizer's state may hold NaN: load it "
            "(or the last checkpoint) before going on"
        )

    def state_dict(self) -> dict:
        """Everything a rank needs to resume bit for bit, mid-way and mid-fragment too:
        the anchor, the outer momentum, the residuals, the steps, the exchanges in flight
        (waited for: their averages are kept, to land at their step), and this rank's own
        weights and inner optimizer state, which differ from the other ranks' between
        synchronisations (``torch.distributed.checkpoint`` keeps one copy of a model's
        plain tensors for all ranks). ``gradcomp.ddp.Checkpointable(outer)`` puts it under
        this rank's key for ``torch.distributed.checkpoint``; load it after the model and
        the optimizer."""
        return checkpoint.state_of(self)

    def load_state_dict(self, saved: dict) -> None:
        """Resume from :meth:`state_dict` (of this schema or an earlier one) saved with the
        same settings."""
        checkpoint.load(self, saved)

    @torch.no_grad()
    def restart(self, saved: dict | None) -> None:
        """Go on from a checkpoint of another world size (``Checkpointable(outer,
        mismatch="drop")``): this rank's saved state where it has one, without its
        residuals or exchanges in flight; then group rank 0's weights, anchor, momentum
        and steps on every rank, so that the ranks agree again. Every rank calls it."""
        checkpoint.restart(self, saved)


def _check_arguments(
    model, sync_every, fragments, overlap_steps, total_steps, outer_lr, outer_momentum
) -> None:
    if not _is_int(sync_every) or sync_every < 1:
        raise ValueError(
            f"sync_every must be an int >= 1 (inner steps between synchronisations), got {sync_every!r}"
        )
    if not _is_int(fragments) or fragments < 1:
        raise ValueError(f"fragments must be an int >= 1, got {fragments!r}")
    if not _is_int(overlap_steps) or not 0 <= overlap_steps < sync_every:
        raise ValueError(
            f"overlap_steps must be an int in [0, sync_every={sync_every}) (a fragment's exchange "
            f"lands before its next one starts), got {overlap_steps!r}"
        )
    if total_steps is not None and (not _is_int(total_steps) or total_steps < 1):
        raise ValueError(
            f"total_steps must be an int >= 1 (the run's inner steps) or None, got {total_steps!r}"
        )
    if not outer_lr > 0:
        raise ValueError(f"outer_lr must be > 0, got {outer_lr!r}")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("DiLoCo averages the weights itself: pass the module, not a DistributedDataParallel")


def _agree_and_copy_rank_0(model: torch.nn.Module, group, settings: dict, device: torch.device) -> None:
    """Wait for every rank of ``group``, check that they agree on ``settings``, then give
    every rank group rank 0's parameters and buffers."""
    ranks = InlineGroup(group)
    wait_for_every_rank(group, "DiLoCo")  # a rank that never makes one: said, not hung
    verify_settings(ranks, "gradcomp.DiLoCo's settings", settings, device)
    source = dist.get_global_rank(ranks.group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=source, group=group)


def _compressor(
    compressor, algorithm: str | None, node_size: int | None, options: dict
) -> Compressor | Chooser:
    """The compressor (or ``"auto"``'s chooser) ``compressor`` and its ``options`` name; a
    misspelt option of DiLoCo's or the compressor's is named with the nearest one."""
    own = [
        name
        for name in inspect.signature(DiLoCo.__init__).parameters
        if name not in ("self", "compressor_options")
    ]
    split_options(compressor, options, own, "gradcomp.DiLoCo")
    chooser = as_chooser(compressor)
    if chooser:
        return chooser
    compressor = get_compressor(compressor, **options)
    check_hierarchy_options(compressor, algorithm, node_size, None)
    return compressor


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
