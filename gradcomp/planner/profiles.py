"""What a machine measured: lines of seconds over elements, codecs, links, nodes; their
JSON (``python -m gradcomp probe`` writes it); every rank's combined into one."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics

import torch

from gradcomp import files
from gradcomp.collectives import cost_model
from gradcomp.compressors import Compressor
from gradcomp.planner.specs import label

STORED = pathlib.Path(__file__).parent.with_name("profiles")
_FASTEST = 1e15  # elements or bytes a second: the most a fit reports


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


def _links_to_json(links: dict[str, cost_model.Link]) -> dict:
    return {k: dataclasses.asdict(v) for k, v in links.items()}


def _links_from_json(data: dict) -> dict[str, cost_model.Link]:
    return {k: cost_model.Link(**v) for k, v in data.get("links", {}).items()}


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
    link: cost_model.Link
    links: dict[str, cost_model.Link] = dataclasses.field(default_factory=dict)

    @staticmethod
    def on_links(size: int, count: int, inside: cost_model.Link, between: cost_model.Link) -> Nodes:
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
        return Nodes(
            data["size"], data["count"], Linear(**data["stages"]), cost_model.Link(**data["link"]), links
        )


@dataclasses.dataclass(frozen=True)
class Profile:
    """What a machine measured: the link and each compressor's codec; ``nodes``, where the
    group spans several nodes of several ranks, the levels of the hierarchical algorithm."""

    device: str
    link: cost_model.Link  # the all-reduce's fit, and every collective's without one of its own
    codecs: dict[str, Codec]
    world_size: int = 2
    note: str = ""
    links: dict[str, cost_model.Link] = dataclasses.field(default_factory=dict)  # "all_gather", "all_to_all"
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
                cost_model.Link(**data["link"]),
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
        """Write the profile as JSON into ``path``, whole or not at all."""
        files.write_text(path, json.dumps(self.to_json(), indent=1) + "\n")

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


def _slowest_links(fits: list[dict[str, cost_model.Link]]) -> dict[str, cost_model.Link]:
    """Per collective, the slowest of every rank's fits, where every rank has one."""
    return {name: _slowest_link([f[name] for f in fits]) for name in fits[0] if all(name in f for f in fits)}


def _slowest_link(links: list[cost_model.Link]) -> cost_model.Link:
    return cost_model.Link(
        min(x.bandwidth for x in links),
        max(x.latency for x in links),
        max(x.cpu_seconds_per_byte for x in links),
    )


def _slowest(lines: list[Linear]) -> Linear:
    return Linear(max(x.overhead for x in lines), min(x.rate for x in lines))
