"""Agreement: ranks whose settings differ raise on every rank, at every call, instead of
hanging, aborting or decoding another rank's payload as their own.

**Fingerprints.** Every payload that goes on the wire carries 64 bits of everything that
decides its bits: the compressor and its options, the algorithm (the one between nodes,
the node layout, the matrices' shapes), ``op``, the tensor's shape and dtype, its key
(the name) and step, and whether residuals are kept (:func:`settle`). Where payloads are
gathered (all-gather, all-to-all), each rank's row ends with :data:`HEADER_BYTES` that
hold it (:func:`write_fingerprint`). Where they are summed on the wire (the dense
all-reduce, low rank's first one), lanes of the payload's dtype hold its bits as 0 or
1, after its values (in an all-reduce of their own where the payload is the tensor
itself, which must sum as torch's all-reduce sums it): each lane sums to 0 or the
number of ranks exactly where the ranks agree (:func:`lane_count` keeps every sum an
integer the dtype holds exactly). Every
rank sees every rank's fingerprint, or the sums of their bits, before it decodes, so
every rank reaches the same verdict; a mismatch raises ``ValueError`` on every rank,
naming each rank's settings, which are gathered in that error path only (every rank is
in it). The algorithms check at their first wait; on a GPU that read waits for the
exchange (one host sync a call).

**Plans.** Collectives of different kinds or sizes must never meet: Gloo aborts the
process where sizes differ. What decides a call's collectives, its *plan* (compressor
settings, algorithm), is agreed per *wire kind* of a group: the tensor's numel, dtype
and device type, which ranks must share as for any collective. The first call of a
kind agrees on its plan with an all-gather of fingerprints (one round trip); later
calls run the agreed plan's collectives. A call whose plan differs from its kind's
first runs the agreed plan's collectives on zeros, its own fingerprint in the headers
(a *probe*): where every rank did the same (the settings changed on all ranks at once)
the ranks agree on the new plan and run the call; where not, every rank raises. A call
costs a round trip more only where its plan changes.

**Bounds.** A group keeps the plans of the last :data:`MAX_PLANS` wire kinds it used
(the least recently used goes first, in call order, which every rank shares); a kind
used again after that agrees once more.

What is left to the user, as with ``torch.distributed.all_reduce``: ranks that pass
tensors of different sizes or dtypes in one call, where each size was agreed before,
run collectives of different sizes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from gradcomp.collectives.job import Agreement, Job
from gradcomp.collectives.nodes import Hierarchy
from gradcomp.collectives.worker import CollectiveQueue, all_gather_async
from gradcomp.compressors import Compressor

# Bytes at the end of a gathered payload's row: its fingerprint (ALIGN-sized, so that
# rows stay aligned for every view into them).
HEADER_BYTES = 8
# Wire kinds (numel, dtype, device type) whose agreed plan a group keeps.
MAX_PLANS = 1024
# Lanes per group of ranks of a summed header: one per bit of the fingerprint.
_BITS = 64
# The most ranks whose 0/1 lanes sum exactly in each dtype (every partial sum an integer
# the dtype holds exactly, in any order): larger worlds put their ranks in groups.
_EXACT_COUNT = {torch.bfloat16: 2**8, torch.float16: 2**11, torch.float32: 2**24, torch.float64: 2**53}
# The one name ``algorithm`` takes for the two-level algorithm (policy.HIERARCHICAL; the
# policy imports the algorithms, which import this module).
_HIERARCHICAL = "hierarchical"


class Replan(Exception):  # noqa: N818 - an outcome, not an error: every rank probed alike
    """Every rank probed with the same fingerprint: the ranks agree on a new plan."""


def settings_key(compressor: Compressor) -> str:
    """The compressor's settings as one stable string (equal settings, equal key); a
    :class:`Compressor` keeps it until an attribute is set (``"auto"``'s chooser makes it
    afresh)."""
    cached = getattr(compressor, "settings_key", None)
    return cached() if cached is not None else repr(sorted(compressor.settings().items()))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What decides the collectives of a job of one wire kind: enough to run them again
    (a probe).

    Attributes:
        key: all of it, the wire kind first (:func:`plan_key`).
        compressor: a copy, taken when the ranks agreed (the caller's may change in place).
    """

    key: tuple
    compressor: Compressor
    algorithm: str
    inter_algorithm: str | None
    shapes: tuple | None
    hierarchy: Hierarchy | None

    @classmethod
    def of(cls, job: Job) -> Plan:
        """``job``'s plan (:attr:`Agreement.plan` its key), its compressor copied."""
        hierarchical, key = job.algorithm == _HIERARCHICAL, job.agreement.plan
        return cls(
            key,
            copy.copy(job.compressor),
            job.algorithm,
            job.inter_algorithm if hierarchical else None,
            key[3] if job.compressor.low_rank else None,
            job.hierarchy if hierarchical else None,
        )

    def probe(self, job: Job) -> Job:
        """A job that runs this plan's collectives for ``job``'s tensor with zeros, no
        residuals, and ``job``'s fingerprint in its headers."""
        terms = job.agreement
        origin = terms.origin or job
        agreement = Agreement(terms.fingerprint, terms.parent, True, origin, self.key)
        return Job(
            torch.zeros_like(job.tensor, memory_format=torch.contiguous_format),
            self.compressor,
            job.op,
            self.algorithm,
            None,
            job.key,
            job.step,
            hierarchy=self.hierarchy,
            inter_algorithm=self.inter_algorithm,
            shapes=self.shapes,
            agreement=agreement,
        )


def plan_key(job: Job) -> tuple:
    """What decides ``job``'s collectives, the same on every rank with the same plan:
    its wire kind (numel, dtype, device type), compressor settings and algorithm, and
    the matrices' shapes (low rank) or the nodes and the algorithm between them."""
    compressor, tensor = job.compressor, job.tensor
    kind = (tensor.numel(), tensor.dtype, tensor.device.type)
    if job.algorithm == _HIERARCHICAL:
        nodes = (job.hierarchy.node_size, len(job.hierarchy.nodes))
        return (kind, compressor.settings_key(), job.algorithm, job.inter_algorithm, nodes)
    if compressor.low_rank:
        return (kind, compressor.settings_key(), job.algorithm, job.shapes or (tuple(tensor.shape),))
    return (kind, compressor.settings_key(), job.algorithm)


def settle(job: Job, q: CollectiveQueue, run: Callable[[Job, CollectiveQueue], object]) -> None:
    """(on the worker, before ``job`` runs on ``q``'s several ranks) Fill in its
    fingerprint and agree on the plan of its wire kind: at the kind's first call, one
    all-gather of fingerprints; where ``job``'s plan differs from the kind's, a probe
    (``run(probe, q)`` runs it to its end), after which every rank runs the new plan.
    Nothing for a probe, which runs the agreed plan.

    Raises:
        ValueError: on every rank, where the ranks' settings differ.
        Replan: where ``job`` is part of a probe (a stage of one) and every rank
            agreed: the probe's outcome, for the job that probes.
    """
    terms = job.agreement
    if terms is None:
        terms = job.agreement = Agreement()
    elif terms.probe and terms.plan:
        return
    key = terms.plan = plan_key(job)
    # A digest, not hash(): strings hash differently in every process.
    described = (key, job.op, job.tensor.shape, job.key, job.step, job.feedback is not None, terms.parent)
    digest = hashlib.blake2b(repr(described).encode(), digest_size=8).digest()
    terms.fingerprint = int.from_bytes(digest, "little", signed=True)
    agreed = q.plans.pop(key[0], None)
    if agreed is not None:
        q.plans[key[0]] = agreed  # the most recently used last
        if agreed.key == key:
            return
        try:
            run(agreed.probe(job), q)
        except Replan:
            pass
        else:
            raise AssertionError("a probe ends in Replan or ValueError")
    elif not _same_everywhere(q, terms.fingerprint, job.tensor.device):
        raise _disagreement(q, job)
    _remember(q.plans, Plan.of(job))
    if terms.probe:
        raise Replan


def write_fingerprint(headers: torch.Tensor, job: Job) -> None:
    """Write ``job``'s fingerprint into ``headers``: :data:`HEADER_BYTES` of a uint8
    buffer (1-D), or of each row (2-D, rows ``ALIGN``-aligned)."""
    headers.view(torch.int64).fill_(job.agreement.fingerprint)


def check_fingerprints(q: CollectiveQueue, job: Job, headers: torch.Tensor, in_flight=()) -> None:
    """Judge ``headers``, every rank's (2-D uint8, a row each): ``ValueError`` on every
    rank unless all hold this rank's fingerprint (:func:`judge`); first, where it
    raises, wait for the job's collectives still ``in_flight`` (works), so that none is
    left on the wire."""
    agreed = holds_fingerprint(headers, job)
    if agreed and not job.agreement.probe:
        return
    for work in in_flight:
        work.wait()
    judge(q, job, agreed)


def holds_fingerprint(headers: torch.Tensor, job: Job) -> bool:
    """Whether every row of ``headers`` (2-D uint8) holds ``job``'s fingerprint: one read
    on the host."""
    return read_on_host(headers.view(torch.int64)) == [[job.agreement.fingerprint]] * headers.shape[0]


def read_on_host(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``: the one host read a job makes on purpose, every rank's
    fingerprints (or their bits' sums) before it decodes; on a GPU it waits for the
    exchange that brought them."""
    return tensor.tolist()


def lane_count(dtype: torch.dtype, world_size: int) -> int:
    """The lanes of a summed header for payloads of ``dtype`` over ``world_size`` ranks:
    a lane per bit of the fingerprint for each group of ranks whose count ``dtype`` holds
    exactly (bf16: 256, fp16: 2048; fp32 and fp64: every world), so that every partial
    sum is exact in any order; 64 lanes up to those sizes."""
    return _BITS * -(-world_size // _EXACT_COUNT[dtype])


def write_lanes(lanes: torch.Tensor, job: Job, q: CollectiveQueue) -> None:
    """Write ``job``'s fingerprint into ``lanes`` (:func:`lane_count` of them) as 0/1 bits,
    in the row of this rank's group (the others' rows 0). No host-to-device copy."""
    rows = lanes.view(-1, _BITS)
    if rows.shape[0] > 1:
        rows.zero_()
    whole = torch.full((), job.agreement.fingerprint, dtype=torch.int64, device=lanes.device)
    rows[q.rank % rows.shape[0]].copy_(whole.bitwise_right_shift(_positions(lanes.device)).bitwise_and_(1))


def check_lanes(q: CollectiveQueue, job: Job, lanes: torch.Tensor) -> None:
    """Judge ``lanes``, the sums of every rank's :func:`write_lanes`: each must be this
    rank's bit times the count of its group where the ranks agree, and some lane sums to
    another count on every rank where any bit differs. One read on the host."""
    mine, groups = job.agreement.fingerprint, lanes.numel() // _BITS
    sums = read_on_host(lanes.view(groups, _BITS))
    counts = [len(range(group, q.world_size, groups)) for group in range(groups)]
    expected = [[((mine >> bit) & 1) * count for bit in range(_BITS)] for count in counts]
    judge(q, job, sums == expected)


def judge(q: CollectiveQueue, job: Job, agreed: bool) -> None:
    """Every rank's verdict alike (every rank judges every rank's fingerprint): nothing
    where ``agreed``, ``Replan`` for a probe that every rank made alike, else
    ``ValueError`` naming each rank's settings."""
    if not agreed:
        raise _disagreement(q, job)
    if job.agreement.probe:
        raise Replan


def _describe(job: Job) -> dict:
    """What decides ``job``'s bits, readable (an error's lines)."""
    compressor, tensor = job.compressor, job.tensor
    described = {
        "compressor": repr(compressor),
        "algorithm": job.algorithm,
        "op": job.op,
        "shape": tuple(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "key": job.key,
        "step": job.step,
        "residuals": job.feedback is not None,
    }
    if job.algorithm == _HIERARCHICAL:
        described["inter_algorithm"] = job.inter_algorithm
        described["node_size"] = job.hierarchy.node_size
    if compressor.low_rank:
        described["shapes"] = job.shapes or (tuple(tensor.shape),)
    return described


def nodes_disagree(intra, job: Job) -> ValueError:
    """The error for a node whose ranks' fingerprints differed, naming each one's settings
    (every rank of the node is in this path)."""
    return _disagreement(intra, job, "inside a node, ")


def _disagreement(q, job: Job, where: str = "") -> ValueError:
    terms = job.agreement
    mine = _describe(terms.origin or job)
    everyone = [None] * q.world_size
    dist.all_gather_object(everyone, mine, group=q.group)
    # The view's own where it has them: torchft's groups have no global ranks to ask torch for.
    ranks = getattr(q, "ranks", None) or dist.get_process_group_ranks(q.group)
    differ = [name for name in mine if any(other.get(name) != mine[name] for other in everyone)]
    named = differ or list(mine)  # the same description: another stage disagreed (a node)
    lines = "\n".join(
        f"  rank {rank}: " + ", ".join(f"{name}={other.get(name)!r}" for name in named)
        for rank, other in zip(ranks, everyone, strict=True)
    )
    return ValueError(f"{where}ranks disagree on the compressed all-reduce's settings:\n{lines}")


def verify_settings(q: CollectiveQueue, what: str, settings: dict, device: torch.device) -> None:
    """Raise ValueError on every rank if ranks' ``settings`` (name -> value) differ,
    naming each rank's differing ones; once per ``what`` and settings on a group.

    The check travels on ``device`` (NCCL groups take CUDA tensors only).
    """
    fingerprint = (what, repr(sorted(settings.items())))
    if q.world_size == 1 or fingerprint in q.verified:
        return
    if not _same_everywhere(q, zlib.crc32(fingerprint[1].encode()), device):
        described = [None] * q.world_size
        dist.all_gather_object(described, settings, group=q.group)
        differ = [k for k in settings if any(d.get(k) != settings[k] for d in described)]
        differ += sorted({k for d in described for k in d if k not in settings}, key=str)
        lines = "\n".join(
            f"  rank {r}: " + ", ".join(f"{k}={d.get(k)!r}" for k in differ) for r, d in enumerate(described)
        )
        raise ValueError(f"ranks disagree on {what}:\n{lines}")
    q.verified.add(fingerprint)


def _same_everywhere(q: CollectiveQueue, value: int, device: torch.device) -> bool:
    """Whether every rank of ``q``'s group passed the same 64-bit ``value`` (one all-gather)."""
    mine = torch.full((1,), value, dtype=torch.int64, device=device)
    everyone = torch.empty(q.world_size, dtype=torch.int64, device=device)
    all_gather_async(everyone, mine, q.group).wait()
    return all(seen == value for seen in everyone.tolist())


def _remember(plans: dict, plan: Plan) -> None:
    kind = plan.key[0]
    plans.pop(kind, None)
    plans[kind] = plan
    while len(plans) > MAX_PLANS:
        del plans[next(iter(plans))]


@functools.cache
def _positions(device: torch.device) -> torch.Tensor:
    return torch.arange(_BITS, dtype=torch.int64, device=device)
