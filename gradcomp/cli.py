"""The ``gradcomp`` command line (also ``python -m gradcomp``).

Example:
    $ python -m gradcomp demo
    $ python -m gradcomp demo --epochs 4 --compressors dense,int8,topk
    $ python -m gradcomp plan --numel 25M --bandwidth 10gbit --latency 20us
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time

from gradcomp import demo

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}
_RATES = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "gb": 1e9, "mb": 1e6}
_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
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


def _quantity(units: dict[str, float], what: str, integer: bool = False):
    def parse(text: str):
        match = re.fullmatch(r"([0-9.]+)\s*([a-z]*)", text.strip().lower())
        if not match or match.group(2) not in units:
            raise argparse.ArgumentTypeError(
                f"{what}: expected a number with one of {sorted(units)}, got {text!r}"
            )
        value = float(match.group(1)) * units[match.group(2)]
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {text!r}")
        return int(value) if integer else value

    return parse


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
        "--compressors",
        type=_names,
        default=list(demo.DEFAULT_RUNS),
        help=f"comma-separated runs (default {','.join(demo.DEFAULT_RUNS)}); 'dense' is DDP "
        "without a hook, 'fp16_hook' torch's fp16 hook, the others gradcomp compressors",
    )
    plan = commands.add_parser(
        "plan",
        help="bytes per rank and predicted time of every compressor and algorithm as the world grows",
        description=(
            "The scale model: for each world size, compressor and algorithm, the bytes one rank "
            "sends in an all-reduce of NUMEL fp32 elements (from the payload layouts, as the "
            "statistics count them) and the time a ring schedule takes on a link of the given "
            "bandwidth per rank and latency per step. * marks each compressor's default algorithm."
        ),
    )
    plan.add_argument(
        "--numel",
        type=_quantity(_UNITS, "numel", integer=True),
        default=25 * 2**20,
        help="elements of the all-reduce (K, M, G suffixes; default 25M)",
    )
    plan.add_argument(
        "--world-sizes",
        type=_world_sizes,
        default=[2**i for i in range(1, 11)],
        help="comma-separated (default 2,4,...,1024)",
    )
    plan.add_argument(
        "--bandwidth",
        type=_quantity(_RATES, "bandwidth"),
        default=10e9 / 8,
        help="per rank, e.g. 1gbit, 100gbit, 25gb (bytes/s; default 10gbit)",
    )
    plan.add_argument(
        "--latency",
        type=_quantity(_TIMES, "latency"),
        default=20e-6,
        help="per collective step, e.g. 20us (default)",
    )
    plan.add_argument(
        "--compressors",
        default="none,bf16,int8,int4,sign,topk,randk",
        help="comma-separated compressor names",
    )
    plan.add_argument("--png", default=None, help="also plot bytes per rank against the world size here")
    return top


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = parser().parse_args(argv)
    if args.command == "plan":
        return _plan(args)
    if importlib.util.find_spec("sklearn") is None:
        sys.stderr.write(
            "the demo trains on scikit-learn's digits, which is not installed: "
            'pip install -e ".[demo]" (or pip install scikit-learn)\n'
        )
        return 2
    print(f"{demo.machine()}, {args.world_size} Gloo ranks", flush=True)
    began = time.perf_counter()
    rows = demo.run_demo(args.compressors, epochs=args.epochs, world_size=args.world_size)
    print(demo.describe(demo.Setup(epochs=args.epochs), rows))
    print(demo.format_table(rows))
    print(f"finished in {time.perf_counter() - began:.0f} s")
    return 0


def _plan(args) -> int:
    from gradcomp.collectives import scale

    names = [name.strip() for name in args.compressors.split(",") if name.strip()]
    link = scale.Link(args.bandwidth, args.latency)
    records = scale.table(names, args.numel, args.world_sizes, link)
    print(
        f"all-reduce of {args.numel:,} fp32 elements; link {args.bandwidth * 8 / 1e9:g} Gbit/s per rank, "
        f"{args.latency * 1e6:g} us per step; bytes one rank sends (ring model) and predicted ms"
    )
    header = ["compressor", "algorithm"] + [f"W={w}" for w in args.world_sizes]
    lines = []
    for (name, algorithm), group in _grouped(records).items():
        cells = [
            f"{r['bytes_sent'] / 1e6:.3g} MB {r['seconds'] * 1e3:.3g} ms{'*' if r['default'] else ''}"
            for r in group
        ]
        lines.append([name, algorithm, *cells])
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *lines]:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    if args.png:
        _plot(records, args, args.png)
        print(f"wrote {args.png}")
    return 0


def _grouped(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        groups.setdefault((record["compressor"], record["algorithm"]), []).append(record)
    return groups


def _plot(records: list[dict], args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for (name, algorithm), group in _grouped(records).items():
        axes.plot(
            [r["world_size"] for r in group],
            [r["bytes_sent"] for r in group],
            marker="o",
            label=f"{name} {algorithm}",
        )
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("ranks")
    axes.set_ylabel("bytes one rank sends")
    axes.set_title(f"all-reduce of {args.numel:,} fp32 elements (ring model)")
    axes.legend(fontsize=7)
    figure.savefig(path, dpi=100, bbox_inches="tight")
