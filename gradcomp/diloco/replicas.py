"""DiLoCo across torchft's replica groups: exchanges a quorum takes part in, committed or
discarded together, and a restarted replica group healed into the next exchange.

With ``manager=`` (a :class:`torchft.Manager` whose quorum is synchronous), each exchange
of :class:`~gradcomp.diloco.DiLoCo` is one torchft step: the quorum, the compressed sum of
the pseudo-gradients over its replica groups
(:class:`gradcomp.integrations.torchft.Compression`), the number of them that trained this
period, then the commit. Committed, the average is the sum over the groups that trained,
and the outer step lands on every one of them alike. Discarded (a group died during the
exchange), every group sets the fragment back to its anchor and its residuals back to
before the exchange: the period's local steps are lost, as torchft loses a failed step.

A replica group that (re)starts joins at its peers' next exchange. torchft heals it from a
peer there: the model and inner optimizer from what the user registered, and from DiLoCo
the anchor, outer momentum, step counts and the period's inner learning rates; its
weights become the anchor and it holds no residuals
(:class:`~gradcomp.integrations.torchft.Compression` says why). It takes part in that
exchange with a zero pseudo-gradient and is not counted among those that trained, so
that the average is the trained groups' and its outer step is theirs: from then on its
anchor and weights equal its peers', bit for bit.
"""

from __future__ import annotations

import torch

from gradcomp.collectives import ReduceStats
from gradcomp.collectives.replica_groups import Compression
from gradcomp.compressors import Compressor
from gradcomp.diloco.fragments import Exchange, starting
from gradcomp.feedback import all_finite


def check(manager, outer, group, node_size, overlap_steps) -> None:
    """``ValueError`` for DiLoCo settings that torchft's loop cannot take."""
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError(
            "DiLoCo on torchft needs the Manager's synchronous quorum (use_async_quorum=False): a "
            "replica group that heals must take its peers' anchor before their exchange"
        )
    if group is not None or node_size is not None:
        raise ValueError(
            "DiLoCo on torchft averages over the Manager's replica groups: no group or node_size"
        )
    if overlap_steps:
        raise ValueError("DiLoCo on torchft lands each exchange at once: overlap_steps=0")
    if not isinstance(outer.compressor, Compressor):
        raise ValueError("DiLoCo on torchft takes a fixed compressor, not 'auto'")


class Replicas:
    """The torchft side of one :class:`~gradcomp.diloco.DiLoCo` (made by it with ``manager=``)."""

    def __init__(self, outer, manager):
        self.outer, self.manager = outer, manager
        self.compression = Compression(
            manager, outer.compressor, algorithm=outer.algorithm, key="gradcomp.diloco.residuals"
        )
        outer.feedback = self.compression.feedback
        self.healed = False
        self.healed_into: tuple[list[int], bool] = ([], False)  # the exchange its peers were in
        self.pending: tuple[list[int], bool] = ([], False)  # the exchange this group is in
        self.commits = self.discards = 0
        manager.register_state_dict_fn("gradcomp.diloco", self._load_heal_state, self._heal_state)

    @torch.no_grad()
    def join(self) -> None:
        """This replica group's first quorum: at the run's start every group's, with the
        others; later, its peers' next exchange (the one they were in when it healed from
        them), which it takes part in."""
        outer = self.outer
        self.pending = ([], False)
        self.manager.start_quorum()
        fragments, average = self.healed_into if self.healed else ([], False)
        if fragments:
            self._exchange(fragments, average=average, started=True)
            return
        # The run's start: healed from a peer's first weights, it trains this period. A
        # collective before the commit: a peer serves its state to the groups that heal
        # from it only until its own commit, and this one returns once they have it.
        self.healed = False
        sums = self.compression.sums([0.0, *_step_terms(outer.local_step)], outer.params[0].device)
        committed = self._commit()
        if committed and sums is not None:
            _check_steps(sums[1:], outer.local_step)

    def step(self) -> ReduceStats | None:
        """(the inner step counted) The exchange due now, if any."""
        outer = self.outer
        if outer.local_step == outer.total_steps:
            return self._exchange(list(range(len(outer.fragments))), average=True)
        due = starting(outer.local_step, outer.sync_every, len(outer.fragments))
        return self._exchange(due) if due else None

    def synchronize(self) -> ReduceStats | None:
        return self._exchange(list(range(len(self.outer.fragments))), average=False)

    def reduce(self, exchange: Exchange, indices: list[int], delta: torch.Tensor, name) -> None:
        """One part of an exchange: the sum over the quorum's replica groups, in place."""
        stats = self.compression.all_reduce(delta, name, op="sum")
        if stats is not None:
            exchange.stats.append(stats)
            exchange.bytes_sent += stats.bytes_sent
        exchange.parts.append((indices, delta, None))

    def _exchange(
        self, fragments: list[int], average: bool = False, started: bool = False
    ) -> ReduceStats | None:
        """One torchft step: the quorum (unless ``started``), every fragment's sum, how many
        groups trained and at which inner step, the commit; then each fragment's outer
        step (``average``: the average loaded), or each set back to its anchor where the
        step is discarded (the run's last exchange is then due again at the next step)."""
        outer = self.outer
        if not started:
            self.pending = (list(fragments), average)  # what a group healing from this one joins
            self.manager.start_quorum()
        trained = 0.0 if self.healed else 1.0
        self.healed = False
        exchanges = [outer._start(fragment, outer.local_step) for fragment in fragments]
        device = outer.params[0].device
        sums = self.compression.sums([trained, *_step_terms(outer.local_step)], device)
        deltas = [delta for exchange in exchanges for delta in exchange.deltas()]
        problem = None
        if sums is not None:
            problem = _steps_differ(sums[1:], outer.local_step)
            if problem is None and not all_finite(deltas):  # the same sums on every group: the same verdict
                problem = FloatingPointError(
                    f"DiLoCo: the replica groups' pseudo-gradients at inner step {outer.local_step} sum "
                    "to NaN or Inf: some group's weights went non-finite in its inner steps. Raised on "
                    "every group, the exchange discarded: DiLoCo's state as before it, the weights back "
                    "at the anchor; load the inner optimizer's state (or a checkpoint) before going on"
                )
            if problem is not None:
                self.manager.report_error(problem)
        if not self._commit() or sums is None or problem is not None:
            for exchange in exchanges:
                for i in outer.fragments[exchange.fragment]:
                    outer.params[i].copy_(outer.anchor[i])
                outer.in_flight.remove(exchange)
            if average:  # the run's last exchange: due again at the next step()
                outer.local_step -= 1
            if problem is not None:
                raise problem
            return None
        stats = None
        for exchange in exchanges:
            for delta in exchange.deltas():
                delta.div_(sums[0])
            exchange.log = None  # the residuals are settled: committed
            stats = outer._land(exchange, average=average)
        return stats

    def _commit(self) -> bool:
        committed = self.compression.should_commit()
        if committed:
            self.commits += 1
        else:
            self.discards += 1
        return committed

    def _heal_state(self) -> dict:
        """What a replica group that heals from this one takes (the quorum's thread, while
        this one waits in ``start_quorum``: nothing changes meanwhile)."""
        outer = self.outer
        return {
            "settings": outer.settings(),
            "local_step": outer.local_step,
            "outer_steps": list(outer.outer_steps),
            "anchor": [t.clone() for t in outer.anchor],
            "momentum": [t.clone() for t in outer.momentum],
            "lr_sums": outer.lr_sums.read(),
            "pending": self.pending,
        }

    @torch.no_grad()
    def _load_heal_state(self, state: dict) -> None:
        outer = self.outer
        if state["settings"] != outer.settings():
            raise ValueError(
                "DiLoCo on torchft: the replica group this one heals from runs other settings:\n"
                f"  theirs: {state['settings']}\n  mine:   {outer.settings()}"
            )
        outer.local_step = int(state["local_step"])
        outer.outer_steps = [int(n) for n in state["outer_steps"]]
        for mine, theirs in zip(
            [*outer.anchor, *outer.momentum], [*state["anchor"], *state["momentum"]], strict=True
        ):
            mine.copy_(theirs)
        outer.lr_sums.load(state["lr_sums"])
        fragments, average = state["pending"]
        self.healed_into = (list(fragments), bool(average))
        for param, anchor in zip(outer.params, outer.anchor, strict=True):
            param.copy_(anchor)
        self.healed = True


def _step_terms(step: int) -> list[float]:
    """What the groups sum to tell whether they all stand at inner step ``step``: a count,
    the steps, their squares (all equal exactly when count * squares == steps ** 2)."""
    return [1.0, float(step), float(step) ** 2]


def _steps_differ(sums: list[float], step: int) -> ValueError | None:
    groups, steps, squares = sums
    if groups * squares == steps * steps:
        return None
    return ValueError(
        "DiLoCo on torchft: the replica groups reached this exchange at different inner steps (this one "
        f"at {step}, their mean {steps / groups:g}): every group steps alike (an uneven data shard, a "
        "group that stepped once more?)"
    )


def _check_steps(sums: list[float], step: int) -> None:
    problem = _steps_differ(sums, step)
    if problem is not None:
        raise problem
