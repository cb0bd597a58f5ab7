"""``gradcomp demo``: will compression pay on my link? Train a 4.7M-parameter MLP on 2 Gloo
ranks once per compressor, time each step behind a ``tc``-limited link where the machine
lets it (root and iproute2) or predict it from the bytes otherwise, and end with a verdict
line a compressor against dense (``--plot``: the step against the link's rate as a PNG).
``--small`` trains the 85K-parameter MLP on digits instead, where it pays only on far slower links.

Example:
    $ python -m gradcomp demo --plot demo.png
    $ python -m gradcomp demo --link 100mbit --compressors dense,int8,int4
    $ python -m gradcomp demo --small --epochs 4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import subprocess
import sys
import time

from gradcomp import demo, limited_link
from gradcomp.cli import verdict
from gradcomp.units import argument, at_least, format_rate, parse_rate, split_list

INSTALL = 'pip install -e ".[demo]"'


def _rate_text(text: str) -> str:
    """A rate checked (``1gbit``) and kept as written, for a label."""
    argument(parse_rate)(text)
    return text.strip().lower()


def _runs(text: str) -> list[str]:
    names = split_list(text)
    try:
        demo.check_runs(names)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return names


def add_parser(commands) -> None:
    """Add ``demo`` and its options to the top parser's subcommands."""
    run = commands.add_parser(
        "demo",
        help="train a 4.7M-parameter MLP with each compressor and say whether it pays on a slow link",
        description=(
            "Train a 4.7M-parameter MLP on a synthetic task with DistributedDataParallel over Gloo, "
            "once per compressor with the same seed and data, and end with a line per compressor: "
            "its step against dense's on a link of --link a rank (measured behind a tc-limited "
            "loopback where the machine lets it, predicted from the bytes otherwise) and its "
            "held-out loss against dense's."
        ),
    )
    run.add_argument(
        "--link",
        type=_rate_text,
        metavar="RATE",
        help=f"each rank's link for the verdict (default {demo.DEFAULT_LINK}): measured behind tc as root "
        "with iproute2, predicted from each run's loopback step and bytes otherwise",
    )
    run.add_argument(
        "--bandwidth",
        type=_rate_text,
        metavar="RATE",
        help="--link RATE, measured or refused: each run steps on behind a tc-limited loopback in a "
        "network namespace of its own (needs root and iproute2)",
    )
    run.add_argument(
        "--predicted", action="store_true", help="predict the step at --link; do not measure it behind tc"
    )
    run.add_argument("--plot", metavar="FILE.png", help="write the step time against the link's rate here")
    run.add_argument(
        "--compressors",
        type=_runs,
        help=f"comma-separated runs (default {','.join(demo.DEFAULT_RUNS)}; with --small "
        f"{','.join(demo.SMALL_RUNS)}); 'dense' is DDP without a hook and must be there, "
        "'fp16_hook' torch's fp16 hook, the others gradcomp compressors (name, name@value or name:k=v)",
    )
    run.add_argument(
        "--steps",
        type=at_least(1),
        help=f"training steps of each run (default {demo.DEFAULT.steps}; not with --small)",
    )
    run.add_argument(
        "--small",
        action="store_true",
        help="the 85K-parameter MLP on scikit-learn's digits instead (340 KB a step: compression "
        "pays only on links far slower than its step), with more compressors and their error",
    )
    run.add_argument(
        "--epochs",
        type=at_least(1),
        help=f"with --small: passes over the digits (default {demo.SMALL.epochs})",
    )
    run.add_argument("--world-size", type=at_least(2), default=2, help="processes to spawn (default 2)")
    run.set_defaults(run=main)


def _refusal(args: argparse.Namespace) -> str | None:
    """Why the options cannot run, checked before any training; None where they can."""
    if args.link and args.bandwidth:
        return "give --link or --bandwidth, not both"
    if args.predicted and args.bandwidth:
        return "--bandwidth measures the link and --predicted does not: give one"
    if args.small and args.steps:
        return "--steps is the default demo's; with --small give --epochs"
    if args.epochs and not args.small:
        return "--epochs is --small's; the default demo takes --steps"
    if args.small and importlib.util.find_spec("sklearn") is None:
        return f"--small trains on scikit-learn's digits, which is not installed: {INSTALL} (or scikit-learn)"
    if args.plot:
        return _plot_refusal(args.plot)
    return None


def _plot_refusal(path: str) -> str | None:
    folder = os.path.dirname(os.path.abspath(path))
    if importlib.util.find_spec("matplotlib") is None:
        return f"--plot draws with matplotlib, which is not installed: {INSTALL} (or pip install matplotlib)"
    if not path.lower().endswith(".png"):
        return f"--plot writes a PNG: give a path ending in .png, got {path!r}"
    if os.path.isdir(path):
        return f"--plot {path!r} is a folder: give a file's path, such as {os.path.join(path, 'demo.png')!r}"
    if not os.path.isdir(folder):
        return f"--plot {path!r}: there is no folder {folder!r}"
    if not os.access(folder, os.W_OK):
        return f"--plot {path!r}: cannot write in {folder!r}"
    return None


def setup_of(args: argparse.Namespace) -> demo.Setup:
    """The demo's settings with the options' changes."""
    if args.small:
        return dataclasses.replace(demo.SMALL, epochs=args.epochs or demo.SMALL.epochs)
    steps = args.steps or demo.DEFAULT.steps
    return dataclasses.replace(demo.DEFAULT, train_samples=steps * demo.DEFAULT.batch_size)


def main(args: argparse.Namespace) -> int:
    """Run ``gradcomp demo``; returns the exit status."""
    refusal = _refusal(args)
    if refusal:
        sys.stderr.write(f"gradcomp demo: {refusal}\n")
        return 2
    link = args.bandwidth or args.link or demo.DEFAULT_LINK
    unmet = limited_link.unmet_requirement("measuring the link")
    if args.bandwidth and unmet:  # said before training, not after
        sys.stderr.write(f"gradcomp demo --bandwidth: {unmet} Without it, --link {link} predicts the step.\n")
        return 2
    measure = not (args.predicted or unmet)
    setup = setup_of(args)
    names = args.compressors or list(demo.SMALL_RUNS if args.small else demo.DEFAULT_RUNS)
    print(f"{demo.machine()}, {args.world_size} Gloo ranks", flush=True)
    began = time.perf_counter()
    try:
        with limited_link.Namespace("measuring the link") if measure else contextlib.nullcontext() as name:
            settings = limited_link.link_settings(link, args.world_size) if measure else None
            rows = demo.run_demo(
                names, setup, world_size=args.world_size, link=(name, settings) if measure else None
            )
    except subprocess.CalledProcessError as error:
        sys.stderr.write(f"gradcomp demo: could not make the network namespace ({error}); try --predicted\n")
        return 2
    print(demo.describe(setup, rows))
    print(verdict.format_rows(rows, link))
    print(f"trained in {time.perf_counter() - began:.0f} s\n")
    print(_how(link, measure, "--predicted" if args.predicted else unmet))
    print(_loss_note(setup))
    print("\n".join(verdict.verdict_lines(rows, link)))
    if args.plot:
        title = f"{demo.parameters(setup):,}-parameter MLP, {args.world_size} Gloo ranks"
        verdict.plot(rows, link, args.plot, title)
        print(f"plot: {args.plot}")
    return 0


def _how(link: str, measure: bool, why_not: str | None) -> str:
    rate = format_rate(parse_rate(link))
    if measure:
        return f"step at {rate} a rank measured: each run stepped on behind a tc-limited loopback"
    why = "" if why_not == "--predicted" else f" ({why_not.rstrip('.')})"
    return f"step at {rate} a rank predicted: each run's loopback step plus its bytes at that rate{why}"


def _loss_note(setup: demo.Setup) -> str:
    held_out = demo.DIGITS_SAMPLES[1] if setup.task == "digits" else demo.TEST_SAMPLES
    return (
        f"loss: cross-entropy on {held_out} held-out samples after {setup.steps} steps, the same seed and "
        "data for every run; a short run: it shows how each compressor slows early learning, not where "
        "a long run ends"
    )
