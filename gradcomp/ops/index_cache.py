"""The last few random-K index sets a backend computed, kept for reuse.

A random-K payload is encoded and then decoded with the same seed (the
all-reduce decodes the sum right away), and computing the indices costs more
than a pass over the tensor. Kept per backend, so that no backend hands out
what another computed, and per stream, so that no stream reads indices
another stream may still be computing (threads share this cache).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from gradcomp import streams

RECENT = 2
_recent: dict[tuple, torch.Tensor] = {}
_lock = threading.Lock()


def remembered(
    backend: str, numel: int, k: int, seed: int, device: torch.device, compute: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """A copy of ``backend``'s random-K indices for these arguments: ``compute()``
    unless they are among the last few asked for."""
    if streams.uses_streams(device) and device.index is None:
        device = torch.device(device.type, streams.cuda.current_device())  # "cuda" is "cuda:N": one key
    key = (backend, numel, k, seed, device, streams.current_stream_id(device))
    with _lock:
        cached = _recent.get(key)
    if cached is not None:
        return cached.clone()
    chosen = compute()
    with _lock:
        _recent[key] = chosen
        while len(_recent) > RECENT:
            _recent.pop(next(iter(_recent)))
    return chosen.clone()


def clear() -> None:
    with _lock:
        _recent.clear()
