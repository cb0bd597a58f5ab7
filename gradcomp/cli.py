"""The ``gradcomp`` command line (also ``python -m gradcomp``).

Example:
    $ python -m gradcomp demo
    $ python -m gradcomp demo --epochs 4 --compressors dense,int8,topk
"""

from __future__ import annotations

import argparse
import time

from gradcomp import demo


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
    return top


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = parser().parse_args(argv)
    print(f"{demo.machine()}, {args.world_size} Gloo ranks", flush=True)
    began = time.perf_counter()
    rows = demo.run_demo(args.compressors, epochs=args.epochs, world_size=args.world_size)
    print(demo.describe(demo.Setup(epochs=args.epochs), rows))
    print(demo.format_table(rows))
    print(f"finished in {time.perf_counter() - began:.0f} s")
    return 0
