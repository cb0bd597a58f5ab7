"""Seeing gradcomp in the PyTorch profiler.

gradcomp's work runs on its collective worker thread, in profiler ranges
``gradcomp.bucket <i>`` (a DDP bucket) or ``gradcomp.all_reduce``, around
``gradcomp.compress``, ``gradcomp.exchange`` and ``gradcomp.decode``. A
default ``torch.profiler.profile()`` records the threads that started it and
those autograd runs work on, not other threads: take the profile with
:func:`all_threads`, and the ranges appear in its tables and traces
(TensorBoard, Perfetto, chrome://tracing).

Example:
    >>> with torch.profiler.profile(experimental_config=gradcomp.profiling.all_threads()) as prof:
    ...     loss_fn(model(x), y).backward()
    >>> print(prof.key_averages().table(sort_by="cpu_time_total"))
"""

from __future__ import annotations

import torch


def all_threads():
    """The profiler configuration that records every thread (gradcomp's worker included)."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError) as error:
        raise RuntimeError(
            f"torch {torch.__version__} cannot profile every thread (gradcomp works on a thread of its own)"
        ) from error
