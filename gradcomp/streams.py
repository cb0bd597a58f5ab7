"""Where a group's collective work runs on a GPU: on the worker's own stream.

The collective worker (:mod:`gradcomp.collectives`) runs every job of a
group on one thread. On CUDA tensors:

* at submit, the caller's current stream records an event: the point after
  the work that produced the tensor (DDP's backward kernels for a bucket);
* the worker's stream waits on that event, and every kernel, collective and
  wait of the job is issued while the worker's stream is current (NCCL
  orders its collectives after the current stream and makes it wait on
  them), so the caller's stream never waits on a collective;
* the job's future is created with its device and completed with the
  worker's stream current, its value holding the tensor the job wrote (a
  DDP bucket, the ``tensor`` of :class:`ReduceStats`):
  ``torch.futures.Future`` records an event there for the devices of the
  tensors it finds in the value, and none for a value without tensors
  (c10's ``Future::markCompleted``); whoever waits on the future (DDP's
  reducer, :meth:`Work.wait`, a ``then`` callback) makes its own current
  stream wait on that event only;
* the caller's tensor is marked as used by the worker's stream
  (``record_stream``), so that the caching allocator cannot hand its memory
  to another stream before the worker's kernels are done with it;
* just before completing a job's future, the worker's stream records one more
  event, kept with the future (:func:`complete`): a future is done once the
  worker has issued the job's work, its GPU work is done once that event is
  (:func:`finished` queries it, never waits).

CPU tensors need none of this: every call here is then a no-op.

Everything CUDA goes through the module attributes ``cuda``, ``Future`` and
:func:`uses_streams`, which a test can replace with a recording fake to
check this discipline on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import threading

import torch

cuda = torch.cuda
Future = torch.futures.Future


def uses_streams(device: torch.device) -> bool:
    """Whether work on ``device`` is ordered by streams (CUDA) rather than by the host."""
    return device.type == "cuda"


def new_future(device: torch.device) -> torch.futures.Future:
    """A future whose waiters synchronise with the stream that completes it."""
    return Future(devices=[device]) if uses_streams(device) else Future()


def submitted(device: torch.device):
    """An event on the caller's current stream of ``device`` (None without streams)."""
    if not uses_streams(device):
        return None
    event = cuda.Event()
    event.record(cuda.current_stream(device))
    return event


def timing_event(device: torch.device):
    """An event that can time, recorded now on the current stream of ``device``
    (None without streams)."""
    if not uses_streams(device):
        return None
    event = cuda.Event(enable_timing=True)
    event.record(cuda.current_stream(device))
    return event


def elapsed_seconds(start, end) -> float | None:
    """Seconds from event ``start`` to event ``end``, once both are done (None
    before: it never waits)."""
    if not (start.query() and end.query()):
        return None
    return start.elapsed_time(end) / 1e3


def complete(future: torch.futures.Future, value, device: torch.device) -> None:
    """Complete ``future`` with ``value`` on the current stream of ``device`` (the
    worker's, for a job), an event recorded there first and kept with the future:
    the point after the job's last GPU work, which :func:`finished` queries."""
    event = cuda.Event()
    event.record(cuda.current_stream(device))
    future.gradcomp_work_done = event
    future.set_result(value)


def finished(future: torch.futures.Future) -> bool:
    """Whether ``future`` is done and, where :func:`complete` completed it, the GPU work
    queued before it too: never waits (``Event.query``). ``future.done()`` alone turns
    true once the worker has issued the work, before the GPU has run it."""
    if not future.done():
        return False
    event = getattr(future, "gradcomp_work_done", None)
    return event is None or event.query()


_NOTHING = contextlib.nullcontext()


class WorkerStreams:
    """The streams of one worker thread, one per device, created on first use."""

    def __init__(self):
        self._streams: dict[torch.device, object] = {}
        self._lock = threading.Lock()

    def stream(self, device: torch.device):
        with self._lock:
            existing = self._streams.get(device)
            if existing is None:
                existing = self._streams[device] = cuda.Stream(device=device)
            return existing

    def running(self, device: torch.device, after=None, tensor: torch.Tensor | None = None):
        """Within: the worker's stream of ``device`` is current; it first waits on
        the event ``after`` (from :func:`submitted`), and ``tensor`` (the caller's)
        is marked as used by it."""
        if not uses_streams(device):
            return _NOTHING  # entered a few times a job: no generator to build
        return self._running(device, after, tensor)

    @contextlib.contextmanager
    def _running(self, device: torch.device, after, tensor: torch.Tensor | None):
        stream = self.stream(device)
        if after is not None:
            stream.wait_event(after)
        if tensor is not None:
            tensor.record_stream(stream)
        with cuda.stream(stream):
            yield


def keep_for_current_stream(tensor: torch.Tensor) -> None:
    """Mark ``tensor``, allocated on another stream, as used by the current stream.

    The caching allocator hands a freed block to new allocations on the stream that
    allocated it at once, without waiting for other streams' work on it; after
    ``record_stream`` it first waits for the work queued on the recording stream up
    to the free (c10's ``CUDACachingAllocator``: ``recordStream``, ``insert_events``).
    FSDP2 allocates a unit's reduce-scatter output on its reduce-scatter stream and
    calls the all-reduce hook on another, and keeps the output alive only for its
    native HSDP (``AllReduceState``): a hook that reads it must record it itself.
    No-op without streams."""
    if uses_streams(tensor.device):
        tensor.record_stream(cuda.current_stream(tensor.device))


def current_stream_id(device: torch.device) -> int | None:
    """An id of the current stream of ``device`` (None without streams): work
    cached on one stream must not be read on another before it is done."""
    return cuda.current_stream(device).stream_id if uses_streams(device) else None
