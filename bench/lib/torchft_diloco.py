"""The DiLoCo runs of ``bench/torchft_train.py``: one replica group's inner loop under
torchft's own DiLoCo or gradcomp's (``gradcomp.DiLoCo(..., manager=)``), a JSON line an
exchange, and what the script's replica groups share (waiting for a file, a JSON line).

Both take the outer step gradcomp takes by default: SGD with lr 1.0 and Nesterov momentum
0.8 (torchft's is the ``torch.optim.SGD`` given to it). torchft's DiLoCo all-reduces the
fp32 pseudo-gradients, one parameter at a time, and ends the run on an outer step; gradcomp's
compresses them (with error feedback), and by default scales its momentum by the inner
learning rate (``follow_inner_lr``) and ends on the replicas' average (``total_steps``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import torch

from lib.convergence_lm import LM_EVAL_EVERY

OUTER_LR, OUTER_MOMENTUM = 1.0, 0.8


def wait_for(path: str | None, seconds: float = 300.0) -> None:
    deadline = time.monotonic() + seconds
    while path is not None and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.02)


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


class Exchanges:
    """A replica group's exchanges: one JSON line each, counted."""

    def __init__(self, manager):
        self.manager = manager
        self.commits = self.discards = 0

    def record(self, step: int, committed: bool, healed: bool = False) -> None:
        self.commits += committed
        self.discards += not committed
        participants = self.manager.num_participants()
        emit(step=step, committed=committed, participants=participants, healed=healed, error=None)


def train(
    config: dict,
    manager,
    net: torch.nn.Module,
    inner: torch.optim.Optimizer,
    inner_step: Callable[[int], None],
    evaluate: Callable[[], float],
    heals: list,
) -> dict:
    """Train ``config['steps']`` inner steps with DiLoCo (``config['kind']``: ``torchft_diloco``
    or ``diloco``); ``inner_step(step)`` runs one step's forward and backward. The counts,
    bytes and validation curve for the script's final line."""
    loop = _torchft if config["kind"] == "torchft_diloco" else _gradcomp
    return loop(config, manager, net, inner, inner_step, evaluate, heals)


def _torchft(config, manager, net, inner, inner_step, evaluate, heals) -> dict:
    from torchft.local_sgd import DiLoCo

    steps, every = config["steps"], config["sync_every"]
    exchanges, curve = Exchanges(manager), []
    outer = torch.optim.SGD(net.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    # torchft's DiLoCo runs in the inner optimizer's step hooks: every sync_every-th step
    # is a quorum, the pseudo-gradients' all-reduce, the commit and the outer step.
    with DiLoCo(manager, [net], inner, outer, sync_every=every):
        for step in range(steps):
            inner_step(step)
            before = manager.current_step()
            inner.step()
            inner.zero_grad(set_to_none=True)
            if (step + 1) % every == 0:
                exchanges.record(step + 1, manager.current_step() > before)
            _evaluate(curve, step + 1, steps, evaluate)
    return dict(step=steps, exchanges=exchanges, curve=curve, bytes_sent=None, dense_bytes=None)


def _gradcomp(config, manager, net, inner, inner_step, evaluate, heals) -> dict:
    import gradcomp

    steps = config["steps"]
    # Made at the run's start with its peers; restarted, it waits here for their next
    # exchange, heals from one of them and takes part in it.
    outer = gradcomp.DiLoCo(
        net,
        inner,
        config["sync_every"],
        config["spec"],
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
        nesterov=True,
        follow_inner_lr=config["follow_inner_lr"],
        total_steps=steps if config["average"] else None,
        manager=manager,
    )
    replicas, exchanges, curve = outer.replicas, Exchanges(manager), []
    if outer.local_step > 0:  # restarted: healed into its peers' exchange at this step
        exchanges.record(outer.local_step, replicas.commits > 0, healed=bool(heals))
    if config.get("die_at") is not None:
        _die_inside_exchange(outer, config["die_at"])
    while outer.local_step < steps:
        if outer.local_step == config.get("hold_at"):
            wait_for(config["hold_gate"])
        inner_step(outer.local_step)
        inner.step()
        inner.zero_grad(set_to_none=True)
        before = (replicas.commits, replicas.discards)
        outer.step()
        if (replicas.commits, replicas.discards) != before:
            exchanges.record(outer.local_step, replicas.commits > before[0])
        _evaluate(curve, outer.local_step, steps, evaluate)
    compression = replicas.compression
    return dict(
        step=outer.local_step,
        exchanges=exchanges,
        curve=curve,
        bytes_sent=compression.bytes_sent,
        dense_bytes=compression.dense_bytes,
    )


def _die_inside_exchange(outer, die_at: int) -> None:
    """End this process inside the exchange at inner step ``die_at``: after its quorum,
    before the all-reduce of the pseudo-gradients (as tests/integrations' replica does)."""
    compression = outer.replicas.compression
    reduce = compression.all_reduce

    def dying(tensor, name, op="avg"):
        if outer.local_step == die_at:
            emit(dying=die_at)
            os._exit(1)
        return reduce(tensor, name, op)

    compression.all_reduce = dying


def _evaluate(curve: list, step: int, steps: int, evaluate: Callable[[], float]) -> None:
    if step % LM_EVAL_EVERY == 0 or step == steps:
        curve.append((step, evaluate()))
