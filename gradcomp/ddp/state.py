"""The hook's state: options, step, residuals, bucket layouts, statistics, and how the
worker reduces each bucket; ``compressor="auto"`` adds its controller."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from gradcomp import ops, planner, streams
from gradcomp.buckets import BucketLayout, BucketLayouts
from gradcomp.collectives import (
    HIERARCHICAL,
    Job,
    ReduceStats,
    default_algorithm,
    drive,
    hierarchy_for,
    job_steps,
    queue_for,
    residuals,
    ring_all_reduce_bytes,
)
from gradcomp.compressors import Compressor, get_compressor
from gradcomp.ddp.auto import DENSE, BucketPlans
from gradcomp.ddp.checkpoint import SCHEMA_VERSION, restore_auto, saved_auto, upgrade
from gradcomp.ddp.options import DEFAULT_TRIAL_STEPS, AutoOptions, HookOptions, renamed
from gradcomp.ddp.stats import StepLedger, StepStats
from gradcomp.ddp.timing import timed_on_stream
from gradcomp.ddp.trial import TRIAL_TURNS
from gradcomp.feedback import ErrorFeedback

logger = logging.getLogger("gradcomp.ddp")

_AUTO_ONLY = ("allow", "profile", "check_every", "drift", "replan_every", "trial_steps")


class HookState:
    """State of :func:`gradcomp.ddp.hook`: compressor, residuals, step counter, statistics.

    Args:
        compressor: a :class:`Compressor`, a compressor spec, ``"auto"``, or a
            :class:`gradcomp.planner.Auto` (the same chooser ``all_reduce`` takes:
            ``"auto"`` with its ``allow`` and ``profile``).
        group: the group to reduce over (default WORLD), as ``all_reduce``,
            CompressedAdam and DiLoCo call it (``process_group=``, the name torch's
            hook states use, still works with a ``FutureWarning``).
        residual: the residual's dtype, ``"fp32"`` (default) or ``"grad"`` (the
            gradient's), as :func:`gradcomp.fsdp.register` calls it
            (``residual_dtype=``: still works with a ``FutureWarning``).
        warmup_steps, min_numel, algorithm, node_size, inter_algorithm,
            measure_error, history: see :class:`HookOptions`.
        allow, profile, check_every, drift, replan_every, trial_steps: with
            ``compressor="auto"``, see :class:`AutoOptions`.

    With ``compressor="auto"`` the hook reduces its first ``warmup_steps`` steps (at
    least 2) dense, then measures the group's link and each candidate's codec on the
    buckets' device, combines every rank's figures (the slowest of each) and picks per
    bucket the candidate and algorithm with the least predicted time; :attr:`plan`
    holds the choice, :attr:`trials` what it tried, and both are kept in
    :meth:`state_dict` (docs/auto.md tells how it plans, checks and tries).

    At its first call (and the first after :meth:`load_state_dict`) the hook compares
    every rank's settings and step (:meth:`agreement_settings`): where they differ,
    every rank raises ``ValueError`` naming each rank's, instead of issuing other
    collectives than its peers and hanging.

    Example:
        >>> state = HookState(gradcomp.get_compressor("int8"), warmup_steps=10)
        >>> ddp_model.register_comm_hook(state, gradcomp.ddp.hook)
    """

    def __init__(
        self,
        compressor: Compressor | str | planner.Auto,
        group: dist.ProcessGroup | None = None,
        warmup_steps: int = 0,
        min_numel: int = 1024,
        *,
        algorithm: str | None = None,
        node_size: int | None = None,
        inter_algorithm: str | None = None,
        residual: str = "fp32",
        measure_error: bool = False,
        history: int = 10_000,
        allow=None,
        profile=None,
        check_every: int = 10,
        drift: float | None = 0.5,
        replan_every: int | None = None,
        trial_steps: int | None = None,
        process_group: dist.ProcessGroup | None = None,  # the old name of group
        residual_dtype: str | None = None,  # the old name of residual
    ):
        group = renamed("process_group", process_group, "group", group)
        residual = renamed("residual_dtype", residual_dtype, "residual", residual, default="fp32")
        is_auto = planner.is_auto(compressor)
        if isinstance(compressor, planner.Auto):  # the all-reduce's chooser: its candidates and profile
            if (allow, profile) != (None, None):
                raise ValueError("allow= and profile= are given by the planner.Auto; give them once")
            allow, profile = compressor.allow, compressor.profile
        given = (allow, profile, replan_every, trial_steps, check_every, drift)
        if not is_auto and given != (None, None, None, None, 10, 0.5):
            raise ValueError(
                f"{', '.join(_AUTO_ONLY[:-1])} and {_AUTO_ONLY[-1]} are options of compressor='auto'"
            )
        options = HookOptions(
            warmup_steps,
            min_numel,
            algorithm,
            node_size,
            inter_algorithm,
            residual,
            measure_error,
            history,
        )
        self.auto: BucketPlans | None = None
        if is_auto:
            trial_steps = DEFAULT_TRIAL_STEPS if trial_steps is None else trial_steps
            auto = AutoOptions(
                planner.SAFE if allow is None else allow,
                profile,
                check_every,
                drift,
                replan_every,
                trial_steps,
            )
            self.options = options.check_for_auto()
            self.auto = self._controller(auto)
            self.compressor: Compressor | None = None  # auto: each bucket's is in its plan
        else:
            self.compressor = get_compressor(compressor)
            self.options = options.check_for(self.compressor)
        ops.check_forced_backend()
        self.process_group = group  # the attribute's name as in torch's hook states
        self.step = 0
        self.feedback = ErrorFeedback(residual)
        self.buckets = BucketLayouts(self.feedback)
        self.ledger = StepLedger(history)
        self.agreed = False  # whether the ranks' settings were compared (the first hook call)
        self._sent_as: dict[int, tuple] = {}  # bucket -> the route it last went through
        self._labels: dict[int, tuple] = {}  # id of a compressor -> (it, its label)
        logger.info("gradcomp hook: %s, %s", "auto" if is_auto else repr(self.compressor), self.options)

    def _controller(self, options: AutoOptions) -> BucketPlans:
        hook = self.options
        return BucketPlans(options, hook.warmup_steps, hook.min_numel, hook.node_size)

    # ------------------------------------------------------------------ what users read
    @property
    def stats(self) -> list[StepStats]:
        """The last ``history`` steps' statistics, oldest first."""
        return self.ledger.closed

    @property
    def last_stats(self) -> StepStats | None:
        """Statistics of the last completed step (None before the first)."""
        return self.stats[-1] if self.stats else None

    @property
    def plan(self) -> list | None:
        """``"auto"``: each bucket's :class:`~gradcomp.planner.Prediction` (None before the
        plan, and for a static compressor)."""
        return None if self.auto is None else self.auto.plan

    @property
    def trials(self) -> list[dict]:
        """``"auto"``: each finished trial: its plans, their milliseconds a step, each turn's,
        which one was kept."""
        return [] if self.auto is None else self.auto.trials

    @property
    def ready_offsets(self) -> list[float] | None:
        """``"auto"``: when each bucket was handed over in the step before the plan, in seconds
        before the last one (that one: 0), the latest of every rank's, in reduction order:
        the overlap with the backward pass the plan weighed. None before a plan, or where
        they were not found (then the plan weighed none)."""
        offsets = None if self.auto is None else self.auto.offsets
        return None if offsets is None else list(offsets)

    @property
    def settle_steps(self) -> int:
        """``"auto"``: the most steps after the warm-up until the plan in force is final: the
        step that plans, a trial's turns of ``trial_steps`` + 1 steps each, and the switch
        to the plan kept (0 without trials, and for a static compressor)."""
        if self.auto is None or not self.auto.options.trial_steps:
            return 0
        return len(TRIAL_TURNS) * (self.auto.options.trial_steps + 1) + 2

    def replan(self) -> None:
        """Measure and plan afresh at the next check (every ``check_every`` steps; ``"auto"`` only).

        Safe to call on one rank: every rank joins the check, and the request of
        any rank re-plans on all of them."""
        if self.auto is None:
            raise RuntimeError("replan() is for compressor='auto'")
        self.auto.replan_requested = True

    def flush(self) -> None:
        """Wait until the worker has recorded the statistics of every bucket submitted so far
        (``auto``'s dense buckets go through torch's all-reduce, their statistics after)."""
        queue_for(self.process_group).submit(lambda: None, torch.device("cpu"), collectives=False).wait()

    def compressor_settings(self) -> dict:
        """The compressor's settings (``"auto"``: its candidates)."""
        if self.auto is not None:
            return {
                "name": "auto",
                "allow": [planner.label(planner.from_spec(c)) for c in self.auto.options.allow],
            }
        return self.compressor.settings()

    def agreement_settings(self) -> dict:
        """What every rank must share, the step included (a rank resumed from another
        step's checkpoint would switch at other steps): the hook's first call compares them."""
        options = self.options
        agreed = {
            "step": self.step,
            "compressor": self.compressor_settings(),
            "warmup_steps": options.warmup_steps,
            "min_numel": options.min_numel,
            "algorithm": options.algorithm,
            "node_size": options.node_size,
            "inter_algorithm": options.inter_algorithm,
            "residual_dtype": self.feedback.dtype,
        }
        return agreed if self.auto is None else agreed | self.auto.options.settings()

    def label(self, compressor: Compressor) -> str:
        """``compressor``'s label (:func:`gradcomp.planner.label`), built once per compressor
        (it constructs a default one). The entry keeps the compressor alive, so its id cannot
        be reused by another."""
        entry = self._labels.get(id(compressor))
        if entry is None or entry[0] is not compressor:
            entry = self._labels[id(compressor)] = (compressor, planner.label(compressor))
        return entry[1]

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Step, residuals, bucket layouts and auto's plan; ``torch.save``-able (schema in
        :mod:`gradcomp.ddp.checkpoint`)."""
        saved = {
            "version": SCHEMA_VERSION,
            "step": self.step,
            "settings": self.compressor_settings(),
            "feedback": self.feedback.state_dict(),
            **self.buckets.state_dict(),
            "auto": None,
        }
        if self.auto is not None:
            routes = {i: self._described(route) for i, route in self._sent_as.items()}
            saved["auto"] = saved_auto(self.auto, routes)
        return saved

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (of any gradcomp version); the next step
        continues the saved run exactly."""
        state = upgrade(state)
        if state["settings"] != self.compressor_settings():
            raise ValueError(
                f"checkpoint was saved with compressor settings {state['settings']}, "
                f"this state has {self.compressor_settings()}"
            )
        self.agreed, self._sent_as = False, {}
        if self.auto is not None:
            self.auto.wait()  # a check or trial job of this run: done before it is replaced
            self.auto = self._controller(self.auto.options)
            routes = restore_auto(self.auto, state["auto"])
            self._sent_as = {
                int(i): (planner.from_spec(label), algorithm, *(between or (None,)))
                for i, (label, algorithm, *between) in routes.items()
            }
        self.step = int(state["step"])
        self.feedback.load_state_dict(state["feedback"])
        self.buckets.load_state_dict(state)

    def __getstate__(self):
        # Process groups cannot be pickled; like torch's hooks, drop it. Another process
        # compares its settings anew.
        return self.__dict__ | {"process_group": None, "agreed": False}

    # ------------------------------------------------------------------ the worker's
    def reduce(self, tensor: torch.Tensor, index: int, layout: BucketLayout, step: int, last: bool, q):
        """Steps (see :func:`gradcomp.collectives.job_steps`) that reduce bucket
        ``index`` (``tensor``) of ``step`` in place on ``q``; their result is ``tensor``."""
        started = self.ledger.start(step, last)
        self.buckets.adopt(index, layout, tensor)
        auto = self.auto
        if auto is not None and auto.plan is None:
            auto.note_size(step, index, tensor.numel())
        dense = step < self.options.warmup_steps or tensor.numel() < self.options.min_numel
        route = (DENSE, "dense", None) if dense else self._route(index, tensor.numel())
        compressor, algorithm, between = route
        dense = dense or compressor.name == "none"
        compressor = DENSE if dense else compressor
        algorithm = "dense" if dense else algorithm or default_algorithm(compressor, q.world_size)
        route = (compressor, algorithm, between if algorithm == HIERARCHICAL else None)
        self._carry(index, tensor, route, q)
        job = Job(
            tensor,
            compressor,
            "avg",
            algorithm,
            None if dense else self.feedback,
            key=index,
            step=step,
            measure_error=self.options.measure_error and not dense,
            shapes=self.buckets.shapes_of(layout) if compressor.low_rank else None,
        )
        if algorithm == HIERARCHICAL:
            job.hierarchy, job.inter_algorithm = hierarchy_for(q, self.options.node_size), route[2]
        timed = None if auto is None else auto.intervals(step, index, tensor.device)
        steps = job_steps(job, q)
        reduced = yield from (steps if timed is None else timed_on_stream(steps, tensor.device, timed))
        how = f"{algorithm}({reduced.inter_algorithm})" if reduced.inter_algorithm else algorithm
        self.ledger.finish(step, index, reduced, f"{self.label(compressor)} {how}", started)
        return tensor

    def _route(self, index: int, numel: int) -> tuple:
        """The compressor, algorithm and algorithm between nodes bucket ``index`` takes."""
        if self.auto is not None:
            return self.auto.route(index, numel)
        return self.compressor, self.options.algorithm, self.options.inter_algorithm

    def _carry(self, index: int, tensor: torch.Tensor, route: tuple, q) -> None:
        """(worker) Where bucket ``index`` goes another way than the last time, what the last
        way held back goes into its input (:func:`gradcomp.collectives.residuals.carry`); at
        its first reduction in this process, what a two_phase owner still holds."""
        if self.auto is None and index in self._sent_as:
            return
        previous, self._sent_as[index] = self._sent_as.get(index), route
        if previous is None and self.auto is None:
            previous = residuals.owners_route(self.feedback, q, index, route, self.options.node_size)
        if previous is not None and self._described(previous) != self._described(route):
            residuals.carry(self.feedback, q, index, tensor, previous, route, self.options.node_size)

    def _described(self, route: tuple) -> tuple:
        return (self.label(route[0]), *route[1:])

    def sent_as(self, index: int) -> tuple | None:
        """The route bucket ``index`` last went through (None: not yet)."""
        return self._sent_as.get(index)

    def account_native(
        self, step: int, index: int, last: bool, numel: int, itemsize: int, world: int
    ) -> None:
        """(worker) Statistics of a bucket ``"auto"`` sent through torch's own all-reduce,
        in bucket order, like every other bucket's."""
        nbytes = ring_all_reduce_bytes(numel * itemsize, world)
        reduced = ReduceStats(bytes_sent=nbytes, dense_bytes=nbytes, algorithm="dense")
        self._sent_as[index] = (DENSE, "dense", None)
        self.ledger.finish(step, index, reduced, "none dense", self.ledger.start(step, last))

    def reduce_held(self, step: int, q) -> None:
        """(worker) Reduce the buckets held by a resumed run's first iteration
        (:meth:`BucketLayouts.reduce_held`)."""

        def reduce(flat: torch.Tensor, index: int, layout: BucketLayout, last: bool) -> None:
            drive(self.reduce(flat, index, layout, step, last, q))

        self.buckets.reduce_held(reduce)

    def measuring_job(self, measure, q, buffer: torch.Tensor):
        """A job that runs ``measure(q)`` after the step's last bucket ``buffer``, with the
        device otherwise idle: the backward pass's kernels and the step's jobs finish first;
        its result is the bucket, so that DDP's wait on it is ordered after its work too."""

        def run() -> torch.Tensor:
            streams.cuda.synchronize(buffer.device)
            measure(q)
            return buffer

        return run
