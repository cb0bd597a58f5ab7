"""Agreement: ranks with different settings raise instead of hanging.

The first time a (compressor settings, numel, dtype, algorithm, op)
combination meets a group, the ranks compare fingerprints; a rank with
different settings makes every rank raise ``ValueError`` instead of hanging
or decoding garbage.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from gradcomp.collectives.worker import CollectiveQueue, all_gather_async
from gradcomp.compressors import Compressor


def settings_key(compressor: Compressor) -> str:
    """The compressor's settings as one stable string (equal settings, equal key); a
    :class:`Compressor` keeps it until an attribute is set (``"auto"``'s chooser makes it
    afresh)."""
    cached = getattr(compressor, "settings_key", None)
    return cached() if cached is not None else repr(sorted(compressor.settings().items()))


def fingerprint_of(compressor: Compressor, tensor: torch.Tensor, algorithm: str, op: str) -> tuple:
    return (settings_key(compressor), tensor.numel(), str(tensor.dtype), algorithm, op)


def verify_agreement(q: CollectiveQueue, fingerprint: tuple, device: torch.device) -> None:
    """Raise ValueError on every rank if ranks disagree on ``fingerprint``.

    The check travels on ``device`` (NCCL groups take CUDA tensors only).
    """
    if q.world_size == 1 or fingerprint in q.verified:
        return
    if not _same_everywhere(q, repr(fingerprint), device):
        described = [None] * q.world_size
        dist.all_gather_object(described, fingerprint, group=q.group)
        lines = "\n".join(
            f"  rank {r}: compressor {d[0]}, numel {d[1]}, dtype {d[2]}, algorithm {d[3]}, op {d[4]}"
            for r, d in enumerate(described)
        )
        raise ValueError(f"ranks disagree on the compressed all-reduce settings:\n{lines}")
    q.verified.add(fingerprint)


def verify_settings(q: CollectiveQueue, what: str, settings: dict, device: torch.device) -> None:
    """Raise ValueError on every rank if ranks' ``settings`` (name -> value) differ,
    naming each rank's differing ones; once per ``what`` and settings on a group.

    The check travels on ``device`` (NCCL groups take CUDA tensors only).
    """
    fingerprint = (what, repr(sorted(settings.items())))
    if q.world_size == 1 or fingerprint in q.verified:
        return
    if not _same_everywhere(q, fingerprint[1], device):
        described = [None] * q.world_size
        dist.all_gather_object(described, settings, group=q.group)
        differ = [k for k in settings if any(d.get(k) != settings[k] for d in described)]
        differ += sorted({k for d in described for k in d if k not in settings}, key=str)
        lines = "\n".join(
            f"  rank {r}: " + ", ".join(f"{k}={d.get(k)!r}" for k in differ) for r, d in enumerate(described)
        )
        raise ValueError(f"ranks disagree on {what}:\n{lines}")
    q.verified.add(fingerprint)


def _same_everywhere(q: CollectiveQueue, text: str, device: torch.device) -> bool:
    """Whether every rank of ``q``'s group passed the same ``text`` (one all-gather of a digest)."""
    digest = zlib.crc32(text.encode())
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = torch.empty(q.world_size, dtype=torch.int64, device=device)
    all_gather_async(everyone, mine, q.group).wait()
    return not bool((everyone != digest).any())
