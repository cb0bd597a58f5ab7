"""auto's trials: where the model cannot tell a plan from its runner-up, both run in turns
and the faster stays."""

from __future__ import annotations

import dataclasses
import statistics

# A trial's turns: the plan's, the runner-up's, the plan's again. Each plan's time is the mean of
# its turns', so that a machine slowing (or speeding up) steadily weighs on both plans alike.
TRIAL_TURNS = (0, 1, 0)


@dataclasses.dataclass
class Trial:
    """A trial under way: its plans (the plan, its runner-up) and each finished turn's seconds."""

    plans: list
    seconds: list = dataclasses.field(default_factory=list)

    def next_turn(self) -> list | None:
        """The plan of the next turn; None once every turn has run."""
        done = len(self.seconds)
        return self.plans[TRIAL_TURNS[done]] if done < len(TRIAL_TURNS) else None

    def outcome(self) -> dict:
        """(every turn run) Each plan's choices, its mean milliseconds a step, each turn's, and
        which plan stays (the faster; ties: the earlier)."""
        means = [
            statistics.mean(t for t, turn in zip(self.seconds, TRIAL_TURNS, strict=True) if turn == i)
            for i in range(len(self.plans))
        ]
        return {
            "plans": [picks(plan) for plan in self.plans],
            "step_ms": [1e3 * t for t in means],
            "turns_ms": [1e3 * t for t in self.seconds],
            "kept": min(range(len(self.plans)), key=lambda i: (means[i], i)),
        }


def turn_seconds(starts: dict[int, float], adopted_at: int, step: int) -> float | None:
    """A turn's seconds a step, at ``step`` (the hook's clock at each step's first bucket in
    ``starts``): the median of its steps but the first (its switch), or None where none is
    timed. A run resumed in the middle of a turn times the steps it ran after its first
    (DDP's first iteration regroups its buckets), one at least (every rank resumed alike).
    The median: a step that stalls for a reason of its own (an evaluation or a checkpoint
    in the training loop) must not decide between the plans."""
    first = max(adopted_at, min(starts))
    begun = [s for s in range(first + 1, step) if s in starts]
    if not begun:
        return None
    steps = [starts[s + 1] - starts[s] for s in begun if s + 1 in starts]
    return statistics.median(steps) if steps else (starts[step] - starts[begun[0]]) / (step - begun[0])


def picks(plan: list) -> list[str]:
    """Each bucket's compressor and algorithm in words (``int8 two_phase``)."""
    return [f"{p.compressor} {p.how}" for p in plan]
