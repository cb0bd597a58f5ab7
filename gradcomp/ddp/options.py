"""The hook's options, policy apart from mechanism: frozen dataclasses, checked when made."""

from __future__ import annotations

import dataclasses
import math
import warnings

from gradcomp import planner
from gradcomp.collectives import HIERARCHICAL, check_algorithm, check_hierarchy_options
from gradcomp.collectives.node_layout import check_node_size
from gradcomp.compressors import Compressor

# compressor="auto" reduces at least this many steps dense: DDP settles its
# buckets after the first, and the plan is made on the settled ones.
AUTO_MIN_WARMUP = 2
DEFAULT_TRIAL_STEPS = 4
MAX_TRIAL_STEPS = 100  # a trial's turn: well within the steps whose times are kept


def _count(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a non-negative" if least == 0 else "a positive"
        raise ValueError(f"{name} must be {kind} integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class HookOptions:
    """How the hook reduces, for a static compressor and for ``"auto"`` alike.

    Attributes:
        warmup_steps: the first steps are reduced dense (no compression).
        min_numel: buckets with fewer elements are reduced dense.
        algorithm: ``"dense"``, ``"allgather"``, ``"two_phase"`` or
            ``"hierarchical"`` (None: from the compressor and the group's size).
        node_size, inter_algorithm: for ``"hierarchical"``, ranks per node and
            the algorithm between nodes (see :func:`gradcomp.all_reduce`).
        residual_dtype: ``"fp32"`` or ``"grad"`` (see :class:`~gradcomp.ErrorFeedback`);
            :class:`HookState` and ``register`` take it as ``residual``.
        measure_error: keep ``relative_error`` in the statistics (one more pass
            over each bucket, and on a GPU a host sync per bucket).
        history: how many :class:`StepStats` to keep (oldest dropped).
    """

    warmup_steps: int = 0
    min_numel: int = 1024
    algorithm: str | None = None
    node_size: int | None = None
    inter_algorithm: str | None = None
    residual_dtype: str = "fp32"
    measure_error: bool = False
    history: int = 10_000

    def __post_init__(self):
        for name in ("warmup_steps", "min_numel", "history"):
            _count(name, getattr(self, name), 0)
        check_node_size(self.node_size)
        object.__setattr__(self, "measure_error", bool(self.measure_error))

    def check_for(self, compressor: Compressor) -> HookOptions:
        """These options, checked against ``compressor`` (its algorithm made canonical)."""
        algorithm = None if self.algorithm is None else check_algorithm(compressor, self.algorithm)
        check_hierarchy_options(compressor, algorithm, self.node_size, self.inter_algorithm)
        return dataclasses.replace(self, algorithm=algorithm)

    def check_for_auto(self) -> HookOptions:
        """These options, checked for ``compressor="auto"`` (at least the warm-up it needs)."""
        if self.algorithm is not None or self.inter_algorithm is not None:
            raise ValueError(
                "compressor='auto' chooses the algorithm: drop algorithm and inter_algorithm "
                "(node_size, where given, says which ranks share a node)"
            )
        return dataclasses.replace(self, warmup_steps=max(self.warmup_steps, AUTO_MIN_WARMUP))

    @property
    def hierarchical(self) -> bool:
        return self.algorithm == HIERARCHICAL


@dataclasses.dataclass(frozen=True)
class AutoOptions:
    """How ``compressor="auto"`` plans and re-plans.

    Attributes:
        allow: the candidates (default :data:`gradcomp.planner.SAFE`;
            ``"topk@0.01"``-style or objects; a string splits at commas).
        profile: a :class:`gradcomp.planner.Profile` to plan from instead of
            measuring (every rank's are combined).
        check_every: every this many steps the ranks compare the observed
            communication time with the plan's prediction and act on
            :meth:`HookState.replan` and ``replan_every``.
        drift: re-plan when the observed/predicted ratio of a check's window
            departs from the first window's after the plan by more than this
            fraction (either way; None: never).
        replan_every: re-measure and re-plan at the first check this many
            steps after the plan (None: only on drift).
        trial_steps: where the model cannot tell the plan from another
            (:func:`gradcomp.planner.runner_up`), how many steps each runs
            before the faster is kept (2 to 100, or 0: never try).
    """

    allow: tuple = planner.SAFE
    profile: planner.Profile | None = None
    check_every: int = 10
    drift: float | None = 0.5
    replan_every: int | None = None
    trial_steps: int = DEFAULT_TRIAL_STEPS

    def __post_init__(self):
        object.__setattr__(self, "allow", planner.checked_candidates(self.allow, self.profile))
        _count("check_every", self.check_every, 1)
        if self.replan_every is not None:
            _count("replan_every", self.replan_every, 1)
        drift = self.drift
        if drift is not None and (type(drift) not in (int, float) or not 0 < drift < math.inf):
            raise ValueError(f"drift must be a positive fraction or None, got {drift!r}")
        trial = self.trial_steps
        valid = isinstance(trial, int) and not isinstance(trial, bool)
        if not valid or trial < 0 or trial == 1 or trial > MAX_TRIAL_STEPS:
            raise ValueError(f"trial_steps must be 0 (no trials) or 2 to {MAX_TRIAL_STEPS}, got {trial!r}")

    def settings(self) -> dict:
        """What every rank must share of these options."""
        return {
            "check_every": self.check_every,
            "drift": self.drift,
            "replan_every": self.replan_every,
            "trial_steps": self.trial_steps,
            "profile": "given" if self.profile is not None else "measured",
        }


def renamed(old: str, old_value, new: str, new_value, default=None):
    """The value of an option whose name changed from ``old`` to ``new``: ``old``'s, with a
    ``FutureWarning``, where only it was given (``new_value`` still ``default``)."""
    if old_value is None:
        return new_value
    if new_value is not default and new_value != default:
        raise TypeError(f"{old}= is the old name of {new}=: give one of them")
    warnings.warn(f"gradcomp: {old}= is now {new}=; {old}= will be removed", FutureWarning, stacklevel=4)
    return old_value
