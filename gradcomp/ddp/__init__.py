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

The package, one concern a module: :mod:`~gradcomp.ddp.hook` (the hook and
:func:`register`), :mod:`~gradcomp.ddp.state` (:class:`HookState`: what the
worker does with a bucket), :mod:`~gradcomp.ddp.options` (frozen options),
:mod:`~gradcomp.ddp.stats` (:class:`StepStats`), :mod:`~gradcomp.ddp.checkpoint`
(the versioned schema, :class:`Checkpointable`), :mod:`~gradcomp.ddp.auto`
(``"auto"``'s controller and its phases), :mod:`~gradcomp.ddp.trial` (its
trials), :mod:`~gradcomp.ddp.timing` (its clocks) and :mod:`~gradcomp.ddp.plan_log`
(the log of its plans).
"""

from gradcomp.ddp.auto import Phase as Phase
from gradcomp.ddp.checkpoint import SCHEMA_VERSION as SCHEMA_VERSION
from gradcomp.ddp.checkpoint import Checkpointable, load_rank_file, save_rank_file
from gradcomp.ddp.checkpoint import on_device as on_device
from gradcomp.ddp.hook import STATE_OPTIONS as STATE_OPTIONS
from gradcomp.ddp.hook import hook, register
from gradcomp.ddp.options import (
    AUTO_MIN_WARMUP as AUTO_MIN_WARMUP,
)
from gradcomp.ddp.options import (
    DEFAULT_TRIAL_STEPS as DEFAULT_TRIAL_STEPS,
)
from gradcomp.ddp.options import (
    MAX_TRIAL_STEPS as MAX_TRIAL_STEPS,
)
from gradcomp.ddp.options import (
    AutoOptions,
    HookOptions,
)
from gradcomp.ddp.state import HookState
from gradcomp.ddp.stats import StepStats
from gradcomp.ddp.trial import TRIAL_TURNS as TRIAL_TURNS

__all__ = [
    "AutoOptions",
    "Checkpointable",
    "HookOptions",
    "HookState",
    "StepStats",
    "hook",
    "load_rank_file",
    "register",
    "save_rank_file",
]
