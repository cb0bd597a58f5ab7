"""Count what a piece of gradcomp costs the host: aten dispatches, kernel launches,
collectives and host synchronisations, on every thread that runs gradcomp's work.

On a machine without a GPU the GPU code path runs on CPU tensors (Triton's
interpreter), where a host sync costs nothing and leaves no trace of its own:
what would be one on a GPU is counted by name instead -- reading a tensor's
value (``_local_scalar_dense``: ``item``, ``bool``, ``int``), ``tolist``,
``numpy``, ``cpu``, ``nonzero`` and boolean indexing (their output size
needs the data), and tensors made from host data (``torch.tensor(...)``,
``from_numpy``: a pageable host-to-device copy on a GPU).

A kernel launch is a Triton or CUDA kernel of gradcomp, or an aten op that
would launch one on a GPU: not a view, not an allocation.
"""

from __future__ import annotations

import collections
import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALLOCATIONS = ("aten.empty", "aten.new_empty")  # with their _like and _strided forms
# bincount: on CUDA it reads its largest input back to size its output.
SYNC_OPS = (
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.lift_fresh",
    "aten.bincount",
)
SYNC_METHODS = ("tolist", "numpy", "cpu", "item")


class Counts:
    def __init__(self):
        self.active = False
        self.dispatches = collections.Counter()
        self.launches = collections.Counter()
        self.collectives = collections.Counter()
        self.syncs = collections.Counter()
        self._inside_kernel = threading.local()

    def reset(self) -> None:
        for counter in (self.dispatches, self.launches, self.collectives, self.syncs):
            counter.clear()

    @property
    def total_dispatches(self) -> int:
        return sum(self.dispatches.values())

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())

    def counting(self) -> bool:
        return self.active and not getattr(self._inside_kernel, "depth", 0)

    def summary(self) -> str:
        return (
            f"{self.total_dispatches} dispatches {dict(self.dispatches)}\n"
            f"{self.total_launches} launches {dict(self.launches)}\n"
            f"collectives {dict(self.collectives)}, host syncs {dict(self.syncs)}"
        )


class _Mode(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        counts = self.counts
        if counts.counting():
            name = str(func.overloadpacket)
            if name.startswith("c10d."):
                counts.collectives[name] += 1
            else:
                counts.dispatches[name] += 1
                boolean_index = name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
                    isinstance(index, torch.Tensor) and index.dtype == torch.bool
                    for index in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ())
                )
                if name.startswith(SYNC_OPS) or boolean_index:
                    counts.syncs[name] += 1
                if not func.is_view and not name.startswith(ALLOCATIONS) and name not in SYNC_OPS:
                    counts.launches[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted() -> Counts:
    """Within: ``counts.active = True`` counts what the calling thread and every
    gradcomp collective worker started within do (start workers inside: call
    ``gradcomp.collectives.release_queues()`` first)."""
    from gradcomp import collectives
    from gradcomp.ops import cuda_backend

    counts = Counts()
    patches = []

    def patch(owner, name, replacement):
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def kernel_runner(original, label):
        def run(self, *args, **kwargs):
            if counts.counting():
                counts.launches[f"{label} {getattr(self, '__name__', None) or self.fn.__name__}"] += 1
            counts._inside_kernel.depth = getattr(counts._inside_kernel, "depth", 0) + 1
            try:
                return original(self, *args, **kwargs)
            finally:
                counts._inside_kernel.depth -= 1

        return run

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    patch(JITFunction, "run", kernel_runner(JITFunction.run, "triton"))
    patch(InterpretedFunction, "run", kernel_runner(InterpretedFunction.run, "triton"))
    launch = cuda_backend._launch

    def cuda_launch(device, family, name, *args):
        if counts.counting():
            counts.launches[f"cuda {name}"] += 1
        return launch(device, family, name, *args)

    patch(cuda_backend, "_launch", cuda_launch)
    for method in SYNC_METHODS:
        original = getattr(torch.Tensor, method)

        def synced(tensor, *args, _original=original, _method=method, **kwargs):
            if counts.counting():
                counts.syncs[f"Tensor.{_method}"] += 1
            return _original(tensor, *args, **kwargs)

        patch(torch.Tensor, method, synced)
    from_numpy = torch.from_numpy

    def counted_from_numpy(array):
        if counts.counting():
            counts.syncs["torch.from_numpy"] += 1
        return from_numpy(array)

    patch(torch, "from_numpy", counted_from_numpy)
    run = collectives.CollectiveQueue._run

    def counted_run(queue):
        with _Mode(counts):
            run(queue)

    patch(collectives.CollectiveQueue, "_run", counted_run)
    try:
        with _Mode(counts):
            yield counts
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)
