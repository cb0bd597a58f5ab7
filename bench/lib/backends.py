"""A backend's own functions, called without the op boundary's checks and dispatch, as
the kernel timings and the memcheck driver need them.

:mod:`gradcomp.ops` offers each backend through its checks (``ops.backend(name)``)
and none without: this module is the one place the bench reads its registry.

Example:
    >>> runs_on("cpu", torch.device("cpu")), "topk_select" in functions("cpu")
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradcomp import ops


def functions(backend: str) -> dict[str, Callable]:
    """``op -> function`` of ``backend`` (an optional one loaded on first use); empty where
    it is not installed."""
    ops._load_optional(backend)
    entry = ops._REGISTRY.get(backend)
    return {} if entry is None else entry[1]


def runs_on(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` is installed and runs on ``device``."""
    functions(backend)
    entry = ops._REGISTRY.get(backend)
    return entry is not None and entry[0](device)
