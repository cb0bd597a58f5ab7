"""``compressor="auto"`` in the DDP hook: a controller with an explicit phase.

WARMUP: every bucket is reduced dense; the worker notes the buckets' sizes and
the hook when each was handed over. PLANNING: a job measures (or takes the
injected profile), combines every rank's figures and chooses per bucket
(:func:`gradcomp.planner.best_plan`). RUNNING: the plan applies; every
``check_every`` steps the ranks compare the observed communication with the
prediction, and re-plan on drift or request. TRIAL: where the model cannot tell
the plan from its runner-up, both run in turns (:data:`TRIAL_TURNS`) and the
faster stays. Plans change only at step boundaries, at the same steps on every
rank, and each logs one line as it comes into force (:mod:`~gradcomp.ddp.plan_log`).
The trials' turns are :mod:`~gradcomp.ddp.trial`'s; the clocks, and what they
observed of a plan, :mod:`~gradcomp.ddp.timing`'s.

The hook (the training thread) and the collective worker both act on the
controller: each method says which. A value one writes and the other reads
crosses in submission order (a job the hook submits sees what the hook wrote
before; the hook sees what a job wrote once it has waited for that job or for a
later one, as DDP does for every bucket of a step before the next).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import math
import time

import torch

from gradcomp import planner, streams
from gradcomp.collectives.node_layout import nodes_for_auto
from gradcomp.compressors import Compressor, NoCompression
from gradcomp.ddp import plan_log
from gradcomp.ddp.options import AutoOptions
from gradcomp.ddp.timing import agreed_offsets, observed, ranks_max, ready_offsets
from gradcomp.ddp.trial import TRIAL_TURNS, Trial, picks, turn_seconds

logger = logging.getLogger("gradcomp.ddp")

DENSE = NoCompression()
# The steps of bucket timings kept for the drift check.
TIMED_STEPS = 256


class Phase(enum.Enum):
    WARMUP = "warm-up"
    PLANNING = "planning"
    RUNNING = "running"
    TRIAL = "trial"


@dataclasses.dataclass
class StepSizes:
    """The sizes of one step's buckets, as the worker reduced them."""

    step: int
    numels: dict = dataclasses.field(default_factory=dict)  # bucket -> elements


@dataclasses.dataclass
class ReadyMarks:
    """When the hook had each bucket of one step: host clock readings, or CUDA events on the
    backward's stream (read once done, never waited for)."""

    step: int
    first: object
    marks: dict = dataclasses.field(default_factory=dict)  # bucket -> mark


@dataclasses.dataclass
class Remeasure:
    """A re-plan a check asked for on a GPU (``why``), measured at the end of step ``at``
    (None until the hook has set it)."""

    why: str
    at: int | None = None


class BucketPlans:
    """The plan of a :class:`~gradcomp.ddp.HookState` made with ``compressor="auto"``.

    Args:
        options: how it plans and re-plans.
        warmup_steps, min_numel, node_size: the hook's (see :class:`~gradcomp.ddp.HookOptions`).
    """

    def __init__(self, options: AutoOptions, warmup_steps: int, min_numel: int, node_size: int | None):
        self.options = options
        self.warmup_steps, self.min_numel, self.node_size = warmup_steps, min_numel, node_size
        self.phase = Phase.WARMUP
        self.plan: list[planner.Prediction] | None = None
        self.compressors: list[Compressor] = []  # the plan's, built once
        self.trial: Trial | None = None
        self.trials: list[dict] = []  # each finished trial: its plans, step times, turns, which stayed
        self.next_plan: list | None = None  # adopted at the next step's first bucket
        self.remeasure_due: Remeasure | None = None
        self.replan_requested = False
        self.planned_at: int | None = None  # the step the first plan applies to
        self.adopted_at: int | None = None  # the first step every bucket went through the plan
        self.pending = None  # the future of the last check or judging job
        self.offsets: list[float] | None = None  # each bucket's, before the backward pass ends (the plan's)
        self.sizes: StepSizes | None = None
        self.ready: ReadyMarks | None = None
        self.dtypes: dict[int, torch.dtype] = {}  # bucket -> its elements' type (the hook's, each step)
        self.device = torch.device("cpu")  # the buckets' (where the codecs are measured)
        # step -> bucket -> its intervals in flight: [[hooked, reduced]] (perf_counter) on CPUs,
        # [[start, end], ...] events on GPUs
        self.times: dict[int, dict[int, list]] = {}
        self.step_starts: dict[int, float] = {}  # step -> when its first bucket was hooked (trials)
        self.hooked_step = -1
        self.baseline: float | None = None  # observed/predicted in the first window after the plan
        self.runner_up: list | None = None  # the last choice's runner-up plan (worker)
        # Why each bucket goes dense where a plan has it so (worker, at each plan; the log's)
        self.dense_reasons: list[str] = []
        self.next_cause = "saved with the checkpoint"  # why next_plan comes (the log's)

    # ------------------------------------------------------------------ hook
    def before_bucket(self, q, buffer: torch.Tensor, index: int, step: int) -> list | None:
        """(hook) Bucket ``index`` of ``step`` is handed over: plan or check where due, note
        when, and start timing it once a plan applies. Returns its host-clock interval on
        CPUs (the future's callback closes it), None on GPUs (events time the work)."""
        self.dtypes[index] = buffer.dtype  # the plans weigh their bytes
        self.device = buffer.device  # where plans measure the codecs (a resumed run's too)
        self._step_boundary(q, buffer, step)
        if self.planned_at is None:
            # Before the plan: when the backward pass hands each bucket over (on GPUs, an event
            # on the backward's stream: when the bucket is ready there; read once done).
            mark = streams.timing_event(buffer.device)
            mark = time.perf_counter() if mark is None else mark
            if self.ready is None or self.ready.step != step:
                self.ready = ReadyMarks(step, mark)
            self.ready.marks[index] = mark
        if self.adopted_at is None or step < self.adopted_at:
            return None
        if streams.uses_streams(buffer.device):
            # A CUDA job's future completes when its work is queued, not done: the job times
            # its work on the worker's stream by events (HookState.reduce).
            self.times.setdefault(step, {})[index] = []
            return None
        timed = [time.perf_counter(), None]
        self.times.setdefault(step, {})[index] = [timed]
        return timed

    def _step_boundary(self, q, buffer: torch.Tensor, step: int) -> None:
        device = buffer.device
        if self.phase is Phase.WARMUP and step >= self.warmup_steps and not streams.uses_streams(device):
            # CPUs plan in a job before the step's first bucket reduces, while its backward
            # pass runs (the codecs' timings count their own thread's CPU time); GPUs at the
            # end of a step (measurement_due).
            self.phase, self.planned_at = Phase.PLANNING, step
            q.submit(functools.partial(self.make_plan, q), device, name="gradcomp.plan")
            return
        if self.hooked_step == step or self.adopted_at is None or step <= self.planned_at:
            return
        # The first bucket of a step after the plan: the step boundary, where plans change.
        self.hooked_step = step
        if self.phase is Phase.TRIAL and streams.uses_streams(device):
            # During a trial only: the host waits for the device at each step's start, so that the
            # turns are timed by the device's steps, not by how fast the host queues them.
            torch.cuda.synchronize(device)
        self.step_starts[step] = time.perf_counter()
        self.step_starts.pop(step - TIMED_STEPS, None)  # steps come one by one: one ages out
        if self.pending is not None:
            self.pending.wait()  # the check of the step before (what it measures takes a while)
            self.pending = None
        if self.next_plan is not None:
            self.switch(step)
        if self.remeasure_due is not None and self.remeasure_due.at is None:
            self.remeasure_due.at = step  # a check's re-plan, measured at this step's end
            return
        since = step - self.adopted_at
        if self.phase is Phase.TRIAL:
            self._time_turn(q, device, step, since)
            return
        if since == 0 or since % self.options.check_every:
            return
        # A check, at the same steps on every rank: each brings its drift and requests.
        replan_every = self.options.replan_every
        forced = self.replan_requested or (replan_every is not None and since >= replan_every)
        self.replan_requested = False
        check = functools.partial(self.check, q, self.observe(step), forced)
        self.pending = q.submit(check, device, name="gradcomp.check")

    def _time_turn(self, q, device: torch.device, step: int, since: int) -> None:
        seconds = turn_seconds(self.step_starts, self.adopted_at, step)
        if since >= self.options.trial_steps and seconds is not None:
            judge = functools.partial(self.judge, q, seconds, step)
            self.pending = q.submit(judge, device, name="gradcomp.trial")

    def measurement_due(self, step: int, device: torch.device):
        """(hook, a step's last bucket) What measures at the end of ``step`` on a GPU: the first
        plan (from this step's buckets), or a re-plan a check asked for; None: nothing.

        On GPUs the probe times its kernels and collectives by synchronizing the device, so it
        runs where the training leaves the device idle: after the step's last bucket, while DDP
        waits for it. On CPUs it runs while the backward pass does, as training runs the codecs:
        their timings count the CPU time of their own thread beside a busy one
        (:func:`gradcomp.planner.busy`)."""
        if not streams.uses_streams(device):
            return None
        if self.phase is Phase.WARMUP and step + 1 >= self.warmup_steps:
            self.phase, self.planned_at = Phase.PLANNING, step + 1  # the plan applies from the next step
            return self.make_plan
        due = self.remeasure_due
        if due is not None and due.at is not None and due.at <= step:
            return functools.partial(self.remeasure, why=due.why)
        return None

    def native(self, index: int, numel: int, step: int, sent_as: tuple | None) -> bool:
        """(hook) Whether bucket ``index`` goes through torch's own all-reduce at ``step``:
        planned dense, and not compressed the last time (that reduction folds its residuals)."""
        # Only from the step after the one that planned: on CPUs, whether the plan job has
        # finished during its own step depends on timing, which differs by rank.
        if self.planned_at is None or step <= self.planned_at or not self.plan or index >= len(self.plan):
            return False
        choice = self.plan[index]
        if choice.compressor != "none" or choice.numel != numel:
            return False
        return sent_as is None or sent_as[0].name == "none"

    def switch(self, step: int) -> None:
        """(hook, first bucket of ``step``) Adopt the plan the last check or turn made."""
        plan, self.next_plan = self.next_plan, None
        self.adopt(plan)
        self.adopted_at, self.baseline = step, None
        self.log_plan(step, self.next_cause)

    def observe(self, step: int) -> float:
        """(hook, at a check) How far this rank's communication drifted from the plan, as a fraction
        (-1 when unknown, or on the first window after a plan, which calibrates); each bucket's
        median share goes into ``plan[i].observed_seconds``."""
        window = [self.times.get(s, {}) for s in range(step - self.options.check_every, step)]
        self.plan, ratio = observed(self.plan, window)
        for old in [s for s in self.times if s < step - TIMED_STEPS]:
            del self.times[old]
        if not ratio > 0 or math.isinf(ratio):
            return -1.0
        if self.baseline is None:
            self.baseline = ratio
            return -1.0
        return max(ratio / self.baseline, self.baseline / ratio) - 1.0

    # ------------------------------------------------------------------ worker
    def note_size(self, step: int, index: int, numel: int) -> None:
        """(worker) Before the plan: bucket ``index`` of ``step`` has ``numel`` elements
        (DDP settles its buckets after its first step)."""
        if self.sizes is None or self.sizes.step != step:
            self.sizes = StepSizes(step)
        self.sizes.numels[index] = numel

    def route(self, index: int, numel: int) -> tuple:
        """(worker) The compressor, algorithm and algorithm between nodes of bucket ``index``."""
        if not self.plan:  # not planned yet (a step without the sizes to plan from): dense
            return DENSE, "dense", None
        if index >= len(self.plan) or self.plan[index].numel != numel:
            raise RuntimeError(
                f"gradcomp auto: bucket {index} ({numel:,} elements) is not in the plan "
                f"({[p.numel for p in self.plan]}): DDP changed its buckets after the plan was made"
            )
        return self.compressors[index], self.plan[index].algorithm, self.plan[index].inter_algorithm

    def intervals(self, step: int, index: int, device: torch.device) -> list | None:
        """(worker) Where the job of bucket ``index`` of ``step`` appends its intervals on a
        GPU's stream (None: not timed)."""
        return self.times.get(step, {}).get(index) if streams.uses_streams(device) else None

    def make_plan(self, q) -> None:
        """(worker) Measure (or take the profile), combine every rank's figures and choose per
        bucket: a job, so that every rank plans at the same point of the collective order.

        The bucket sizes are those the worker reduced in the step before; where it has
        none of that step (a checkpoint without them), this step stays dense and records
        them, and the next one plans."""
        if self.sizes is None or self.sizes.step != self.planned_at - 1:
            self.phase, self.planned_at = Phase.WARMUP, None
            return
        sizes = [self.sizes.numels[index] for index in sorted(self.sizes.numels)]
        # When each bucket was ready in that step, before the backward pass ended: read after
        # the measurements (on GPUs they wait for the device), agreed by every rank. Kept for
        # the re-plans of these buckets.
        hooked = self.ready if self.ready is not None and self.ready.step == self.planned_at - 1 else None
        first = None if hooked is None else hooked.first
        marks = [None if hooked is None else hooked.marks.get(index) for index in range(len(sizes))]
        self.offsets = None
        self.adopt(self._plan_for(q, sizes, (first, marks)))
        self.adopted_at = self.planned_at + 1  # the planning step's CPU dense buckets went natively
        self.log_plan(self.adopted_at, "first plan")
        self._begin_trial(self.plan)

    def _plan_for(self, q, sizes: list[int], marks: tuple | None = None) -> list:
        """(worker) The plan for buckets of ``sizes``: measured, or from the injected profiles.
        ``marks``: the hook's (first, per bucket) of the step before, to find the offsets."""
        if q.world_size == 1:  # nothing to send: nothing to compress
            self.runner_up = None
            self.dense_reasons = ["one rank, nothing to send"] * len(sizes)
            return planner.dense_plan(sizes)
        options = self.options
        # Measured where the buckets live: the codecs at their sizes, the link up to 16 MB.
        grid = planner.link_sizes(sizes)
        hierarchy = nodes_for_auto(q, self.node_size)  # made by the hook, on its first call
        profile = planner.agreed_profile(
            options.profile, options.allow, grid, sizes, q.group, self.device, hierarchy
        )
        # Agreed at every plan, a re-plan's too: offsets from a checkpoint were each rank's own.
        offsets = self.offsets if marks is None else ready_offsets(*marks)
        self.offsets = agreed_offsets(q, offsets, len(sizes))
        if marks is not None and self.offsets is None:
            logger.info("gradcomp auto: planning without the overlap with the backward pass (no ready times)")
        dtypes = [self.dtypes.get(index, torch.float32) for index in range(len(sizes))]
        plan = planner.best_plan(
            sizes, q.world_size, profile, options.allow, ready=self.offsets, dtypes=dtypes
        )
        # Buckets under min_numel go dense whatever the plan says: the plan says so too.
        plan = [
            p if n >= self.min_numel else planner.predict("none", n, q.world_size, profile, dtype=dtype)
            for n, p, dtype in zip(sizes, plan, dtypes, strict=True)
        ]
        self.dense_reasons = plan_log.dense_reasons(
            sizes, q.world_size, profile, dtypes, options.allow, self.min_numel
        )
        self.runner_up = None
        if options.trial_steps:
            other = planner.runner_up(sizes, q.world_size, profile, plan, options.allow, dtypes=dtypes)
            # Buckets the hook reduces dense whatever the plan says cannot tell two plans apart.
            if other is not None:
                other = [
                    p if n >= self.min_numel else mine for n, p, mine in zip(sizes, other, plan, strict=True)
                ]
                self.runner_up = None if other == plan else other
        return plan

    def _begin_trial(self, plan: list) -> None:
        """(worker, after :meth:`_plan_for`) Try ``plan`` against its runner-up, if it has one."""
        other, self.runner_up = self.runner_up, None
        self.trial = None if other is None else Trial([plan, other])
        self.phase = Phase.RUNNING if other is None else Phase.TRIAL
        if other is not None:
            logger.info(
                "gradcomp auto tries the plan against %s for %d steps each (predicted within %.0f%%)",
                ", ".join(picks(other)),
                self.options.trial_steps,
                planner.MARGIN * 100,
            )

    def judge(self, q, seconds: float, step: int) -> None:
        """(worker, the last step of a plan's turn, ``step``) Every rank's time of its steps
        combined (the slowest); the next plan to try, or the faster kept (adopted from the
        next step)."""
        (worst,) = ranks_max(q, [seconds])
        self.trial.seconds.append(worst)
        self.next_plan = self.trial.next_turn()
        if self.next_plan is not None:
            turn = len(self.trial.seconds)
            whose = "the runner-up's" if TRIAL_TURNS[turn] else "the plan's"
            self.next_cause = f"trial, {whose} turn ({turn + 1} of {len(TRIAL_TURNS)})"
            return
        outcome, plans = self.trial.outcome(), self.trial.plans
        self.trial, self.phase = None, Phase.RUNNING
        self.trials.append(outcome)
        plan_log.trial_reasons(self.dense_reasons, plans, outcome)
        best, ms = outcome["kept"], outcome["step_ms"]
        other = 1 - best
        verdict = "the plan" if best == 0 else "the runner-up"
        cause = f"trial kept {verdict}, {ms[best]:.4g} ms a step against {ms[other]:.4g} ms"
        if best != TRIAL_TURNS[-1]:
            self.next_plan, self.next_cause = plans[best], cause
        else:  # in force already: said now
            self.log_plan(step, cause)

    def check(self, q, deviation: float, forced: bool) -> None:
        """(worker) Every rank's drift and requests combined; a new plan when due, for the next step."""
        worst, forced = ranks_max(q, [deviation, float(forced)])
        drift = self.options.drift
        drifted = drift is not None and worst > drift
        if forced or drifted:
            why = f"drift {worst:.0%} past {drift:.0%}" if drifted else "requested"
            if streams.uses_streams(self.device):
                # Measured at the end of the next step (the hook schedules it): while this
                # step's backward pass runs, a GPU's timings would count its kernels too.
                self.remeasure_due = Remeasure(why)
                return
            self.remeasure(q, why)

    def remeasure(self, q, why: str = "requested") -> None:
        """(worker) Measure and choose afresh for the plan's buckets; adopted from the next step."""
        self.remeasure_due = None
        self.next_plan = self._plan_for(q, [p.numel for p in self.plan])
        self.next_cause = f"re-plan, {why}"
        self._begin_trial(self.next_plan)

    def log_plan(self, step: int, cause: str) -> None:
        """Log the plan in force from ``step`` and its ``cause`` (see :mod:`~gradcomp.ddp.plan_log`)."""
        plan_log.log_plan(step, cause, self.plan, self.dense_reasons, self.trial)

    def adopt(self, plan: list) -> None:
        """Make ``plan`` the plan (its compressors built once)."""
        self.compressors = [planner.from_spec(p.compressor) for p in plan]
        self.plan = plan

    def wait(self) -> None:
        """(hook) Wait for the check or judging job under way, if any."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def __getstate__(self):
        # A pending check's future, and the marks of when buckets were ready (CUDA events on GPUs)
        # and of when steps began: host clock readings mean nothing elsewhere.
        self.wait()
        return self.__dict__ | {"ready": None, "step_starts": {}}
