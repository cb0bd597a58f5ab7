"""``--nodes N --ranks-per-node R --inter-bandwidth RATE``: a cluster emulated on one machine.

Each node is a network namespace whose ranks talk over its own loopback
without limit; the nodes are joined through a bridge (in a namespace of its
own) by veth links that a ``tc`` token bucket limits to RATE at both ends,
each direction, as a node's NIC is. Needs root and iproute2.

Example:
    >>> with cluster_from(args) as cluster:  # None without --nodes
    ...     spawning.spawn(body, cluster.world_size)  # each rank in its node's namespace
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from gradcomp.limited_link import link_settings, token_bucket, unmet_requirement
from gradcomp.units import argument, format_size, parse_rate, parse_size

_CLONE_NEWNET = 0x40000000
# The interface name of every node's link, in its own namespace.
NODE_INTERFACE = "gc0"
# The emulated cluster the ranks run in, while :func:`cluster_from` holds one.
_current: EmulatedCluster | None = None


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nodes", type=int, metavar="N", help="emulate N nodes (network namespaces; needs root and iproute2)"
    )
    parser.add_argument(
        "--ranks-per-node", type=int, default=2, metavar="R", help="ranks per node (default 2)"
    )
    parser.add_argument(
        "--inter-bandwidth",
        default="1gbit",
        metavar="RATE",
        help="each node's link to the others, bits per second each way (a tc rate; default 1gbit)",
    )


def add_link_check_option(parser: argparse.ArgumentParser, default: str) -> None:
    """``--link-check-bytes``: the dense all-reduce that measures the links before the runs."""
    parser.add_argument(
        "--link-check-bytes",
        type=argument(parse_size),
        default=parse_size(default),
        help=f"size of the dense all-reduce that measures the links first (default {default})",
    )


class EmulatedCluster:
    """``nodes`` network namespaces joined by a bridge in a namespace of its own; each
    node's veth link limited to ``rate`` by a ``tc`` token bucket at both ends (what the
    node sends and what it receives), and its ranks talking over its own loopback without
    limit. Only addresses inside these namespaces are used; they are deleted on exit,
    whatever happens.

    The spawned ranks enter their node's namespace before they join the
    group (:meth:`spawn_options`) and see torchrun's ``LOCAL_WORLD_SIZE``,
    ``LOCAL_RANK`` and ``GROUP_RANK``.
    """

    def __init__(self, nodes: int, ranks_per_node: int, rate: str):
        if nodes < 2 or ranks_per_node < 1:
            raise ValueError(f"an emulated cluster needs >= 2 nodes of >= 1 rank: {nodes} x {ranks_per_node}")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.link = link_settings(rate)
        tag = f"gradcomp-{os.getpid()}-{secrets.token_hex(2)}"
        self.switch = f"{tag}-sw"
        self.names = [f"{tag}-n{i}" for i in range(nodes)]
        subnet = 16 + secrets.randbelow(200)
        self.addresses = [f"10.213.{subnet}.{i + 1}" for i in range(nodes)]
        self._created: list[str] = []

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        return (
            f"{self.nodes} nodes x {self.ranks_per_node} ranks, {self.link['rate']} between nodes "
            "(tc tbf on each node's veth link, each direction), unlimited loopback inside a node"
        )

    def __enter__(self) -> EmulatedCluster:
        unmet = unmet_requirement("an emulated cluster")
        if unmet:
            sys.stderr.write(unmet + "\n")
            sys.exit(2)
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # the spawned ranks inherit it
        # A TERM signal (a timeout) ends the script through SystemExit, so the namespaces go too.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            self._create()
        except BaseException:
            self._delete()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._delete()

    def _create(self) -> None:
        def run(*command: str) -> None:
            subprocess.run(command, check=True, capture_output=True, text=True)

        limit = token_bucket(self.link)
        self._add_namespace(self.switch)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            self._add_namespace(name)
            port = f"p{i}"
            run("ip", "link", "add", NODE_INTERFACE, "netns", name, "type", "veth", "peer", "name", port,
                "netns", self.switch)  # fmt: skip
            run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", NODE_INTERFACE)
            run("ip", "-n", name, "link", "set", NODE_INTERFACE, "up")
            run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            run("ip", "-n", self.switch, "link", "set", port, "up")
            run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", NODE_INTERFACE, "root", *limit)
            run("ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", port, "root", *limit)
        sys.stderr.write(f"emulated cluster: {self.describe()}; namespaces {self.names[0]}...\n")

    def _add_namespace(self, name: str) -> None:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
        self._created.append(name)
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True)

    def _delete(self) -> None:
        for name in reversed(self._created):
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)
        self._created = []

    def spawn_options(self) -> dict:
        """Options of :func:`gradcomp.spawn.run_ranks`: meet at node 0, each rank in its node."""
        setup = functools.partial(enter_node, tuple(self.names), self.ranks_per_node)
        return {"address": self.addresses[0], "setup": setup}


def enter_node(names: tuple[str, ...], ranks_per_node: int, rank: int, world_size: int) -> None:
    """In a spawned rank: move into its node's network namespace and set
    torchrun's variables (Gloo then talks over the node's link interface)."""
    node = rank // ranks_per_node
    libc = ctypes.CDLL(None, use_errno=True)
    descriptor = os.open(f"/var/run/netns/{names[node]}", os.O_RDONLY)
    try:
        if libc.setns(descriptor, _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot enter network namespace {names[node]}: {os.strerror(error)}")
    finally:
        os.close(descriptor)
    os.environ.update(
        GLOO_SOCKET_IFNAME=NODE_INTERFACE,
        LOCAL_WORLD_SIZE=str(ranks_per_node),
        LOCAL_RANK=str(rank % ranks_per_node),
        GROUP_RANK=str(node),
        TORCH_CPP_LOG_LEVEL="ERROR",
    )


@contextlib.contextmanager
def cluster_from(args: argparse.Namespace):
    """The emulated cluster ``--nodes`` asks for (current for :func:`lib.spawning.spawn`), or None."""
    global _current
    if not getattr(args, "nodes", None):
        yield None
        return
    with EmulatedCluster(args.nodes, args.ranks_per_node, args.inter_bandwidth) as cluster:
        _current = cluster
        try:
            yield cluster
        finally:
            _current = None


@contextlib.contextmanager
def described_cluster(args: argparse.Namespace, facts: dict):
    """:func:`cluster_from`, its links and nodes written into the results' machine ``facts``."""
    with cluster_from(args) as cluster:
        if cluster:
            facts["link"] = cluster.describe()
            facts["machine"] += f", {args.nodes} emulated nodes, {args.inter_bandwidth} between them"
        yield cluster


def spawn_options() -> dict:
    """:meth:`EmulatedCluster.spawn_options` of the current cluster ({} without one)."""
    return _current.spawn_options() if _current else {}


def measure_levels(settings: dict, iters: int = 3) -> dict | None:
    """In the ranks of the cluster ``settings`` (a script's options) emulate: the median
    time of a dense all-reduce of ``--link-check-bytes`` between two nodes (local rank 0
    of nodes 0 and 1) and inside node 0, and the rate each rank sends at (ring model).
    None without ``--nodes``."""
    if not settings["nodes"]:
        return None
    nbytes, ranks_per_node = settings["link_check_bytes"], settings["ranks_per_node"]
    rank = dist.get_rank()
    levels = {"inter": [0, ranks_per_node], "intra": list(range(ranks_per_node))}
    groups = {label: dist.new_group(members) for label, members in levels.items() if len(members) > 1}
    mine = {}
    for label, group in groups.items():
        dist.barrier()
        if rank not in levels[label]:
            continue
        tensor = torch.ones(nbytes // 4)
        seconds = []
        for iteration in range(1 + iters):
            began = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            if iteration:
                seconds.append(time.perf_counter() - began)
        median = statistics.median(seconds)
        size = len(levels[label])
        mine[f"{label}_seconds"] = median
        mine[f"{label}_gbit_per_s"] = 2 * (size - 1) * nbytes // size * 8 / median / 1e9
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {"bytes": nbytes}
    for part in everyone:
        merged.update({k: v for k, v in part.items() if k not in merged})
    return merged


def describe_levels(check: dict, rate_bits: float) -> str:
    """The emulation check in words: each level's rate against the limit."""
    inter, limit = check["inter_gbit_per_s"], rate_bits / 1e9
    verdict = "matches the limit" if 0.75 <= inter / limit <= 1.05 else "DOES NOT match the limit"
    text = (
        f"emulation check: dense all_reduce of {format_size(check['bytes'])} between two nodes "
        f"{check['inter_seconds']:.3f} s = {inter:.2f} Gbit/s sent per rank, "
        f"limit {limit:g} Gbit/s: {verdict}"
    )
    if "intra_gbit_per_s" in check:
        intra = check["intra_gbit_per_s"]
        seconds = check["intra_seconds"]
        text += f"; inside a node {seconds:.3f} s = {intra:.2f} Gbit/s ({intra / limit:.1f}x the limit)"
    return text


def describe_check(check: dict, facts: dict, inter_bandwidth: str) -> str:
    """Two lines: the cluster's links (from the results' machine ``facts``) and
    :func:`describe_levels` of its emulation ``check`` against ``inter_bandwidth``."""
    return f"cluster: {facts['link']}\n{describe_levels(check, parse_rate(inter_bandwidth))}"
