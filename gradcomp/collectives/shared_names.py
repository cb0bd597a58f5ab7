"""A name given to two tensors in flight at once, or used on two groups at once: warned of.

``all_reduce`` keeps residuals (and PowerSGD's warm start) under the tensor's
name, by default its shape and dtype, so every tensor of one shape shares them.
A group's worker runs such jobs one after the other (its rule, in
:mod:`~gradcomp.collectives.worker`), so the bits are those of calls made one
at a time; but each tensor then takes what compression dropped from the
other, which is rarely what the caller meant. A name submitted for another
tensor while a job under it is still queued or in flight is warned of, once
per residual memory and name. The same tensor reduced twice is not (the second
call reduces the first one's result), nor a name whose earlier job has finished
(a gradient reduced step after step under its name).

One residual memory used on two groups at once is worse: each group has its own
worker, nothing orders their jobs, and one reads what the other is writing. The
default memory is one per group and settings; an ``ErrorFeedback`` passed to calls
on two groups whose jobs overlap is warned of too.

The warning is the caller's, after its job is submitted: whether an earlier job
has finished depends on timing, which differs between ranks, and a warning
turned into an error must not stop one rank short of a collective the others
issue.
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from collections.abc import Hashable

import torch

from gradcomp.feedback import ErrorFeedback

# State token (Job.state) -> (address of the last tensor submitted under it, its queue, its
# future, a serial number). A queue's jobs complete in submission order: where the last
# is done, every earlier one of that queue is.
_LAST: dict[tuple, tuple[int, object, torch.futures.Future, int]] = {}
_LOCK = threading.Lock()
_SERIALS = itertools.count()
# Residual memory -> the names already warned of.
_WARNED: weakref.WeakKeyDictionary[ErrorFeedback, set] = weakref.WeakKeyDictionary()


def sharing(state: tuple, tensor: torch.Tensor, queue) -> str | None:
    """Before a job on ``tensor`` with state ``state`` (:meth:`Job.state`) is submitted to
    ``queue``: ``"group"`` where a job under that state on another queue has not
    finished, ``"tensor"`` where one on another tensor has not, else None."""
    if not state:
        return None
    last = _LAST.get(state[0])
    if last is None or last[2].done():
        return None
    if last[1] is not queue:
        return "group"
    return "tensor" if last[0] != tensor.data_ptr() else None


def submitted(state: tuple, tensor: torch.Tensor, queue, future: torch.futures.Future) -> None:
    """A job on ``tensor`` with state ``state`` went to ``queue``: its ``future`` is the
    last under that state until another is; forgotten once it completes."""
    if not state:
        return
    token, serial = state[0], next(_SERIALS)
    with _LOCK:
        _LAST[token] = (tensor.data_ptr(), queue, future, serial)
    future.add_done_callback(lambda _: _forget(token, serial))


def warn(what: str, feedback: ErrorFeedback, name: Hashable) -> None:
    """Warn of ``what`` :func:`sharing` found, once per residual memory and name."""
    with _LOCK:
        warned = _WARNED.setdefault(feedback, set())
        if (what, name) in warned:
            return
        warned.add((what, name))
    if what == "group":
        message = (
            f"gradcomp.all_reduce: name {name!r} is reduced on two process groups at once with one "
            "ErrorFeedback: nothing orders the two groups' calls, and each reads the residual (and "
            "PowerSGD's warm start) the other is writing. Give each group an ErrorFeedback of its own"
        )
    else:
        message = (
            f"gradcomp.all_reduce: name {name!r} was given to another tensor while the reduction "
            "of the one before it under that name is still queued or in flight: the two share one "
            "residual (and PowerSGD's warm start), and the later waits for the earlier. Give each "
            "tensor a name of its own (name=...); the default name is the tensor's shape and dtype"
        )
    warnings.warn(message, stacklevel=3)


def _forget(token: tuple, serial: int) -> None:
    with _LOCK:
        last = _LAST.get(token)
        if last is not None and last[3] == serial:
            del _LAST[token]
