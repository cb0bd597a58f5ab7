"""The planner: the predicted time of a compressed all-reduce on a measured
link and device, and the compressor and algorithm it picks per bucket.

A :class:`Profile` holds what a machine measured: the link as an
alpha-beta fit of all-reduce times (latency per ring step, bytes per second
per rank), and per compressor the seconds to encode and to decode ``n``
elements as ``overhead + n / rate``. :func:`predict` adds the exchange time
of the scale model (:mod:`gradcomp.collectives.scale`: the bytes one rank
sends, the ring steps) and the encode and decode passes each algorithm
makes; :func:`choose` takes, per bucket, the candidate with the least
predicted time, so a bucket below the break-even size stays dense.
:func:`measure_link` and :func:`measure_codec` make a profile on this
machine (``python -m gradcomp probe``); :func:`combine` makes every rank's
measurements one profile (the slowest of each), so every rank chooses alike.
:class:`Auto` is ``gradcomp.all_reduce(tensor, "auto")``'s planner.

Example:
    >>> profile = planner.Profile.load()  # the stored 2-core CPU profile (on a CPU machine)
    >>> plan = planner.choose([6_553_600, 4096], 16, profile.with_link(1e9 / 8))  # 1 Gbit/s
    >>> [(p.compressor, p.algorithm) for p in plan]
    [('int4', 'two_phase'), ('int8', 'allgather')]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import pathlib
import statistics
import threading
import time
import typing

import torch
import torch.distributed as dist

from gradcomp.collectives import scale
from gradcomp.collectives.algorithms import (
    ALGORITHMS,
    HIERARCHICAL,
    allgather_segments,
    check_algorithm,
    default_algorithm,
)
from gradcomp.collectives.stats import ring_all_reduce_bytes
from gradcomp.collectives.two_phase import two_phase_segments
from gradcomp.compressors import Compressor, Context, get_compressor

# What ``auto`` may choose unless told: the compressors that kept accuracy on
# every task measured (bench/README.md). Sign, sparse and low-rank ones only
# when allowed.
SAFE = ("none", "bf16", "int8", "int4")
# ``name@value`` sets this option of the compressor (``topk@0.01``).
_SHORT_OPTION = {"topk": "ratio", "randk": "ratio", "powersgd": "rank", "int8": "block", "int4": "block"}
STORED = pathlib.Path(__file__).with_name("profiles")
_FASTEST = 1e15  # elements or bytes a second: the most a fit reports
# A compressor must be predicted this much faster than dense to be chosen: on the
# 2-core CPU machine the model still misses by up to 30% for codecs on fast links
# (and dense by more where it overlaps the backward pass; bench/README.md), and
# gains there were 10-30%.
MARGIN = 0.25
LINK_MAX = 2**22  # the largest all-reduce (fp32 elements) the link is timed at when planning
# A probe times each codec this many times as often as the link: on the 2-core machine
# two ranks' probes of int8 and int4 at the 25 MB buckets spread 65-103 and 94-132 ms
# over 4 probes of 5 repeats, 73-83 and 90-97 ms over 4 of 15.
CODEC_REPEATS = 3


def candidate(spec: str | Compressor) -> Compressor:
    """A compressor from ``"int8"``, ``"topk@0.01"``, ``"int4:block=128"`` or an instance."""
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a candidate is a compressor's name or a Compressor, got {spec!r}")
    name, at, value = spec.strip().partition("@")
    if at:
        option = _SHORT_OPTION.get(name.lower())
        if option is None:
            raise ValueError(f"{spec!r}: only {sorted(_SHORT_OPTION)} take name@value")
        return get_compressor(name, **{option: _number(value, spec)})
    name, _, rest = name.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{spec!r}: expected key=value, got {item!r}")
        options[key.strip()] = _number(value, spec)
    return get_compressor(name, **options)


def _number(text: str, spec: str):
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text  # a string option (index_dtype=int32); the compressor checks it


def label(compressor: Compressor) -> str:
    """A short name: the compressor's name and the options that differ from its defaults."""
    default = get_compressor(compressor.name).settings()
    changed = {k: v for k, v in compressor.settings().items() if default.get(k) != v}
    return compressor.name + "".join(f",{k}={v}" for k, v in sorted(changed.items())).replace(",", ":", 1)


@dataclasses.dataclass(frozen=True)
class Linear:
    """Seconds for ``n`` elements: ``overhead + n / rate``."""

    overhead: float
    rate: float

    def seconds(self, numel: float) -> float:
        return self.overhead + numel / self.rate if numel else 0.0

    @staticmethod
    def fit(numels: list[int], seconds: list[float]) -> Linear:
        """The least-squares line through the points, its overhead at least 0
        and its rate positive."""
        if len(set(numels)) == 1:  # one size: all rate (the mean time)
            return Linear(0.0, min(numels[0] / max(statistics.fmean(seconds), 1e-30), _FASTEST))
        mean_n, mean_s = statistics.fmean(numels), statistics.fmean(seconds)
        spread = sum((n - mean_n) ** 2 for n in numels)
        slope = sum((n - mean_n) * (s - mean_s) for n, s in zip(numels, seconds, strict=True)) / spread
        if slope <= 0:  # flat: all overhead (a rate bounded to keep the JSON finite)
            return Linear(max(seconds), _FASTEST)
        overhead = mean_s - slope * mean_n
        if overhead < 0:  # through the origin instead
            slope = sum(n * s for n, s in zip(numels, seconds, strict=True)) / sum(n * n for n in numels)
            overhead = 0.0
        return Linear(overhead, min(1.0 / slope, _FASTEST))


@dataclasses.dataclass(frozen=True)
class Codec:
    """One compressor's encode and decode times on one device."""

    encode: Linear
    decode: Linear


def _links_to_json(links: dict[str, scale.Link]) -> dict:
    return {k: dataclasses.asdict(v) for k, v in links.items()}


def _links_from_json(data: dict) -> dict[str, scale.Link]:
    return {k: scale.Link(**v) for k, v in data.get("links", {}).items()}


@dataclasses.dataclass(frozen=True)
class Nodes:
    """A group cut into ``count`` nodes of ``size`` ranks, as measured for the
    ``hierarchical`` algorithm: ``stages``, the seconds of a node's dense stages
    (the reduce-scatter and the all-gather of ``n`` elements, through shared
    memory or collectives); ``link`` and ``links`` (per collective, like
    :class:`Profile`'s), between nodes as the ranks of one local rank see it
    while every local rank's group runs at once (they share the nodes' NICs)."""

    size: int
    count: int
    stages: Linear
    link: scale.Link
    links: dict[str, scale.Link] = dataclasses.field(default_factory=dict)

    @staticmethod
    def on_links(size: int, count: int, inside: scale.Link, between: scale.Link) -> Nodes:
        """Nodes whose stages run as ring collectives on ``inside`` (a reduce-scatter and an
        all-gather: ``2 (size-1)`` steps, ``2 (size-1)/size`` of the fp32 bytes a rank), with
        ``between`` from node to node: what a model of a cluster assumes without measuring."""
        steps = 2 * (size - 1)
        rate = inside.bandwidth * size / (4 * steps) if steps else _FASTEST
        return Nodes(size, count, Linear(steps * inside.latency, min(rate, _FASTEST)), between)

    def to_json(self) -> dict:
        return dict(
            size=self.size,
            count=self.count,
            stages=dataclasses.asdict(self.stages),
            link=dataclasses.asdict(self.link),
            links=_links_to_json(self.links),
        )

    @staticmethod
    def from_json(data: dict) -> Nodes:
        links = _links_from_json(data)
        return Nodes(data["size"], data["count"], Linear(**data["stages"]), scale.Link(**data["link"]), links)


@dataclasses.dataclass(frozen=True)
class Profile:
    """What a machine measured: the link and each compressor's codec; ``nodes``, where the
    group spans several nodes of several ranks, the levels of the hierarchical algorithm."""

    device: str
    link: scale.Link  # the all-reduce's fit, and every collective's without one of its own
    codecs: dict[str, Codec]
    world_size: int = 2
    note: str = ""
    links: dict[str, scale.Link] = dataclasses.field(default_factory=dict)  # "all_gather", "all_to_all"
    nodes: Nodes | None = None

    def with_link(self, bandwidth: float | None = None, latency: float | None = None) -> Profile:
        """This profile on another link (bytes/s per rank, seconds per step), every
        collective on it (the collectives' own fits were measured on the old one, and
        so were its nodes: they go too)."""
        link = dataclasses.replace(
            self.link,
            bandwidth=bandwidth or self.link.bandwidth,
            latency=self.link.latency if latency is None else latency,
        )  # the host's CPU time a byte stays: it is not the wire's
        return dataclasses.replace(self, link=link, links={}, nodes=None)

    @property
    def on_cpu(self) -> bool:
        """Whether the profile was measured on CPUs (its device name says so: :func:`device_name`)."""
        return " CPUs (" in self.device or self.device.endswith(" CPUs")

    def codec(self, compressor: Compressor) -> Codec:
        key = label(compressor)
        if key not in self.codecs:
            raise KeyError(
                f"the profile of {self.device} has no measurement of {key!r} (it has {sorted(self.codecs)}); "
                "measure it: python -m gradcomp probe --compressors ..."
            )
        return self.codecs[key]

    def to_json(self) -> dict:
        return dict(
            device=self.device,
            world_size=self.world_size,
            note=self.note,
            link=dataclasses.asdict(self.link),
            links=_links_to_json(self.links),
            codecs={k: dataclasses.asdict(c) for k, c in self.codecs.items()},
            **({"nodes": self.nodes.to_json()} if self.nodes else {}),
        )

    @staticmethod
    def from_json(data: dict) -> Profile:
        """The profile :meth:`to_json` wrote.

        Raises:
            ValueError: ``data`` is not one (a field missing or of another type, a rate or
                bandwidth not positive, a latency or overhead negative), naming what.
        """
        if not isinstance(data, dict):
            raise ValueError(f"not a gradcomp profile: a JSON {type(data).__name__}, not an object")
        try:
            codecs = {
                k: Codec(Linear(**c["encode"]), Linear(**c["decode"])) for k, c in data["codecs"].items()
            }
            links = _links_from_json(data)
            nodes = Nodes.from_json(data["nodes"]) if data.get("nodes") else None
            profile = Profile(
                data["device"],
                scale.Link(**data["link"]),
                codecs,
                data["world_size"],
                data["note"],
                links,
                nodes,
            )
        except KeyError as error:
            raise ValueError(f"not a gradcomp profile: no {error.args[0]!r}") from None
        except (TypeError, AttributeError) as error:
            raise ValueError(f"not a gradcomp profile: {error}") from None
        _check_figures(profile)
        return profile

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @staticmethod
    def load(path: str | pathlib.Path | None = None) -> Profile:
        """A profile from ``path``, or the stored one: on a machine without a GPU, that of a
        2-core CPU machine (``cpu.json``); none is stored for GPUs (probe one).

        Raises:
            FileNotFoundError: no ``path`` and no stored profile for this device.
            ValueError: the file is not JSON or not a profile (:meth:`from_json`), naming it.
        """
        if path is None:
            path = STORED / ("cuda.json" if torch.cuda.is_available() else "cpu.json")
            if not path.exists():
                raise FileNotFoundError(
                    f"no stored profile for this device ({path.name}); measure one: python -m gradcomp probe"
                )
        text = pathlib.Path(path).read_text()
        try:
            data = json.loads(text)
        except ValueError as error:
            raise ValueError(f"{path}: not JSON ({error})") from None
        try:
            return Profile.from_json(data)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None


def _check_figures(profile: Profile) -> None:
    """ValueError unless every figure of ``profile`` is a number the model can use."""

    def check(where: str, value, positive: bool) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"not a gradcomp profile: {where} is {value!r}, not a finite number")
        if value <= 0 if positive else value < 0:
            raise ValueError(f"{where} must be {'positive' if positive else 'at least 0'}, got {value!r}")

    links = {"link": profile.link, **{f"links.{k}": v for k, v in profile.links.items()}}
    if profile.nodes is not None:
        links |= {"nodes.link": profile.nodes.link}
        links |= {f"nodes.links.{k}": v for k, v in profile.nodes.links.items()}
    for where, link in links.items():
        check(f"{where}.bandwidth", link.bandwidth, True)
        check(f"{where}.latency", link.latency, False)
        check(f"{where}.cpu_seconds_per_byte", link.cpu_seconds_per_byte, False)
    lines = {
        f"codecs.{k}.{part}": getattr(c, part)
        for k, c in profile.codecs.items()
        for part in ("encode", "decode")
    }
    if profile.nodes is not None:
        lines["nodes.stages"] = profile.nodes.stages
    for where, line in lines.items():
        check(f"{where}.rate", line.rate, True)
        check(f"{where}.overhead", line.overhead, False)
    world = profile.world_size
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"not a gradcomp profile: world_size is {world!r}, not a positive integer")


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
    needs: :class:`gradcomp.collectives.scale.Link`): of the exchange ``X`` and the codec
    ``C``, ``min(X - T, C) (1 - 1/S)`` overlaps (a pipeline's fill and drain keep the
    rest). A profile measured on a CPU says so in its device name."""
    compressor = candidate(compressor)
    if compressor.low_rank:
        raise ValueError(f"{compressor.name}: the planner does not model low-rank compressors yet")
    if algorithm == HIERARCHICAL:
        return _predict_hierarchical(compressor, numel, world_size, profile, inter_algorithm, dtype)
    algorithm = check_algorithm(compressor, algorithm, world_size)
    cost = scale.cost(compressor, numel, world_size, algorithm, dtype)
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


def options(candidates, world_size: int) -> list[tuple[Compressor, str]]:
    """Every (compressor, algorithm) pair the candidates can run at this world size (``none``: dense only)."""
    pairs, seen = [], set()
    for spec in candidates:
        compressor = candidate(spec)
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


def choices(candidates, world_size: int, nodes: Nodes | None = None) -> list[tuple[Compressor, str, str]]:
    """Every (compressor, algorithm, algorithm between nodes) :func:`choose` weighs: ``none``
    dense first, then each candidate's flat :func:`options` and, on several ``nodes`` of several
    ranks, each compressor hierarchical with every algorithm it can run between them (fp32
    dense goes flat). The third item is None for the flat ones."""
    flat = options(["none", *[c for c in candidates if c != "none"]], world_size)
    found = [(c, a, None) for c, a in flat]
    if nodes is not None and nodes.size > 1 and nodes.count > 1:
        compressed = [c for c in candidates if label(candidate(c)) != "none"]
        found += [(c, HIERARCHICAL, a) for c, a in options(compressed, nodes.count)]
    return found


def choose(
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
    pairs = choices(candidates, world_size, profile.nodes)
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


def contender(
    numels: list[int],
    world_size: int,
    profile: Profile,
    plan: list[Prediction],
    candidates=SAFE,
    within: float = MARGIN,
    dtypes: list[torch.dtype] | None = None,
) -> list[Prediction] | None:
    """The plan to try beside ``plan`` (:func:`choose`'s), or None: per bucket the fastest
    other pair predicted within ``within`` of the plan's choice either way (where the model
    cannot tell them apart), the plan's choice where none is. None where no bucket has one.

    Another compressor comes before another algorithm of the same one: the codecs' times
    are what the model misses most (they depend on what else the cores do). A pair
    predicted far faster is no contender: :func:`choose` kept it out for a reason (the
    margin over dense, the overlap with the backward pass)."""
    pairs = choices(candidates, world_size, profile.nodes)
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


def combine(profiles: list[Profile]) -> Profile:
    """One profile from every rank's: the slowest link and the slowest codec of each compressor."""
    first = profiles[0]
    link = _slowest_link([p.link for p in profiles])
    links = _slowest_links([p.links for p in profiles])
    codecs = {}
    for key in first.codecs:
        if all(key in p.codecs for p in profiles):
            codecs[key] = Codec(
                *(_slowest([getattr(p.codecs[key], w) for p in profiles]) for w in ("encode", "decode"))
            )
    return dataclasses.replace(first, link=link, codecs=codecs, links=links, nodes=_combine_nodes(profiles))


def _combine_nodes(profiles: list[Profile]) -> Nodes | None:
    """The slowest of every rank's nodes measurements; None unless every rank has one of one layout."""
    everyone = [p.nodes for p in profiles]
    if any(n is None for n in everyone) or len({(n.size, n.count) for n in everyone}) > 1:
        return None
    first = everyone[0]
    stages, link = _slowest([n.stages for n in everyone]), _slowest_link([n.link for n in everyone])
    return Nodes(first.size, first.count, stages, link, _slowest_links([n.links for n in everyone]))


def _slowest_links(fits: list[dict[str, scale.Link]]) -> dict[str, scale.Link]:
    """Per collective, the slowest of every rank's fits, where every rank has one."""
    return {name: _slowest_link([f[name] for f in fits]) for name in fits[0] if all(name in f for f in fits)}


def _slowest_link(links: list[scale.Link]) -> scale.Link:
    return scale.Link(
        min(x.bandwidth for x in links),
        max(x.latency for x in links),
        max(x.cpu_seconds_per_byte for x in links),
    )


# ----------------------------------------------------------------------------- all_reduce(t, "auto")


class Auto:
    """``gradcomp.all_reduce(tensor, Auto(...))``: the compressor and algorithm chosen per tensor size.

    The first call on a group compares the ranks' settings (``allow``,
    ``profile`` given or not: ``ValueError`` on every rank where they differ),
    then measures its link and the candidates' codecs on the tensor's device
    (every rank, on the group's worker, in call order: like any collective,
    every rank must make the same calls), at the tensor's size (the link up
    to 4M elements, :data:`LINK_MAX`) and a grid from 4K to 1M elements
    (:func:`link_sizes`), or takes ``profile``; every rank's figures combine,
    so every rank chooses alike. Each new size is then planned from those
    lines (:func:`choose`, in the tensor's own dtype: bf16 gradients send half
    the bytes, and a cast to bf16 saves them nothing) and keeps its choice;
    :attr:`plans` holds them per group, keyed by (elements, dtype). An empty
    tensor is sent dense without measuring. Where the group spans several
    nodes of several ranks (``all_reduce``'s ``node_size``, else
    ``LOCAL_WORLD_SIZE``, else host names), the first call also measures
    the nodes' levels and each size may go ``hierarchical`` (profiles and
    plans made for nodes are keyed by the node size too).
    ``gradcomp.all_reduce(t, "auto")`` uses one shared instance with the
    :data:`SAFE` candidates.

    Args:
        allow: the candidates (default :data:`SAFE`; ``"topk@0.01"``-style or objects).
        profile: a :class:`Profile` to plan from instead of measuring.

    Example:
        >>> auto = planner.Auto(allow=("bf16", "int8", "int4", "topk@0.01"))
        >>> stats = gradcomp.all_reduce(grad, auto)
        >>> auto.plans  # {group: {numel: Prediction}}
    """

    def __init__(self, allow=SAFE, profile: Profile | None = None):
        self.allow, self.profile = checked_candidates(allow, profile), profile
        self.profiles: dict = {}  # group -> the combined profile
        self.plans: dict = {}  # group -> numel -> Prediction
        self._chosen: dict = {}  # label -> Compressor

    def settings(self) -> dict:
        return {"name": "auto", "allow": [label(candidate(c)) for c in self.allow]}

    def choice(self, q, tensor: torch.Tensor, hierarchy=None) -> tuple[Compressor, Prediction]:
        """(on ``q``'s worker) The compressor and the plan for ``tensor`` on ``q``'s group
        (``hierarchy``: its nodes, where the hierarchical algorithm may be weighed)."""
        plans = self.plans.setdefault(q.group, {})
        key = (tensor.numel(), tensor.dtype)
        if hierarchy is not None and len(hierarchy.nodes) > 1:
            key += (hierarchy.node_size,)  # planned for these nodes
        plan = plans.get(key)
        if plan is None:
            if q.world_size == 1 or tensor.numel() == 0:  # nothing to send
                plan = dense_plan([tensor.numel()])[0]
            else:
                profile = self._profile(q, tensor, hierarchy)
                plan = choose([tensor.numel()], q.world_size, profile, self.allow, dtypes=[tensor.dtype])[0]
            plans[key] = plan
        compressor = self._chosen.get(plan.compressor)
        if compressor is None:
            compressor = self._chosen[plan.compressor] = candidate(plan.compressor)
        return compressor, plan

    def _profile(self, q, tensor: torch.Tensor, hierarchy) -> Profile:
        key = q.group if hierarchy is None or len(hierarchy.nodes) == 1 else (q.group, hierarchy.node_size)
        found = self.profiles.get(key)
        if found is None:
            # Later calls of other sizes plan from these lines: a grid up to 1M elements at least.
            grid = link_sizes([tensor.numel(), 2**20])
            found = self.profiles[key] = agreed_profile(
                self.profile, self.allow, grid, grid, q.group, tensor.device, hierarchy
            )
        return found


def checked_candidates(allow, profile: Profile | None = None) -> tuple:
    """``allow`` as a tuple (a string splits at commas), checked; ``profile`` checked too."""
    allow = SAFE if allow is None else allow
    if isinstance(allow, str):
        allow = [c.strip() for c in allow.split(",") if c.strip()]
    allow = tuple(allow)
    for spec in allow:
        if not isinstance(spec, (str, Compressor)):
            raise TypeError(f"allow holds compressors' names or Compressors, got {spec!r}")
    if not allow:
        raise ValueError("allow names no candidate")
    options(allow, None)  # unknown names and low-rank ones raise here
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(f"profile must be a gradcomp.planner.Profile, got {type(profile).__name__}")
    if profile is not None:  # found now, not after the warm-up
        missing = [key for key in (label(candidate(c)) for c in allow) if key != "none"]
        missing = [key for key in dict.fromkeys(missing) if key not in profile.codecs]
        if missing:
            raise ValueError(
                f"the profile of {profile.device} has no measurement of {', '.join(map(repr, missing))} "
                f"(it has {sorted(profile.codecs)}); measure them: python -m gradcomp probe --compressors ..."
            )
    return allow


def dense_plan(numels: list[int]) -> list[Prediction]:
    """Every bucket dense: what one rank (or an empty tensor) sends, which is nothing."""
    one = Profile("one rank", scale.Link(1.0, 0.0), {}, 1, "")
    return [predict("none", n, 1, one) for n in numels]


def agreed_profile(
    injected: Profile | None, allow, sizes: list[int], codec_sizes: list[int], group, device, hierarchy=None
):
    """Every rank's profile combined (the slowest of each): ``injected`` where given, else
    measured by :func:`probe` on ``device`` (the link at ``sizes``, the codecs at
    ``codec_sizes``; the levels of ``hierarchy`` where it has several nodes of several
    ranks). A collective: every rank calls it at the same point.

    Raises:
        ValueError: the profile's nodes are not ``hierarchy``'s (an injected profile's).
    """
    if injected is None:
        return probe(sizes, allow, codec_sizes, group=group, device=device, hierarchy=hierarchy)[0]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, injected, group=group)
    profile = combine(everyone)
    nodes = profile.nodes
    if nodes is not None and (hierarchy is None or (nodes.size, nodes.count) != _layout(hierarchy)):
        group = "has no usable node layout"
        if hierarchy is not None:
            size, count = _layout(hierarchy)
            group = f"holds {count} x {size} ({hierarchy.source})"
        raise ValueError(
            f"gradcomp auto: the profile's nodes hold {nodes.count} x {nodes.size} ranks, the group {group}"
        )
    return profile


def _layout(hierarchy) -> tuple[int, int]:
    return hierarchy.node_size, len(hierarchy.nodes)


def link_sizes(sizes: list[int]) -> list[int]:
    """Where to time the link for buckets of ``sizes``: their sizes and a grid below, up to
    16 MB of fp32 (the line through them extrapolates; a slow link takes seconds beyond)."""
    top = min(max(sizes), LINK_MAX)
    grid = {*(min(n, LINK_MAX) for n in sizes if n > 0), *(2**k for k in (12, 16, 20) if 2**k < top)}
    return sorted(grid) or [2**12]


def is_auto(compressor) -> bool:
    """Whether ``compressor`` asks gradcomp to choose (``"auto"`` or an :class:`Auto`)."""
    return isinstance(compressor, Auto) or (isinstance(compressor, str) and compressor.lower() == "auto")


# ----------------------------------------------------------------------------- measuring


def _slowest(lines: list[Linear]) -> Linear:
    return Linear(max(x.overhead for x in lines), min(x.rate for x in lines))


def _synchronize(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _median_seconds(fn, repeat: int, clock=time.perf_counter) -> float:
    fn()  # warm
    times = []
    for _ in range(repeat):
        began = clock()
        fn()
        times.append(clock() - began)
    return statistics.median(times)


def _other_threads_cpu() -> dict[int, float]:
    """The CPU seconds of this process's other Python threads (the backward pass's, a busy
    thread's), by thread; empty where the platform cannot tell."""
    me, seconds = threading.get_ident(), {}
    for thread in threading.enumerate():
        if thread.ident is None or thread.ident == me:
            continue
        try:
            seconds[thread.ident] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (AttributeError, OSError):  # no per-thread clocks here, or the thread has ended
            continue
    return seconds


def _transport_cpu(fn) -> tuple[float, float]:
    """Wall and CPU seconds of ``fn()``: the process's CPU time (the transport's own threads
    and this one), less what its other Python threads computed meanwhile (one that started
    meanwhile: all it computed). Threads that are not Python threads count as the
    transport's: with several torch threads a rank, a backward pass's share of an op on
    them too (an error towards less overlap credited)."""
    cpu = time.process_time()
    others, began = _other_threads_cpu(), time.perf_counter()  # inside the process's bracket:
    fn()  # what the other threads compute between the readings is never subtracted unseen
    wall, after = time.perf_counter() - began, _other_threads_cpu()
    cpu = time.process_time() - cpu
    cpu -= sum(seconds - others.get(ident, 0.0) for ident, seconds in after.items())
    return wall, min(max(cpu, 0.0), wall)


def _timed_collective(fn, repeat: int, device: torch.device) -> tuple[float, float]:
    """Median wall seconds of ``fn()`` and, on a CPU device, the median CPU seconds of its
    transport (:func:`_transport_cpu`; elsewhere 0: a GPU's collectives leave the host free)."""
    if device.type != "cpu":
        return _median_seconds(fn, repeat), 0.0
    fn()  # warm
    walls, cpus = zip(*(_transport_cpu(fn) for _ in range(repeat)), strict=True)
    return statistics.median(walls), statistics.median(cpus)


def _cpu_per_byte(rows: list[dict]) -> float:
    """The transport's CPU seconds a byte sent, fitted over ``rows`` (0 where none measured it).
    The fit's CPU time a call is left out: what overlaps is a long tensor's pipeline, whose
    segments are large."""
    if not any(r.get("cpu_seconds") for r in rows):
        return 0.0
    line = Linear.fit([r["bytes_sent"] for r in rows], [r["cpu_seconds"] for r in rows])
    return 1.0 / line.rate


# What a CPU codec competes with while it runs in training: a layer's forward and
# weight-gradient matmuls (batch x width @ width x width, and back), streaming a
# width x width fp32 weight through memory as a backward pass of a wide layer does.
BUSY_SHAPE = (64, 4096)


_busy_here = threading.local()  # whether this thread already has a busy thread running


@contextlib.contextmanager
def busy(device: torch.device) -> typing.Iterator[None]:
    """On a CPU, another thread of this process computes until the block ends (a stand-in
    for the backward pass a codec competes with in training); elsewhere, nothing. Nested
    blocks of one thread share the outer block's thread.

    Raises:
        RuntimeError: at the end of the block, if the busy thread failed (the codecs
            were then timed without it).
    """
    if torch.device(device).type != "cpu" or getattr(_busy_here, "active", False):
        yield
        return
    batch, width = BUSY_SHAPE
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch, width, generator=generator)
    weight = torch.randn(width, width, generator=generator)
    outputs, gradient = torch.empty(batch, width), torch.empty(width, width)
    stop, started, failed = threading.Event(), threading.Event(), []

    def work() -> None:
        started.set()
        try:
            while not stop.is_set():
                torch.mm(inputs, weight, out=outputs)
                torch.mm(inputs.t(), outputs, out=gradient)
        except Exception as error:  # noqa: BLE001 - reported on the probing thread
            failed.append(error)

    thread = threading.Thread(target=work, name="gradcomp-probe-busy", daemon=True)
    _busy_here.active = True
    try:
        thread.start()
        started.wait()
        yield
    finally:
        stop.set()
        thread.join()
        _busy_here.active = False
    if failed:
        raise RuntimeError(f"the probe's busy thread failed: {failed[0]!r}") from failed[0]


def measure_link(sizes: list[int], group=None, repeat: int = 5, device=None) -> tuple[scale.Link, list[dict]]:
    """Time dense fp32 all-reduces of ``sizes`` elements on ``device`` (default: CUDA for an NCCL
    group, else CPU) over ``group`` and fit ``steps * latency + bytes / bandwidth`` (the scale
    model's ring). Every rank must call it; every rank gets the slowest rank's times. On a CPU,
    also the transport's CPU time (``cpu_seconds`` in each row, :func:`_transport_cpu`),
    fitted per byte sent: the part of a collective that takes the host's cores."""
    world = dist.get_world_size(group)
    device = torch.device(device or default_device(group))
    rows = []
    for numel in sorted(set(sizes)):
        tensor = torch.ones(numel, device=device)
        once = functools.partial(_all_reduce_once, tensor, group)
        dist.barrier(group=group)
        seconds = _slowest_rank(_timed_collective(once, repeat, device), group, device)
        rows.append(dict(numel=numel, bytes_sent=ring_all_reduce_bytes(numel * 4, world), **seconds))
    return fit_link(rows, world), rows


def _slowest_rank(timed: tuple[float, float], group, device: torch.device) -> dict:
    """The most of every rank's (wall, CPU) seconds, as a row's ``seconds`` and ``cpu_seconds``."""
    seconds = torch.tensor(timed, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    wall, cpu = seconds.tolist()
    return dict(seconds=wall, cpu_seconds=cpu) if device.type == "cpu" else dict(seconds=wall)


def measure_collectives(
    sizes: list[int], group=None, repeat: int = 5, device=None
) -> tuple[dict[str, scale.Link], list[dict]]:
    """Like :func:`measure_link`, for the collectives the compressed algorithms use: an
    all-gather whose output holds ``n`` fp32 elements (``n / W`` from each rank) and an
    all-to-all of ``n`` elements a rank; each fitted as ``(W-1) latency + bytes / bandwidth``
    (bytes one rank sends, ring schedules), and on a CPU the transport's CPU time per byte
    (as :func:`measure_link`). Every rank must call it."""
    world = dist.get_world_size(group)
    device = torch.device(device or default_device(group))
    links, rows = {}, []
    for name in ("all_gather", "all_to_all"):
        mine = []
        for numel in sorted(set(sizes)):
            part = max(1, numel // world)
            source = torch.ones(part * world if name == "all_to_all" else part, device=device)
            output = torch.empty(part * world, device=device)
            once = functools.partial(_collective_once, name, output, source, group)
            dist.barrier(group=group)
            seconds = _slowest_rank(_timed_collective(once, repeat, device), group, device)
            mine.append(
                dict(collective=name, numel=part * world, bytes_sent=part * 4 * (world - 1), **seconds)
            )
        line = Linear.fit([r["bytes_sent"] for r in mine], [r["seconds"] for r in mine])
        links[name] = scale.Link(line.rate, line.overhead / max(world - 1, 1), _cpu_per_byte(mine))
        rows += mine
    return links, rows


def measure_pingpong(
    sizes: list[int], group=None, repeat: int = 5, device=None
) -> tuple[scale.Link, list[dict]]:
    """A pingpong, as the usual point-to-point latency and bandwidth tests run it: the group's
    first two ranks send messages of ``sizes`` fp32 elements back and forth; half a round
    trip is one message's time, fitted as ``latency + bytes / bandwidth``. Every rank of the
    group must call it (the others wait); every rank gets the first rank's figures."""
    if dist.get_world_size(group) < 2:
        raise ValueError("a pingpong needs two ranks")
    device = torch.device(device or default_device(group))
    rank = dist.get_rank(group)
    peers = [dist.get_global_rank(group or dist.group.WORLD, r) for r in (0, 1)]
    rows = []
    for numel in sorted(set(sizes)):
        message = torch.ones(numel, device=device)
        dist.barrier(group=group)
        seconds = 0.0
        if rank < 2:
            seconds = _median_seconds(functools.partial(_round_trip, message, rank, peers, group), repeat) / 2
        seconds = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.broadcast(seconds, src=peers[0], group=group)
        rows.append(dict(collective="pingpong", numel=numel, bytes_sent=numel * 4, seconds=seconds.item()))
    line = Linear.fit([r["bytes_sent"] for r in rows], [r["seconds"] for r in rows])
    return scale.Link(line.rate, line.overhead), rows


def _round_trip(message: torch.Tensor, rank: int, peers: list[int], group) -> None:
    if rank == 0:
        dist.send(message, peers[1], group=group)
        dist.recv(message, peers[1], group=group)
    else:
        dist.recv(message, peers[0], group=group)
        dist.send(message, peers[0], group=group)
    _synchronize(message)


def _collective_once(name: str, output: torch.Tensor, source: torch.Tensor, group) -> None:
    if name == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(output, source, group=group)
    else:
        dist.all_to_all_single(output, source, group=group)
    _synchronize(output)


def default_device(group=None) -> torch.device:
    """Where a group's collectives take tensors: the current CUDA device for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_once(tensor: torch.Tensor, group) -> None:
    dist.all_reduce(tensor, group=group)
    _synchronize(tensor)


def _encode_once(compressor: Compressor, x: torch.Tensor, residual, segments, buffered: bool) -> None:
    for start, end in segments:
        part = None if residual is None else residual[start:end]
        payload = compressor.compress(x[start:end], Context(residual=part))
        if buffered:
            payload.to_buffer()
    _synchronize(x)


def _decode_once(compressor: Compressor, payloads, out: torch.Tensor) -> None:
    for payload, rows, (start, end) in payloads:
        if rows is None:
            compressor.decompress(payload, out=out[start:end])
        else:
            compressor.decompress_sum(rows, out.dtype, out[start:end], meta=payload.meta, divisor=len(rows))
    _synchronize(out)


def fit_link(rows: list[dict], world_size: int) -> scale.Link:
    """Least squares of ``seconds = 2 (W-1) latency + bytes_sent / bandwidth`` over the rows."""
    steps = 2 * (world_size - 1)
    if steps == 0:  # one rank sends nothing: any link will do
        return scale.Link(_FASTEST, 0.0)
    line = Linear.fit([r["bytes_sent"] for r in rows], [r["seconds"] for r in rows])
    return scale.Link(line.rate, line.overhead / steps, _cpu_per_byte(rows))


def measure_codec(compressor: Compressor | str, sizes: list[int], device="cpu", repeat: int = 5) -> Codec:
    """Time the encode and decode of ``sizes`` random fp32 elements on ``device`` as the
    algorithms run them; fit each.

    Encode: ``compress`` (with a residual when the compressor keeps one by default); of
    a summable payload (casts) the whole tensor's, which an all-reduce sums as it is; of
    others each pipeline segment's (:func:`gradcomp.collectives.allgather_segments`),
    written into its send buffer. Decode: of a summable payload, ``decompress`` of the
    one summed; of others, ``decompress_sum`` of two ranks' rows a segment (zeroing,
    two accumulating decodes and the division: what every reduction of received rows
    runs), counted as one row's, half of it.

    On a CPU the codec is timed while another thread computes (:func:`busy`), by the CPU
    time of the thread that runs it: in training it shares the cores, caches and memory
    with the backward pass, and what it adds to a step is the work it does there, not its
    waits for a turn on a core. Where torch runs an op on
    several threads, the thread that calls it does its share: what the op adds to a step
    whose cores are all busy; work it does alone (Python, serial ops) counts in full."""
    compressor = candidate(compressor)
    device = torch.device(device)
    clock = time.thread_time if device.type == "cpu" else time.perf_counter
    summed = default_algorithm(compressor, 2) == "dense"
    encode, decode = [], []
    with busy(device):
        for numel in sizes:
            x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(device)
            out = torch.empty_like(x)
            # With error feedback where the compressor has it by default: the fused pass training runs.
            residual = torch.zeros_like(x) if compressor.needs_feedback else None
            segments = [(0, numel)] if summed else allgather_segments(compressor, numel, device)
            payloads = []
            for start, end in segments:
                payload = compressor.compress(x[start:end])
                rows = None if summed else torch.stack([payload.to_buffer()] * 2)
                payloads.append((payload, rows, (start, end)))
            encoding = functools.partial(_encode_once, compressor, x, residual, segments, not summed)
            decoding = functools.partial(_decode_once, compressor, payloads, out)
            encode.append(_median_seconds(encoding, repeat, clock))
            decode.append(_median_seconds(decoding, repeat, clock) / (1 if summed else 2))
    return Codec(Linear.fit(sizes, encode), Linear.fit(sizes, decode))


def measure_nodes(hierarchy, sizes: list[int], repeat: int = 5, device=None) -> tuple[Nodes, list[dict]]:
    """Time ``hierarchy``'s levels (a :class:`gradcomp.collectives.hierarchical.Hierarchy`
    of several nodes): the node's dense stages of ``sizes`` elements, fitted as
    ``overhead + n / rate``, and between nodes the all-reduce, all-gather and all-to-all
    of every local rank's group at once. Every rank of the hierarchy's group must call it."""
    from gradcomp.collectives.algorithms import Job
    from gradcomp.collectives.hierarchical import hierarchical, node_stages_only
    from gradcomp.collectives.stats import ReduceStats
    from gradcomp.collectives.worker import drive

    device = torch.device(device or default_device(hierarchy.intra.group))
    stages_only, seconds, numels = node_stages_only(hierarchy), [], sorted(set(sizes))
    for numel in numels:
        flat = torch.ones(numel, device=device)
        job = Job(flat, get_compressor("none"), "avg", HIERARCHICAL, None, key=0, step=0)

        def stages(job=job, flat=flat) -> None:
            drive(hierarchical(job, flat, stages_only, ReduceStats()))
            _synchronize(flat)

        dist.barrier(group=hierarchy.intra.group)
        seconds.append(_median_seconds(stages, repeat))
        stages_only.areas.clear()  # one size's shared memory at a time
    rows = [dict(collective="node stages", numel=n, seconds=t) for n, t in zip(numels, seconds, strict=True)]
    # Between nodes: every local rank's group at once, as in training (they share the NICs).
    shards = sorted({max(1, -(-n // hierarchy.node_size)) for n in sizes})
    dist.barrier(group=hierarchy.intra.group)
    link, more = measure_link(shards, hierarchy.inter.group, repeat, device)
    links, collectives = measure_collectives(shards, hierarchy.inter.group, repeat, device)
    for row in more:
        row["collective"] = "all_reduce"
    for row in [*more, *collectives]:
        row["collective"] = "between nodes: " + row["collective"]
    stages = Linear.fit(numels, seconds)
    nodes = Nodes(hierarchy.node_size, len(hierarchy.nodes), stages, link, links)
    return nodes, rows + more + collectives


def probe(
    sizes: list[int],
    compressors,
    codec_sizes: list[int] | None = None,
    group=None,
    repeat: int = 5,
    device=None,
    hierarchy=None,
    pingpong: bool = False,
    codec_repeat: int | None = None,
):
    """Measure this group's link and, on every rank, each compressor's codec on ``device``
    (default: CUDA for an NCCL group, else CPU); every rank returns the same
    :class:`Profile` (the slowest of each measurement) and the timings of each
    collective (all-reduce, all-gather, all-to-all; ``collective`` in each row).
    With a ``hierarchy`` of several nodes of several ranks, its levels too
    (:func:`measure_nodes`; the codecs also at the shards' sizes). With ``pingpong``,
    a :func:`measure_pingpong` too, kept as ``links["pingpong"]`` (for people: no
    algorithm is predicted on it). Each codec is timed ``codec_repeat`` times (default
    ``CODEC_REPEATS`` times ``repeat``): on a shared CPU a codec's time varies more than
    the link's, and its median settles only over more runs."""
    device = torch.device(device or default_device(group))
    link, rows = measure_link(sizes, group, repeat, device)
    for row in rows:
        row["collective"] = "all_reduce"
    links, more = (
        measure_collectives(sizes, group, repeat, device) if dist.get_world_size(group) > 1 else ({}, [])
    )
    rows += more
    if pingpong and dist.get_world_size(group) > 1:
        links["pingpong"], more = measure_pingpong(sizes, group, repeat, device)
        rows += more
    codec_sizes = set(codec_sizes or sizes)
    nodes = None
    if hierarchy is not None and hierarchy.node_size > 1 and len(hierarchy.nodes) > 1:
        nodes, more = measure_nodes(hierarchy, sizes, repeat, device)
        rows += more
        codec_sizes |= {max(1, -(-n // hierarchy.node_size)) for n in codec_sizes}
    codecs = {}
    with busy(device):  # one busy thread for every codec (measure_codec's own nest in it)
        for spec in compressors:
            compressor = candidate(spec)
            if compressor.name != "none":
                times = CODEC_REPEATS * repeat if codec_repeat is None else codec_repeat
                codecs[label(compressor)] = measure_codec(compressor, sorted(codec_sizes), device, times)
    world = dist.get_world_size(group)
    mine = Profile(
        device_name(device), link, codecs, world, f"{dist.get_backend(group)}, {world} ranks", links, nodes
    )
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    return combine(everyone), rows


def device_name(device: torch.device) -> str:
    """The device a profile was measured on, in words."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import os
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} CPUs ({model})"
