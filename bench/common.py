"""What the bench scripts share: the machine, result files, spawned ranks, progress, limited links.

Every script measures its baseline in the same run, prints a table, and
writes CSV and JSON (and a PNG where it plots) to ``bench/results/``, each
record naming the machine. Ranks are either spawned here (Gloo on
127.0.0.1, a free port) or started by ``torchrun`` (``env://``).

``--bandwidth RATE`` re-runs a script inside a network namespace of its own
whose loopback is limited by a ``tc`` token bucket: the ranks then talk over
a link of that rate. Both directions of the loopback share the one limit, so
a rate of 1gbit carries 1 Gbit/s in all, not 1 Gbit/s each way.

``--nodes N --ranks-per-node R --inter-bandwidth RATE`` emulates a cluster
(:class:`EmulatedCluster`): each node a network namespace whose ranks talk
over its loopback without limit, the nodes joined through a bridge by veth
links limited to RATE in each direction, as a node's NIC is.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import datetime
import functools
import json
import math
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

import gradcomp

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Set in the environment of a script re-run inside a limited namespace: the link's settings (JSON).
LINK_ENV = "GRADCOMP_BENCH_LINK"
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


# ----------------------------------------------------------------------------- sizes and names


def parse_size(text: str) -> int:
    """Bytes from ``"64KiB"``, ``"1M"``, ``"1GiB"`` or ``"4096"`` (binary prefixes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size like 64KiB, 1MiB or 4096, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_size(nbytes: float) -> str:
    """``65536`` -> ``"64K"``, ``1.5 * 2**20`` -> ``"1.5M"`` (binary prefixes)."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(nbytes) < 1024 or unit == "T":
            text = f"{nbytes:.1f}" if unit and nbytes != int(nbytes) else f"{nbytes:.0f}"
            return f"{text.removesuffix('.0')}{unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def parse_rate(text: str) -> float:
    """Bits per second from a ``tc`` rate such as ``"1gbit"`` or ``"100mbit"``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a rate like 1gbit or 100mbit, got {text!r}")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


# Options of the DDP hook rather than of the compressor.
HOOK_OPTIONS = ("algorithm", "inter_algorithm")


def parse_compressor(text: str) -> tuple[str, str, dict]:
    """``"topk:ratio=0.001"`` -> ``("topk:ratio=0.001", "topk", {"ratio": 0.001})``.

    Options are checked by building the compressor once; ``algorithm=`` and
    ``inter_algorithm=`` (for the scripts that register the DDP hook) are
    checked against it. The label
    names the run in tables and result files.
    """
    name, _, rest = text.strip().partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, equals, value = item.partition("=")
        if not equals:
            raise argparse.ArgumentTypeError(f"compressor option {item!r} is not key=value (in {text!r})")
        options[key.strip()] = _literal(value.strip())
    if name == "auto":  # the DDP hook's planner: "auto" or "auto:allow=bf16|int8|topk@0.01"
        unknown = sorted(set(options) - {"allow"})
        if unknown:
            raise argparse.ArgumentTypeError(f"auto takes only allow=NAME|NAME|..., not {unknown}")
        if "allow" in options:
            options["allow"] = tuple(str(options["allow"]).split("|"))
        try:
            gradcomp.planner.options(options.get("allow", gradcomp.planner.SAFE), None)
        except (ValueError, TypeError) as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text.strip(), name, options
    try:
        compressor = gradcomp.get_compressor(
            name, **{k: v for k, v in options.items() if k not in HOOK_OPTIONS}
        )
        if "algorithm" in options:
            gradcomp.collectives.check_algorithm(compressor, options["algorithm"])
        if "inter_algorithm" in options:
            if options.get("algorithm") != "hierarchical":
                raise ValueError("inter_algorithm= goes with algorithm=hierarchical")
            gradcomp.collectives.check_algorithm(compressor, options["inter_algorithm"])
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip(), name, options


def _literal(text: str):
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def split_list(values: Sequence[str]) -> list[str]:
    """Items of a list option given space- or comma-separated (``int8 fp16`` or ``int8,fp16``).

    A comma followed by ``key=`` continues a compressor's options (``topk:ratio=0.1,exact=true``).
    """
    items = []
    for value in values:
        for piece in re.split(r",(?![^,:=]*=)", value):
            if piece.strip():
                items.append(piece.strip())
    return items


# ----------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``"unknown"`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def gpu_name() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine_kind() -> str:
    """A short name for file names: ``cpu2`` (2 CPUs, no GPU) or ``8xnvidia-h200``."""
    if torch.cuda.is_available():
        slug = re.sub(r"[^a-z0-9]+", "-", gpu_name().lower()).strip("-")
        return f"{torch.cuda.device_count()}x{slug}"
    return f"cpu{os.cpu_count()}"


def link_info() -> dict | None:
    """The link limit this process runs under (None: unlimited loopback or a real network)."""
    text = os.environ.get(LINK_ENV)
    return json.loads(text) if text else None


def machine(world_size: int, backend: str) -> dict:
    """The facts every result record carries."""
    link = link_info()
    gpu = gpu_name()
    link_text = (
        f"{link['rate']} (tc tbf on a namespace's loopback, shared by both directions)" if link else ""
    )
    summary = (
        f"{os.cpu_count()} CPUs ({cpu_model()}), {gpu or 'no GPU'}, torch {torch.__version__}, "
        f"{world_size} {backend} ranks" + (f", link {link['rate']}" if link else "")
    )
    return {
        "machine": summary,
        "kind": machine_kind(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "gpu": gpu or "",
        "torch": torch.__version__,
        "gradcomp": gradcomp.__version__,
        "revision": source_revision(),
        "world_size": world_size,
        "backend": backend,
        "link": link_text or "unlimited",
    }


def source_revision() -> str:
    """The git commit of the checkout the bench runs from (``-dirty`` with local changes), or ``""``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{commit}-dirty" if commit and dirty else commit


def loadavg() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


# ----------------------------------------------------------------------------- results


class Results:
    """Collects a run's records and writes them with the machine and the load average.

    Example:
        >>> results = Results("allreduce", machine(2, "gloo"), settings=vars(args))
        >>> results.write(records)  # bench/results/allreduce-cpu2-w2.{csv,json}
    """

    def __init__(
        self,
        benchmark: str,
        machine_facts: dict,
        settings: dict,
        directory: str = RESULTS,
        suffix: str | None = None,
    ):
        self.benchmark = benchmark
        self.machine = machine_facts
        self.settings = settings
        self.directory = directory
        self.load_start = loadavg()
        self.started = time.time()
        link = link_info()
        if suffix is None:
            suffix = f"-{link['rate']}" if link else ""
        self.stem = f"{benchmark}-{machine_facts['kind']}-w{machine_facts['world_size']}{suffix}"

    def path(self, extension: str) -> str:
        return os.path.join(self.directory, f"{self.stem}.{extension}")

    def write(self, records: list[dict], extra: dict | None = None) -> list[str]:
        """Write ``records`` as CSV (machine columns first) and JSON; returns the paths."""
        os.makedirs(self.directory, exist_ok=True)
        load_end = loadavg()
        facts = {
            **self.machine,
            "load_start": "/".join(map(str, self.load_start)),
            "load_end": "/".join(map(str, load_end)),
        }
        rows = [{**facts, **record} for record in records]
        columns = list(dict.fromkeys(key for row in rows for key in row))
        with open(self.path("csv"), "w", newline="") as file:
            writer = csv.DictWriter(file, columns)
            writer.writeheader()
            writer.writerows(rows)
        document = {
            "benchmark": self.benchmark,
            "command": " ".join(["python", *sys.argv]),
            "date": datetime.datetime.fromtimestamp(self.started).isoformat(timespec="seconds"),
            "seconds": round(time.time() - self.started, 1),
            "machine": self.machine,
            "load_start": self.load_start,
            "load_end": load_end,
            "settings": self.settings,
            **(extra or {}),
            "records": rows,
        }
        with open(self.path("json"), "w") as file:
            json.dump(document, file, indent=1, default=_jsonable)
        return [self.path("csv"), self.path("json")]


def _jsonable(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def format_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    groups: Sequence | None = None,
    left: Sequence[int] = (0,),
) -> str:
    """A fixed-width table: the ``left`` columns left-aligned (default the first), the others right.

    ``groups``, if given, is a list of ``(title, number of columns)`` printed
    centred above the header (e.g. one title per compressor).
    """
    left = {i % len(header) for i in left}
    widths = [max(len(str(line[i])) for line in (header, *rows)) for i in range(len(header))]
    lines = []
    if groups:
        cells, column = [], 0
        for title, span in groups:
            width = sum(widths[column : column + span]) + 2 * (span - 1)
            cells.append(title[:width].center(width) if title else " " * width)
            column += span
        lines.append("  ".join(cells).rstrip())

    def join(cells):
        return "  ".join(
            str(cell).ljust(width) if i in left else str(cell).rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    lines += [join(header), "  ".join("-" * width for width in widths), *map(join, rows)]
    return "\n".join(lines)


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or not denominator > 0:
        return math.nan
    return numerator / denominator


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """``value`` formatted, ``"-"`` for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


# ----------------------------------------------------------------------------- progress

# Where progress goes in a spawned rank whose stderr is captured to a log file.
_progress_stream = None


class Progress:
    """A progress bar on stderr (tqdm): done/total, elapsed time, a note.

    Off unless ``enabled`` (default: stderr is a terminal).

    Example:
        >>> progress = Progress(total=10, enabled=True)
        >>> progress.update(3, "int8 64M")
        >>> progress.close()
    """

    def __init__(self, total: int, enabled: bool | None = None):
        stream = _progress_stream or sys.stderr
        enabled = stream.isatty() if enabled is None else enabled
        self.bar = tqdm(
            total=max(total, 1), file=stream, disable=not enabled, leave=False, dynamic_ncols=True
        )

    def update(self, done: int, note: str = "") -> None:
        if self.bar.disable:
            return
        changed = note != self.bar.desc
        self.bar.set_description_str(note, refresh=False)
        self.bar.update(done - self.bar.n)
        if changed:
            self.bar.refresh()  # a new note shows at once, however soon after the last redraw

    def close(self) -> None:
        self.bar.close()


def add_common_options(parser: argparse.ArgumentParser, spawn_default: int | None = 2) -> None:
    """Options every script has: ranks to spawn, output folder, progress."""
    parser.add_argument(
        "--spawn",
        type=int,
        metavar="N",
        default=spawn_default,
        help="spawn N Gloo ranks on 127.0.0.1"
        + (f" (default {spawn_default})" if spawn_default else " (default: run under torchrun)"),
    )
    parser.add_argument("--out", default=RESULTS, help=f"folder for CSV/JSON/PNG (default {RESULTS})")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rewrite a progress line on stderr (default: when stderr is a terminal)",
    )


# ----------------------------------------------------------------------------- ranks


class RanksFailed(RuntimeError):
    """A spawned rank raised, died or hung; ``reason`` says how in one line, ``logs`` hold the rest."""

    def __init__(self, reason: str, logs: str):
        super().__init__(f"{reason}\n{logs}")
        self.reason = reason
        self.logs = logs


def threads_per_rank(world_size: int) -> int:
    """The CPU cores each rank of this machine may use."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _logged(rank, world_size, directory, body, *args):
    """``body`` with this rank's output in a log (shown if the run fails); progress keeps the terminal."""
    global _progress_stream
    _progress_stream = os.fdopen(os.dup(2), "w")
    log = os.open(os.path.join(directory, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        return body(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise


# The emulated cluster the ranks run in (EmulatedCluster), when the script made one.
_cluster: EmulatedCluster | None = None


def spawn(body: Callable, world_size: int, *args, timeout: float = 600.0):
    """Run ``body(rank, world_size, *args)`` on ``world_size`` spawned Gloo ranks
    (:func:`gradcomp.spawn.run_ranks`, the machine's cores split between them);
    rank 0's return value (JSON data) is returned here.

    Raises:
        RanksFailed: a rank raised, was killed (a native abort included) or
            was still running after ``timeout`` seconds; its log is attached.
    """
    if world_size < 2:
        raise ValueError(f"spawn at least 2 ranks (one rank has nothing to communicate), got {world_size}")
    with tempfile.TemporaryDirectory(prefix="gradcomp-bench-") as directory:
        try:
            return gradcomp.spawn.run_ranks(
                _logged,
                world_size,
                directory,
                body,
                *args,
                timeout=timeout + 60,
                group_timeout=timeout,
                threads=threads_per_rank(world_size),
                **(_cluster.spawn_options() if _cluster else {}),
            )
        except gradcomp.spawn.RanksFailed as error:
            logs = _logs(directory)
            raise RanksFailed(_reason(error, logs), logs) from None


def _logs(directory: str) -> str:
    parts = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".log"):
            with open(os.path.join(directory, name), errors="replace") as file:
                lines = [line for line in file.read().splitlines() if "hostname of the client" not in line]
            parts.append(f"--- {name} (last lines)\n" + "\n".join(lines[-25:]))
    return "\n".join(parts)


def _reason(error: Exception, logs: str) -> str:
    """One line: the native error or the exception of the failing rank, and how it ended."""
    lines = logs.splitlines()
    native = [line.split("what():", 1)[1].strip() for line in lines if "what():" in line]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    detail = (native[:1] or raised[-1:] or [""])[0]
    # Native messages start with the enforce location; the explanation follows it.
    detail = re.sub(r"^\[enforce fail at [^\]]*\]\s*", "", detail)
    ending = next((line.strip(" -") for line in str(error).splitlines() if line.strip()), "")
    ending = ending.removesuffix(" with the following error:") or type(error).__name__
    return f"{ending}: {detail}" if detail else ending


def torchrun_world() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def init_torchrun(timeout: float = 600.0) -> tuple[str, torch.device]:
    """``init_process_group`` from torchrun's environment: NCCL on GPUs, else Gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(threads_per_rank(int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return backend, device


# ----------------------------------------------------------------------------- limited links


def add_bandwidth_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bandwidth",
        type=str,
        metavar="RATE",
        help="run the ranks in a network namespace whose loopback is limited to RATE "
        "(a tc rate such as 1gbit or 100mbit, shared by both directions; needs root and iproute2)",
    )


def link_settings(rate: str) -> dict:
    """tc token-bucket settings for ``rate``: a burst of 2 ms at that rate, at least 256 KiB
    (above loopback's 64 KiB packets), and 50 ms of queue, which measured no drops at 1gbit."""
    bits = parse_rate(rate)
    burst = max(256 * 1024, int(bits / 8 * 0.002))
    return {"rate": rate.strip().lower(), "bits_per_second": bits, "burst_bytes": burst, "latency": "50ms"}


def run_limited(rate: str) -> int:
    """Re-run this script (same arguments) inside a fresh namespace limited to ``rate``.

    Returns the script's exit status, or 2 with a message on stderr when the
    machine cannot do it (not root, no ``ip``/``tc``). The namespace is
    deleted afterwards, whatever happens.
    """
    settings = link_settings(rate)
    if os.geteuid() != 0:
        sys.stderr.write(
            "--bandwidth needs root: it creates a network namespace and limits its loopback "
            "with tc. Run as root, or drop --bandwidth to run on the unlimited loopback.\n"
        )
        return 2
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        sys.stderr.write(f"--bandwidth needs {' and '.join(missing)} (iproute2), not found on PATH\n")
        return 2
    name = f"gradcomp-bench-{os.getpid()}-{secrets.token_hex(3)}"
    settings["namespace"] = name
    limit = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", settings["rate"]]
    limit += ["burst", str(settings["burst_bytes"]), "latency", settings["latency"]]
    inside = ["ip", "netns", "exec", name]
    try:
        subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run([*inside, *limit], check=True)
        sys.stderr.write(f"network namespace {name}: loopback limited to {settings['rate']}\n")
        env = {**os.environ, LINK_ENV: json.dumps(settings), "TORCH_CPP_LOG_LEVEL": "ERROR"}
        command = [*inside, sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
        return subprocess.run(command, env=env).returncode
    except subprocess.CalledProcessError as error:
        sys.stderr.write(f"could not set up the limited namespace: {error}\n")
        return 2
    finally:
        subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)


def maybe_run_limited(args: argparse.Namespace) -> None:
    """With ``--bandwidth``, outside a namespace: run the script inside one and exit with its status."""
    if args.bandwidth and link_info() is None:
        sys.exit(run_limited(args.bandwidth))


# ----------------------------------------------------------------------------- emulated cluster

_CLONE_NEWNET = 0x40000000
# The interface name of every node's link, in its own namespace.
NODE_INTERFACE = "gc0"


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
        help="each node's link to the others, each direction (a tc rate; default 1gbit)",
    )


class EmulatedCluster:
    """``nodes`` network namespaces joined by a bridge in a namespace of its
    own; each node's veth link limited to ``rate`` by a ``tc`` token bucket
    at both ends (what the node sends and what it receives), and its ranks
    talking over its own loopback without limit. Only addresses inside these
    namespaces are used; they are deleted on exit, whatever happens.

    The spawned ranks enter their node's namespace before they join the
    group (:meth:`spawn_options`) and see torchrun's ``LOCAL_WORLD_SIZE``,
    ``LOCAL_RANK`` and ``GROUP_RANK``.

    Example:
        >>> with EmulatedCluster(2, 2, "1gbit") as cluster:
        ...     spawn(body, cluster.world_size)
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
        check_root("an emulated cluster")
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

        limit = ["tbf", "rate", self.link["rate"], "burst", str(self.link["burst_bytes"])]
        limit += ["latency", self.link["latency"]]
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


def check_root(what: str) -> None:
    """Exit with a message unless root with iproute2."""
    if os.geteuid() != 0:
        sys.stderr.write(f"{what} needs root: it creates network namespaces and limits links with tc.\n")
        sys.exit(2)
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        sys.stderr.write(f"{what} needs {' and '.join(missing)} (iproute2), not found on PATH\n")
        sys.exit(2)


@contextlib.contextmanager
def cluster_from(args: argparse.Namespace):
    """The emulated cluster ``--nodes`` asks for (made current for :func:`spawn`), or None."""
    global _cluster
    if not getattr(args, "nodes", None):
        yield None
        return
    with EmulatedCluster(args.nodes, args.ranks_per_node, args.inter_bandwidth) as cluster:
        _cluster = cluster
        try:
            yield cluster
        finally:
            _cluster = None


def measure_levels(nbytes: int, ranks_per_node: int, iters: int = 3) -> dict:
    """In the ranks of an emulated cluster: the median time of a dense
    all-reduce of ``nbytes`` between two nodes (local rank 0 of nodes 0 and
    1) and inside node 0, and the rate each rank sends at (ring model)."""
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
