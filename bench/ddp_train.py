"""End to end: DDP training steps of a ~25M-parameter MLP with each way of communicating.

Every run trains the same model (same seed, same synthetic data, SGD with
momentum) for ``--steps`` steps on spawned Gloo ranks and reports the median
step time over the steps after ``--warmup-steps`` (each step after a
barrier; a step's time is the slowest rank's). The runs:

* ``compute only``: a no-op comm hook (no communication at all): the compute
  time of a step;
* ``dense``: DDP without a hook (fp32 all-reduce);
* ``torch fp16 hook`` and ``torch PowerSGD`` (rank 4, ``start_powerSGD_iter=2``;
  in ranks of its own, retried with the whole model in one bucket where Gloo
  aborts on its callback-issued collectives);
* each gradcomp run: ``gradcomp.ddp.register`` with the spec's compressor and
  options (``int8``, ``topk@0.001``, ``int8:algorithm=hierarchical``, ``auto``),
  ``measure_error=False``.

Communication time = step time - the compute-only step time: compression on
the CPU as well as the transfers. Bytes per step are what one rank sends
under the ring model. After the first round's runs the ranks probe the link
and the static runs' codecs, and the cost model predicts each static run's
communication from that probe.

``--rounds N`` runs the list N times and pools the timed steps; ``--interleave``
steps the runs in turn, so that a machine whose speed drifts slows every run
alike. ``--bandwidth RATE`` gives each rank a link of RATE (:mod:`lib.link`);
``--bandwidth RATE,RATE,...,none`` sweeps links and judges auto against the
best static choice at each (:mod:`lib.ddp_sweep`). ``--nodes N`` runs on an
emulated cluster (:mod:`lib.cluster`) with flat and hierarchical int8,
hierarchical int4 and Top-K, and auto, after checking the emulation.

Examples:
    python bench/ddp_train.py
    python bench/ddp_train.py --bandwidth 500mbit --rounds 3          # needs root
    python bench/ddp_train.py --compressors bf16 int8 int4 auto --baselines --interleave \\
        --rounds 2 --bandwidth 50mbit,500mbit,5gbit,none
    python bench/ddp_train.py --nodes 2 --ranks-per-node 2 --inter-bandwidth 1gbit
    python bench/ddp_train.py --compressors int8 topk:ratio=0.001 --steps 20
    python bench/ddp_train.py --compressors int8 --profile traces/     # a trace of each run's last step
"""

from __future__ import annotations

import argparse
import os
import sys

from lib.cluster import add_cluster_options, add_link_check_option, describe_check
from lib.ddp_report import (
    add_predictions,
    derive,
    describe,
    describe_link,
    describe_model,
    describe_probe,
    format_report,
    plot,
)
from lib.ddp_schedule import execute
from lib.ddp_sweep import sweep
from lib.ddp_training import LABELS
from lib.link import add_bandwidth_option, maybe_run_limited
from lib.options import add_common_options
from lib.results import publish
from lib.spawning import on_cluster
from lib.specs import parse_run

from gradcomp import planner
from gradcomp.units import parse_rate, split_list

DEFAULT_COMPRESSORS = ("int8", "int4", "sign", "topk", "randk")

BASELINES = ("fp16_hook", "powersgd")

# On an emulated cluster: flat int8 against the hierarchical algorithm, and what auto picks.
CLUSTER_COMPRESSORS = (
    "int8:algorithm=two_phase",
    "int8:algorithm=hierarchical",
    "int4:algorithm=hierarchical",
    "topk:algorithm=hierarchical",
    "auto",
)

CLUSTER_BASELINES = ("fp16_hook",)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Ranks are spawned Gloo processes on 127.0.0.1 (each with its share of the cores).",
    )
    top.add_argument(
        "--compressors",
        nargs="*",
        metavar="NAME[:k=v,...]",
        help=f"gradcomp compressors (default: {' '.join(DEFAULT_COMPRESSORS)}; topk and randk keep 1%%; "
        f"with --nodes: {' '.join(CLUSTER_COMPRESSORS)})",
    )
    top.add_argument(
        "--baselines",
        nargs="*",
        choices=BASELINES,
        help="torch hooks to compare as well (default: both; with --nodes: fp16_hook); "
        "dense and compute only always run",
    )
    top.add_argument("--steps", type=int, default=12, help="training steps per run (default 12)")
    top.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the whole list this many times, interleaved, and pool the timed steps "
        "(evens out drift on a noisy machine; default 1)",
    )
    top.add_argument(
        "--interleave",
        action="store_true",
        help="step the runs in turn (one timed step of each, in rotating order) instead of one "
        "run after another, so that drift slows every run alike (every run's model is in "
        "memory at once)",
    )
    top.add_argument(
        "--warmup-steps", type=int, default=3, help="first steps left out of the timing (default 3, min 2)"
    )
    top.add_argument("--batch-size", type=int, default=64, help="samples per rank and step (default 64)")
    top.add_argument("--features", type=int, default=2048, help="MLP input width (default 2048)")
    top.add_argument("--width", type=int, default=4096, help="MLP hidden width (default 4096: 25.2M params)")
    top.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size (default 25)")
    top.add_argument("--lr", type=float, default=0.03, help="SGD learning rate (default 0.03)")
    add_link_check_option(top, "64MiB")
    top.add_argument(
        "--profile",
        metavar="DIR",
        help="write a PyTorch profiler trace of each run's last step (rank 0, every thread, "
        "gradcomp's ranges included) into DIR",
    )
    add_common_options(top)
    add_bandwidth_option(top)
    add_cluster_options(top)
    return top


def plan(args: argparse.Namespace) -> list[dict]:
    """The runs in table order: compute only, dense, torch baselines, gradcomp compressors."""
    runs = [dict(kind=kind, label=LABELS[kind]) for kind in ("compute", "dense")]
    if "fp16_hook" in args.baselines:
        runs.append(dict(kind="fp16_hook", label=LABELS["fp16_hook"]))
    if "powersgd" in args.baselines:
        runs.append(dict(kind="powersgd", label=LABELS["powersgd"]))
    for spec in args.compressors:
        label, name, options = parse_run(spec)
        runs.append(dict(kind="gradcomp", label=label, name=name, options=options))
    return runs


def check_links(args: argparse.Namespace, rates: list[str]) -> None:
    """Exit with the parser's message where a rate is not one, or the link options clash."""
    if args.nodes and rates not in ([], ["none"]):
        parser().error("--bandwidth limits one namespace's loopback; with --nodes use --inter-bandwidth")
    if args.nodes is not None and (args.nodes < 2 or args.ranks_per_node < 1):
        parser().error("--nodes needs at least 2 nodes and --ranks-per-node at least 1")
    try:
        for rate in [*rates, *([args.inter_bandwidth] if args.nodes else [])]:
            if rate != "none":
                parse_rate(rate)
    except ValueError as error:
        parser().error(str(error))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rates = [rate.lower() for rate in split_list(args.bandwidth or "")]
    check_links(args, rates)
    if len(rates) > 1:
        return sweep(os.path.abspath(__file__), args, rates, sys.argv[1:] if argv is None else argv)
    args.bandwidth = None if rates == ["none"] else args.bandwidth
    cluster_mode = bool(args.nodes)
    if cluster_mode:
        args.spawn = args.nodes * args.ranks_per_node
    maybe_run_limited(args)
    if args.compressors is None:
        args.compressors = list(CLUSTER_COMPRESSORS if cluster_mode else DEFAULT_COMPRESSORS)
    if args.baselines is None:
        args.baselines = list(CLUSTER_BASELINES if cluster_mode else BASELINES)
    args.compressors = split_list(args.compressors)
    try:
        runs = plan(args)
    except argparse.ArgumentTypeError as error:
        parser().error(str(error))
    if args.warmup_steps < 2 or args.steps <= args.warmup_steps or args.spawn < 2 or args.rounds < 1:
        parser().error(
            "need --warmup-steps >= 2 (PowerSGD starts at step 2), --steps > --warmup-steps, --spawn >= 2, "
            "--rounds >= 1"
        )
    for position, run in enumerate(runs, 1):
        run["position"] = position
    settings = {**vars(args), "total_runs": len(runs)}
    results, outcome = on_cluster("ddp_train", args, settings, lambda: execute(runs, settings))
    if outcome is None:
        return 1
    check, probed, records = outcome
    derive(records)
    add_predictions(records, args.spawn, probed)
    print(describe(settings, records))
    if cluster_mode:
        print(describe_check(check, results.machine, args.inter_bandwidth))
    else:
        print(describe_link(check))
    print(format_report(records))
    print(describe_probe(planner.Profile.from_json(probed)))
    summary = describe_model(records)
    if summary:
        print(summary)
    publish(results, records, plot, extra=dict(link_check=check, probe=probed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
