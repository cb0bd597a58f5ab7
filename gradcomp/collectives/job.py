"""One compressed all-reduce, fully described: what every algorithm module takes.

A leaf of the package: the algorithms (:mod:`~gradcomp.collectives.dense`,
:mod:`~gradcomp.collectives.allgather`, :mod:`~gradcomp.collectives.two_phase`,
...) import it, and the dispatcher (:mod:`~gradcomp.collectives.dispatch`)
runs it; it imports none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import torch

from gradcomp.collectives.nodes import Hierarchy
from gradcomp.compressors import Compressor
from gradcomp.feedback import ErrorFeedback


@dataclasses.dataclass
class Agreement:
    """What a job's payload headers carry and how they are judged
    (:mod:`gradcomp.collectives.agreement`).

    Attributes:
        fingerprint: 64 bits (signed) of everything that decides the job's bits, the
            same on every rank that has the same settings; every rank sends it with
            its payload and compares every rank's before decoding.
        parent: the fingerprint of the job this one is a stage of (a hierarchical
            job's shard between nodes), 0 for none: part of this one's.
        probe: a run whose payload is zeros, in the collectives the ranks agreed on
            before, to tell them that this rank's plan changed (it never decodes).
        origin: the job whose settings an error names (a probe's or a stage's), None:
            the job itself.
        plan: what decides the job's collectives: its tensor's size, dtype and device
            type, its compressor's settings, its algorithm
            (:func:`gradcomp.collectives.agreement.plan_key`); jobs of one plan exchange
            the same sizes.
    """

    fingerprint: int = 0
    parent: int = 0
    probe: bool = False
    origin: Job | None = None
    plan: tuple = ()


@dataclasses.dataclass
class Job:
    """One compressed all-reduce, fully described (run by
    :func:`gradcomp.collectives.dispatch.job_steps`).

    Attributes:
        feedback: where the residuals live (None: no error feedback).
        key: residual and random-stream key (the same on every rank).
        step: step number of the random streams.
        hierarchy: the nodes of a ``hierarchical`` job; ``inter_algorithm``
            the algorithm between nodes (None: the compressor's default).
        shapes: the shapes of the tensors laid end to end in ``tensor``
            (a DDP bucket's parameters), for a low-rank compressor; None:
            the tensor's own shape.
        gathered: a list: an ``allgather`` leaves its gathered payloads there,
            ``(rows, meta)`` a segment, for the caller to decode (the
            hierarchical algorithm's node stage), instead of decoding them.
        agreement: what its headers carry (set by the dispatcher); None: no headers
            (one rank, or a stage run on its own to time it).
    """

    tensor: torch.Tensor
    compressor: Compressor | None
    op: str
    algorithm: str
    feedback: ErrorFeedback | None
    key: int
    step: int
    measure_error: bool = False
    hierarchy: Hierarchy | None = None
    inter_algorithm: str | None = None
    shapes: tuple[tuple[int, ...], ...] | None = None
    gathered: list | None = None
    agreement: Agreement | None = None

    def state(self) -> tuple:
        """What the job reads and writes, besides its tensor, that outlives it: the
        residuals and the warm start kept in ``feedback`` under ``key`` and the keys
        the algorithms make from it (a segment's, an owner's, a shard's), as one token
        ``(feedback, key)`` (the memory compared by identity); empty where the
        compressor keeps nothing between calls. A job whose compressor is not chosen
        yet (None: a chooser picks it on the worker) declares the key. The worker
        orders jobs by what they declare
        (:meth:`gradcomp.collectives.worker.CollectiveQueue.submit`)."""
        if self.feedback is None or (self.compressor is not None and not self.compressor.keeps_state):
            return ()
        return ((self.feedback, self.key),)

    def residual(self, name: Hashable, like: torch.Tensor) -> torch.Tensor | None:
        """The residual kept under ``name`` (shaped like ``like``), or None without feedback."""
        if self.feedback is None or not self.compressor.needs_feedback:
            return None
        return self.feedback.residual(name, like)
