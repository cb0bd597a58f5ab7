"""The ordered worker: one thread per process group runs gradcomp's collectives.

Every collective of gradcomp on a process group runs on one worker thread per
group, in submission order, over a private clone of the group. Callers (DDP
bucket hooks, user code) submit in the same order on every rank, so the
collectives match across ranks even though the multi-step algorithms issue
their later steps after earlier ones finish. A ``Future.then`` chain cannot
promise that: callbacks run in completion order, which differs between
ranks. The clone keeps these collectives apart from whatever the caller's
thread issues on the group meanwhile.

Overlap. A job may pause once its last collective is issued (it yields, see
:func:`gradcomp.collectives.dispatch.job_steps`): while more jobs are queued,
the worker starts them (compressing one overlaps the transfers of those
before it), up to :data:`IN_FLIGHT` paused at once, and finishes the paused
ones, oldest first, when nothing is queued or when the limit is reached; a
job that runs to its end without pausing completes after them. Collectives
are still issued, and futures completed, in submission order; a job with
nothing queued behind it finishes at once.

The rule that keeps this exact: a job starts while earlier ones are paused
only if it touches nothing they touch. Each job declares at submission what
it reads or writes that outlives it (:meth:`CollectiveQueue.submit`): the
tensor it writes its result into, and the state kept between calls under its
key (residuals, PowerSGD's warm start: :meth:`gradcomp.collectives.Job.state`).
A paused job may still be writing any of it (its result arrives after the
pause, the warm start is the sum Gloo is filling), so a job that shares any of
it first finishes every paused job up to the last that does; a job that
declares nothing waits for them all. Each job then reads what it would read
with one job at a time. What the worker keeps itself and sets after a pause
(:attr:`CollectiveQueue.lanes`) decides only how a job runs, never its bits
(:mod:`gradcomp.collectives.allgather`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import datetime
import hashlib
import inspect
import logging
import queue
import threading
from collections.abc import Callable, Generator

import torch
import torch.distributed as dist

from gradcomp import streams
from gradcomp.collectives.stats import profiled

logger = logging.getLogger(__name__)

# The most jobs paused at once, their exchanges in flight (each holds its gathered
# payloads until it finishes). On Gloo a collective's latency is several times a
# small bucket's codec time: one job in flight left the worker waiting on it.
IN_FLIGHT = 4


class CollectiveQueue:
    """One worker thread that runs a group's gradcomp collectives in FIFO order.

    ``submit(fn)`` returns a Future set to ``fn()``'s result (or its error);
    when ``fn()`` returns a generator (:func:`job_steps`), to the generator's
    return value, and the worker may overlap it with the next job where it
    yields. CUDA work runs on the worker's own stream, after the work the
    submitting stream had queued (:mod:`gradcomp.streams`).

    After a job fails, every later job fails at once without touching the
    network: the ranks may no longer agree on what comes next, and a rank
    that goes on issuing collectives would hang its peers (or race a
    ``destroy_process_group`` after the error). This includes a job that had
    started while the failed one was paused: whether it had started depends
    on timing, which differs between ranks, so every rank fails it alike.
    :func:`release_queues` starts afresh.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = clone_group(group)
        timeout = group_timeout(group) or dist.constants.default_pg_timeout
        self.timeout_seconds = timeout.total_seconds()
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.verified: set[tuple] = set()
        self.hierarchies: dict = {}  # node_size setting -> Hierarchy (collectives.hierarchical)
        self.lanes: dict = {}  # (fingerprint, device) -> row width (collectives.allgather's one-row lane)
        self.layout_exchanges = 0  # how many layouts were exchanged (failed ones included)
        self.lock = threading.Lock()
        self.failure: BaseException | None = None
        self.streams = streams.WorkerStreams()
        # How many jobs were submitted, the number of the last that issues collectives, and
        # the number of the last the worker has started: a started job has issued every
        # collective it will issue (it pauses only after its last). wait_issued().
        self._submitted = self._issuing = self._started = 0
        self._progress = threading.Condition()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="gradcomp-collectives", daemon=True)
        self._thread.start()

    def submit(
        self,
        fn: Callable[[], object],
        device: torch.device,
        writes: torch.Tensor | None = None,
        name: str = "gradcomp.job",
        collectives: bool = True,
        state: tuple = (),
    ) -> torch.futures.Future:
        """Queue ``fn``; ``writes``: the caller's tensor it writes its result into (None:
        not said, the job may touch anything); ``state``: hashable tokens of what else it
        reads or writes that outlives it (:meth:`gradcomp.collectives.Job.state`);
        ``name``: the profiler range the job's work runs in; ``collectives``: False for a
        job that issues none (statistics), which :meth:`wait_issued` need not wait for.

        A job starts while earlier ones are paused only if it shares neither the
        storage of ``writes`` nor a token of ``state`` with them (the module's rule).
        """
        future = streams.new_future(device)
        with self._progress:
            number = self._submitted = self._submitted + 1
            if collectives:
                self._issuing = number
            started = _Started(fn, future, device, streams.submitted(device), writes, state, name, number)
            self._jobs.put(started)
        return future

    def wait_issued(self) -> None:
        """Block until the worker has issued the collectives of every job submitted so far.

        A collective the caller then issues on another communicator of the same
        devices (DDP's own all-reduce on the model's group) comes after them on
        every rank: NCCL may deadlock where two communicators' collectives are
        issued in orders that differ between ranks. Jobs submitted later are issued
        after it (the caller submits them later). Returns at once when the worker
        has started them all; raises ``RuntimeError`` after the group's timeout."""
        with self._progress:
            target = self._issuing  # the last job that issues collectives; jobs start in order
            if not self._progress.wait_for(lambda: self._started >= target, timeout=self.timeout_seconds):
                raise RuntimeError(
                    f"gradcomp: the collective worker did not issue the jobs before this one within "
                    f"{self.timeout_seconds:.0f} s"
                )

    def close(self) -> None:
        """Stop the worker after the jobs already submitted."""
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # this thread's only: no job records a graph
        paused: collections.deque[_Started] = collections.deque()  # started, their exchanges in flight
        while True:
            if paused and (len(paused) >= IN_FLIGHT or self._jobs.empty()):
                self._finish(paused.popleft())  # nothing to overlap it with, or enough in flight
                continue
            job = self._jobs.get()
            if job is None:
                while paused:
                    self._finish(paused.popleft())
                return
            job.touches = None if job.writes is None else (_storage(job.writes), *job.state)
            while paused and _shares(job.touches, [earlier.touches for earlier in paused]):
                self._finish(paused.popleft())  # the next job touches what one of these writes
            self._start(job)
            if job.steps is None:
                while paused:  # futures complete in order
                    self._finish(paused.popleft())
                self._finish(job)
            else:
                paused.append(job)

    def _earlier_failure(self) -> RuntimeError:
        return RuntimeError(
            f"an earlier gradcomp collective on this group failed ({self.failure!r}); "
            "call gradcomp.collectives.release_queues() on every rank to start afresh"
        )

    def _start(self, job: _Started) -> None:
        """Run ``job`` up to its pause or to its end."""
        try:
            self._start_job(job)
        finally:
            with self._progress:
                self._started = job.number
                self._progress.notify_all()

    def _start_job(self, job: _Started) -> None:
        if self.failure is not None:
            job.error = self._earlier_failure()
            return
        try:
            if _bare(job.device):
                job.result = _first_step(job)
                return
            with (
                self.streams.running(job.device, job.ready, job.writes),
                profiled(job.name),
            ):
                job.result = _first_step(job)
        except BaseException as error:  # noqa: BLE001 - handed to the waiter
            self.failure = job.error = error

    def _finish(self, job: _Started) -> None:
        """Run a paused job to its end; complete its future."""
        if job.error is None and self.failure is not None:
            # It started while the failed job was paused, a timing that differs
            # between ranks: fail it as every rank fails the jobs behind a failure.
            job.error = self._earlier_failure()
        elif job.steps is not None:
            try:
                if _bare(job.device):
                    job.result = drive(job.steps)
                else:
                    with self.streams.running(job.device), profiled(job.name):
                        job.result = drive(job.steps)
            except BaseException as error:  # noqa: BLE001 - handed to the waiter
                self.failure = job.error = error
        job.steps = None
        # The future's callbacks run here, the caller's ``then`` among them: with grad mode
        # as on any thread, not the worker's.
        torch._C._set_grad_enabled(True)
        try:
            if job.error is not None:
                job.future.set_exception(job.error)
            elif not streams.uses_streams(job.device):
                job.future.set_result(job.result)
            else:
                with self.streams.running(job.device):
                    job.future.set_result(job.result)
        finally:
            torch._C._set_grad_enabled(False)


def _bare(device: torch.device) -> bool:
    """Whether a job on ``device`` runs without a stream and outside a profiler range (a
    CPU job, no profile running): its with-blocks are skipped (a few calls a bucket)."""
    return not streams.uses_streams(device) and not torch.autograd.profiler._is_profiler_enabled


def _first_step(job: _Started):
    """Run ``job``'s function; a generator (job steps) up to its pause, kept in
    ``job.steps``. The result, where it ran to its end."""
    result = job.fn()
    if not inspect.isgenerator(result):
        return result
    try:
        next(result)
    except StopIteration as done:
        return done.value
    job.steps = result
    return None


@dataclasses.dataclass
class _Started:
    """A submitted job; once started, run up to its pause (``steps`` to resume) or to its end."""

    fn: Callable[[], object]
    future: torch.futures.Future
    device: torch.device
    ready: object  # the submitting stream's event (None on CPU)
    writes: torch.Tensor | None
    state: tuple  # tokens of the state it reads or writes besides writes (Job.state)
    name: str = "gradcomp.job"
    number: int = 0  # in submission order, from 1
    steps: Generator | None = None
    touches: tuple | None = None  # the storage of writes and the state, once started (None: anything)
    result: object = None
    error: BaseException | None = None


def _storage(writes: torch.Tensor) -> int:
    """The address of the storage a job writes into."""
    return writes.untyped_storage().data_ptr()


def _shares(touches: tuple | None, paused: list[tuple | None]) -> bool:
    """Whether a job touching ``touches`` may touch what a paused one does (None, not
    said, counts as everything): the module's rule, in one place."""
    if touches is None:
        return True
    return any(earlier is None or any(token in earlier for token in touches) for earlier in paused)


def clone_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A private group of ``group``'s ranks with its backends, timeout and options."""
    return new_group_like(group, dist.get_process_group_ranks(group))


def new_group_like(group: dist.ProcessGroup, ranks: list[int]) -> dist.ProcessGroup:
    """A group of ``ranks`` (global ranks, a subset of ``group``'s) with
    ``group``'s backends, timeout and options.

    Created by the given ranks only (``use_local_synchronization``): every
    rank must create the groups it belongs to in the same order. torch names
    such a group after its ranks and how many groups this process already
    holds, which differs between ranks that joined different subgroups
    before (they would wait for each other under different names until the
    timeout): the name here counts only gradcomp's groups of these ranks. With a
    device-bound default group (``init_process_group(device_id=...)``),
    torch would create it by splitting the default group's communicator, a
    collective over every rank of the job, which the ranks outside ``ranks``
    never join: for a group smaller than the job the binding is lifted for
    the call, and the group connects on its own, among its ranks. NCCL
    groups get fresh options with ``group``'s settings
    (:func:`_nccl_options_like`), never its communicator's split source.
    """
    timeout = group_timeout(group)
    options = {"timeout": timeout, "backend": dist.get_backend_config(group)}
    nccl = _backend_of(group, "cuda")
    if nccl is not None and type(nccl).__name__ == "ProcessGroupNCCL":
        options["pg_options"] = _nccl_options_like(nccl, timeout)
    default = dist.distributed_c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    lift = bound is not None and len(ranks) < dist.get_world_size()
    with _GROUPS_LOCK, _named(ranks):
        if lift:
            default.bound_device_id = None
        try:
            return dist.new_group(ranks=ranks, use_local_synchronization=True, **options)
        finally:
            if lift:
                default.bound_device_id = bound


# ncclConfig_t fields (as torch binds them) a new communicator takes from its
# group's: the job's tuning (blocking calls, CTA counts, cluster size, network
# plugin), nothing that names a communicator. Not split_share: it makes a split
# child share its parent's internal resources, and the worker's group must
# progress on its own beside the model's (a clone of the whole job is split).
_NCCL_CONFIG_FIELDS = ("blocking", "cga_cluster_size", "min_ctas", "max_ctas", "net_name")


def _nccl_options_like(nccl, timeout: datetime.timedelta | None):
    """New ``ProcessGroupNCCL.Options`` with the settings of backend ``nccl``'s.

    Not a copy: torch's ``_new_process_group_helper`` writes ``split_from``
    and ``split_color`` into the options of a group it splits from a
    device-bound default group, and overwrites them only where it splits
    again, which it does not for the groups this module creates with the
    binding lifted. With a copy's, ProcessGroupNCCL (``initNCCLComm``) would
    split the new group's communicator from the default group's with the
    colour of ``nccl``'s ranks, a collective of every rank that the ranks
    outside the new group never join: a hang. ``global_ranks_in_group`` and
    ``group_name`` are the new group's, set by torch.
    """
    parent = nccl.options
    options = type(nccl).Options(is_high_priority_stream=parent.is_high_priority_stream)
    if timeout is not None:
        options._timeout = timeout  # torch warns where it differs from the group's timeout
    config, fresh = getattr(parent, "config", None), getattr(options, "config", None)
    if config is not None and fresh is not None:
        for field in _NCCL_CONFIG_FIELDS:
            value = getattr(config, field, None)
            if value is not None:  # an unset net_name reads None; setting None would fail
                setattr(fresh, field, value)
    return options


_GROUPS_LOCK = threading.Lock()
_GROUPS_MADE: dict[tuple[int, ...], int] = {}  # ranks -> how many gradcomp groups of them this process made


@contextlib.contextmanager
def _named(ranks: list[int]):
    """While creating gradcomp's group of ``ranks``: torch names it
    ``gradcomp-<ranks>-<n>``, the n-th such group, a name every member agrees on."""
    c10d = dist.distributed_c10d
    original = getattr(c10d, "_process_group_name", None)
    number = _GROUPS_MADE.get(tuple(ranks), 0)
    _GROUPS_MADE[tuple(ranks)] = number + 1
    if original is None:  # a torch that names groups otherwise: nothing to fix
        yield
        return
    digest = hashlib.sha1(f"{sorted(ranks)}/{number}".encode(), usedforsecurity=False).hexdigest()

    def name(of_ranks, use_hashed_name):
        if use_hashed_name and sorted(of_ranks) == sorted(ranks):
            return f"gradcomp-{digest}"
        return original(of_ranks, use_hashed_name)

    c10d._process_group_name = name
    try:
        yield
    finally:
        c10d._process_group_name = original


def _backend_of(group: dist.ProcessGroup, device_type: str):
    """``group``'s backend object for ``device_type``, or None."""
    try:
        return group._get_backend(torch.device(device_type))
    except (RuntimeError, ValueError):
        return None


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``group`` was created with (None where torch does not say:
    the clone then gets torch's default)."""
    for device_type in ("cuda", "cpu"):
        options = getattr(_backend_of(group, device_type), "options", None)
        timeout = getattr(options, "_timeout", None)
        if timeout is not None:
            return timeout
    logger.warning("gradcomp: cannot read the timeout of process group %s; its clone gets the default", group)
    return None


def drive(steps: Generator):
    """Run a job's steps to the end, without pausing; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


_QUEUES: dict[object, CollectiveQueue] = {}
_QUEUES_LOCK = threading.Lock()


def release_queues() -> None:
    """Drop every collective queue (and its cloned group), after their pending jobs.

    Runs at interpreter exit: a cloned Gloo group still alive when the
    interpreter tears down after ``destroy_process_group`` aborts the process.
    Call it yourself (on every rank) before re-initializing torch.distributed
    in one process, or to go on after a failed gradcomp collective.
    """
    with _QUEUES_LOCK:
        queues = list(_QUEUES.values())
        _QUEUES.clear()
    for q in queues:
        q.close()


atexit.register(release_queues)


def queue_for(group: dist.ProcessGroup | None) -> CollectiveQueue:
    """The collective queue of ``group`` (WORLD when None), created on first use.

    Creating it is a collective: every rank of the group must reach the first
    gradcomp collective on it, as with any collective.
    """
    existing = _QUEUES.get(group)  # every bucket asks: no lock once it exists
    if existing is not None and dist.is_initialized():
        return existing
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first")
    group = group or dist.group.WORLD
    existing = _QUEUES.get(group)
    if existing is not None:
        return existing
    with _QUEUES_LOCK:
        existing = _QUEUES.get(group)
        if existing is None:
            existing = _QUEUES[group] = CollectiveQueue(group)
        return existing


# The process group's own all-gather into one tensor (``all_gather_single`` from torch 2.13).
_GATHER_INTO_TENSOR = (
    getattr(dist.ProcessGroup, "all_gather_single", None) or dist.ProcessGroup._allgather_base
)


def all_gather_async(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup):
    """Gather ``tensor`` of every rank into ``output`` (rank order); the pending work.

    Issued on ``group`` itself: the call torch's ``all_gather_single``
    (``all_gather_into_tensor``) ends in, without its checks of each call, which
    hold here by construction (dense tensors, a group this rank belongs to, no
    coalescing context): some twenty microseconds a bucket on a CPU.
    """
    options = dist.distributed_c10d.AllgatherOptions()
    options.asyncOp = True
    return _GATHER_INTO_TENSOR(group, output, tensor, options)
