"""Low-rank compression (PowerSGD): a gradient matrix ``M`` (n x m) travels as
two thin factors, ``P`` (n x r) and ``Q`` (m x r), with ``M ~ P Q^T``.

One power iteration finds the factors: ``P = M Q`` with last step's ``Q``
(the warm start), ``P`` orthonormalised, then ``Q = M^T P``. Across ranks the
factors are summable: all-reduce ``P``, orthonormalise it (the same bits on
every rank), and then ``P (sum_i Q_i)^T = sum_i P P^T M_i``; the exchange is
two dense all-reduces (:mod:`gradcomp.collectives.low_rank`).

A tensor of two or more dimensions is a matrix (its first dimension by the
rest, as a convolution's weight); vectors, and matrices whose factors would
not be ``min_compression`` times smaller, go as they are. The matrices of
one shape are processed together: one batched matrix product and one
batched orthonormalisation per shape, whatever the number of matrices.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from gradcomp.compressors.base import Compressor, Context, check_positive_int, mix_seed
from gradcomp.ops import reference
from gradcomp.ops.reference import write_out
from gradcomp.payload import Layout, Payload

Shapes = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class MatrixGroup:
    """The matrices of one shape among the tensors of a flat buffer.

    Attributes:
        rows, cols: each matrix's shape.
        starts: where each matrix begins in the flat buffer (elements).
        p_start, q_start: where the group's factors begin in the P and Q buffers.
    """

    rows: int
    cols: int
    starts: tuple[int, ...]
    p_start: int
    q_start: int

    @property
    def count(self) -> int:
        return len(self.starts)


@dataclasses.dataclass(frozen=True)
class Factorization:
    """How a flat buffer of tensors of ``shapes`` is sent by a low-rank compressor.

    Attributes:
        numel: elements of all the tensors.
        groups: the factorised matrices, grouped by shape.
        dense: ``(start, end)`` slices of the flat buffer sent as they are.
        rank: the factors' number of columns.
        p_numel, q_numel, dense_numel: elements of all P factors, of all Q
            factors and of the dense slices.
    """

    numel: int
    groups: tuple[MatrixGroup, ...]
    dense: tuple[tuple[int, int], ...]
    rank: int
    p_numel: int
    q_numel: int
    dense_numel: int


@functools.lru_cache(maxsize=256)
def factorization(shapes: Shapes, rank: int, min_compression: float) -> Factorization:
    """The :class:`Factorization` of tensors of ``shapes`` laid end to end."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    dense: list[tuple[int, int]] = []
    offset = 0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else 0
        cols = numel // rows if rows else 0
        if rows and (rows + cols) * rank * min_compression <= numel:
            by_shape.setdefault((rows, cols), []).append(offset)
        elif numel:
            if dense and dense[-1][1] == offset:
                dense[-1] = (dense[-1][0], offset + numel)
            else:
                dense.append((offset, offset + numel))
        offset += numel
    groups, p_numel, q_numel = [], 0, 0
    for (rows, cols), starts in by_shape.items():
        groups.append(MatrixGroup(rows, cols, tuple(starts), p_numel, q_numel))
        p_numel += len(starts) * rows * rank
        q_numel += len(starts) * cols * rank
    dense_numel = sum(end - start for start, end in dense)
    return Factorization(offset, tuple(groups), tuple(dense), rank, p_numel, q_numel, dense_numel)


def factor_views(buffer: torch.Tensor, fact: Factorization, which: str) -> list[torch.Tensor]:
    """Per group, the ``(count, rows or cols, rank)`` view of its P (``which="p"``)
    or Q factors in the flat ``buffer``."""
    views = []
    for group in fact.groups:
        start, side = (group.p_start, group.rows) if which == "p" else (group.q_start, group.cols)
        numel = group.count * side * fact.rank
        views.append(buffer[start : start + numel].view(group.count, side, fact.rank))
    return views


def matrix_views(flat: torch.Tensor, group: MatrixGroup) -> list[torch.Tensor]:
    """The group's matrices in ``flat``, as ``(rows, cols)`` views."""
    numel = group.rows * group.cols
    return [flat[start : start + numel].view(group.rows, group.cols) for start in group.starts]


def gather_matrices(flat: torch.Tensor, residual: torch.Tensor | None, fact: Factorization, dtype):
    """Per group, its matrices stacked (``count, rows, cols``) in ``dtype``, the
    residual added: the error-compensated gradients, one copy of them."""
    stacks = []
    for group in fact.groups:
        stack = torch.stack(matrix_views(flat, group)).to(dtype)
        if residual is not None:
            stack += torch.stack(matrix_views(residual, group))
        stacks.append(stack)
    return stacks


def scatter_matrices(stacks: list[torch.Tensor], flat: torch.Tensor, fact: Factorization) -> None:
    """Write each group's stacked matrices back to their places in ``flat`` (rounded to its dtype)."""
    for stack, group in zip(stacks, fact.groups, strict=True):
        torch._foreach_copy_(matrix_views(flat, group), list(stack.unbind(0)))


def residual_differences(stacks, p: torch.Tensor, q: torch.Tensor, fact: Factorization) -> list[torch.Tensor]:
    """``M - P Q^T`` for every matrix, non-finite entries zeroed (as every
    compressor's residual: a NaN step must not poison the next)."""
    p_views, q_views = factor_views(p, fact, "p"), factor_views(q, fact, "q")
    return [
        torch.baddbmm(m, p_view, q_view.transpose(1, 2), alpha=-1).nan_to_num_(0.0, 0.0, 0.0)
        for m, p_view, q_view in zip(stacks, p_views, q_views, strict=True)
    ]


def store_residuals(differences, residual: torch.Tensor, fact: Factorization) -> None:
    """``residual <- differences`` on the matrices, zero on the dense slices (sent exactly)."""
    scatter_matrices(differences, residual, fact)
    if fact.dense:
        torch._foreach_zero_([residual[start:end] for start, end in fact.dense])  # one call for every slice


def project(stacks: list[torch.Tensor], q: torch.Tensor, p: torch.Tensor, fact: Factorization) -> None:
    """``P = M Q`` for every matrix: ``p`` (flat) from the flat ``q``."""
    for stack, q_view, p_view in zip(
        stacks, factor_views(q, fact, "q"), factor_views(p, fact, "p"), strict=True
    ):
        torch.bmm(stack, q_view, out=p_view)


def project_back(stacks: list[torch.Tensor], p: torch.Tensor, q: torch.Tensor, fact: Factorization) -> None:
    """``Q = M^T P`` for every matrix: ``q`` (flat) from the flat ``p``."""
    for stack, p_view, q_view in zip(
        stacks, factor_views(p, fact, "p"), factor_views(q, fact, "q"), strict=True
    ):
        torch.bmm(stack.transpose(1, 2), p_view, out=q_view)


def orthonormalize(p: torch.Tensor, fact: Factorization) -> None:
    """Orthonormalise the columns of every P factor in the flat ``p``, in place:
    one batched QR per shape. A NaN or infinity spreads to its matrix (never
    hidden); a column that is zero or dependent on the others becomes a unit
    vector orthogonal to them, which the projection ``P P^T M`` may use."""
    for view in factor_views(p, fact, "p"):
        view.copy_(torch.linalg.qr(view).Q)


def reconstruct(p: torch.Tensor, q: torch.Tensor, fact: Factorization) -> list[torch.Tensor]:
    """Per group, ``P Q^T`` of every matrix, stacked (``count, rows, cols``)."""
    return [
        torch.bmm(p_view, q_view.transpose(1, 2))
        for p_view, q_view in zip(factor_views(p, fact, "p"), factor_views(q, fact, "q"), strict=True)
    ]


def gather_dense(flat: torch.Tensor, residual: torch.Tensor | None, fact: Factorization, out) -> None:
    """The dense slices of ``flat`` (the residual added) into ``out``, one after another."""
    if fact.dense:
        torch.cat([flat[start:end] for start, end in fact.dense], out=out)
        if residual is not None:
            out += torch.cat([residual[start:end] for start, end in fact.dense])


def scatter_dense(packed: torch.Tensor, flat: torch.Tensor, fact: Factorization) -> None:
    """The inverse of :func:`gather_dense`: ``packed`` back to the dense slices of ``flat``."""
    if fact.dense:
        sizes = [end - start for start, end in fact.dense]
        torch._foreach_copy_([flat[start:end] for start, end in fact.dense], list(packed.split(sizes)))


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype factors are computed and sent in: fp32, or fp64 for fp64 tensors."""
    return torch.promote_types(dtype, torch.float32)


class PowerSGD(Compressor):
    """Low-rank factors of each gradient matrix (PowerSGD), with error feedback.

    Args:
        rank: columns of the factors; a ``n x m`` matrix travels as
            ``(n + m) * rank`` values.
        warm_start: start each step's power iteration from the last step's
            ``Q`` of the same bucket (kept with its residual); without it, or
            without error feedback memory, a seeded random ``Q``.
        min_compression: factorise a matrix only if its factors are at least
            this many times smaller than it; the rest is sent as it is.

    The payloads of a bucket are summed in two dense all-reduces (P, then Q):
    the algorithm is ``"dense"``. Factors and the tensors sent as they are
    travel in fp32 (fp64 for fp64 gradients), also for 16-bit gradients. A tensor compressed on its own
    (:meth:`compress`) is one matrix of its first dimension by the rest.

    Example:
        >>> state = gradcomp.ddp.register(model, "powersgd", rank=4)
    """

    name = "powersgd"
    low_rank = True

    def __init__(
        self,
        rank: int = 4,
        warm_start: bool = True,
        min_compression: float = 2.0,
        *,
        feedback: bool | None = None,
        seed: int = 0,
    ):
        super().__init__(feedback=feedback, seed=seed)
        self.rank = check_positive_int("rank", rank)
        if not isinstance(warm_start, bool):
            raise TypeError(f"warm_start must be True or False, got {warm_start!r}")
        self.warm_start = warm_start
        if isinstance(min_compression, bool) or not isinstance(min_compression, (int, float)):
            raise TypeError(f"min_compression must be a number, got {min_compression!r}")
        if not min_compression >= 1:
            raise ValueError(f"min_compression must be >= 1, got {min_compression!r}")
        self.min_compression = float(min_compression)

    @property
    def keeps_state(self) -> bool:
        return self.needs_feedback or self.warm_start  # the warm start is kept without feedback too

    def factorization(self, shapes) -> Factorization:
        """How tensors of ``shapes`` (laid end to end) are sent."""
        return factorization(tuple(tuple(s) for s in shapes), self.rank, self.min_compression)

    def initial_q(self, fact: Factorization, key: int, step: int, device) -> torch.Tensor:
        """A seeded random ``Q`` (flat), the same on every rank; drawn on
        ``device`` (a copy from the host would wait for the device)."""
        generator = reference.generator(mix_seed(self.seed, step, key), torch.device(device))
        return torch.randn(fact.q_numel, generator=generator, device=device)

    # ------------------------------------------------------------------ one tensor
    def payload_layout(self, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Layout:
        rows = meta.get("rows", 0)
        if not rows:
            return [("values", dtype, numel)]
        wire = work_dtype(dtype)
        return [("p", wire, rows * self.rank), ("q", wire, numel // rows * self.rank)]

    def _encode_shaped(self, flat: torch.Tensor, shape: torch.Size, ctx: Context):
        fact = self.factorization([shape])
        if not fact.groups:  # a vector, or a matrix too small to factorise
            if ctx.residual is None:
                return {"values": flat}, {"rows": 0}
            y = reference.compensate(flat, ctx.residual)
            values = y.to(flat.dtype, copy=True)  # store_residual consumes y
            reference.store_residual(ctx.residual, y, values.float())
            return {"values": values}, {"rows": 0}
        stacks = gather_matrices(flat, ctx.residual, fact, work_dtype(flat.dtype))
        q = self.initial_q(fact, ctx.key, ctx.step, flat.device).to(stacks[0].dtype)
        p = torch.empty(fact.p_numel, dtype=q.dtype, device=flat.device)
        project(stacks, q, p, fact)
        orthonormalize(p, fact)
        project_back(stacks, p, q, fact)
        if ctx.residual is not None:
            store_residuals(residual_differences(stacks, p, q, fact), ctx.residual, fact)
        return {"p": p, "q": q}, {"rows": fact.groups[0].rows}

    def _decode(self, payload: Payload, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        if "values" in payload.tensors:
            values = payload.tensors["values"]
            return write_out(values.clone() if out is None else values, out, accumulate)
        rows = payload.meta["rows"]
        fact = factorization(((rows, payload.numel // rows),), self.rank, 1.0)
        (decoded,) = reconstruct(payload.tensors["p"], payload.tensors["q"], fact)
        return write_out(decoded.view(-1), out, accumulate)
