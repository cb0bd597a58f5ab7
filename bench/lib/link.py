"""``--bandwidth RATE``: the ranks talk as over links of RATE each, a ``tc``-limited loopback.

RATE is each rank's link in bits per second each way, as a NIC's rate is given
and as ``gradcomp plan --bandwidth`` takes it (``1gbit``, ``100mbit``). The
script runs again (same arguments) inside a network namespace of its own
whose loopback a ``tc`` token bucket limits to RATE times the ranks: the
loopback carries every rank's sends, and in a ring collective every rank
sends at once, so each gets RATE. Needs root and iproute2; the namespace is
deleted afterwards, whatever happens.

Results made before this meaning name the loopback's whole limit instead
(bench/reports/auto-sweeps-cpu2-2026.md says which).

Example:
    >>> maybe_run_limited(args)  # outside a namespace with --bandwidth: runs inside one, exits
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys

from gradcomp.units import parse_rate

# Set in the environment of a script re-run inside a limited namespace: the link's settings (JSON).
LINK_ENV = "GRADCOMP_BENCH_LINK"


def add_bandwidth_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bandwidth",
        type=str,
        metavar="RATE",
        help="each rank's link, bits per second each way (a tc rate such as 1gbit or 100mbit): the "
        "ranks run in a network namespace whose loopback is limited to RATE times the ranks "
        "(needs root and iproute2)",
    )


def link_info() -> dict | None:
    """The link limit this process runs under (None: unlimited loopback or a real network)."""
    text = os.environ.get(LINK_ENV)
    return json.loads(text) if text else None


def describe(limit: dict) -> str:
    return (
        f"{limit['rate']} a rank, each way (tc tbf at {limit['tc_rate']} on a namespace's "
        f"loopback, which carries the {limit['ranks']} ranks' sends)"
    )


def link_settings(rate: str, ranks: int = 1) -> dict:
    """tc token-bucket settings for one interface that ``ranks`` ranks share, each at ``rate``
    (the bucket's rate ``rate`` times ``ranks``): a burst of 2 ms at that rate, at least
    256 KiB (above loopback's 64 KiB packets), and 50 ms of queue, which measured no drops
    at 1gbit."""
    bits = parse_rate(rate)
    shared = bits * ranks
    return {
        "rate": rate.strip().lower(),
        "bits_per_second": bits,
        "ranks": ranks,
        "tc_rate": f"{shared:.0f}bit",
        "tc_bits_per_second": shared,
        "burst_bytes": max(256 * 1024, int(shared / 8 * 0.002)),
        "latency": "50ms",
    }


def token_bucket(settings: dict) -> list[str]:
    """The ``tc qdisc add ... root`` arguments that limit an interface to ``settings``."""
    return [
        "tbf", "rate", settings["tc_rate"], "burst", str(settings["burst_bytes"]),
        "latency", settings["latency"],
    ]  # fmt: skip


def loopback_seconds(nbytes: float, limit: dict) -> float:
    """The least time ``nbytes`` sent in all (every rank's sends) take through the loopback."""
    return nbytes * 8 / limit["tc_bits_per_second"]


def unmet_requirement(what: str) -> str | None:
    """Why ``what`` cannot make namespaces here (not root, no ``ip``/``tc``), or None."""
    if os.geteuid() != 0:
        return f"{what} needs root: it creates network namespaces and limits links with tc."
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{what} needs {' and '.join(missing)} (iproute2), not found on PATH"
    return None


def run_limited(rate: str, ranks: int) -> int:
    """Re-run this script (same arguments) inside a fresh namespace whose loopback gives each
    of ``ranks`` ranks ``rate``.

    Returns the script's exit status, or 2 with a message on stderr when the
    machine cannot do it (not root, no ``ip``/``tc``).
    """
    settings = link_settings(rate, ranks)
    unmet = unmet_requirement("--bandwidth")
    if unmet:
        sys.stderr.write(f"{unmet} Drop --bandwidth to run on the unlimited loopback.\n")
        return 2
    name = f"gradcomp-bench-{os.getpid()}-{secrets.token_hex(3)}"
    inside = ["ip", "netns", "exec", name]
    try:
        subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(
            [*inside, "tc", "qdisc", "add", "dev", "lo", "root", *token_bucket(settings)], check=True
        )
        sys.stderr.write(
            f"network namespace {name}: loopback limited to {settings['tc_rate']}, "
            f"{settings['rate']} for each of {ranks} ranks\n"
        )
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
        sys.exit(run_limited(args.bandwidth, args.spawn or int(os.environ.get("WORLD_SIZE", 2))))
