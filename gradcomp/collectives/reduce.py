"""``all_reduce``, the compressed all-reduce a user calls, and :class:`Work`, its handle
for ``async_op=True``: the call checked, described as a :class:`Job` and queued on the
group's worker (the package's docstring lists the modules it draws on)."""

from __future__ import annotations

import collections
import functools
import inspect
import threading
import warnings
import zlib
from collections.abc import Callable, Generator, Hashable

import torch
import torch.distributed as dist

from gradcomp import ops, streams
from gradcomp.collectives import shared_names
from gradcomp.collectives.agreement import settings_key
from gradcomp.collectives.chooser import (
    Chooser,
    as_chooser,
    chosen_steps,
)
from gradcomp.collectives.dispatch import job_steps
from gradcomp.collectives.job import Job
from gradcomp.collectives.node_layout import check_node_size, hierarchy_for, nodes_for_auto
from gradcomp.collectives.policy import HIERARCHICAL, check_algorithm
from gradcomp.collectives.worker import (
    queue_for,
)
from gradcomp.compressors import Compressor, get_compressor, label, split_options
from gradcomp.compressors.base import check_tensor
from gradcomp.feedback import ErrorFeedback, UndoLog, recording_log

_OPS = {"avg": "avg", "mean": "avg", "sum": "sum"}


class Work:
    """Handle of an asynchronous :func:`all_reduce`, like ``dist.Work``."""

    __slots__ = ("_future",)

    def __init__(self, future: torch.futures.Future):
        self._future = future

    def wait(self) -> bool:
        """Block until done; re-raises the collective's error. On CUDA the current
        stream then waits for the reduction (the host does not)."""
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the reduction is done: on CUDA, once the GPU has run its last kernel
        too (queried, never waited for), as ``dist.Work.is_completed()`` for NCCL."""
        return streams.finished(self._future)

    def get_future(self) -> torch.futures.Future:
        """Future holding the :class:`ReduceStats` of the call. As with torch's own
        ``Work.get_future()``, its ``wait()`` and ``then()`` callbacks are ordered
        after the reduction on CUDA streams (the statistics hold the tensor)."""
        return self._future


def resolve_op(op) -> str:
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    if isinstance(op, str) and op.lower() in _OPS:
        return _OPS[op.lower()]
    raise ValueError(f"op must be 'avg' or 'sum' (or dist.ReduceOp.AVG / SUM), got {op!r}")


def check_hierarchy_options(
    compressor: Compressor, algorithm: str | None, node_size, inter_algorithm
) -> None:
    """``ValueError`` for ``node_size`` / ``inter_algorithm`` the algorithm cannot take."""
    if algorithm != HIERARCHICAL and (node_size is not None or inter_algorithm is not None):
        named = repr(algorithm) if algorithm else "the default algorithm"
        raise ValueError(f"node_size and inter_algorithm apply to algorithm='hierarchical', not {named}")
    check_node_size(node_size)
    if inter_algorithm == HIERARCHICAL:
        raise ValueError(
            "inter_algorithm must be a flat algorithm (dense, allgather, two_phase), not 'hierarchical'"
        )
    if inter_algorithm is not None:
        check_algorithm(compressor, inter_algorithm)


def key_of(name: Hashable) -> int:
    """A stable integer for a residual/random-stream name (same on every rank)."""
    if isinstance(name, int):
        return name
    return zlib.crc32(repr(name).encode())


# The most tensors reduced without a name= whose default state all_reduce keeps, over
# every group and compressor settings: a loop reduces the same few shapes step after
# step, and a program that reduces ever new shapes must not pile up residuals.
UNNAMED_LIMIT = 256

# Residuals and call counters of all_reduce calls that pass no ErrorFeedback, per
# group and compressor settings: a compressor given by name is a new object on every
# call, but the same settings must find the same residuals; each group's jobs run on
# a worker of their own, which orders nothing of another group's. The calls that name
# their tensor share one memory per group and settings, kept for good (the caller
# asked for it); an unnamed tensor's default name (its shape and dtype) has a memory
# of its own, least recently used first, so that releasing it releases every residual
# the algorithms keep for it.
_DEFAULT_FEEDBACK: dict[tuple, tuple[ErrorFeedback, dict]] = {}
_UNNAMED: collections.OrderedDict[tuple, tuple[ErrorFeedback, dict]] = collections.OrderedDict()
_UNNAMED_LOCK = threading.Lock()
_unnamed_warned = False


def _default_feedback(
    compressor: Compressor, group: dist.ProcessGroup, name: Hashable, named: bool
) -> tuple[ErrorFeedback, dict]:
    """The default residual memory and call counters for a call on ``group`` under
    ``name``: the named calls' memory of the group and settings, or (``named`` False)
    the unnamed tensor's own, made most recently used; past :data:`UNNAMED_LIMIT` of
    those the least recently used is released, with a warning the first time."""
    key = (group, settings_key(compressor))
    if named:
        entry = _DEFAULT_FEEDBACK.get(key)
        if entry is None:
            entry = _DEFAULT_FEEDBACK[key] = (ErrorFeedback(), {})
        return entry
    key = (*key, name)
    with _UNNAMED_LOCK:
        entry = _UNNAMED.get(key)
        if entry is not None:
            _UNNAMED.move_to_end(key)
            return entry
        entry = _UNNAMED[key] = (ErrorFeedback(), {})
        if len(_UNNAMED) <= UNNAMED_LIMIT:
            return entry
        _UNNAMED.popitem(last=False)
    _warn_released()
    return entry


def _warn_released() -> None:
    # Every rank makes the same calls in the same order: they release alike and warn alike.
    global _unnamed_warned
    if _unnamed_warned:
        return
    _unnamed_warned = True
    warnings.warn(
        f"gradcomp.all_reduce: more than {UNNAMED_LIMIT} tensor shapes reduced without a name=: the "
        "residual and step counter of the least recently used one are released, and its error "
        "feedback starts afresh if it comes back. Name the tensors you reduce step after step "
        "(name=...) to keep each one's state",
        stacklevel=4,
    )


def _recorded(log: UndoLog, steps: Callable[[], Generator]) -> Generator:
    """``steps()`` with ``log`` recording on the worker's thread while they run, not while
    they are paused (other jobs run then)."""
    inner = steps()
    while True:
        with log.recording():
            try:
                next(inner)
            except StopIteration as done:
                return done.value
        yield


def _labelled(name: str, steps: Callable[[], Generator]) -> Generator:
    """``steps()``, their statistics naming the compressor (as a chooser's do)."""
    stats = yield from steps()
    stats.compressor = name
    return stats


def all_reduce(
    tensor: torch.Tensor,
    compressor: Compressor | Chooser | str,
    group: dist.ProcessGroup | None = None,
    op="avg",
    async_op: bool = False,
    *,
    algorithm: str | None = None,
    feedback: ErrorFeedback | bool | None = None,
    name: Hashable | None = None,
    step: int | None = None,
    measure_error: bool = False,
    node_size: int | None = None,
    inter_algorithm: str | None = None,
    **compressor_options,
):
    """Compressed, in-place all-reduce of ``tensor`` across ``group``.

    Args:
        tensor: floating tensor (fp32, fp16, bf16, fp64), same shape on every rank.
        compressor: a :class:`Compressor`, a name for :func:`get_compressor`,
            or a :class:`Chooser` (an object, or the name it is registered
            under: :func:`register_chooser`), which picks the compressor and
            algorithm on the worker, call by call. ``"auto"`` (or a
            :class:`gradcomp.planner.Auto`) picks them for this size on this
            group's measured link and device (the first call measures them).
        group: process group (default WORLD).
        op: ``"avg"`` (default, what gradients need) or ``"sum"``.
        async_op: return a :class:`Work` at once instead of waiting. With
            :data:`~gradcomp.collectives.worker.MAX_PENDING` calls of the group
            still pending, the call first waits for the oldest to complete (at
            most the group's timeout, then ``RuntimeError``); a call made on a
            worker's thread (a future's callback) never waits for room, and
            must pass ``async_op=True`` (``RuntimeError`` otherwise: it would
            wait for the worker it runs on).
        algorithm: ``"dense"``, ``"allgather"``, ``"two_phase"`` or
            ``"hierarchical"`` (dense inside each node, compressed between
            nodes); default from the compressor and the group's size
            (:func:`default_algorithm`).
        feedback: an :class:`ErrorFeedback` to keep residuals in, ``False``
            for none, or None for the default: residuals kept per group,
            compressor settings and name, shared by the calls with equal ones.
            Those of named calls are kept for good; those of unnamed tensors
            (and their step counters) for the :data:`UNNAMED_LIMIT` most
            recently used shapes: past that, the least recently used shape's
            are released (its error feedback starts afresh if it comes back),
            with a warning the first time.
        name: residual and random-stream key; give distinct names to distinct
            tensors of one shape (default: the tensor's shape and dtype). Calls
            under one name share the residual and run one after the other; a
            name given to another tensor while a call under it is in flight is
            warned of once.
        step: step number for random streams (default: a per-name call counter,
            kept as the residual is).
        measure_error: fill ``error_sq`` / ``input_sq`` of the stats. Off by
            default: it reads the tensor and the residual once more (or
            decodes once more, without feedback) and waits for the result.
        node_size: ranks per node for ``"hierarchical"`` (consecutive ranks
            of the group); default torchrun's ``LOCAL_WORLD_SIZE``, else the
            ranks' host names. With ``"auto"``, the nodes it finds this way
            let it weigh the hierarchical algorithm too.
        inter_algorithm: the algorithm between nodes for ``"hierarchical"``
            (default from the compressor and the number of nodes).
        compressor_options: the options of a compressor given by name
            (``all_reduce(t, "int4", block=128)`` is ``all_reduce(t, "int4:block=128")``).
            An option neither takes raises ``ValueError`` naming the nearest.

    Returns:
        ``ReduceStats`` if ``async_op`` is False, else a :class:`Work` whose
        future holds them.

    Example:
        >>> c = gradcomp.get_compressor("int8")
        >>> for p in model.parameters():
        ...     gradcomp.all_reduce(p.grad, c, name=p_name)
    """
    if compressor_options:  # checked before anything else: a typo raises on its rank alone
        split_options(compressor, compressor_options, ALL_REDUCE_OPTIONS, "gradcomp.all_reduce")
    chooser = as_chooser(compressor)
    if chooser is not None and (algorithm is not None or inter_algorithm is not None):
        named = repr(compressor) if isinstance(compressor, str) else type(compressor).__name__
        raise ValueError(
            f"compressor={named} chooses the algorithm: drop algorithm and inter_algorithm "
            "(node_size, where given, says which ranks share a node)"
        )
    compressor = chooser or get_compressor(compressor, **compressor_options)
    check_tensor(tensor)
    ops.check_forced_backend()
    op = resolve_op(op)
    if chooser is not None:
        check_node_size(node_size)
    else:
        if algorithm is not None:
            check_algorithm(compressor, algorithm)
        check_hierarchy_options(compressor, algorithm, node_size, inter_algorithm)
    q = queue_for(group)
    if not async_op and q._thread is threading.current_thread():
        raise RuntimeError(
            "gradcomp.all_reduce: a call in a callback of one of the group's futures runs on the group's "
            "worker, which it would wait for: pass async_op=True there and chain on the work's future"
        )
    named = name is not None
    name = (tuple(tensor.shape), str(tensor.dtype)) if name is None else name
    residuals, counters = _default_feedback(compressor, group or dist.group.WORLD, name, named)
    if feedback is False:
        residuals = None
    elif isinstance(feedback, ErrorFeedback):
        residuals = feedback
    elif feedback not in (None, True):
        raise TypeError(f"feedback must be an ErrorFeedback, True, False or None, got {feedback!r}")
    if step is None:
        step = counters.get(name, 0)
        counters[name] = step + 1
    if chooser is not None:
        job = Job(tensor, None, op, None, residuals, key_of(name), step, measure_error)
        if q.world_size > 1:  # made here, in call order; a chooser weighs hierarchical on several nodes
            job.hierarchy = nodes_for_auto(q, node_size)
        steps = functools.partial(chosen_steps, chooser, job, q)
    else:
        algorithm = check_algorithm(compressor, algorithm, q.world_size)
        job = Job(tensor, compressor, op, algorithm, residuals, key_of(name), step, measure_error)
        if algorithm == HIERARCHICAL:
            job.hierarchy, job.inter_algorithm = hierarchy_for(q, node_size), inter_algorithm
        steps = functools.partial(_labelled, label(compressor), functools.partial(job_steps, job, q))
    log = recording_log(residuals)
    if log is not None:
        steps = functools.partial(_recorded, log, steps)
    state = job.state()
    shared = shared_names.sharing(state, tensor, q)
    future = q.submit(steps, tensor.device, writes=tensor, name="gradcomp.all_reduce", state=state)
    shared_names.submitted(state, tensor, q, future)
    if shared:  # after the submit: whether it warns differs between ranks
        shared_names.warn(shared, residuals, name)
    if async_op:
        return Work(future)
    return future.wait()


# What all_reduce takes beside the tensor, by name (the compressor's options aside).
ALL_REDUCE_OPTIONS = tuple(
    name for name in inspect.signature(all_reduce).parameters if name not in ("tensor", "compressor_options")
)
