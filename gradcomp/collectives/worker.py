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
import dataclasses
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator

import torch
import torch.distributed as dist

from gradcomp import streams
from gradcomp.collectives import waiting
from gradcomp.collectives.groups import clone_group, group_timeout
from gradcomp.collectives.stats import profiled

logger = logging.getLogger(__name__)

# The most jobs paused at once, their exchanges in flight (each holds its gathered
# payloads until it finishes). On Gloo a collective's latency is several times a
# small bucket's codec time: one job in flight left the worker waiting on it.
IN_FLIGHT = 4
# The most jobs of a group submitted and not yet completed: past it, submit waits for
# the oldest (back-pressure, as a communicator's own queue gives), so that a caller
# that submits faster than the group reduces does not pile up jobs without end.
MAX_PENDING = 256

# Marks the workers' threads: a job's future completes there, and a callback that
# submits must not wait for the worker that runs it (nor for another one, which may
# be waiting on this one).
_ON_WORKER = threading.local()


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

    def __init__(self, group: dist.ProcessGroup, what: str | None = None):
        self.group = clone_group(group, what)
        timeout = group_timeout(group) or dist.constants.default_pg_timeout
        self.timeout_seconds = timeout.total_seconds()
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.ranks = dist.get_process_group_ranks(self.group)
        self.verified: set[tuple] = set()
        self.hierarchies: dict = {}  # node_size setting -> Hierarchy (collectives.hierarchical)
        self.lanes: dict = {}  # plan -> row width (collectives.allgather's one-row lane)
        self.plans: dict = {}  # wire kind -> the plan its ranks agreed on (collectives.agreement)
        self.layout_exchanges = 0  # how many layouts were exchanged (failed ones included)
        self.lock = threading.Lock()
        self.failure: BaseException | None = None
        self.streams = streams.WorkerStreams()
        # How many jobs were submitted, the number of the last that issues collectives, and
        # the number of the last the worker has started: a started job has issued every
        # collective it will issue (it pauses only after its last). wait_issued().
        self._submitted = self._issuing = self._started = 0
        self._completed = 0  # jobs whose future is set (pending: submitted - completed)
        self._progress = threading.Condition()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # The job the worker runs now and since when (None: none), which the watch reads.
        self._running: tuple[_Started, float] | None = None
        # The watch's last finding (a job's number, the ranks behind it), for that job's error.
        self.behind: tuple[int, dict[int, int | None]] | None = None
        self._thread = threading.Thread(target=self._run, name="gradcomp-collectives", daemon=True)
        self._thread.start()
        self._watch = _Watch(self)

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

        With :data:`MAX_PENDING` jobs pending (submitted, their futures not yet set),
        it first waits for the oldest to complete, at most the group's timeout
        (then ``RuntimeError``); on a worker's thread (a future's callback) it never
        waits.
        """
        future = streams.new_future(device)
        with self._progress:
            if self._submitted - self._completed >= MAX_PENDING and not getattr(_ON_WORKER, "marked", False):
                self._wait_below(MAX_PENDING)
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
                    f"{self.timeout_seconds:.0f} s{self._stuck_in()}"
                )

    @property
    def pending(self) -> int:
        """Jobs submitted whose futures are not set yet."""
        return self._submitted - self._completed

    def _wait_below(self, depth: int) -> None:
        """(holding ``_progress``) Wait until fewer than ``depth`` jobs are pending."""
        if not self._progress.wait_for(lambda: self.pending < depth, timeout=self.timeout_seconds):
            raise RuntimeError(
                f"gradcomp: {self.pending} collectives of this group still pending after "
                f"{self.timeout_seconds:.0f} s (the group's timeout): a peer stalled or left"
                f"{self._stuck_in()}"
            )

    def _stuck_in(self) -> str:
        """Where the worker waits now, for an error's end: ``"; the worker waits in ..."``."""
        running = self._running
        return "" if running is None else f"; the worker waits in {self.describe(running[0])}"

    def describe(self, job: _Started) -> str:
        """``job`` as waits name it: ``"gradcomp.all_reduce of 1,048,576 float32 elements, job 7
        of group [0, 1]"``."""
        return f"{waiting.describe_call(job.name, job.writes)}, job {job.number} of group {self.ranks}"

    def close(self) -> None:
        """Stop the worker after the jobs already submitted, and its watch."""
        self._jobs.put(None)
        self._thread.join(timeout=30)
        self._watch.stop()

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # this thread's only: no job records a graph
        _ON_WORKER.marked = True
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
        self._running = (job, time.monotonic())
        try:
            self._start_job(job)
        finally:
            self._running = None
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
            self.failure = job.error = self._named(job, error)

    def _named(self, job: _Started, error: BaseException) -> BaseException:
        """``error`` as ``job``'s waiters get it: a collective's timeout as gradcomp's own
        error, naming the job and the ranks that had not reached it (as far as the watch
        learnt before: nothing is asked of the store here, whose host may be the rank
        that stalled); any other error as it is."""
        if isinstance(error, waiting.TimedOut) or not waiting.is_timeout(error):
            return error
        number, behind = self.behind or (None, None)
        missing = "a peer skipped the call, stalled or left"
        if number == job.number and behind:
            missing = waiting.describe_behind(behind)
        named = waiting.TimedOut(
            f"gradcomp: {self.describe(job)} did not complete within the group's timeout "
            f"({waiting.seconds(self.timeout_seconds)}): {missing}. Every rank makes gradcomp's calls "
            f"on a group in the same order. ({error})"
        )
        named.__cause__ = error
        return named

    def _finish(self, job: _Started) -> None:
        """Run a paused job to its end; complete its future."""
        if job.error is None and self.failure is not None:
            # It started while the failed job was paused, a timing that differs
            # between ranks: fail it as every rank fails the jobs behind a failure.
            job.error = self._earlier_failure()
        elif job.steps is not None:
            self._running = (job, time.monotonic())
            try:
                if _bare(job.device):
                    job.result = drive(job.steps)
                else:
                    with self.streams.running(job.device), profiled(job.name):
                        job.result = drive(job.steps)
            except BaseException as error:  # noqa: BLE001 - handed to the waiter
                self.failure = job.error = self._named(job, error)
            finally:
                self._running = None
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
                    streams.complete(job.future, job.result, job.device)
        finally:
            torch._C._set_grad_enabled(False)
            with self._progress:
                self._completed += 1
                self._progress.notify_all()


class _Watch:
    """A queue's watch: a daemon thread that warns while the worker waits in one job.

    The worker says which job it runs and since when (``CollectiveQueue._running``: a
    tuple set and cleared per job, nothing more on a job that does not wait). Once a job
    has waited :func:`~gradcomp.collectives.waiting.posting_time`, the watch posts its
    number in the store; at :func:`~gradcomp.collectives.waiting.first_warning` and
    every :data:`~gradcomp.collectives.waiting.WARN_EVERY_SECONDS` after, it reads the
    peers' numbers and warns, naming the job and the ranks that have not reached it.
    Stopped with its queue (:meth:`CollectiveQueue.close`)."""

    def __init__(self, q: CollectiveQueue):
        self.q = q
        self.stopped = threading.Event()
        self.progress = waiting.Progress(
            dist.distributed_c10d._get_default_store(), q.group.group_name, q.ranks, q.rank
        )
        self.thread = threading.Thread(target=self._run, name="gradcomp-watch", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _period(self) -> float:
        """Seconds between looks at the worker: a fraction of the first warning's delay."""
        return min(max(waiting.first_warning(self.q.timeout_seconds) / 8, 0.01), 5.0)

    def _run(self) -> None:
        watched, posted, warned = None, False, 0
        while not self.stopped.wait(self._period()):
            running = self.q._running
            if running is None:
                continue
            if running is not watched:
                watched, posted, warned = running, False, 0
            job, since = running
            waited = time.monotonic() - since
            try:
                if not posted and waited >= waiting.posting_time(self.q.timeout_seconds):
                    self.progress.post(job.number)
                    posted = True
                if waiting.warning_due(waited, warned, self.q.timeout_seconds):
                    warned += 1
                    self._warn(job, waited)
            except (RuntimeError, ValueError) as error:  # the store unreachable: said, the watch goes on
                logger.warning(
                    "gradcomp: %s has waited %s (%s)", self.q.describe(job), waiting.seconds(waited), error
                )

    def _warn(self, job: _Started, waited: float) -> None:
        behind = self.progress.behind(job.number)
        self.q.behind = (job.number, behind)
        logger.warning(
            "gradcomp: rank %d has waited %s in %s: %s; it raises at the group's timeout (%s)",
            self.q.ranks[self.q.rank],
            waiting.seconds(waited),
            self.q.describe(job),
            waiting.describe_behind(behind) if behind else "every rank says it is in it (one may be slow)",
            waiting.seconds(self.q.timeout_seconds),
        )


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


def queue_for(group: dist.ProcessGroup | None, what: str | None = None) -> CollectiveQueue:
    """The collective queue of ``group`` (WORLD when None), created on first use.

    Creating it is a collective: every rank of the group must reach the first
    gradcomp collective on it, as with any collective. ``what``: the call that asks
    (:func:`~gradcomp.collectives.waiting.describe_call`), named by the warnings and the
    error of a creation that waits for ranks that do not come.
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
            existing = _QUEUES[group] = CollectiveQueue(group, what)
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
