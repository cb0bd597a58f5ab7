"""``--bandwidth RATE``: the ranks talk as over links of RATE each, a ``tc``-limited loopback.

RATE is each rank's link in bits per second each way (``1gbit``, ``100mbit``):
the script runs again (same arguments) inside a network namespace of its own
(:mod:`gradcomp.limited_link` says how the loopback is limited). Needs root and
iproute2.

Results made before this meaning name the loopback's whole limit instead
(bench/reports/auto-sweeps-cpu2-2026.md says which).

Example:
    >>> maybe_run_limited(args)  # outside a namespace with --bandwidth: runs inside one, exits
"""

from __future__ import annotations

import argparse
import os
import sys

from gradcomp.limited_link import link_info, link_settings, run_limited  # noqa: F401 (tests use link_settings)


def add_bandwidth_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bandwidth",
        type=str,
        metavar="RATE",
        help="each rank's link, bits per second each way (a tc rate such as 1gbit or 100mbit): the "
        "ranks run in a network namespace whose loopback is limited to RATE times the ranks "
        "(needs root and iproute2)",
    )


def describe(limit: dict) -> str:
    return (
        f"{limit['rate']} a rank, each way (tc tbf at {limit['tc_rate']} on a namespace's "
        f"loopback, which carries the {limit['ranks']} ranks' sends)"
    )


def loopback_seconds(nbytes: float, limit: dict) -> float:
    """The least time ``nbytes`` sent in all (every rank's sends) take through the loopback."""
    return nbytes * 8 / limit["tc_bits_per_second"]


def maybe_run_limited(args: argparse.Namespace) -> None:
    """With ``--bandwidth``, outside a namespace: run the script inside one and exit with its status."""
    if args.bandwidth and link_info() is None:
        ranks = args.spawn or int(os.environ.get("WORLD_SIZE", 2))
        command = [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
        sys.exit(run_limited(command, args.bandwidth, ranks))
