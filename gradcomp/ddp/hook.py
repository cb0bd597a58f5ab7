"""The DDP communication hook: bucket -> compressed all-reduce on the group's worker -> Future.

(No ``from __future__ import annotations`` here: DDP's ``register_comm_hook`` reads the
hook's annotations and wants ``dist.GradBucket`` itself, not its name.)"""

import functools
import inspect
import os
import time
import warnings

import torch
import torch.distributed as dist

from gradcomp import planner, streams
from gradcomp.collectives import HIERARCHICAL, hierarchy_for, queue_for, verify_settings
from gradcomp.collectives.arrival import wait_for_every_rank
from gradcomp.collectives.node_layout import nodes_for_auto
from gradcomp.compressors import Compressor, get_compressor, split_options
from gradcomp.ddp.state import HookState


def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages ``bucket`` across ranks through ``state.compressor``.

    Returns at once with a Future of the reduced bucket; the reduction runs
    on the process group's ordered collective worker.

    Example:
        >>> ddp_model.register_comm_hook(HookState("int8"), hook)
    """
    q = queue_for(state.process_group)
    buffer = bucket.buffer()
    if not state.agreed:
        # Ranks with other settings would issue other collectives (and hang): every rank
        # raises here instead, at its first bucket.
        settings = state.agreement_settings()
        what = "the gradcomp DDP hook's settings"
        q.submit(lambda: verify_settings(q, what, settings, buffer.device), buffer.device).wait()
        state.agreed = True
    auto = state.auto
    if state.options.algorithm == HIERARCHICAL:
        hierarchy_for(q, state.options.node_size)  # its groups are made here, on the first call, in order
    elif auto is not None and q.world_size > 1:
        nodes_for_auto(q, state.options.node_size)  # likewise; the planner measures its levels
    index, last = bucket.index(), bucket.is_last()
    layout = state.buckets.layout_of(bucket)
    step = state.step
    if last:
        state.step += 1
    timed = None if auto is None else auto.before_bucket(q, buffer, index, step)
    measure = auto.measurement_due(step, buffer.device) if last and auto is not None else None
    if state.buckets.holds(index, layout):
        # A resumed process: DDP's first buckets differ from the checkpoint's.
        future = streams.new_future(buffer.device)
        state.buckets.hold(buffer, layout, future)
        if last:
            q.submit(lambda: state.reduce_held(step, q), buffer.device, name="gradcomp.buckets_held")
            future = _step_end(state, q, buffer, measure, future)
        return future.then(_value)
    native = auto is not None and measure is None
    if native and auto.native(index, buffer.numel(), step, state.sent_as(index)):
        return _reduce_natively(state, q, buffer, index, step, last, timed)
    steps = functools.partial(state.reduce, buffer, index, layout, step, last, q)
    # What the bucket keeps between steps, under its index (Job.state's token, written out:
    # a call a bucket less): another bucket's job may start while this one is in flight.
    kept = ((state.feedback, index),)
    future = q.submit(steps, buffer.device, writes=buffer, name=f"gradcomp.bucket {index}", state=kept)
    if last:
        future = _step_end(state, q, buffer, measure, future)
    return future.then(_value if timed is None else functools.partial(_done, timed, None))


def _step_end(state: HookState, q, buffer: torch.Tensor, measure, future: torch.futures.Future):
    """(the step's last bucket ``buffer``, its jobs submitted) The future DDP waits for in
    its place: after ``measure``'s job where one is due. DDP waits for it before the
    optimizer step and the next forward pass, so the device runs nothing else while
    auto measures. On GPUs the hook then waits until the worker has issued the step's
    collectives: DDP's own that follow on the model's group (find_unused_parameters'
    all-reduce) come after them on every rank (CollectiveQueue.wait_issued)."""
    if measure is not None:
        measured = state.measuring_job(measure, q, buffer)
        future = q.submit(measured, buffer.device, writes=buffer, name="gradcomp.plan")
    if streams.uses_streams(buffer.device):
        q.wait_issued()
    return future


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
        intervals = state.auto.times.get(step, {}).get(index)
        if intervals is not None:  # timed from here to the end of the collective, by events
            timed = [streams.timing_event(buffer.device), None]
            intervals.append(timed)
    buffer.div_(q.world_size)
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    account = functools.partial(
        state.account_native, step, index, last, buffer.numel(), buffer.element_size(), q.world_size
    )
    q.submit(account, buffer.device, writes=buffer, name=f"gradcomp.bucket {index}", collectives=False)
    return work.get_future().then(functools.partial(_done, timed, 0))


def _done(timed: list | None, item: int | None, future: torch.futures.Future) -> torch.Tensor:
    # A bucket's result: when it came (for auto's drift check), then the tensor
    # (torch's all-reduce gives a list of one). On GPUs an event on the callback's
    # stream, which waited for the collective.
    value = future.value()
    tensor = value if item is None else value[item]
    if timed is not None:
        timed[1] = time.perf_counter() if isinstance(timed[0], float) else streams.timing_event(tensor.device)
    return tensor


def _value(future: torch.futures.Future) -> torch.Tensor:
    # Re-raised inside a callback, a worker error reaches the training loop
    # with its type and message (a bare failed Future reaches DDP garbled).
    return future.value()


# The HookState options register() takes; every other keyword goes to the compressor.
# The options' old names, still taken (with a FutureWarning): not listed.
OLD_NAMES = ("process_group", "residual_dtype")
STATE_OPTIONS = tuple(
    name
    for name in inspect.signature(HookState.__init__).parameters
    if name not in ("self", "compressor", *OLD_NAMES)
)


def _not_distributed(model) -> str:
    """What :func:`register` says of a ``model`` that is not a DistributedDataParallel: where
    the process was launched as one of several ranks but torch.distributed was not set up
    for them, that first, and what sets it up."""
    said = f"gradcomp.ddp.register needs a DistributedDataParallel model, got {type(model).__name__}"
    launched = os.environ.get("WORLD_SIZE", "1")
    launched = int(launched) if launched.isdigit() else 1
    initialized = dist.is_available() and dist.is_initialized()
    if launched > 1 and (not initialized or dist.get_world_size() == 1):
        found = "torch.distributed is not initialized" if not initialized else "its process group has 1 rank"
        return (
            f"{said}: this process is one of WORLD_SIZE={launched} ranks, but {found}, so nothing "
            "wrapped the model. On CPUs, accelerate sets up the ranks with Accelerator(cpu=True) and "
            "the Trainer with TrainingArguments(use_cpu=True); without a framework, call "
            "torch.distributed.init_process_group() and wrap the model in DistributedDataParallel"
        )
    if not initialized:
        return (
            f"{said}: torch.distributed is not initialized. Launch the ranks (torchrun "
            "--nproc-per-node=N), call torch.distributed.init_process_group() and wrap the model in "
            "DistributedDataParallel (a framework does both: Trainer, accelerate, Lightning's 'ddp')"
        )
    return (
        f"{said}: wrap it first, DistributedDataParallel(model), or register on the model a framework wrapped"
    )


def register(
    model: torch.nn.parallel.DistributedDataParallel, compressor: Compressor | str | planner.Auto, **options
) -> HookState:
    """Register gradcomp's hook on ``model`` in one call and return its state.

    ``options`` holds both :class:`HookState` options (``warmup_steps``,
    ``min_numel``, ``group``, ``algorithm``, ``node_size``,
    ``inter_algorithm``, ``residual``, ``measure_error``, ``history``;
    with ``"auto"``: ``allow``, ``profile``, ``check_every``, ``drift``,
    ``replan_every``, ``trial_steps``) and the compressor's own (``ratio``, ``block``, ...);
    one that neither takes raises ``ValueError`` naming the nearest of both and both lists,
    before the model is looked at or any collective runs.
    The hook reduces over the group the model was built on
    (``DistributedDataParallel(..., process_group=...)``); a ``group`` given
    here must be that group.

    Example:
        >>> state = gradcomp.ddp.register(ddp_model, "topk", ratio=0.01, warmup_steps=50)
        >>> state = gradcomp.ddp.register(ddp_model, "auto", allow=("bf16", "int8", "int4", "topk@0.01"))
    """
    # The options first, before the model and any collective: a typo raises on its rank alone.
    own = ("compressor", *STATE_OPTIONS, *OLD_NAMES)
    state_options, options = split_options(
        compressor, options, own, "gradcomp.ddp.register", hidden=OLD_NAMES
    )
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(_not_distributed(model))
    if "group" in state_options or "process_group" in state_options:
        group = state_options.get("group", state_options.get("process_group"))
    else:
        group = state_options["group"] = model.process_group
    if group is not model.process_group and not (group is None and model.process_group is dist.group.WORLD):
        raise ValueError(
            "group differs from the group the DistributedDataParallel model reduces over "
            "(model.process_group): the hook must reduce over the model's group"
        )
    if planner.is_auto(compressor):
        if options:
            raise ValueError(
                f"compressor='auto' takes no compressor options, got {sorted(options)}: use allow="
            )
    else:
        compressor = get_compressor(compressor, **options)
    state = HookState(compressor, **state_options)
    wait_for_every_rank(group, "gradcomp.ddp.register")  # a rank that never registers: said, not hung
    if "nccl" in str(dist.get_backend(group)) and any(
        isinstance(module, torch.nn.SyncBatchNorm) for module in model.modules()
    ):
        warnings.warn(
            "SyncBatchNorm all-reduces on the model's group during the backward pass while gradcomp's "
            "worker issues the buckets' collectives on a group of its own: NCCL may hang where ranks "
            "issue the two in different orders, and gradcomp cannot order them (BatchNorm does not "
            "synchronise across ranks)",
            stacklevel=2,
        )
    model.register_comm_hook(state, hook)
    return state
