"""A recording fake of ``torch.cuda``'s streams and events, for CPU tensors.

``install_fake()`` routes :mod:`gradcomp.streams` through :class:`FakeCuda`: every
stream and event call, ``record_stream``, future completion and wait, and (with a
:class:`Recorder` or on the collective worker) every aten and c10d op is logged with
the stream it would be enqueued on. The fakes do what torch does (each says where
torch's source says so), so that a discipline checked against them holds on a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from gradcomp import collectives, streams

WORKER = "gradcomp-collectives"


class FakeStream:
    _ids = itertools.count(1)

    def __init__(self, fake: FakeCuda, name: str):
        self.fake, self.name, self.stream_id = fake, name, next(self._ids)

    def wait_event(self, event: FakeEvent) -> None:
        self.fake.log.append(("wait event", self, event))

    def __repr__(self) -> str:
        return self.name


class Hold:
    """The device held back (a long kernel ahead of everything): work queued meanwhile
    has not run until :meth:`release`."""

    def __init__(self, fake: FakeCuda):
        self.fake, self.released = fake, False

    def release(self) -> None:
        self.released = True
        self.fake.held = None


class FakeEvent:
    _ids = itertools.count(1)

    def __init__(self, fake: FakeCuda, timing: bool = False):
        self.fake, self.stream, self.id, self.timing, self.at = fake, None, next(self._ids), timing, None
        self.hold: Hold | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream or self.fake.current_stream()
        self.at = time.perf_counter()  # the host's clock stands for the device's
        self.hold = self.fake.held  # the work before it has not run while the device is held
        self.fake.log.append(("record", self.stream, self))

    def query(self) -> bool:
        """c10's ``CUDAEvent::query`` (c10/cuda/CUDAEvent.h): true for an event never
        recorded, else whether ``cudaEventQuery`` finds the work queued before the record
        done (``cudaSuccess``, not ``cudaErrorNotReady``); it never waits."""
        return self.at is None or self.hold is None or self.hold.released

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.timing and end.timing, "elapsed_time needs events made with enable_timing=True"
        assert self.at is not None and end.at is not None, "both events must be recorded"
        return (end.at - self.at) * 1e3

    def __repr__(self) -> str:
        return f"event{self.id}@{self.stream}"


class FakeCuda:
    """``torch.cuda``'s stream and event API, recording; one default stream, a current stream per thread."""

    def __init__(self):
        self.log: list[tuple] = []
        self.default = FakeStream(self, "default")
        self._local = threading.local()
        self.held: Hold | None = None

    def hold(self) -> Hold:
        """Hold the device back: the events recorded until the returned hold is released
        stay incomplete (the test's stand-in for kernels still running)."""
        self.held = Hold(self)
        return self.held

    def current_stream(self, device=None) -> FakeStream:
        return getattr(self._local, "stream", self.default)

    def Stream(self, device=None, priority: int = 0) -> FakeStream:  # noqa: N802 - torch.cuda's name
        return FakeStream(self, f"stream{len(self.log)}")

    def Event(self, enable_timing: bool = False, **options) -> FakeEvent:  # noqa: N802 - torch.cuda's name
        return FakeEvent(self, enable_timing)

    def synchronize(self, device=None) -> None:
        """The host waits for every stream of the device (c10's ``device_synchronize``)."""
        self.log.append(("synchronize", threading.current_thread().name))

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        previous = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous


class Recorder(TorchDispatchMode):
    """Logs every op with the thread and the fake stream it runs on."""

    def __init__(self, fake: FakeCuda):
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.fake.log.append(("op", self.fake.current_stream(), threading.current_thread().name, str(func)))
        return func(*args, **(kwargs or {}))


def install_fake() -> FakeCuda:
    """Route gradcomp.streams through a FakeCuda for CPU tensors; record the worker's ops too."""
    fake = FakeCuda()
    streams.cuda = fake
    streams.uses_streams = lambda device: True

    class RecordingFuture(torch.futures.Future):
        """``torch.futures.Future(devices=...)`` as c10's ``ivalue::Future`` behaves
        (aten/src/ATen/core/ivalue_inl.h), CPU tensors standing for the device's:

        * ``set_result`` (``markCompleted``) looks for the tensors in the value as torch
          does for a Python value, by pickling it (``extractStorages`` ->
          ``PyObjectHolder::extractTensors`` -> ``torch._jit_internal._extract_tensors``),
          and records an event on the current stream of each of their devices
          (``getDevicesOfStorages``): none at all where the value holds no tensor, or
          where the future was made without devices; a tensor on a device the future
          was not made with is an error (``ensureIsSubsetOfDevices``);
        * ``wait()`` and every ``then()`` callback first make the current stream wait
          on those events (``synchronizeWithCurrentStreams``);
        * ``then()`` runs its callback with a stream from the pool current
          (``wrapCallback``: ``getStreamFromPool`` per device) and completes the child,
          made with the parent's devices, with what the callback returns (or its error).
        """

        def __init__(self, devices=None):
            super().__init__()
            self.devices, self.events = tuple(devices or ()), []
            fake.log.append(("future", self.devices))

        def set_result(self, result, kind: str = "complete") -> None:
            if self.devices:
                tensors = torch._jit_internal._extract_tensors(result)
                used = {tensor.device for tensor in tensors}
                assert used <= {torch.device(d) for d in self.devices}, (used, self.devices)
                for _ in used:
                    event = FakeEvent(fake)
                    event.record(fake.current_stream())
                    self.events.append(event)
            fake.log.append((kind, fake.current_stream(), threading.current_thread().name, self))
            super().set_result(result)

        def synchronize(self) -> None:
            for event in self.events:
                fake.current_stream().wait_event(event)

        def wait(self):
            try:
                return super().wait()
            finally:
                self.synchronize()
                fake.log.append(("waited", fake.current_stream(), threading.current_thread().name, self))

        def then(self, callback):
            child = RecordingFuture(self.devices)
            child.parent = self  # for the checks: the job whose work the child's waiters need

            def run(parent):
                with fake.stream(fake.Stream()):
                    self.synchronize()
                    try:
                        value = callback(self)
                    except BaseException as error:  # noqa: BLE001 - the child's error, as in torch
                        child.set_exception(error)
                    else:
                        child.set_result(value, kind="complete then")

            self.add_done_callback(run)
            return child

    streams.Future = RecordingFuture
    original_record_stream = torch.Tensor.record_stream
    # c10/cuda/CUDACachingAllocator.cpp, recordStream: the block's stream_uses gains the
    # stream; when the block is freed, insert_events records an event on each of them and
    # the block returns to its pool only once they complete. Logged with the storage kept.
    torch.Tensor.record_stream = lambda tensor, stream: fake.log.append(
        ("record_stream", stream, tensor.untyped_storage().data_ptr())
    )
    original_wait = dist.Work.wait

    def logged_wait(work, *args, **kwargs):
        fake.log.append(("work wait", fake.current_stream(), threading.current_thread().name))
        return original_wait(work, *args, **kwargs)

    dist.Work.wait = logged_wait
    original_run = collectives.CollectiveQueue._run

    def recorded_run(queue):
        with Recorder(fake):
            original_run(queue)

    collectives.CollectiveQueue._run = recorded_run
    original_submit, original_start = collectives.CollectiveQueue.submit, collectives.CollectiveQueue._start

    def logged_submit(queue, fn, device, writes=None, name="gradcomp.job", collectives=True, state=()):
        fake.log.append(("submit", threading.current_thread().name, name, collectives))
        return original_submit(queue, fn, device, writes, name, collectives, state)

    def logged_start(queue, job):
        fake.log.append(("start", WORKER, job.name))
        try:
            original_start(queue, job)
        finally:  # the job has issued every collective it will issue
            fake.log.append(("started", WORKER, job.name))

    collectives.CollectiveQueue.submit, collectives.CollectiveQueue._start = logged_submit, logged_start
    fake.restore = lambda: setattr(torch.Tensor, "record_stream", original_record_stream)
    return fake
