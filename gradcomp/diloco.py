"""DiLoCo: local steps, then a compressed average of the weights' change and an outer step.

Each rank trains on its own for ``sync_every`` inner steps. Then the ranks
average their pseudo-gradients (the anchor, the weights every rank held after
the last synchronisation, minus this rank's weights) through gradcomp's
compressed all-reduce with error feedback, and an outer optimizer (SGD with
Nesterov momentum) moves the anchor; every rank takes the new anchor as its
weights. Replicas are identical after every synchronisation: every rank decodes
the same average and applies the same outer step.

With ``fragments=F`` (Streaming DiLoCo) the parameters are F parts that
synchronise in turn, one about every ``sync_every / F`` steps, each still every
``sync_every``; with ``overlap_steps=T`` a part's exchange runs on gradcomp's
worker while training goes on, and its outer step lands T inner steps later,
on top of what the rank learnt meanwhile. The anchors are then identical on
every rank at every step, the weights after :meth:`DiLoCo.synchronize`.
"""

from __future__ import annotations

import copy
import inspect
import itertools

import torch
import torch.distributed as dist

from gradcomp.collectives import Chooser, ReduceStats, all_reduce, check_hierarchy_options, verify_settings
from gradcomp.collectives.arrival import wait_for_every_rank
from gradcomp.collectives.chooser import as_chooser
from gradcomp.collectives.inline import InlineGroup
from gradcomp.compressors import Compressor, get_compressor, split_options
from gradcomp.ddp import records
from gradcomp.feedback import ErrorFeedback, UndoLog, all_finite

# 2: per-fragment outer steps and exchanges in flight (1 read with one fragment);
# 3: the inner learning rates summed per fragment, for follow_inner_lr (1 and 2 read without it)
SCHEMA_VERSION = 3


class _Exchange:
    """One fragment's pseudo-gradients on their way: one all-reduce per dtype."""

    def __init__(self, fragment: int, lands: int):
        self.fragment, self.lands = fragment, lands
        self.parts: list[tuple[list[int], torch.Tensor, object]] = []  # (indices, delta, work or None)
        self.snapshot: list[torch.Tensor] | None = None  # the weights it was taken from (overlapped)
        self.lr_sums: list[float] = []  # per inner group, the learning rates of its inner steps
        self.stats: list[ReduceStats] = []  # of the parts waited for
        self.bytes_sent = 0  # by this rank, the parts waited for (kept by a checkpoint)
        self.log: UndoLog | None = None  # the residuals before it (None: restored from a checkpoint)

    def wait(self) -> None:
        """Wait for every part still on its way; keep its statistics."""
        for n, (indices, delta, work) in enumerate(self.parts):
            if work is not None:
                stats = work.get_future().wait()
                self.stats.append(stats)
                self.bytes_sent += stats.bytes_sent
                self.parts[n] = (indices, delta, None)


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
        **compressor_options,
    ):
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
            raise TypeError(
                "DiLoCo averages the weights itself: pass the module, not a DistributedDataParallel"
            )
        own = [
            name
            for name in inspect.signature(DiLoCo.__init__).parameters
            if name not in ("self", "compressor_options")
        ]
        split_options(compressor, compressor_options, own, "gradcomp.DiLoCo")  # a typo: the nearest name said
        chooser = as_chooser(compressor)
        compressor = chooser or get_compressor(compressor, **compressor_options)
        if not chooser:
            check_hierarchy_options(compressor, algorithm, node_size, None)
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
        self.fragments = _split([p.numel() for p in self.params], fragments)
        self.overlap_steps = overlap_steps
        self.local_step = 0  # inner steps taken (step() calls)
        self.outer_steps = [0] * fragments  # synchronisations done, per fragment
        self.in_flight: list[_Exchange] = []
        self.bytes_sent = 0  # by this rank, every exchange landed so far
        self.feedback = ErrorFeedback()
        self.last_stats: ReduceStats | None = None
        self.follow_inner_lr = bool(follow_inner_lr)
        self.total_steps = total_steps
        groups = {id(p): g for g, group in enumerate(inner.param_groups) for p in group["params"]}
        self._group_of = [groups.get(id(p)) for p in self.params]  # None: the inner optimizer skips it
        # Per fragment and inner group, the learning rates of the inner steps since its exchange.
        self.lr_sums = [[0.0] * len(inner.param_groups) for _ in self.fragments]
        self._lr_hook = inner.register_step_pre_hook(self._count_lr) if self.follow_inner_lr else None
        ranks = InlineGroup(group)
        device = self.params[0].device
        wait_for_every_rank(group, "DiLoCo")  # a rank that never makes one: said, not hung
        # total_steps may change between a checkpoint and its resume, not between ranks
        agreed = {**self.settings(), "total_steps": total_steps}
        verify_settings(ranks, "gradcomp.DiLoCo's settings", agreed, device)
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
            "fragments": len(self.fragments),
            "overlap_steps": self.overlap_steps,
            "follow_inner_lr": self.follow_inner_lr,
            "node_size": self.node_size,
        }

    def _count_lr(self, optimizer, args, kwargs) -> None:
        """(before each inner step) Add the learning rate it takes to every fragment's sums
        (a tensor learning rate is added as a tensor: no host sync a step; :meth:`_start`
        reads the sums once an exchange)."""
        for sums in self.lr_sums:
            for g, group in enumerate(optimizer.param_groups):
                sums[g] = sums[g] + group["lr"]

    def _read_lr_sums(self) -> list[list[float]]:
        return [[float(x) for x in sums] for sums in self.lr_sums]

    @property
    def outer_step(self) -> int:
        """Synchronisations of the whole model done (of its last fragment)."""
        return self.outer_steps[-1]

    def _starts(self, step: int) -> list[int]:
        """The fragments whose exchange starts at inner step ``step``."""
        h, count = self.sync_every, len(self.fragments)
        return [f for f in range(count) if step % h == (f + 1) * h // count % h]

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
        if self.local_step == self.total_steps:
            return self._land_everything(average=True)
        stats = None
        for exchange in [e for e in self.in_flight if e.lands == self.local_step]:
            stats = self._land(exchange)
        for fragment in self._starts(self.local_step):
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

    def _start(self, fragment: int, lands: int) -> _Exchange:
        """Send fragment's pseudo-gradients (anchor - weights) into the all-reduce."""
        exchange = _Exchange(fragment, lands)
        exchange.lr_sums = [float(x) for x in self.lr_sums[fragment]]
        self.lr_sums[fragment] = [0.0] * len(self.lr_sums[fragment])
        indices = self.fragments[fragment]
        if lands > self.local_step:  # training goes on: what it learns meanwhile is kept
            exchange.snapshot = [self.params[i].detach().clone() for i in indices]
        options = {"algorithm": self.algorithm} if self.algorithm is not None else {}
        if self.node_size is not None:
            options["node_size"] = self.node_size
        exchange.log = UndoLog(self.feedback)
        for dtype in sorted({self.params[i].dtype for i in indices}, key=str):
            typed = [i for i in indices if self.params[i].dtype == dtype]
            delta = torch.cat([(self.anchor[i] - self.params[i]).reshape(-1) for i in typed])
            name = ("diloco", str(dtype)) if len(self.fragments) == 1 else ("diloco", fragment, str(dtype))
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

    def _land(self, exchange: _Exchange, average: bool = False) -> ReduceStats | None:
        """Wait for the average, take the outer step on the anchor (``average``: subtract
        the average, no outer step), load the weights."""
        exchange.wait()
        stats = exchange.stats[-1] if exchange.stats else None  # none restored from a checkpoint
        if stats is not None:
            self.last_stats = stats
        self.bytes_sent += exchange.bytes_sent
        if not all_finite([delta for _, delta, _ in exchange.parts]):
            self._refuse(exchange)
        first = self.outer_steps[exchange.fragment] == 0
        for indices, delta, _ in exchange.parts:
            offset = 0
            for i in indices:
                numel = self.params[i].numel()
                part = delta[offset : offset + numel].view_as(self.params[i])
                if average:
                    self.anchor[i].sub_(part)
                else:
                    lr_sum = None
                    if self.follow_inner_lr:
                        group = self._group_of[i]
                        lr_sum = exchange.lr_sums[group] if group is not None else 0.0
                    self._outer(i, part, first, lr_sum)
                offset += numel
        indices = self.fragments[exchange.fragment]
        if exchange.snapshot is None:
            for i in indices:
                self.params[i].copy_(self.anchor[i])
        else:  # the new anchor, and what this rank learnt since the exchange started
            for i, taken in zip(indices, exchange.snapshot, strict=True):
                self.params[i].sub_(taken).add_(self.anchor[i])
        self.outer_steps[exchange.fragment] += 1
        self.in_flight.remove(exchange)
        return stats

    def _refuse(self, exchange: _Exchange) -> None:
        """Raise ``FloatingPointError`` for an exchange whose average is not finite (on every
        rank: a non-finite pseudo-gradient on any rank reaches every rank's average), its
        fragment set back to the anchor first: DiLoCo's state as before the exchange, the
        weights identical and finite on every rank."""
        if exchange.log is not None:
            exchange.log.undo()
        indices = self.fragments[exchange.fragment]
        for i in indices:
            self.params[i].copy_(self.anchor[i])
        self.lr_sums[exchange.fragment] = [0.0] * len(self.lr_sums[exchange.fragment])
        self.in_flight.remove(exchange)
        raise FloatingPointError(
            f"DiLoCo: the replicas' average pseudo-gradient of fragment {exchange.fragment} holds NaN or "
            f"Inf at inner step {self.local_step}: some rank's weights went non-finite in its inner "
            "steps (a NaN or Inf gradient or loss). Raised on every rank, with DiLoCo's anchor, outer "
            "momentum, residuals and step counts as before the exchange and the fragment's weights "
            "set back to the anchor on every rank; the inner optimizer's state may hold NaN: load it "
            "(or the last checkpoint) before going on"
        )

    def _outer(self, i: int, gradient: torch.Tensor, first: bool, lr_sum: float | None = None) -> None:
        """SGD with (Nesterov) momentum on the anchor, as ``torch.optim.SGD`` takes it; with
        ``lr_sum`` (follow_inner_lr) the buffer sums ``gradient / lr_sum`` and its part of
        the step is scaled by ``lr_sum`` (a period without learning rate adds nothing)."""
        update, scale = gradient, 1.0 if lr_sum is None else lr_sum
        if self.outer_momentum:
            buffer = self.momentum[i]
            if scale == 1.0:
                added = gradient
            else:  # a period without learning rate adds nothing
                added = gradient / scale if scale > 0 else torch.zeros_like(gradient)
            if first:
                buffer.copy_(added)
            else:
                buffer.mul_(self.outer_momentum).add_(added)
            if self.nesterov:
                update = gradient.add(buffer, alpha=self.outer_momentum * scale)
            else:
                update = buffer if scale == 1.0 else buffer.mul(scale)
        self.anchor[i].add_(update, alpha=-self.outer_lr)

    def state_dict(self) -> dict:
        """Everything a rank needs to resume bit for bit, mid-way and mid-fragment too:
        the anchor, the outer momentum, the residuals, the steps, the exchanges in flight
        (waited for: their averages are kept, to land at their step), and this rank's own
        weights and inner optimizer state, which differ from the other ranks' between
        synchronisations (``torch.distributed.checkpoint`` keeps one copy of a model's
        plain tensors for all ranks). ``gradcomp.ddp.Checkpointable(outer)`` puts it under
        this rank's key for ``torch.distributed.checkpoint``; load it after the model and
        the optimizer."""
        for exchange in self.in_flight:
            exchange.wait()
        return {
            "version": SCHEMA_VERSION,
            "settings": self.settings(),
            "local_step": self.local_step,
            "outer_steps": list(self.outer_steps),
            "bytes_sent": self.bytes_sent,
            "anchor": [t.clone() for t in self.anchor],
            "momentum": [t.clone() for t in self.momentum],
            "lr_sums": self._read_lr_sums(),
            "feedback": self.feedback.state_dict(),
            "weights": [p.detach().clone() for p in self.params],
            "inner": copy.deepcopy(self.inner.state_dict()),
            "in_flight": [
                {
                    "fragment": e.fragment,
                    "lands": e.lands,
                    "deltas": [delta.clone() for _, delta, _ in e.parts],
                    "snapshot": None if e.snapshot is None else [t.clone() for t in e.snapshot],
                    "bytes_sent": e.bytes_sent,
                    "lr_sums": list(e.lr_sums),
                }
                for e in self.in_flight
            ],
        }

    @torch.no_grad()
    def restart(self, saved: dict | None) -> None:
        """Go on from a checkpoint of another world size (``Checkpointable(outer,
        mismatch="drop")``): this rank's saved state where it has one, without its
        residuals or exchanges in flight; then group rank 0's weights, anchor, momentum
        and steps on every rank, so that the ranks agree again. Every rank calls it."""
        for exchange in self.in_flight:
            exchange.wait()
        # Before the broadcasts: a saved state refused on the ranks that have one (other
        # settings) must fail the ranks that have none too, not leave them in a broadcast.
        records.on_every_rank(self.group, lambda: (self._restore_own(saved), None))
        self.feedback, self.in_flight = ErrorFeedback(), []
        device = self.params[0].device
        counters = torch.tensor([self.local_step, *self.outer_steps], dtype=torch.int64, device=device)
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        lr_sums = torch.tensor(self._read_lr_sums(), dtype=torch.float64, device=device)
        for tensor in [*self.params, *self.anchor, *self.momentum, counters, lr_sums]:
            dist.broadcast(tensor, src=source, group=self.group)
        self.local_step, *self.outer_steps = (int(n) for n in counters.tolist())
        self.lr_sums = lr_sums.tolist()

    def _restore_own(self, saved: dict | None) -> None:
        """This rank's ``saved`` state where it has one, without its residuals or exchanges."""
        if saved is not None:
            self.load_state_dict({**saved, "feedback": ErrorFeedback().state_dict(), "in_flight": []})

    def load_state_dict(self, saved: dict) -> None:
        version = saved.get("version")
        ours = self.settings()
        if version == 1:
            if ours["fragments"] != 1 or ours["overlap_steps"]:
                raise ValueError(
                    "a DiLoCo state of schema 1 (one fragment, no overlap) loads only into one fragment "
                    "without overlap"
                )
            saved = {**saved, "outer_steps": [saved["outer_step"]], "in_flight": [], "bytes_sent": 0}
            saved["settings"] = {**saved["settings"], "fragments": 1, "overlap_steps": 0}
        elif version not in (2, SCHEMA_VERSION):
            raise ValueError(f"DiLoCo state of schema {version!r}; this version reads 1 to {SCHEMA_VERSION}")
        if version in (1, 2):  # before follow_inner_lr: DiLoCo's outer step
            saved = {**saved, "settings": {**saved["settings"], "follow_inner_lr": False}}
        saved = {**saved, "settings": {"node_size": None, **saved["settings"]}}  # saved before node_size
        if saved["settings"] != ours:
            differ = sorted(k for k, v in ours.items() if saved["settings"].get(k) != v)
            hint = ""
            if version in (1, 2) and "follow_inner_lr" in differ:
                hint = " (saved before follow_inner_lr: make DiLoCo with follow_inner_lr=False to resume it)"
            raise ValueError(f"the checkpoint's DiLoCo settings differ in {differ}{hint}")
        for exchange in self.in_flight:  # nothing of this run may still write a residual
            exchange.wait()
        self.local_step = int(saved["local_step"])
        self.outer_steps = [int(n) for n in saved["outer_steps"]]
        if "lr_sums" in saved:
            self.lr_sums = [[float(x) for x in sums] for sums in saved["lr_sums"]]
        self.bytes_sent = int(saved["bytes_sent"])
        own = saved.get("weights", [])  # schema 1 held neither: the caller loaded them
        with torch.no_grad():
            for mine, theirs in zip(
                [*self.anchor, *self.momentum, *(self.params if own else [])],
                [*saved["anchor"], *saved["momentum"], *own],
                strict=True,
            ):
                mine.copy_(theirs)
        if "inner" in saved:
            self.inner.load_state_dict(saved["inner"])
        self.feedback.load_state_dict(saved["feedback"])
        self.in_flight = []
        device = self.params[0].device
        for entry in saved["in_flight"]:
            exchange = _Exchange(int(entry["fragment"]), int(entry["lands"]))
            indices = self.fragments[exchange.fragment]
            dtypes = sorted({self.params[i].dtype for i in indices}, key=str)
            for dtype, delta in zip(dtypes, entry["deltas"], strict=True):
                typed = [i for i in indices if self.params[i].dtype == dtype]
                exchange.parts.append((typed, delta.to(device), None))
            if entry["snapshot"] is not None:
                exchange.snapshot = [t.to(device) for t in entry["snapshot"]]
            exchange.bytes_sent = int(entry["bytes_sent"])
            exchange.lr_sums = [float(x) for x in entry.get("lr_sums", [])]
            self.in_flight.append(exchange)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _split(sizes: list[int], count: int) -> list[list[int]]:
    """``count`` runs of consecutive indices of ``sizes``, none empty, each cut where the
    running total comes closest to its share of the whole."""
    total, cumulative = sum(sizes), list(itertools.accumulate(sizes))
    cuts, first = [], 0
    for k in range(1, count):
        last = len(sizes) - (count - k) - 1  # leaves an index for each run still to come
        cut = min(range(first, last + 1), key=lambda j: (abs(cumulative[j] * count - total * k), j))
        cuts.append(cut)
        first = cut + 1
    bounds = [-1, *cuts, len(sizes) - 1]
    return [list(range(a + 1, b + 1)) for a, b in zip(bounds, bounds[1:], strict=False)]
