"""Error feedback: the residual memory of what compression dropped.

A residual is kept per key (a bucket index, a parameter name) and added to
the next tensor compressed under that key. The compressors' fused ops read
and update it in place: ``y = x + residual; c = C(y); residual <- y - D(c)``.

An :class:`UndoLog` keeps what the residuals held before the calls made under
it changed them, so that a step found bad afterwards (a non-finite average)
can be taken back on every rank.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator

import torch

# The undo log a thread records into (UndoLog.recording): the caller's thread around
# its submissions, a worker's thread while it runs the jobs submitted under one.
_RECORDING = threading.local()

RESIDUAL_DTYPES = ("fp32", "grad")


class ErrorFeedback:
    """Residuals keyed by name.

    Args:
        dtype: ``"fp32"`` (default; exact bookkeeping for fp16/bf16
            gradients) or ``"grad"`` (the gradient's own dtype: half the
            memory for fp16/bf16).

    Example:
        >>> memory = ErrorFeedback()
        >>> r = memory.residual("layer1", grad)   # zeros the first time
        >>> payload = compressor.compress(grad, Context(residual=r))
    """

    __slots__ = ("dtype", "_residuals", "__weakref__")

    def __init__(self, dtype: str = "fp32"):
        if dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"residual dtype must be one of {RESIDUAL_DTYPES}, got {dtype!r}")
        self.dtype = dtype
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def residual(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        """The flat residual for ``key``; created as zeros shaped like ``like`` the first time."""
        dtype = torch.float32 if self.dtype == "fp32" else like.dtype
        self._note(key, copy=True)  # the caller updates it in place
        existing = self._residuals.get(key)
        if existing is None:
            existing = torch.zeros(like.numel(), dtype=dtype, device=like.device)
            self._residuals[key] = existing
        elif existing.device != like.device:  # restored from a checkpoint on another device
            existing = self._residuals[key] = existing.to(like.device)
        elif existing.numel() != like.numel():
            raise ValueError(
                f"residual {key!r} holds {existing.numel()} elements but the tensor has "
                f"{like.numel()}; give each tensor its own key"
            )
        return existing

    def get(self, key: Hashable) -> torch.Tensor | None:
        self._note(key, copy=True)
        return self._residuals.get(key)

    def set(self, key: Hashable, residual: torch.Tensor) -> None:
        self._note(key, copy=False)  # replaced, not written into
        self._residuals[key] = residual.reshape(-1)

    def pop(self, key: Hashable) -> torch.Tensor | None:
        self._note(key, copy=False)
        return self._residuals.pop(key, None)

    def keys(self) -> list[Hashable]:
        return list(self._residuals)

    def clear(self) -> None:
        self._residuals.clear()

    def __len__(self) -> int:
        return len(self._residuals)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._residuals

    def state_dict(self) -> dict:
        """Residuals (cloned, on their devices) and the dtype policy."""
        return {"dtype": self.dtype, "residuals": {k: v.clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["dtype"] != self.dtype:
            raise ValueError(f"saved residual dtype {state['dtype']!r} differs from {self.dtype!r}")
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}

    def _note(self, key: Hashable, copy: bool) -> None:
        """Keep ``key``'s residual as it is now in the undo log this thread records into,
        if that log is this memory's and does not hold it yet (``copy``: a copy, for a
        residual the caller goes on to write into)."""
        log = getattr(_RECORDING, "log", None)
        if log is None or log.feedback is not self or key in log.before:
            return
        existing = self._residuals.get(key)
        log.before[key] = existing.clone() if copy and existing is not None else existing


class UndoLog:
    """What one :class:`ErrorFeedback`'s residuals held before the calls made under
    :meth:`recording` changed them (the first change of each is kept), for
    :meth:`undo` to put back: the residuals as they were before the step.

    A job submitted while it records (``gradcomp.all_reduce`` on this memory) records
    into it on the worker too, while the job runs: other jobs on the same memory keep
    their changes. Undo once those jobs are done.

    Example:
        >>> log = UndoLog(memory)
        >>> with log.recording():
        ...     work = gradcomp.all_reduce(x, "int8", feedback=memory, name="w", async_op=True)
        >>> work.wait()
        >>> if not torch.isfinite(x).all():
        ...     log.undo()
    """

    __slots__ = ("feedback", "before")

    def __init__(self, feedback: ErrorFeedback):
        self.feedback = feedback
        self.before: dict[Hashable, torch.Tensor | None] = {}  # None: there was none

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the changes this thread makes to the memory while inside."""
        outer = getattr(_RECORDING, "log", None)
        _RECORDING.log = self
        try:
            yield
        finally:
            _RECORDING.log = outer

    def undo(self) -> None:
        """Put back every residual recorded, remove those made since; the log is then empty."""
        for key, residual in self.before.items():
            if residual is None:
                self.feedback._residuals.pop(key, None)
            else:
                self.feedback._residuals[key] = residual
        self.before.clear()


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (a step's averages, before an
    :class:`UndoLog` is kept or undone): one host read per device."""
    checks = [torch.isfinite(t).all() for t in tensors]
    devices = {c.device for c in checks}
    return all(bool(torch.stack([c for c in checks if c.device == d]).all()) for d in devices)


def recording_log(feedback: ErrorFeedback | None) -> UndoLog | None:
    """The undo log of ``feedback`` this thread records into, or None."""
    log = getattr(_RECORDING, "log", None)
    return log if log is not None and feedback is not None and log.feedback is feedback else None
