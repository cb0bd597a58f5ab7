"""DDP communication hooks: bucket -> compressed all-reduce -> Future.

Example:
    >>> model = DistributedDataParallel(net)
    >>> state = gradcomp.ddp.HookState(gradcomp.get_compressor("int8"))
    >>> model.register_comm_hook(state, gradcomp.ddp.hook)
    >>> # or in one line:
    >>> state = gradcomp.ddp.register(model, "topk", ratio=0.01, warmup_steps=100)
    >>> ...; loss.backward(); state.last_stats.ratio

How the hook keeps a training run safe:

* Every bucket's collectives go through the group's ordered worker
  (:mod:`gradcomp.collectives`), in bucket order, which is the same on every
  rank; hooks return at once, so communication overlaps the backward pass.
* Residuals follow the parameters when DDP rebuilds its buckets, and a
  resumed run regroups its first iteration's buckets into the saved ones, so
  it continues bit for bit (:mod:`gradcomp.buckets`).
"""

import dataclasses
import functools
import inspect
import io
import logging
import math
import statistics
import time

import torch
import torch.distributed as dist

from gradcomp import ops, planner, streams
from gradcomp.buckets import BucketLayout, BucketLayouts
from gradcomp.collectives import (
    HIERARCHICAL,
    Job,
    ReduceStats,
    check_algorithm,
    check_hierarchy_options,
    default_algorithm,
    drive,
    hierarchy_for,
    job_steps,
    owner_ranges,
    queue_for,
    ring_all_reduce_bytes,
    verify_settings,
)
from gradcomp.collectives.hierarchical import check_node_size, nodes_for_auto, shard_bounds, shard_key
from gradcomp.compressors import Compressor, NoCompression, get_compressor
from gradcomp.feedback import ErrorFeedback

logger = logging.getLogger(__name__)

_DENSE = NoCompression()
# compressor="auto" reduces at least this many steps dense: DDP settles its
# buckets after the first, and the plan is made on the settled ones.
AUTO_MIN_WARMUP = 2
# "auto" keeps this many steps of bucket timings (for the drift check).
_TIMED_STEPS = 256
DEFAULT_TRIAL_STEPS = 4
MAX_TRIAL_STEPS = 100  # a trial's turn: well within the steps whose times are kept
# A trial's turns: the plan's, the contender's, the plan's again. Each plan's time is the mean of
# its turns', so that a machine slowing (or speeding up) steadily weighs on both plans alike.
TRIAL_TURNS = (0, 1, 0)


@dataclasses.dataclass
class StepStats:
    """Per-step statistics of one rank, summed over the step's buckets.

    Attributes:
        step: hook step (one per synchronised backward pass).
        bytes_sent: bytes this rank sent (ring model, see ``ReduceStats``).
        bytes_sent_intra, bytes_sent_inter: of those, the bytes inside a node
            and between nodes (``hierarchical`` only; 0 for the flat algorithms).
        dense_bytes: bytes a dense ring all-reduce of the same buckets sends.
        compress_seconds: wall time compressing and decoding.
        relative_error: ``||decoded - input|| / ||input||`` of this rank's own
            compression over the compressed buckets (NaN when not measured,
            0 for a fully dense step).
        buckets, compressed_buckets: buckets seen, and how many were compressed.
        compressors: bucket index -> the compressor and algorithm it went
            through (``"int4 two_phase"``, ``"int8 hierarchical(allgather)"``;
            ``"none dense"`` when dense).
    """

    step: int
    bytes_sent: int = 0
    dense_bytes: int = 0
    compress_seconds: float = 0.0
    relative_error: float = math.nan
    bytes_sent_intra: int = 0
    bytes_sent_inter: int = 0
    buckets: int = 0
    compressed_buckets: int = 0
    compressors: dict = dataclasses.field(default_factory=dict)
    _error_sq: float = dataclasses.field(default=0.0, repr=False)
    _input_sq: float = dataclasses.field(default=0.0, repr=False)

    @property
    def ratio(self) -> float:
        """Compression ratio: dense bytes / bytes sent (NaN on a single rank)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.nan

    def add(self, reduced: ReduceStats, compressed: bool) -> None:
        self.bytes_sent += reduced.bytes_sent
        self.bytes_sent_intra += reduced.bytes_sent_intra
        self.bytes_sent_inter += reduced.bytes_sent_inter
        self.dense_bytes += reduced.dense_bytes
        self.compress_seconds += reduced.compress_seconds
        self.buckets += 1
        self.compressed_buckets += int(compressed)
        if compressed and not math.isnan(reduced.error_sq):
            self._error_sq += reduced.error_sq
            self._input_sq += reduced.input_sq
            self.relative_error = math.sqrt(self._error_sq / self._input_sq) if self._input_sq > 0 else 0.0
        elif self.compressed_buckets == 0:
            self.relative_error = 0.0


class HookState:
    """State of :func:`hook`: compressor, residuals, step counter, statistics.

    Args:
        compressor: a :class:`Compressor` or a compressor name.
        process_group: group to reduce over (default WORLD).
        warmup_steps: the first steps are reduced dense (no compression).
        min_numel: buckets with fewer elements are reduced dense.
        algorithm: force ``"dense"``, ``"allgather"``, ``"two_phase"`` or
            ``"hierarchical"`` (default: from the compressor and the group's size).
        node_size, inter_algorithm: for ``"hierarchical"``, ranks per node
            and the algorithm between nodes (see :func:`gradcomp.all_reduce`).
        residual_dtype: ``"fp32"`` or ``"grad"`` (see :class:`ErrorFeedback`).
        measure_error: keep ``relative_error`` in the statistics (off by
            default: one more pass over each bucket, and on a GPU a host
            sync per bucket).
        history: how many :class:`StepStats` to keep (oldest dropped).
        allow: with ``compressor="auto"``: the candidates (default
            :data:`gradcomp.planner.SAFE`; ``"topk@0.01"``-style or objects).
        profile: with ``"auto"``: a :class:`gradcomp.planner.Profile` to plan
            from instead of measuring (every rank's are combined).
        check_every: with ``"auto"``: every this many steps the ranks compare
            the observed communication time with the plan's prediction and
            act on :meth:`replan` and ``replan_every``.
        drift: with ``"auto"``: re-plan when the observed/predicted ratio of a
            check's window departs from the first window's after the plan by
            more than this fraction (either way; None: never).
        replan_every: with ``"auto"``: re-measure and re-plan at the first
            check this many steps after the plan (None: only on drift).
        trial_steps: with ``"auto"``: where the model cannot tell the plan from
            another (:func:`gradcomp.planner.contender`), how many steps each
            runs before the faster is kept (default 4; 2 to 100, or 0: never try).

    With ``compressor="auto"`` the hook reduces its first ``warmup_steps``
    steps (at least 2) dense; at the first step after them it measures the
    group's link (up to 16 MB) and each candidate's compress and
    decode time on the buckets' device, combines every rank's figures (the
    slowest of each) and picks per bucket the candidate and algorithm with
    the least predicted time (:func:`gradcomp.planner.choose`; ``none``
    included, so small buckets stay dense; on CPUs, a bucket whose dense
    reduction fits in the backward pass still to run stays dense too: the
    hook notes when each bucket is handed over in the step before the plan; each bucket
    weighed in its gradients' dtype, and one under ``min_numel`` planned dense, as it is
    sent). :attr:`plan` holds the choice
    (and, once a check has run, each bucket's observed milliseconds); it is
    kept in :meth:`state_dict`, so a resumed run reduces as the saved one did.

    Links are shared and change. Every ``check_every`` steps the ranks
    combine how far each one's communication time has drifted from the
    prediction: the observed/predicted ratio over the window (the median of
    its steps) against the ratio of the first window after the plan, which
    calibrates what the model leaves out (overlap with the backward pass).
    Past ``drift``, after ``replan_every`` steps, or when :meth:`replan` was
    called on any rank, the check measures again and plans afresh; the new
    plan applies from the next step. A bucket whose compressor or algorithm
    changes carries its residuals: into the next compressor's error
    feedback, or folded into the bucket's next dense reduction, so nothing
    compression held back is lost.

    The model misses by up to a quarter on some links and devices, so where
    another choice is predicted within :data:`gradcomp.planner.MARGIN` of a
    plan's (either way), the plan is tried against it before it is kept, in
    three turns (:data:`TRIAL_TURNS`: the plan's, the contender's, the plan's
    again, so that a steady drift of the machine weighs on both alike): each
    turn runs ``trial_steps`` steps and one more (the step it is judged in;
    the first turn also has the step that planned); its steps but the first
    (which may fold residuals in) are timed on every rank (on GPUs the host
    waits for the device at each step's start, during a trial only), the
    slowest rank's median step counts (a step the training loop stalls for
    its own reasons does not), a plan's turns are averaged and the faster
    plan stays (:attr:`trials` records each trial: its plans, their
    milliseconds a step, each turn's, which one was kept). Checks wait
    until it ends; a checkpoint keeps a trial under way, and a resumed run
    times the turn it is in from its steps after its first.

    At its first call (and the first after :meth:`load_state_dict`) the hook
    compares every rank's settings and step (:meth:`agreement_settings`): where
    they differ, every rank raises ``ValueError`` naming each rank's, instead of
    issuing other collectives than its peers and hanging.

    Example:
        >>> state = HookState(gradcomp.get_compressor("int8"), warmup_steps=10)
        >>> ddp_model.register_comm_hook(state, hook)
    """

    __slots__ = (
        # configuration
        "compressor",
        "process_group",
        "warmup_steps",
        "min_numel",
        "algorithm",
        "node_size",
        "inter_algorithm",
        "measure_error",
        "history",
        "allow",
        "profile",
        "check_every",
        "drift",
        "replan_every",
        "trial_steps",
        # progress and residuals
        "plan",
        "trials",
        "_trial",
        "_contender",
        "_marks",
        "_sizes",
        "_dtypes",
        "_ready",
        "_offsets",
        "_planned_at",
        "_chosen",
        "_device",
        "_labels",
        "_adopted_at",
        "_last",
        "_pending",
        "_replanned",
        "_remeasure",
        "_replan_requested",
        "_baseline",
        "_times",
        "_hooked_step",
        "_agreed",
        "step",
        "feedback",
        "buckets",
        # statistics (written by the collective worker)
        "stats",
        "_open_stats",
        "_started",
    )

    def __init__(
        self,
        compressor: Compressor | str,
        process_group: dist.ProcessGroup | None = None,
        warmup_steps: int = 0,
        min_numel: int = 1024,
        *,
        algorithm: str | None = None,
        node_size: int | None = None,
        inter_algorithm: str | None = None,
        residual_dtype: str = "fp32",
        measure_error: bool = False,
        history: int = 10_000,
        allow=None,
        profile=None,
        check_every: int = 10,
        drift: float | None = 0.5,
        replan_every: int | None = None,
        trial_steps: int | None = None,
    ):
        auto = is_auto(compressor)
        self.compressor = _DENSE if auto else get_compressor(compressor)  # auto: dense until planned
        if not auto and (
            (allow, profile, replan_every, trial_steps) != (None,) * 4 or (check_every, drift) != (10, 0.5)
        ):
            raise ValueError(
                "allow, profile, check_every, drift, replan_every and trial_steps are options of "
                "compressor='auto'"
            )
        trial_steps = DEFAULT_TRIAL_STEPS if trial_steps is None else trial_steps
        for name, value in (("check_every", check_every), ("replan_every", replan_every)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if check_every is None:
            raise ValueError("check_every must be a positive integer, got None")
        if drift is not None and (type(drift) not in (int, float) or not 0 < drift < math.inf):
            raise ValueError(f"drift must be a positive fraction or None, got {drift!r}")
        valid_trial = isinstance(trial_steps, int) and not isinstance(trial_steps, bool)
        if not valid_trial or trial_steps < 0 or trial_steps == 1 or trial_steps > MAX_TRIAL_STEPS:
            raise ValueError(
                f"trial_steps must be 0 (no trials) or 2 to {MAX_TRIAL_STEPS}, got {trial_steps!r}"
            )
        self.check_every, self.drift, self.replan_every = check_every, drift, replan_every
        self.trial_steps = trial_steps
        if auto:
            if algorithm is not None or inter_algorithm is not None:
                raise ValueError(
                    "compressor='auto' chooses the algorithm: drop algorithm and inter_algorithm "
                    "(node_size, where given, says which ranks share a node)"
                )
            allow = planner.checked_candidates(allow, profile)
        for name, value in (("warmup_steps", warmup_steps), ("min_numel", min_numel), ("history", history)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if auto:
            warmup_steps = max(warmup_steps, AUTO_MIN_WARMUP)
        self.allow = allow
        self.profile = profile
        self.plan: list | None = None
        self._sizes: dict[int, int] = {}
        self._dtypes: dict[int, torch.dtype] = {}  # bucket -> its elements' type (the hook's, each step)
        self._ready: dict[int, float] = {}  # bucket -> when the hook had it, in the last step before the plan
        self._offsets: list[float] | None = None  # each bucket's, before the backward pass ends (the plan's)
        self._planned_at: int | None = None  # the step whose first bucket submitted the plan job
        self._chosen: list[Compressor] = []  # the plan's compressors, built once
        self._device = torch.device("cpu")  # the buckets' (for measuring the codecs)
        self._labels: dict[int, tuple] = {}  # id of a compressor -> (it, its label)
        self._adopted_at: int | None = None  # the first step every bucket went through the plan
        self._last: dict[int, tuple] = {}  # bucket -> the (compressor, algorithm) it last went through
        self._pending = None  # the future of the last check job
        self._replanned: list | None = None  # a check's new plan, adopted at the next step
        self._replan_requested = False
        self._baseline: float | None = None  # observed/predicted in the first window after the plan
        # step -> bucket -> its intervals in flight: [[hooked, reduced]] (perf_counter) on CPUs,
        # [[start, end], ...] events of the worker's stream on GPUs
        self._times: dict[int, dict[int, list]] = {}
        self._hooked_step = -1
        # GPUs: a re-plan a check asked for, and the step at whose end it measures (a boundary)
        self._remeasure: tuple[str, int | None] | None = None
        self._agreed = False  # whether the ranks' settings were compared (the first hook call)
        # each trial: its plans' choices, their step times, its turns', which stayed
        self.trials: list[dict] = []
        self._trial: dict | None = None  # the trial under way: {"plans": [...], "seconds": [a turn's]}
        self._marks: dict[int, float] = {}  # step -> when its first bucket was hooked (after the plan)
        self._contender: list | None = None  # the last _choose's contender plan (worker)
        ops.check_forced_backend()
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.min_numel = min_numel
        self.algorithm = None if algorithm is None else check_algorithm(self.compressor, algorithm)
        if auto:
            check_node_size(node_size)
        else:
            check_hierarchy_options(self.compressor, algorithm, node_size, inter_algorithm)
        self.node_size = node_size
        self.inter_algorithm = inter_algorithm
        self.measure_error = bool(measure_error)
        self.history = history
        self.step = 0
        self.feedback = ErrorFeedback(residual_dtype)
        self.buckets = BucketLayouts(self.feedback)
        self.stats: list[StepStats] = []
        self._open_stats: dict[int, StepStats] = {}
        self._started: dict[int, list] = {}  # step -> [buckets started, buckets in the step once known]
        logger.info(
            "gradcomp hook: %r, algorithm=%s, warmup_steps=%d, min_numel=%d, residual_dtype=%s",
            self.compressor,
            self.algorithm or "default",
            warmup_steps,
            min_numel,
            residual_dtype,
        )

    @property
    def last_stats(self) -> StepStats | None:
        """Statistics of the last completed step (None before the first)."""
        return self.stats[-1] if self.stats else None

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Step, residuals and bucket layouts; ``torch.save``-able."""
        saved = {
            "step": self.step,
            "settings": self._settings(),
            "feedback": self.feedback.state_dict(),
            **self.buckets.state_dict(),
        }
        if self.auto:
            saved["auto_sizes"] = dict(self._sizes)
            saved["auto_ready"] = self._offsets
            if self.plan is not None:
                saved["plan"] = _saved_plan(self.plan)
                saved["auto_adopted_at"] = self._adopted_at
                saved["auto_last"] = {i: self._described_choice(last) for i, last in self._last.items()}
                if self._pending is not None:
                    self._pending.wait()  # a check of the step just ended: its plan applies from the next
                if self._replanned is not None:
                    saved["next_plan"] = _saved_plan(self._replanned)
                if self._remeasure is not None:
                    saved["auto_remeasure"] = self._remeasure[0]
                if self._trial is not None:
                    saved["auto_trial"] = {
                        "plans": [_saved_plan(plan) for plan in self._trial["plans"]],
                        "seconds": list(self._trial["seconds"]),
                    }
            saved["auto_trials"] = list(self.trials)
        return saved

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; the next step continues the saved run exactly."""
        if self._pending is not None:
            self._pending.wait()  # a check or trial job of this state's own run: done before it is replaced
        if state["settings"] != self._settings():
            raise ValueError(
                f"checkpoint was saved with compressor settings {state['settings']}, "
                f"this state has {self._settings()}"
            )
        self._sizes = dict(state.get("auto_sizes", {}))
        self._offsets, self._ready = state.get("auto_ready"), {}
        self._planned_at = -1 if "plan" in state else None
        self._pending, self._replanned, self._baseline, self._times = None, None, None, {}
        self._remeasure = (state["auto_remeasure"], None) if "auto_remeasure" in state else None
        self._hooked_step, self._replan_requested, self._agreed = -1, False, False
        self.plan, self._chosen, self._adopted_at, self._last = None, [], None, {}
        self.trials, self._trial, self._marks = list(state.get("auto_trials", [])), None, {}
        self._contender = None
        if "auto_trial" in state:
            trial = state["auto_trial"]
            self._trial = {
                "plans": [_loaded_plan(plan) for plan in trial["plans"]],
                "seconds": list(trial["seconds"]),
            }
        if "plan" in state:
            self._adopt_plan(_loaded_plan(state["plan"]))
            self._adopted_at = state.get("auto_adopted_at", int(state["step"]))
            self._last = {
                i: (planner.candidate(label), a, *(inter or (None,)))
                for i, (label, a, *inter) in state.get("auto_last", {}).items()
            }
            if "next_plan" in state:
                self._replanned = _loaded_plan(state["next_plan"])
        self.step = int(state["step"])
        self.feedback.load_state_dict(state["feedback"])
        self.buckets.load_state_dict(state)

    @property
    def ready_offsets(self) -> list[float] | None:
        """auto: when each bucket was handed over in the step before the plan, in seconds
        before the last one (that one: 0), the latest of every rank's, in reduction order:
        the overlap with the backward pass the plan weighed. None before a plan, or where
        they were not found (then the plan weighed none)."""
        return None if self._offsets is None else list(self._offsets)

    @property
    def auto(self) -> bool:
        """Whether this state chooses its compressors (``compressor="auto"``)."""
        return self.allow is not None

    def agreement_settings(self) -> dict:
        """What every rank must share, the step included (a rank resumed from another
        step's checkpoint would switch at other steps): the hook's first call compares them."""
        agreed = {
            "step": self.step,
            "compressor": self._settings(),
            "warmup_steps": self.warmup_steps,
            "min_numel": self.min_numel,
            "algorithm": self.algorithm,
            "node_size": self.node_size,
            "inter_algorithm": self.inter_algorithm,
            "residual_dtype": self.feedback.dtype,
        }
        if self.auto:
            agreed |= {
                "check_every": self.check_every,
                "drift": self.drift,
                "replan_every": self.replan_every,
                "trial_steps": self.trial_steps,
                "profile": "given" if self.profile is not None else "measured",
            }
        return agreed

    def _settings(self) -> dict:
        if self.auto:
            return {"name": "auto", "allow": [planner.label(planner.candidate(c)) for c in self.allow]}
        return self.compressor.settings()

    def make_plan(self, q) -> None:
        """``compressor="auto"``: measure (or take ``profile``), combine every rank's figures and
        choose per bucket; runs as a job on the group's worker, so every rank plans at the same point.

        The bucket sizes are those the worker reduced in the step before; where
        it has none of that step (a checkpoint without them), this step stays
        dense and records them, and the next one plans."""
        if self._sizes.get("step") != self._planned_at - 1:
            self.plan, self._planned_at = None, None
            return
        sizes = [self._sizes[index] for index in sorted(k for k in self._sizes if k != "step")]
        # When each bucket was ready in that step, before the backward pass ended: read after
        # the measurements (on GPUs they wait for the device), agreed by every rank. Kept for
        # the re-plans of these buckets.
        hooked = self._ready if self._ready.get("step") == self._planned_at - 1 else {}
        marks = [hooked.get(index) for index in range(len(sizes))]
        self._offsets = None
        self._adopt_plan(self._choose(q, sizes, (hooked.get("first"), marks)))
        self._adopted_at = self._planned_at + 1  # the planning step's CPU dense buckets went natively
        logger.info("gradcomp auto plan: %s", _described(self.plan))
        self._begin_trial(self.plan)

    def _choose(self, q, sizes: list[int], marks: tuple | None = None) -> list:
        """(worker) The plan for buckets of ``sizes``: measured, or from the injected profiles.
        ``marks``: the hook's (first, per bucket) of the step before, to find the offsets."""
        if q.world_size == 1:  # nothing to send: nothing to compress
            return planner.dense_plan(sizes)
        # Measured where the buckets live: the codecs at their sizes, the link up to 16 MB.
        grid = planner.link_sizes(sizes)
        hierarchy = nodes_for_auto(q, self.node_size)  # made by the hook, on its first call
        profile = planner.agreed_profile(
            self.profile, self.allow, grid, sizes, q.group, self._device, hierarchy
        )
        # Agreed at every plan, a re-plan's too: offsets from a checkpoint were each rank's own.
        offsets = self._offsets if marks is None else _offsets(*marks)
        self._offsets = _agreed_offsets(q, offsets, len(sizes))
        if marks is not None and self._offsets is None:
            logger.info("gradcomp auto: planning without the overlap with the backward pass (no ready times)")
        ready = self._offsets
        dtypes = [self._dtypes.get(index, torch.float32) for index in range(len(sizes))]
        plan = planner.choose(sizes, q.world_size, profile, self.allow, ready=ready, dtypes=dtypes)
        # Buckets under min_numel go dense whatever the plan says: the plan says so too.
        plan = [
            p if n >= self.min_numel else planner.predict("none", n, q.world_size, profile, dtype=dtype)
            for n, p, dtype in zip(sizes, plan, dtypes, strict=True)
        ]
        self._contender = None
        if self.trial_steps:
            other = planner.contender(sizes, q.world_size, profile, plan, self.allow, dtypes=dtypes)
            # Buckets the hook reduces dense whatever the plan says cannot tell two plans apart.
            if other is not None:
                other = [
                    p if n >= self.min_numel else mine for n, p, mine in zip(sizes, other, plan, strict=True)
                ]
                self._contender = None if other == plan else other
        return plan

    def _begin_trial(self, plan: list) -> None:
        """(worker, after :meth:`_choose`) Try ``plan`` against its contender, if it has one."""
        other, self._contender = self._contender, None
        self._trial = None if other is None else {"plans": [plan, other], "seconds": []}
        if other is not None:
            logger.info(
                "gradcomp auto tries the plan against %s for %d steps each (predicted within %.0f%%)",
                _choices(other),
                self.trial_steps,
                planner.MARGIN * 100,
            )

    def _judge(self, q, seconds: float) -> None:
        """(worker, the last step of a plan's trial) Every rank's time of its steps combined (the
        slowest); the next plan to try, or the faster kept (adopted from the next step)."""
        trial = self._trial
        (worst,) = _ranks_max(q, [seconds])
        trial["seconds"].append(worst)
        plans, times = trial["plans"], trial["seconds"]
        if len(times) < len(TRIAL_TURNS):
            self._replanned = plans[TRIAL_TURNS[len(times)]]
            return
        means = [
            statistics.mean(t for t, turn in zip(times, TRIAL_TURNS, strict=True) if turn == i)
            for i in range(len(plans))
        ]
        best = min(range(len(plans)), key=lambda i: (means[i], i))
        self._trial = None
        self.trials.append(
            {
                "plans": [_picks(plan) for plan in plans],
                "step_ms": [1e3 * t for t in means],
                "turns_ms": [1e3 * t for t in times],
                "kept": best,
            }
        )
        logger.info(
            "gradcomp auto keeps %s: %s ms a step",
            _choices(plans[best]),
            " against ".join(f"{1e3 * t:.4g}" for t in means),
        )
        if best != TRIAL_TURNS[-1]:
            self._replanned = plans[best]

    def replan(self) -> None:
        """Measure and plan afresh at the next check (every ``check_every`` steps; ``"auto"`` only).

        Safe to call on one rank: every rank joins the check, and the request of
        any rank re-plans on all of them."""
        if not self.auto:
            raise RuntimeError("replan() is for compressor='auto'")
        self._replan_requested = True

    def _check(self, q, deviation: float, forced: bool) -> None:
        """(worker) Every rank's drift and requests combined; a new plan when due, for the next step."""
        worst, forced = _ranks_max(q, [deviation, float(forced)])
        drifted = self.drift is not None and worst > self.drift
        if forced or drifted:
            why = f"drift {worst:.0%} past {self.drift:.0%}" if drifted else "requested"
            if streams.uses_streams(self._device):
                # Measured at the end of the next step (the hook schedules it): while this
                # step's backward pass runs, a GPU's timings would count its kernels too.
                self._remeasure = (why, None)
                return
            self.remeasure(q, why)

    def remeasure(self, q, why: str = "requested") -> None:
        """(worker) Measure and choose afresh for the plan's buckets; adopted from the next step."""
        self._remeasure = None
        self._replanned = self._choose(q, [p.numel for p in self.plan])
        logger.info("gradcomp auto re-plans (%s): %s", why, _described(self._replanned))
        self._begin_trial(self._replanned)

    def _switch(self, step: int) -> None:
        """(hook, first bucket of ``step``) Adopt the plan the last check made."""
        plan, self._replanned = self._replanned, None
        changed = [
            f"bucket {i}: {old.compressor} {old.how} -> {new.compressor} {new.how}"
            for i, (old, new) in enumerate(zip(self.plan, plan, strict=True))
            if (old.compressor, old.how) != (new.compressor, new.how)
        ]
        if changed:
            logger.info("gradcomp auto plan changes from step %d: %s", step, "; ".join(changed))
        self._adopt_plan(plan)
        self._adopted_at, self._baseline = step, None

    def _observe(self, step: int) -> float:
        """(hook, at a check) How far this rank's communication drifted from the plan, as a fraction
        (-1 when unknown, or on the first window after a plan, which calibrates).

        A step's communication time is the time some bucket was in flight (on CPUs
        from its hook to its result; on GPUs while the worker's stream ran its work);
        a bucket's share is what it added to that time."""
        window = range(step - self.check_every, step)
        ratios, shares = [], {}
        predicted = sum(p.seconds for p in self.plan)
        for s in window:
            times = self._times.get(s, {})
            if len(times) != len(self.plan) or any(not t or t[-1][1] is None for t in times.values()):
                continue
            intervals = _in_seconds(times)
            if intervals is None:  # a GPU's events not done yet
                continue
            total, free, mine = 0.0, -math.inf, {}
            for began, ended, index in sorted(intervals):
                share = max(0.0, ended - max(began, free))
                mine[index] = mine.get(index, 0.0) + share
                total, free = total + share, max(free, ended)
            for index, share in mine.items():
                shares.setdefault(index, []).append(share)
            ratios.append(total / predicted if predicted > 0 else math.nan)
        for old in [s for s in self._times if s < step - _TIMED_STEPS]:
            del self._times[old]
        if shares:
            self.plan = [
                dataclasses.replace(p, observed_seconds=statistics.median(shares[i])) if i in shares else p
                for i, p in enumerate(self.plan)
            ]
        ratio = statistics.median(ratios) if ratios else math.nan
        if not ratio > 0 or math.isinf(ratio):
            return -1.0
        if self._baseline is None:
            self._baseline = ratio
            return -1.0
        return max(ratio / self._baseline, self._baseline / ratio) - 1.0

    def _label(self, compressor: Compressor) -> str:
        # Built once per compressor (the state's own, the plan's, _DENSE): labels construct a default one.
        # The entry keeps the compressor alive, so its id cannot be reused by another.
        entry = self._labels.get(id(compressor))
        if entry is None or entry[0] is not compressor:
            entry = self._labels[id(compressor)] = (compressor, planner.label(compressor))
        return entry[1]

    def _adopt_plan(self, plan: list) -> None:
        self._chosen = [planner.candidate(p.compressor) for p in plan]
        self.plan = plan

    def _choice(self, index: int, numel: int) -> tuple[Compressor, str | None, str | None]:
        """The compressor, algorithm and algorithm between nodes of bucket ``index``."""
        if not self.auto:
            return self.compressor, self.algorithm, self.inter_algorithm
        if not self.plan:  # not planned yet (a step without the sizes to plan from): dense
            return _DENSE, "dense", None
        if index >= len(self.plan) or self.plan[index].numel != numel:
            raise RuntimeError(
                f"gradcomp auto: bucket {index} ({numel:,} elements) is not in the plan "
                f"({[p.numel for p in self.plan]}): DDP changed its buckets after the plan was made"
            )
        return self._chosen[index], self.plan[index].algorithm, self.plan[index].inter_algorithm

    def flush(self) -> None:
        """Wait until the worker has recorded the statistics of every bucket submitted so far
        (``auto``'s dense buckets go through torch's all-reduce, their statistics after)."""
        queue_for(self.process_group).submit(lambda: None, torch.device("cpu")).wait()

    def __getstate__(self):
        # Process groups cannot be pickled; like torch's hooks, drop it (and a pending check's
        # future, the marks of when buckets were ready: CUDA events on GPUs, and of when steps began).
        if self._pending is not None:
            self._pending.wait()
        dropped = ("process_group", "_pending", "_ready", "_marks", "_agreed")
        kept = {name: getattr(self, name) for name in self.__slots__ if name not in dropped}
        # host clock readings mean nothing elsewhere; another process compares its settings anew
        return kept | {"_ready": {}, "_marks": {}, "_agreed": False}

    def __setstate__(self, state):
        for name, value in state.items():
            setattr(self, name, value)
        self.process_group, self._pending = None, None

    # ------------------------------------------------------------------ reduction (worker thread)
    def reduce(self, tensor: torch.Tensor, index: int, layout: BucketLayout, step: int, last: bool, q):
        """Steps (see :func:`gradcomp.collectives.job_steps`) that reduce bucket
        ``index`` (``tensor``) of ``step`` in place on ``q``; their result is ``tensor``."""
        started = self._start_bucket(step, last)
        self.buckets.adopt(index, layout, tensor)
        if self.auto and not self.plan:
            # The buckets reduced before the plan: its sizes (DDP settles them after its first step).
            if self._sizes.get("step") != step:
                self._sizes = {"step": step}
            self._sizes[index] = tensor.numel()
        dense = step < self.warmup_steps or tensor.numel() < self.min_numel
        choice = (_DENSE, "dense", None) if dense else self._choice(index, tensor.numel())
        compressor, algorithm, inter = choice
        dense = dense or compressor.name == "none"
        compressor = _DENSE if dense else compressor
        algorithm = "dense" if dense else algorithm or default_algorithm(compressor, q.world_size)
        inter = inter if algorithm == HIERARCHICAL else None
        if self.auto:
            self._carry(index, tensor, (compressor, algorithm, inter), q)
        elif index not in self._last:
            self._fold_owners_kept(index, tensor, (compressor, algorithm, inter), q)
        job = Job(
            tensor,
            compressor,
            "avg",
            algorithm,
            None if dense else self.feedback,
            key=index,
            step=step,
            measure_error=self.measure_error and not dense,
            shapes=self.buckets.shapes_of(layout) if compressor.low_rank else None,
        )
        if job.algorithm == HIERARCHICAL:
            job.hierarchy, job.inter_algorithm = hierarchy_for(q, self.node_size), inter
        timed = self._times.get(step, {}).get(index) if streams.uses_streams(tensor.device) else None
        steps = job_steps(job, q)
        reduced = yield from (steps if timed is None else _timed_on_stream(steps, tensor.device, timed))
        how = f"{job.algorithm}({reduced.inter_algorithm})" if reduced.inter_algorithm else job.algorithm
        self._finish_bucket(step, index, reduced, f"{self._label(job.compressor)} {how}", started)
        return tensor

    def _carry(self, index: int, tensor: torch.Tensor, now: tuple, q) -> None:
        """(worker) Before bucket ``index`` first goes through another compressor or
        algorithm (``now``: compressor, algorithm, algorithm between nodes): what the
        last one held back is added to this rank's input, so that the next reduction
        sends it. The owner's residual of a two-phase reduction where it owned (times
        the ranks: the hook averages); the sender's where the new reduction keeps it
        under another key or keeps none (a hierarchical shard's where the shard lies,
        times the node's ranks: the node averages before the stage between nodes)."""
        previous, self._last[index] = self._last.get(index), now
        if previous is None or self._described_choice(previous) == self._described_choice(now):
            return
        compressor, algorithm, _ = now
        flat = tensor.view(-1)
        keeps = compressor.name != "none" and compressor.needs_feedback
        if previous[1] == HIERARCHICAL:
            hierarchy = hierarchy_for(q, self.node_size)
            start, own, length = shard_bounds(flat.numel(), hierarchy)
            key, inter = shard_key(index, hierarchy), hierarchy.inter
            shard, scale = flat[start : start + own], hierarchy.node_size
            owner = owner_ranges(previous[0], previous[2], length, inter.world_size, inter.rank, flat.device)
            same_key = algorithm == HIERARCHICAL
        else:
            key, shard, scale = index, flat, 1
            owner = owner_ranges(*previous[:2], flat.numel(), q.world_size, q.rank, flat.device)
            same_key = algorithm != HIERARCHICAL
        held = self.feedback.pop(("two_phase", key))
        if held is not None:
            at = 0
            for begin, end in owner:
                end_ = min(end, shard.numel())  # a shard's padding holds nothing of the input
                if end_ > begin:
                    shard[begin:end_].add_(held[at : at + end_ - begin].to(flat.dtype), alpha=q.world_size)
                at += end - begin
        if not (same_key and keeps):
            sender = self.feedback.pop(key)
            if sender is not None:
                shard.add_(sender[: shard.numel()].to(flat.dtype), alpha=scale)

    def _fold_owners_kept(self, index: int, tensor: torch.Tensor, now: tuple, q) -> None:
        """(worker) A bucket's first reduction in this process (not ``"auto"``): an owner's
        residual of a two_phase it no longer runs (a checkpoint of a run that reduced it so:
        two_phase was also the default on 2 ranks and between 2 nodes) goes into its input,
        as :meth:`_carry` folds it when auto's plan changes."""
        self._last[index] = now
        compressor, algorithm, inter = now
        hierarchical = algorithm == HIERARCHICAL
        if compressor.name == "none" or (inter if hierarchical else algorithm) == "two_phase":
            return
        key = shard_key(index, hierarchy_for(q, self.node_size)) if hierarchical else index
        if ("two_phase", key) not in self.feedback:
            return
        self._last[index] = (
            (compressor, HIERARCHICAL, "two_phase") if hierarchical else (compressor, "two_phase", None)
        )
        self._carry(index, tensor, now, q)

    def _described_choice(self, choice: tuple) -> tuple:
        return (self._label(choice[0]), *choice[1:])

    # Jobs start in submission order but may finish out of it (a dense bucket
    # can finish while an earlier one waits on its exchange): a step's
    # statistics close when as many buckets finished as had started by its last.
    def _start_bucket(self, step: int, last: bool) -> list:
        started = self._started.setdefault(step, [0, None])
        started[0] += 1
        if last:
            started[1] = started[0]
        return started

    def _finish_bucket(self, step: int, index: int, reduced: ReduceStats, how: str, started: list) -> None:
        current = self._open_stats.setdefault(step, StepStats(step))
        current.add(reduced, compressed=not how.startswith("none "))
        current.compressors[index] = how
        if current.buckets == started[1]:
            del self._started[step]
            self.stats.append(self._open_stats.pop(step))
            del self.stats[: max(0, len(self.stats) - self.history)]

    def account_native(
        self, step: int, index: int, last: bool, numel: int, itemsize: int, world: int
    ) -> None:
        """Statistics of a bucket ``"auto"`` sent through torch's own all-reduce (run on the worker,
        in bucket order, like every other bucket's)."""
        nbytes = ring_all_reduce_bytes(numel * itemsize, world)
        reduced = ReduceStats(bytes_sent=nbytes, dense_bytes=nbytes, algorithm="dense")
        self._last[index] = (_DENSE, "dense", None)
        self._finish_bucket(step, index, reduced, "none dense", self._start_bucket(step, last))

    def reduce_held(self, step: int, q) -> None:
        """Reduce the buckets held by a resumed run's first iteration
        (:meth:`BucketLayouts.reduce_held`)."""

        def reduce(flat: torch.Tensor, index: int, layout: BucketLayout, last: bool) -> None:
            drive(self.reduce(flat, index, layout, step, last, q))

        self.buckets.reduce_held(reduce)


def _saved_plan(plan: list) -> list:
    return [
        (
            p.numel,
            p.compressor,
            p.algorithm,
            p.bytes_sent,
            p.exchange_seconds,
            p.codec_seconds,
            p.overlap_seconds,
            p.inter_algorithm,
        )
        for p in plan
    ]


def _loaded_plan(saved: list) -> list:
    # Plans saved before their predictions were kept have three fields.
    return [planner.Prediction(c, a, n, *(rest or (0, 0.0, 0.0))) for n, c, a, *rest in saved]


def _picks(plan: list) -> list[str]:
    """Each bucket's compressor and algorithm in words (``int8 two_phase``)."""
    return [f"{p.compressor} {p.how}" for p in plan]


def _choices(plan: list) -> str:
    return ", ".join(_picks(plan))


def _described(plan: list) -> str:
    return "; ".join(
        f"bucket {i} ({p.numel:,} elements): {p.compressor} {p.how}, "
        f"{p.seconds * 1e3:.3g} ms predicted, {p.bytes_sent:,} bytes"
        for i, p in enumerate(plan)
    )


class Checkpointable:
    """A :class:`HookState` for ``torch.distributed.checkpoint`` (a ``Stateful``):
    one checkpoint directory holds the model, the optimizer and every rank's
    residuals, each rank's under a key of its own.

    Args:
        state: the hook state to save or restore.
        mismatch: what loading a checkpoint of another world size does:
            ``"raise"`` (default) a ``ValueError``; ``"drop"`` keeps the
            step but starts the residuals afresh, with a warning.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> everything = {"model": model.state_dict(), "optim": optimizer.state_dict(),
        ...               "gradcomp": gradcomp.ddp.Checkpointable(state)}
        >>> dcp.save(everything, checkpoint_id=directory)
        >>> dcp.load(everything, checkpoint_id=directory)  # later, same world size
    """

    def __init__(self, state: HookState, mismatch: str = "raise"):
        if mismatch not in ("raise", "drop"):
            raise ValueError(f"mismatch must be 'raise' or 'drop', got {mismatch!r}")
        self.state = state
        self.mismatch = mismatch

    def state_dict(self) -> dict:
        buffer = io.BytesIO()
        torch.save(on_device(self.state.state_dict(), "cpu"), buffer)
        buffer.seek(0)
        self._placeholder = buffer  # what a load that finds nothing leaves in place
        rank, world = _rank_and_world(self.state.process_group)
        return {"world_size": world, f"rank{rank}": buffer}

    def load_state_dict(self, state_dict: dict) -> None:
        rank, world = _rank_and_world(self.state.process_group)
        saved, mine = int(state_dict["world_size"]), state_dict.get(f"rank{rank}")
        if mine is getattr(self, "_placeholder", None):
            mine = None  # the checkpoint had no state for this rank (a partial load)
        if isinstance(mine, io.BytesIO):
            mine.seek(0)
            mine = torch.load(mine, weights_only=False)
        if saved != world or mine is None:
            message = (
                f"the checkpoint holds the hook state of {saved} ranks and this run has {world}: "
                "residuals belong to their rank"
            )
            if self.mismatch == "raise":
                raise ValueError(message + "; resume on as many ranks, or pass mismatch='drop'")
            logger.warning("gradcomp: %s; the residuals start afresh (mismatch='drop')", message)
            if mine is not None:
                self.state.step = int(mine["step"])
            return
        self.state.load_state_dict(mine)  # residuals move to their gradients' device at first use


def _rank_and_world(group) -> tuple[int, int]:
    """This process's global rank (a key no replica in another group shares) and the group's size."""
    return dist.get_rank(), dist.get_world_size(group)


def on_device(value, device: torch.device | str):
    """``value`` (a state dict) with every tensor in it moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device) for v in value)
    return value


def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages ``bucket`` across ranks through ``state.compressor``.

    Returns at once with a Future of the reduced bucket; the reduction runs
    on the process group's ordered collective worker.

    Example:
        >>> ddp_model.register_comm_hook(HookState("int8"), hook)
    """
    q = queue_for(state.process_group)
    buffer = bucket.buffer()
    if not state._agreed:
        # Ranks with other settings would issue other collectives (and hang): every rank
        # raises here instead, at its first bucket.
        settings = state.agreement_settings()
        what = "the gradcomp DDP hook's settings"
        q.submit(lambda: verify_settings(q, what, settings, buffer.device), buffer.device).wait()
        state._agreed = True
    if state.algorithm == HIERARCHICAL:
        hierarchy_for(q, state.node_size)  # its groups are made here, on the first call, in order
    elif state.auto and q.world_size > 1:
        nodes_for_auto(q, state.node_size)  # likewise; the planner measures its levels
    index, last = bucket.index(), bucket.is_last()
    layout = state.buckets.layout_of(bucket)
    step = state.step
    if last:
        state.step += 1
    timed = None
    if state.auto:
        state._dtypes[index] = buffer.dtype  # the plans weigh their bytes
        state._device = buffer.device  # where plans measure the codecs (a resumed run's too)
        _plan_when_due(state, q, buffer, index, step)
        if state._planned_at is None:
            # Before the plan: when the backward pass hands each bucket over (on GPUs, an event
            # on the backward's stream: when the bucket is ready there; read once done).
            mark = streams.timing_event(buffer.device)
            mark = time.perf_counter() if mark is None else mark
            if state._ready.get("step") != step:
                state._ready = {"step": step, "first": mark}
            state._ready[index] = mark
        adopted = state._adopted_at is not None and step >= state._adopted_at
        if adopted and streams.uses_streams(buffer.device):
            # A CUDA job's future completes when its work is queued, not done: the job
            # times its work on the worker's stream by events (HookState.reduce).
            state._times.setdefault(step, {})[index] = []
        elif adopted:
            timed = [time.perf_counter(), None]
            state._times.setdefault(step, {})[index] = [timed]
    if state.buckets.holds(index, layout):
        # A resumed process: DDP's first buckets differ from the checkpoint's.
        future = streams.new_future(buffer.device)
        state.buckets.hold(buffer, layout, future)
        if last:
            q.submit(lambda: state.reduce_held(step, q), buffer.device, name="gradcomp.buckets_held")
        return future.then(_value)
    measure = _measurement_due(state, step, buffer.device) if last and state.auto else None
    if state.auto and measure is None and _native(state, index, buffer, step):
        return _reduce_natively(state, q, buffer, index, step, last, timed)
    steps = functools.partial(state.reduce, buffer, index, layout, step, last, q)
    future = q.submit(steps, buffer.device, writes=buffer, name=f"gradcomp.bucket {index}")
    if measure is not None:
        # After the step's last bucket, and holding it: DDP waits for this future before the
        # optimizer step and the next forward pass, so the device runs nothing else meanwhile.
        measured = functools.partial(_measured, measure, q, buffer)
        future = q.submit(measured, buffer.device, writes=buffer, name="gradcomp.plan")
    return future.then(_value if timed is None else functools.partial(_done, timed, None))


def _reduce_natively(state: HookState, q, buffer: torch.Tensor, index: int, step: int, last: bool, timed):
    """A bucket planned dense: torch's own all-reduce on the model's group, as DDP without a
    hook; only the statistics go through the worker. Its future (DDP's)."""
    if streams.uses_streams(buffer.device):
        # NCCL may deadlock where two communicators' collectives (the model's group here, the
        # worker's clone there) are issued in orders that differ between ranks. This one is
        # issued once the worker has issued those of every job submitted before it, and the
        # jobs submitted after it come after: every rank issues them all in one order, the
        # order of its calls, which is the same on every rank.
        q.wait_issued()
        intervals = state._times.get(step, {}).get(index)
        if intervals is not None:  # timed from here to the end of the collective, by events
            timed = [streams.timing_event(buffer.device), None]
            intervals.append(timed)
    buffer.div_(q.world_size)
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    account = functools.partial(
        state.account_native, step, index, last, buffer.numel(), buffer.element_size(), q.world_size
    )
    q.submit(account, buffer.device, writes=buffer, name=f"gradcomp.bucket {index}")
    return work.get_future().then(functools.partial(_done, timed, 0))


def _measurement_due(state: HookState, step: int, device: torch.device):
    """(hook, a step's last bucket) What measures at the end of ``step`` on a GPU: the first
    plan (from this step's buckets), or a re-plan a check asked for; None: nothing.

    On GPUs the probe times its kernels and collectives by synchronizing the device, so it
    runs where the training leaves the device idle: after the step's last bucket, while DDP
    waits for it. On CPUs it runs while the backward pass does, as training runs the codecs:
    their timings count the CPU time of their own thread beside a busy one
    (:func:`gradcomp.planner.busy`)."""
    if not streams.uses_streams(device):
        return None
    if state.plan is None and step + 1 >= state.warmup_steps:
        state.plan, state._planned_at = [], step + 1  # the plan applies from the next step
        return state.make_plan
    if state._remeasure is not None and state._remeasure[1] == step:
        return functools.partial(state.remeasure, why=state._remeasure[0])
    return None


def _measured(measure, q, buffer: torch.Tensor) -> torch.Tensor:
    # (worker) The backward pass's kernels and the step's jobs finish first; the result is
    # the bucket, so that DDP's wait on it is ordered after this job's work too.
    streams.cuda.synchronize(buffer.device)
    measure(q)
    return buffer


def _native(state: HookState, index: int, buffer: torch.Tensor, step: int) -> bool:
    # Only from the step after the one that planned: whether the plan job has
    # finished during its own step depends on timing, which differs by rank.
    if state._planned_at is None or step <= state._planned_at or not state.plan or index >= len(state.plan):
        return False
    choice = state.plan[index]
    if choice.compressor != "none" or choice.numel != buffer.numel():
        return False
    # A bucket that was compressed until this plan goes once more through the
    # worker, which folds its residuals into this reduction (HookState._carry).
    last = state._last.get(index)
    return last is None or last[0].name == "none"


def _timed_on_stream(steps, device: torch.device, intervals: list):
    """A job's steps, the work they queue on the current (the worker's) stream timed by
    events: an interval up to its pause and one from its resumption to its end, so that
    what the stream runs for other jobs (and its waits on their buckets) is left out."""
    interval = [streams.timing_event(device), None]
    try:
        while True:
            next(steps)
            interval[1] = streams.timing_event(device)
            intervals.append(interval)
            yield
            interval = [streams.timing_event(device), None]
    except StopIteration as done:
        interval[1] = streams.timing_event(device)
        intervals.append(interval)
        return done.value


def _in_seconds(times: dict) -> list | None:
    """A step's intervals in flight as ``(began, ended, bucket)`` seconds: on CPUs as they
    are; on GPUs from the events, counted from the step's first (None while any is pending)."""
    first = next(iter(times.values()))[0][0]
    if isinstance(first, float):
        return [(a, b, index) for index, intervals in times.items() for a, b in intervals]
    seconds = []
    for index, intervals in times.items():
        for start, end in intervals:
            began, ended = streams.elapsed_seconds(first, start), streams.elapsed_seconds(first, end)
            if began is None or ended is None:
                return None
            seconds.append((began, ended, index))
    return seconds


def _done(timed: list | None, item: int | None, future: torch.futures.Future) -> torch.Tensor:
    # A bucket's result: when it came (for auto's drift check), then the tensor
    # (torch's all-reduce gives a list of one). On GPUs an event on the callback's
    # stream, which waited for the collective.
    value = future.value()
    tensor = value if item is None else value[item]
    if timed is not None:
        timed[1] = time.perf_counter() if isinstance(timed[0], float) else streams.timing_event(tensor.device)
    return tensor


def _plan_when_due(state: HookState, q, buffer: torch.Tensor, index: int, step: int) -> None:
    if step >= state.warmup_steps and state.plan is None and not streams.uses_streams(buffer.device):
        state.plan = []  # planned once, by this job, before the step's first bucket reduces
        state._planned_at = step
        q.submit(functools.partial(state.make_plan, q), buffer.device, name="gradcomp.plan")
        return
    if state._hooked_step == step or state._adopted_at is None or step <= state._planned_at:
        return
    # The first bucket of a step after the plan: the step boundary, where plans change.
    state._hooked_step = step
    if state._trial is not None and streams.uses_streams(buffer.device):
        # During a trial only: the host waits for the device at each step's start, so that the
        # turns are timed by the device's steps, not by how fast the host queues them.
        torch.cuda.synchronize(buffer.device)
    state._marks[step] = time.perf_counter()
    state._marks.pop(step - _TIMED_STEPS, None)  # steps come one by one: one mark ages out
    if state._pending is not None:
        state._pending.wait()  # the check of the step before (what it measures takes a while)
        state._pending = None
    if state._replanned is not None:
        state._switch(step)
    if state._remeasure is not None and state._remeasure[1] is None:
        state._remeasure = (state._remeasure[0], step)  # a check's re-plan, measured at this step's end
        return
    since = step - state._adopted_at
    if state._trial is not None:
        # The plan's steps but the first (its switch), timed up to this one's start; a run
        # resumed in the middle of a turn times the steps it ran after its first (DDP's first
        # iteration rebuilds its buckets), one at least (every rank resumed alike).
        first = max(state._adopted_at, min(state._marks))
        begun = [s for s in range(first + 1, step) if s in state._marks]
        if since >= state.trial_steps and begun:
            # The median step: one that stalls for a reason of its own (an evaluation or a
            # checkpoint in the training loop) must not decide between the plans.
            marks = state._marks
            steps = [marks[s + 1] - marks[s] for s in begun if s + 1 in marks]
            seconds = (
                statistics.median(steps) if steps else (marks[step] - marks[begun[0]]) / (step - begun[0])
            )
            state._pending = q.submit(
                functools.partial(state._judge, q, seconds), buffer.device, name="gradcomp.trial"
            )
        return
    if since == 0 or since % state.check_every:
        return
    # A check, at the same steps on every rank: each brings its drift and requests.
    forced = state._replan_requested or (state.replan_every is not None and since >= state.replan_every)
    state._replan_requested = False
    check = functools.partial(state._check, q, state._observe(step), forced)
    state._pending = q.submit(check, buffer.device, name="gradcomp.check")


def _offsets(first, marks: list) -> list[float] | None:
    """Each bucket's seconds before the last one was handed over (the last: 0), from the hook's
    marks: host clock readings, or CUDA timing events on the backward's stream (``first``: the
    step's first mark). None where one is missing or an event is not done yet (never waits)."""
    if not marks or first is None or None in marks:
        return None
    try:
        if isinstance(first, float):
            times = [mark - first for mark in marks]
        else:
            times = [streams.elapsed_seconds(first, mark) for mark in marks]
    except (RuntimeError, TypeError):  # events of different devices, a mix of clocks: none to weigh
        return None
    if None in times:
        return None
    return [t - max(times) for t in times]


def _agreed_offsets(q, offsets: list[float] | None, count: int) -> list[float] | None:
    """(worker; a collective) Every rank's offsets made one: per bucket the latest (a bucket's
    reduction starts when its last rank hands it over), or None on every rank where any rank
    has none. The plan depends on them: ranks must agree, or they would reduce a bucket
    differently."""
    missing = offsets is None or len(offsets) != count
    agreed = _ranks_max(q, [1.0, *[0.0] * count] if missing else [0.0, *offsets])
    return None if agreed[0] else agreed[1:]


def _ranks_max(q, values: list[float]) -> list[float]:
    """(worker; a collective) Each of ``values``, the largest any rank of ``q`` has."""
    mine = torch.tensor(values, dtype=torch.float64).to(planner.default_device(q.group))
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=q.group)
    return mine.tolist()


def is_auto(compressor) -> bool:
    """Whether ``compressor`` asks the hook to choose (``"auto"``)."""
    return isinstance(compressor, str) and planner.is_auto(compressor)


def _value(future: torch.futures.Future) -> torch.Tensor:
    # Re-raised inside a callback, a worker error reaches the training loop
    # with its type and message (a bare failed Future reaches DDP garbled).
    return future.value()


# The HookState options register() takes; every other keyword goes to the compressor.
_STATE_OPTIONS = tuple(
    name for name in inspect.signature(HookState.__init__).parameters if name not in ("self", "compressor")
)


def register(
    model: torch.nn.parallel.DistributedDataParallel, compressor: Compressor | str, **options
) -> HookState:
    """Register gradcomp's hook on ``model`` in one call and return its state.

    ``options`` holds both :class:`HookState` options (``warmup_steps``,
    ``min_numel``, ``process_group``, ``algorithm``, ``node_size``,
    ``inter_algorithm``, ``residual_dtype``, ``measure_error``, ``history``;
    with ``"auto"``: ``allow``, ``profile``, ``check_every``, ``drift``,
    ``replan_every``, ``trial_steps``) and the compressor's own (``ratio``, ``block``, ...).
    The hook reduces over the group the model was built on
    (``DistributedDataParallel(..., process_group=...)``); a
    ``process_group`` given here must be that group.

    Example:
        >>> state = gradcomp.ddp.register(ddp_model, "topk", ratio=0.01, warmup_steps=50)
        >>> state = gradcomp.ddp.register(ddp_model, "auto", allow=("bf16", "int8", "int4", "topk@0.01"))
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register needs a DistributedDataParallel model, got {type(model).__name__}")
    state_options = {k: options.pop(k) for k in _STATE_OPTIONS if k in options}
    group = state_options.setdefault("process_group", model.process_group)
    if group is not model.process_group and not (group is None and model.process_group is dist.group.WORLD):
        raise ValueError(
            "process_group differs from the group the DistributedDataParallel model reduces over "
            "(model.process_group): the hook must reduce over the model's group"
        )
    if is_auto(compressor):
        if options:
            raise ValueError(
                f"compressor='auto' takes no compressor options, got {sorted(options)}: use allow="
            )
    else:
        compressor = get_compressor(compressor, **options)
    state = HookState(compressor, **state_options)
    model.register_comm_hook(state, hook)
    return state
