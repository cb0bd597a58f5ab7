"""auto's log of its plans: the line each plan logs when it comes into force (its cause, its
buckets grouped by what they go through) and why each of its dense buckets is dense (below
``min_numel``, the model's prediction against the fastest compressed choice, or the trial
that kept it)."""

from __future__ import annotations

import logging

from gradcomp import planner
from gradcomp.ddp.trial import picks

logger = logging.getLogger("gradcomp.ddp")


def log_plan(step: int, cause: str, plan: list, reasons: list[str], trial) -> None:
    """Log ``plan``, in force from ``step`` (one line, at INFO): ``cause``, its buckets grouped
    by what they go through, and why each dense one is (``reasons``; ``trial``: the trial
    under way, or None)."""
    logger.info("gradcomp auto plan from step %d (%s): %s", step, cause, summary(plan, reasons, trial))
    logger.debug("gradcomp auto plan in detail: %s", described(plan))


def summary(plan: list, reasons: list[str], trial) -> str:
    """The plan in a line: how many buckets it compresses, the bytes it sends a step, and
    its buckets grouped by choice (a dense one with its reason)."""
    tried = trial is not None and picks(plan) == picks(trial.plans[1])  # the runner-up's turn
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(plan):
        choice = f"{p.compressor} {p.how}"
        if p.compressor == "none":
            if tried and trial.plans[0][i].compressor != "none":
                reason = "the runner-up's choice, on trial"
            elif i < len(reasons):
                reason = reasons[i]
            else:
                reason = "planned before a restart"
            choice = f"{choice}, {reason}"
        groups.setdefault(choice, []).append(i)
    compressed = sum(p.compressor != "none" for p in plan)
    buckets = "; ".join(f"{_bucket_list(indices)}: {choice}" for choice, indices in groups.items())
    sent = sum(p.bytes_sent for p in plan)
    return f"{compressed} of {len(plan)} buckets compressed, {sent:,} bytes a step; {buckets}"


def described(plan: list) -> str:
    """Each bucket of ``plan``: its size, its choice, its predicted time and bytes."""
    return "; ".join(
        f"bucket {i} ({p.numel:,} elements): {p.compressor} {p.how}, "
        f"{p.seconds * 1e3:.3g} ms predicted, {p.bytes_sent:,} bytes"
        for i, p in enumerate(plan)
    )


def dense_reasons(
    sizes: list[int], world_size: int, profile, dtypes: list, allow, min_numel: int
) -> list[str]:
    """Why each bucket goes dense where a plan has it so: below ``min_numel``, or what the
    model predicted of dense and of the fastest compressed choice of ``allow``."""
    pairs = planner.routes(allow, world_size, profile.nodes)
    reasons, said = [], {}  # buckets are mostly of one size: weigh each size once
    for numel, dtype in zip(sizes, dtypes, strict=True):
        if numel < min_numel:
            reasons.append(f"below min_numel={min_numel:,}")
            continue
        if (numel, dtype) not in said:
            predicted = [
                planner.predict(c, numel, world_size, profile, a, inter, dtype)
                for c, a, inter in pairs
                if planner.saves(planner.from_spec(c), dtype)
            ]
            dense = next(p for p in predicted if p.compressor == "none")
            other = [p for p in predicted if p.compressor != "none"]
            said[numel, dtype] = _why_dense(dense, min(other, key=lambda p: p.seconds, default=None))
        reasons.append(said[numel, dtype])
    return reasons


def trial_reasons(reasons: list[str], plans: list, outcome: dict) -> None:
    """A finished trial's verdict (``outcome`` of ``plans``) in ``reasons``: a bucket the kept
    plan has dense where the other compresses is dense by the trial."""
    best, ms = outcome["kept"], outcome["step_ms"]
    other = 1 - best
    for i, (kept, lost) in enumerate(zip(plans[best], plans[other], strict=True)):
        if kept.compressor == "none" and lost.compressor != "none" and i < len(reasons):
            reasons[i] = (
                f"trial kept dense, {ms[best]:.4g} ms a step against {ms[other]:.4g} ms "
                f"with {lost.compressor} {lost.how}"
            )


def _why_dense(dense, fastest) -> str:
    """Why the model keeps a bucket dense, from its prediction ``dense`` and the fastest
    compressed one (None: no candidate sends fewer bytes)."""
    if fastest is None:
        return "no candidate sends fewer bytes than dense"
    ms = f"{dense.seconds * 1e3:.3g} ms"
    theirs = f"{fastest.compressor} {fastest.how} {fastest.seconds * 1e3:.3g} ms"
    if fastest.seconds >= dense.seconds:
        return f"dense predicted fastest, {ms} against {theirs}"
    if fastest.seconds > (1 - planner.MARGIN) * dense.seconds:
        return f"dense predicted {ms} against {theirs}, less than the {planner.MARGIN:.0%} gain to compress"
    # best_plan kept it dense for the overlap with the backward pass.
    return (
        f"reduced while the backward pass runs: {theirs} against dense {ms} would end the step little sooner"
    )


def _bucket_list(indices: list[int]) -> str:
    """``"bucket 3"``, ``"buckets 0-2, 5"``."""
    runs, start = [], indices[0]
    for before, index in zip(indices, [*indices[1:], None], strict=True):
        if index != before + 1:
            runs.append(str(start) if start == before else f"{start}-{before}")
            start = index
    return f"bucket{'s' if len(indices) > 1 else ''} {', '.join(runs)}"
