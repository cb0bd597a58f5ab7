"""The cost model: a bucket's predicted all-reduce on a profile, and the plan (per bucket,
the compressor and algorithm with the least predicted time)."""

from __future__ import annotations

import dataclasses
import math

import torch

from gradcomp.collectives import (
    ALGORITHMS,
    HIERARCHICAL,
    check_algorithm,
    cost_model,
    two_phase_segments,
)
from gradcomp.compressors import Compressor
from gradcomp.planner.profiles import Nodes, Profile
from gradcomp.planner.specs import SAFE, from_spec, label

# A compressor must be predicted this much faster than dense to be chosen: the
# model misses most for codecs on fast links (and for dense where it overlaps the
# backward pass), where the gains are small too; the margin chosen against the
# alternatives is in bench/reports/auto-sweeps-cpu2-2026.md (run C).
MARGIN = 0.25


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A bucket's predicted all-reduce: the exchange and the encode/decode passes, less
    what of them overlaps (a pipelined two_phase). For ``hierarchical``, the exchange
    holds the node's dense stages too, and ``bytes_sent`` both levels' bytes."""

    compressor: str
    algorithm: str
    numel: int
    bytes_sent: int
    exchange_seconds: float
    codec_seconds: float
    overlap_seconds: float = 0.0
    inter_algorithm: str | None = None  # hierarchical: the algorithm between nodes
    # Filled in by the DDP hook's "auto" as it runs; not part of what a prediction is.
    observed_seconds: float = dataclasses.field(default=math.nan, compare=False)

    @property
    def seconds(self) -> float:
        return self.exchange_seconds + self.codec_seconds - self.overlap_seconds

    @property
    def how(self) -> str:
        """The algorithm in words: ``two_phase``, ``hierarchical(allgather)``."""
        return f"{self.algorithm}({self.inter_algorithm})" if self.inter_algorithm else self.algorithm


def passes(algorithm: str, world_size: int) -> tuple[float, int, float, int]:
    """Encode passes over a bucket's elements and encode calls, decode passes
    and decode calls, that ``algorithm`` makes on one rank.

    dense: one encode, one decode of the summed payload; allgather: one
    encode, a decode of every rank's payload; two_phase: an encode, then a
    re-encode of its own reduced chunk (1/W); decodes of the W-1 chunks it
    receives and of the W it gathers (about two passes in 2W - 1 calls).
    """
    w = world_size
    if algorithm == "dense":
        return 1.0, 1, 1.0, 1
    if algorithm == "allgather":
        return 1.0, 1, float(w), w
    return 1.0 + 1.0 / w, 2, 2.0 - 1.0 / w, 2 * w - 1


def predict(
    compressor: Compressor | str,
    numel: int,
    world_size: int,
    profile: Profile,
    algorithm: str | None = None,
    inter_algorithm: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Prediction:
    """The predicted time of one all-reduce of ``numel`` elements of ``dtype`` (the bytes
    are ``dtype``'s; the codecs' times per element are the profile's, measured on fp32).

    ``hierarchical`` (the profile must hold its :class:`Nodes`): the node's
    dense stages, then the compressed all-reduce of a shard (``numel`` over
    the node size) among the nodes with ``inter_algorithm`` (default: the
    compressor's), on the link between nodes.

    A two_phase or allgather all-reduce of a long CPU tensor (dense payloads) runs as a
    pipeline of ``S`` segments (:func:`gradcomp.collectives.two_phase_segments`,
    :func:`gradcomp.collectives.allgather_segments`): one segment's
    codec work overlaps another's exchange while the exchange waits on the wire,
    not while the transport's own CPU time ``T`` runs (it takes the cores the codec
    needs: :class:`gradcomp.collectives.cost_model.Link`): of the exchange ``X`` and the codec
    ``C``, ``min(X - T, C) (1 - 1/S)`` overlaps (a pipeline's fill and drain keep the
    rest). A profile measured on a CPU says so in its device name."""
    compressor = from_spec(compressor)
    if compressor.low_rank:
        raise ValueError(f"{compressor.name}: the planner does not model low-rank compressors yet")
    if algorithm == HIERARCHICAL:
        return _predict_hierarchical(compressor, numel, world_size, profile, inter_algorithm, dtype)
    algorithm = check_algorithm(compressor, algorithm, world_size)
    cost = cost_model.cost(compressor, numel, world_size, algorithm, dtype)
    exchange = cost.seconds(profile.link, profile.links)
    if compressor.name == "none" or world_size == 1:
        codec = 0.0
    else:
        c = profile.codec(compressor)
        encode, encode_calls, decode, decode_calls = passes(algorithm, world_size)
        codec = encode_calls * c.encode.overhead + encode * numel / c.encode.rate
        codec += decode_calls * c.decode.overhead + decode * numel / c.decode.rate
    overlap = 0.0
    if (
        algorithm in ("two_phase", "allgather")
        and not compressor.sparse
        and profile.on_cpu
        and world_size > 1
    ):
        align = getattr(compressor, "block", 1)
        ranks = world_size if algorithm == "two_phase" else 1  # allgather's segments are whole
        segments = len(two_phase_segments(numel, ranks, align, torch.device("cpu")))
        waiting = exchange - cost.cpu_seconds(profile.link, profile.links)
        overlap = min(waiting, codec) * (1 - 1 / segments)
    return Prediction(label(compressor), algorithm, numel, cost.bytes_sent, exchange, codec, overlap)


def _predict_hierarchical(
    compressor: Compressor,
    numel: int,
    world_size: int,
    profile: Profile,
    inter_algorithm: str | None,
    dtype: torch.dtype,
) -> Prediction:
    nodes = profile.nodes
    if nodes is None or nodes.size * nodes.count != world_size:
        held = f"nodes of {nodes.count} x {nodes.size} ranks" if nodes else "no nodes"
        raise ValueError(f"hierarchical over {world_size} ranks: the profile has {held}")
    shard = -(-numel // nodes.size)
    between = dataclasses.replace(profile, link=nodes.link, links=nodes.links, nodes=None)
    inner = predict(compressor, shard, nodes.count, between, inter_algorithm, dtype)
    # What a ring would send in the node (hierarchical's count).
    intra = 2 * (nodes.size - 1) * shard * dtype.itemsize
    return Prediction(
        label(compressor),
        HIERARCHICAL,
        numel,
        intra + inner.bytes_sent,
        nodes.stages.seconds(numel) + inner.exchange_seconds,
        inner.codec_seconds,
        inner.overlap_seconds,
        inner.algorithm,
    )


def flat_routes(candidates, world_size: int) -> list[tuple[Compressor, str]]:
    """Every (compressor, algorithm) pair the candidates can run at this world size (``none``: dense only)."""
    pairs, seen = [], set()
    for spec in candidates:
        compressor = from_spec(spec)
        if label(compressor) in seen:
            continue
        seen.add(label(compressor))
        if compressor.low_rank:
            raise ValueError(f"{compressor.name}: the planner does not model low-rank compressors yet")
        for algorithm in ALGORITHMS:
            if compressor.name == "none" and algorithm != "dense":
                continue  # dense fp32 goes as torch's all-reduce
            try:
                check_algorithm(compressor, algorithm, world_size)
            except ValueError:
                continue
            pairs.append((compressor, algorithm))
    return pairs


def routes(candidates, world_size: int, nodes: Nodes | None = None) -> list[tuple[Compressor, str, str]]:
    """Every (compressor, algorithm, algorithm between nodes) :func:`best_plan` weighs: ``none``
    dense first, then each candidate's flat :func:`flat_routes` and, on several ``nodes`` of several
    ranks, each compressor hierarchical with every algorithm it can run between them (fp32
    dense goes flat). The third item is None for the flat ones."""
    flat = flat_routes(["none", *[c for c in candidates if c != "none"]], world_size)
    found = [(c, a, None) for c, a in flat]
    if nodes is not None and nodes.size > 1 and nodes.count > 1:
        compressed = [c for c in candidates if label(from_spec(c)) != "none"]
        found += [(c, HIERARCHICAL, a) for c, a in flat_routes(compressed, nodes.count)]
    return found


def best_plan(
    numels: list[int],
    world_size: int,
    profile: Profile,
    candidates=SAFE,
    margin: float = MARGIN,
    ready: list[float] | None = None,
    dtypes: list[torch.dtype] | None = None,
) -> list[Prediction]:
    """Per bucket, the candidate pair with the least predicted time (ties: fewer bytes, then the
    earlier candidate). ``none`` is always a candidate, and a compressor is chosen over it only
    when predicted at least ``margin`` faster: a smaller gain is within the model's error.
    Where the profile has :class:`Nodes` (several of several ranks), every compressor is
    also considered ``hierarchical`` with each algorithm between nodes.

    ``ready``: when each bucket is handed over, in seconds before the backward pass ends
    (the last bucket's: 0), in the order the buckets are reduced. Then what overlaps the
    backward pass counts: a bucket stays dense (first to last) unless compressing it
    shortens the communication left after the backward pass (:func:`exposed_seconds`) by at
    least ``margin`` of what it saves the bucket: one reduced while the backward pass
    still runs, with time to spare, gains nothing by compressing.

    ``dtypes``: each bucket's element type (default fp32): bf16 buckets send half the
    bytes dense, and casting them to bf16 saves nothing."""
    keys = list(zip(numels, _dtypes(dtypes, numels), strict=True))
    pairs = routes(candidates, world_size, profile.nodes)
    best, dense = {}, {}  # buckets are mostly of one size: predict each size once
    for key in set(keys):
        predictions = [
            predict(c, key[0], world_size, profile, a, inter, key[1])
            for c, a, inter in pairs
            if saves(c, key[1])
        ]
        dense[key] = predictions[0]
        fastest = min(predictions, key=lambda p: (p.seconds, p.bytes_sent))
        best[key] = fastest if fastest.seconds <= (1 - margin) * dense[key].seconds else dense[key]
    plan = [best[key] for key in keys]
    if ready is None:
        return plan
    if len(ready) != len(numels):
        raise ValueError(f"ready has {len(ready)} times for {len(numels)} buckets")
    for i, key in enumerate(keys):
        if plan[i] is dense[key]:
            continue
        kept = exposed_seconds(ready, [p.seconds for p in plan])
        undone = plan[:i] + [dense[key]] + plan[i + 1 :]
        if exposed_seconds(ready, [p.seconds for p in undone]) - kept < margin * (
            dense[key].seconds - plan[i].seconds
        ):
            plan = undone
    return plan


def saves(compressor: Compressor, dtype: torch.dtype) -> bool:
    """Whether ``compressor`` may send fewer bytes than dense ``dtype``: False for a cast
    to a type no narrower than ``dtype`` (bf16 of bf16 gradients), which sends what dense
    sends after a pass that costs (``none`` itself is weighed)."""
    wire = getattr(compressor, "wire_dtype", None)
    return wire is None or wire.itemsize < dtype.itemsize


def _dtypes(dtypes: list[torch.dtype] | None, numels: list[int]) -> list[torch.dtype]:
    if dtypes is None:
        return [torch.float32] * len(numels)
    if len(dtypes) != len(numels):
        raise ValueError(f"dtypes has {len(dtypes)} types for {len(numels)} buckets")
    return list(dtypes)


def runner_up(
    numels: list[int],
    world_size: int,
    profile: Profile,
    plan: list[Prediction],
    candidates=SAFE,
    within: float = MARGIN,
    dtypes: list[torch.dtype] | None = None,
) -> list[Prediction] | None:
    """The plan to try beside ``plan`` (:func:`best_plan`'s), or None: per bucket the fastest
    other pair predicted within ``within`` of the plan's choice either way (where the model
    cannot tell them apart), the plan's choice where none is. None where no bucket has one.

    Another compressor comes before another algorithm of the same one: the codecs' times
    are what the model misses most (they depend on what else the cores do). A pair
    predicted far faster is no runner-up: :func:`best_plan` kept it out for a reason (the
    margin over dense, the overlap with the backward pass)."""
    pairs = routes(candidates, world_size, profile.nodes)
    other, found = [], False
    for numel, dtype, chosen in zip(numels, _dtypes(dtypes, numels), plan, strict=True):
        close = [
            p
            for p in (
                predict(c, numel, world_size, profile, a, inter, dtype)
                for c, a, inter in pairs
                if saves(c, dtype)
            )
            if (p.compressor, p.how) != (chosen.compressor, chosen.how)
            and abs(p.seconds - chosen.seconds) <= within * chosen.seconds
        ]
        best = min(
            close, key=lambda p: (p.compressor == chosen.compressor, p.seconds, p.bytes_sent), default=None
        )
        found = found or best is not None
        other.append(chosen if best is None else best)
    return other if found else None


def exposed_seconds(ready: list[float], seconds: list[float]) -> float:
    """The communication left when the backward pass ends: buckets reduced one after another
    in this order, each from when it is ready (seconds before the end, at most 0) or the one
    before it is done, taking ``seconds``."""
    free = -math.inf
    for at, took in zip(ready, seconds, strict=True):
        free = max(free, at) + took
    return max(0.0, free)


def dense_plan(numels: list[int]) -> list[Prediction]:
    """Every bucket dense: what one rank (or an empty tensor) sends, which is nothing."""
    one = Profile("one rank", cost_model.Link(1.0, 0.0), {}, 1, "")
    return [predict("none", n, 1, one) for n in numels]
