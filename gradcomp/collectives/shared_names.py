"""Two tensors under one name while the first is in flight: warned of, once.

``all_reduce`` keeps residuals (and PowerSGD's warm start) under the tensor's
name, by default its shape and dtype, so every tensor of one shape shares them.
The worker runs such jobs one after the other (its rule, in
:mod:`~gradcomp.collectives.worker`), so the bits are those of calls made one
at a time; but each tensor then takes what compression dropped from the
other, which is rarely what the caller meant. A name submitted for another
tensor while a job under it is still queued or in flight is warned of, once
per residual memory and name. The same tensor reduced twice is not (the second
call reduces the first one's result), nor a name whose earlier job has finished
(a gradient reduced step after step under its name).
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from collections.abc import Hashable

import torch

from gradcomp.feedback import ErrorFeedback

# State token (Job.state) -> (address of the last tensor submitted under it, its future, a
# serial number). Jobs complete in submission order: where the last is done, every earlier is.
_LAST: dict[tuple, tuple[int, torch.futures.Future, int]] = {}
_SERIALS = itertools.count()
_LOCK = threading.Lock()
# Residual memory -> the names already warned of.
_WARNED: weakref.WeakKeyDictionary[ErrorFeedback, set] = weakref.WeakKeyDictionary()


def warn_if_shared(state: tuple, tensor: torch.Tensor, feedback: ErrorFeedback, name: Hashable) -> None:
    """Before a job on ``tensor`` with state ``state`` (:meth:`Job.state`) is submitted:
    warn where another tensor's job under that state has not finished."""
    if not state:
        return
    last = _LAST.get(state[0])
    if last is None or last[0] == tensor.data_ptr() or last[1].done():
        return
    with _LOCK:
        warned = _WARNED.setdefault(feedback, set())
        if name in warned:
            return
        warned.add(name)
    warnings.warn(
        f"gradcomp.all_reduce: name {name!r} was given to another tensor while the reduction "
        "of the one before it under that name is still queued or in flight: the two share one "
        "residual (and PowerSGD's warm start), and the later waits for the earlier. Give each "
        "tensor a name of its own (name=...); the default name is the tensor's shape and dtype",
        stacklevel=3,
    )


def submitted(state: tuple, tensor: torch.Tensor, future: torch.futures.Future) -> None:
    """A job on ``tensor`` with state ``state`` was submitted: its ``future`` is the last
    under that state until another is; forgotten once it completes."""
    if not state:
        return
    token, serial = state[0], next(_SERIALS)
    with _LOCK:
        _LAST[token] = (tensor.data_ptr(), future, serial)
    future.add_done_callback(lambda _: _forget(token, serial))


def _forget(token: tuple, serial: int) -> None:
    with _LOCK:
        last = _LAST.get(token)
        if last is not None and last[2] == serial:
            del _LAST[token]
