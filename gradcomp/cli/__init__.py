"""The ``gradcomp`` command line (also ``python -m gradcomp``): its parser, and the
demo; ``plan`` and ``probe`` run in :mod:`gradcomp.cli.plan` and :mod:`gradcomp.cli.probe`.

Example:
    $ python -m gradcomp demo
    $ python -m gradcomp demo --epochs 4 --compressors dense,int8,topk
    $ python -m gradcomp plan --numel 25M --bandwidth 10gbit --latency 20us
    $ python -m gradcomp probe --out profile.json
    $ python -m gradcomp plan --params 350M --world 16 --bandwidth 10gbit --profile profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import tempfile
import time

from gradcomp import demo, files, limited_link, planner
from gradcomp.cli import plan as plan_command
from gradcomp.cli import probe as probe_command
from gradcomp.units import argument, parse_count, parse_duration, parse_rate, parse_size, split_list

_RATE = argument(parse_rate)
_DURATION = argument(parse_duration)


def _rate_text(text: str) -> str:
    """A rate checked (``1gbit``) and kept as written, for a label."""
    _RATE(text)
    return text.strip().lower()


def _runs(text: str) -> list[str]:
    names = split_list(text)
    try:
        demo.check_runs(names)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return names


def _at_least(minimum: int):
    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return integer


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def _sizes(text: str) -> list[int]:
    sizes = [argument(parse_size)(part) for part in split_list(text)]
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one size")
    return sizes


def _world_sizes(text: str) -> list[int]:
    sizes = [_at_least(2)(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one world size")
    return sizes


def parser() -> argparse.ArgumentParser:
    """The argument parser of :func:`main`."""
    top = argparse.ArgumentParser(
        prog="gradcomp", description="Gradient compression for data-parallel PyTorch."
    )
    commands = top.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "demo",
        help="train a small MLP on CPU with every compressor and compare them",
        description=(
            "Train a small MLP on scikit-learn's digits data set with DistributedDataParallel "
            "over Gloo, once per compressor, and print bytes, step time, loss and accuracy."
        ),
    )
    run.add_argument("--epochs", type=_at_least(1), default=demo.Setup.epochs, help="passes over the data")
    run.add_argument("--world-size", type=_at_least(2), default=2, help="processes to spawn (default 2)")
    run.add_argument(
        "--link",
        type=_rate_text,
        help="each rank's link in the predicted column, where each step is predicted on it (default "
        f"--bandwidth's, else {demo.DEFAULT_LINK}): over loopback, faster than any network, "
        "compression does not pay",
    )
    run.add_argument(
        "--bandwidth",
        type=_rate_text,
        metavar="RATE",
        help="train every run again with the ranks behind links of RATE each (a tc-limited loopback "
        "in a network namespace of its own; needs root and iproute2) and add its step as a measured column",
    )
    run.add_argument("--rows-out", help=argparse.SUPPRESS)  # inside --bandwidth's namespace: the rows
    run.add_argument(
        "--compressors",
        type=_runs,
        default=list(demo.DEFAULT_RUNS),
        help=f"comma-separated runs (default {','.join(demo.DEFAULT_RUNS)}); 'dense' is DDP "
        "without a hook, 'fp16_hook' torch's fp16 hook, the others gradcomp compressors "
        "(name, name@value or name:k=v)",
    )
    plan = commands.add_parser(
        "plan",
        help="bytes per rank and predicted time of every compressor and algorithm as the world grows",
        description=(
            "The cost model: for each world size, compressor and algorithm, the bytes one rank "
            "sends in an all-reduce of NUMEL fp32 elements (from the payload layouts, as the "
            "statistics count them) and the time a ring schedule takes on links of the given "
            "rate (each rank's, bits per second each way) and latency per step. * marks each "
            "compressor's default algorithm."
        ),
    )
    plan.add_argument(
        "--numel",
        type=argument(parse_size),
        default=25 * 2**20,
        help="elements of the all-reduce (K, M, G suffixes; default 25M)",
    )
    plan.add_argument(
        "--params",
        type=argument(parse_count, positive=False),  # 0.4 is refused below: "at least 1"
        default=None,
        help="a model of this many parameters (K, M, G: thousands, millions, billions): print what "
        "each candidate costs a step in DDP buckets and what auto picks, instead of the sweep",
    )
    plan.add_argument("--world", type=_at_least(2), default=None, help="with --params: ranks (default 8)")
    plan.add_argument(
        "--dtype",
        choices=sorted(plan_command.DTYPES),
        default=None,
        help="with --params: the gradients' type (default fp32; bf16 and fp16 send half the bytes dense)",
    )
    plan.add_argument(
        "--bucket-mb", type=_positive, default=25.0, help="with --params: DDP bucket size in MB (default 25)"
    )
    plan.add_argument(
        "--compute-ms",
        type=_positive,
        default=None,
        help="with --params: forward and backward time of a step, for the bound on the step's speedup",
    )
    plan.add_argument(
        "--allow",
        default=",".join(planner.SAFE),
        help=f"with --params: auto's candidates (default {','.join(planner.SAFE)}; e.g. add topk@0.01)",
    )
    plan.add_argument(
        "--profile",
        default=None,
        help="with --params: a profile from 'gradcomp probe' (default: the stored profile of a 2-core CPU "
        "machine; none is stored for GPUs); --bandwidth and --latency, when given, replace its link",
    )
    plan.add_argument(
        "--node-size",
        type=_at_least(1),
        default=None,
        help="with --params: ranks per node; --bandwidth is then each rank's link between nodes (its "
        "share of the node's where they share one), and the hierarchical algorithm is weighed too",
    )
    plan.add_argument(
        "--intra-bandwidth",
        type=_RATE,
        default=None,
        help="with --node-size: each rank's link inside a node, bits per second each way, e.g. "
        "7200gbit (NVLink's 900 GB/s; default: the profile's link, measured inside one machine)",
    )
    plan.add_argument(
        "--intra-latency",
        type=_DURATION,
        default=None,
        help="with --node-size: per collective step inside a node, e.g. 5us (default: the profile's)",
    )
    plan.add_argument(
        "--world-sizes",
        type=_world_sizes,
        default=[2**i for i in range(1, 11)],
        help="comma-separated (default 2,4,...,1024)",
    )
    plan.add_argument(
        "--bandwidth",
        type=_RATE,
        default=None,
        help="each rank's link, bits per second each way as a NIC's rate is given, e.g. 1gbit, "
        "100gbit (default 10gbit, or the profile's with --params)",
    )
    plan.add_argument(
        "--latency",
        type=_DURATION,
        default=None,
        help="per collective step, e.g. 20us (default 20us, or the profile's with --params)",
    )
    plan.add_argument(
        "--compressors",
        default="none,bf16,int8,int4,sign,topk,randk",
        help="comma-separated compressor names",
    )
    plan.add_argument("--png", default=None, help="also plot bytes per rank against the world size here")
    probe = commands.add_parser(
        "probe",
        help="measure this machine's link and compressors and write a profile for plan and auto",
        description=(
            "Spawn Gloo ranks on 127.0.0.1, time a pingpong between two of them (one message's "
            "latency and bandwidth), dense all-reduces, all-gathers and all-to-alls of each "
            "size (fitting each one's latency per ring step and bandwidth per rank) and each "
            "compressor's compress and decompress (on CPUs beside a busy thread, by its CPU time), "
            "and write the profile as JSON. Each figure is the slowest rank's median."
        ),
    )
    probe.add_argument("--world-size", type=_at_least(2), default=2, help="processes to spawn (default 2)")
    probe.add_argument(
        "--sizes",
        type=_sizes,
        default=[2**12, 2**16, 2**20, 2**22],
        help="comma-separated all-reduce sizes in fp32 elements (default 4K,64K,1M,4M)",
    )
    probe.add_argument(
        "--codec-sizes",
        type=_sizes,
        default=[2**16, 2**20, 2**22, 2**24],
        help="comma-separated sizes the compressors are timed at, in fp32 elements (default "
        "64K,1M,4M,16M: up to the buckets of a large model, whose codecs run from memory, not cache)",
    )
    probe.add_argument(
        "--compressors",
        default="none,bf16,int8,int4,ternary,sign,topk,randk",
        help="comma-separated compressors to time (name, name@value or name:k=v)",
    )
    probe.add_argument("--repeat", type=_at_least(1), default=5, help="timings per size (median; default 5)")
    probe.add_argument("--out", default="gradcomp-profile.json", help="where to write the profile")
    return top


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = parser().parse_args(argv)
    if args.command == "plan":
        if args.params is None:
            options = (
                "world",
                "dtype",
                "compute_ms",
                "profile",
                "node_size",
                "intra_bandwidth",
                "intra_latency",
            )
            given = [f"--{k.replace('_', '-')}" for k in options if getattr(args, k) is not None]
            if given or args.allow != ",".join(planner.SAFE):
                sys.stderr.write(f"gradcomp plan: {', '.join(given) or '--allow'} needs --params\n")
                return 2
        return plan_command.ring_table(args) if args.params is None else plan_command.decide(args)
    if args.command == "probe":
        return probe_command.run(args)
    if importlib.util.find_spec("sklearn") is None:
        sys.stderr.write(
            "the demo trains on scikit-learn's digits, which is not installed: "
            'pip install -e ".[demo]" (or pip install scikit-learn)\n'
        )
        return 2
    if args.rows_out:  # one run behind the limited link, for the caller outside it
        rows = demo.run_demo(args.compressors, epochs=args.epochs, world_size=args.world_size)
        files.write_text(args.rows_out, json.dumps([dataclasses.asdict(row) for row in rows]))
        return 0
    unmet = args.bandwidth and limited_link.unmet_requirement("gradcomp demo --bandwidth")
    if unmet:  # said before training, not after
        sys.stderr.write(f"{unmet} Without it, the predicted column (--link) estimates a slow link.\n")
        return 2
    print(f"{demo.machine()}, {args.world_size} Gloo ranks", flush=True)
    began = time.perf_counter()
    rows = demo.run_demo(args.compressors, epochs=args.epochs, world_size=args.world_size)
    measured = None
    if args.bandwidth:
        measured = _rows_behind(args)
        if measured is None:
            return 2
    print(demo.describe(demo.Setup(epochs=args.epochs), rows))
    link = args.link or args.bandwidth or demo.DEFAULT_LINK
    print(demo.format_table(rows, link, measured=None if measured is None else (args.bandwidth, measured)))
    print(f"finished in {time.perf_counter() - began:.0f} s")
    return 0


def _rows_behind(args: argparse.Namespace) -> list | None:
    """The demo's runs trained again by a ``gradcomp demo`` inside a namespace whose
    loopback gives each rank ``args.bandwidth``; None (said on stderr) where that failed."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "rows.json")
        command = [sys.executable, "-m", "gradcomp", "demo", "--epochs", str(args.epochs)]
        command += ["--world-size", str(args.world_size), "--compressors", ",".join(args.compressors)]
        status = limited_link.run_limited(
            [*command, "--rows-out", out], args.bandwidth, args.world_size, "gradcomp demo --bandwidth"
        )
        if status != 0 or not os.path.exists(out):
            sys.stderr.write(f"gradcomp demo: the runs behind {args.bandwidth} links failed ({status})\n")
            return None
        with open(out) as file:
            return [demo.Row(**row) for row in json.load(file)]
