"""auto's clocks: when buckets were handed over and how long their work ran, read from the
host's clock on CPUs and from CUDA events on GPUs (never waited for), what that observed of a
plan against its prediction (the drift check's measure), and the figures every rank must
agree on."""

from __future__ import annotations

import dataclasses
import math
import statistics

import torch
import torch.distributed as dist

from gradcomp import planner, streams


def timed_on_stream(steps, device: torch.device, intervals: list):
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


def in_seconds(times: dict) -> list | None:
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


def ready_offsets(first, marks: list) -> list[float] | None:
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


def agreed_offsets(q, offsets: list[float] | None, count: int) -> list[float] | None:
    """(worker; a collective) Every rank's offsets made one: per bucket the latest (a bucket's
    reduction starts when its last rank hands it over), or None on every rank where any rank
    has none. The plan depends on them: ranks must agree, or they would reduce a bucket
    differently."""
    missing = offsets is None or len(offsets) != count
    agreed = ranks_max(q, [1.0, *[0.0] * count] if missing else [0.0, *offsets])
    return None if agreed[0] else agreed[1:]


def ranks_max(q, values: list[float]) -> list[float]:
    """(worker; a collective) Each of ``values``, the largest any rank of ``q`` has."""
    mine = torch.tensor(values, dtype=torch.float64).to(planner.default_device(q.group))
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=q.group)
    return mine.tolist()


def communication(window: list[dict], buckets: int) -> tuple[list[float], dict[int, list[float]]]:
    """Of the steps of ``window`` (each: bucket -> its intervals in flight) that timed all
    ``buckets`` and whose times are read: each step's communication seconds (the time some
    bucket was in flight), and per bucket its shares (what it added to that time)."""
    totals, shares = [], {}
    for times in window:
        if len(times) != buckets or any(not t or t[-1][1] is None for t in times.values()):
            continue
        intervals = in_seconds(times)
        if intervals is None:  # a GPU's events not done yet
            continue
        total, free, mine = 0.0, -math.inf, {}
        for began, ended, index in sorted(intervals):
            share = max(0.0, ended - max(began, free))
            mine[index] = mine.get(index, 0.0) + share
            total, free = total + share, max(free, ended)
        for index, share in mine.items():
            shares.setdefault(index, []).append(share)
        totals.append(total)
    return totals, shares


def observed(plan: list, window: list[dict]) -> tuple[list, float]:
    """What ``window``'s steps (see :func:`communication`) observed of ``plan``: the plan with
    each bucket's median share in its ``observed_seconds``, and the median step's communication
    seconds over the plan's prediction (NaN where either is unknown)."""
    totals, shares = communication(window, len(plan))
    if shares:
        plan = [
            dataclasses.replace(p, observed_seconds=statistics.median(shares[i])) if i in shares else p
            for i, p in enumerate(plan)
        ]
    predicted = sum(p.seconds for p in plan)
    return plan, statistics.median(totals) / predicted if totals and predicted > 0 else math.nan
