"""``gradcomp plan``: the ring model's table and plot (``--numel``), or the planner's
report for a model (``--params``): every candidate predicted, and what auto picks."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from gradcomp import planner
from gradcomp.tables import format_table
from gradcomp.units import (
    argument,
    at_least,
    parse_count,
    parse_duration,
    parse_rate,
    parse_size,
    positive_number,
    split_list,
)

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype
# Options that only --params reads.
PARAMS_OPTIONS = ("world", "dtype", "compute_ms", "profile", "node_size", "intra_bandwidth", "intra_latency")


def _world_sizes(text: str) -> list[int]:
    sizes = [at_least(2)(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one world size")
    return sizes


def add_parser(commands) -> None:
    """Add ``plan`` and its options to the top parser's subcommands."""
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
    plan.add_argument("--world", type=at_least(2), default=None, help="with --params: ranks (default 8)")
    plan.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="with --params: the gradients' type (default fp32; bf16 and fp16 send half the bytes dense)",
    )
    plan.add_argument(
        "--bucket-mb",
        type=positive_number,
        default=25.0,
        help="with --params: DDP bucket size in MB (default 25)",
    )
    plan.add_argument(
        "--compute-ms",
        type=positive_number,
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
        type=at_least(1),
        default=None,
        help="with --params: ranks per node; --bandwidth is then each rank's link between nodes (its "
        "share of the node's where they share one), and the hierarchical algorithm is weighed too",
    )
    plan.add_argument(
        "--intra-bandwidth",
        type=argument(parse_rate),
        default=None,
        help="with --node-size: each rank's link inside a node, bits per second each way, e.g. "
        "7200gbit (NVLink's 900 GB/s; default: the profile's link, measured inside one machine)",
    )
    plan.add_argument(
        "--intra-latency",
        type=argument(parse_duration),
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
        type=argument(parse_rate),
        default=None,
        help="each rank's link, bits per second each way as a NIC's rate is given, e.g. 1gbit, "
        "100gbit (default 10gbit, or the profile's with --params)",
    )
    plan.add_argument(
        "--latency",
        type=argument(parse_duration),
        default=None,
        help="per collective step, e.g. 20us (default 20us, or the profile's with --params)",
    )
    plan.add_argument(
        "--compressors",
        default="none,bf16,int8,int4,sign,topk,randk",
        help="comma-separated compressor names",
    )
    plan.add_argument("--png", default=None, help="also plot bytes per rank against the world size here")
    plan.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    """Run ``gradcomp plan``: the ring table, or with ``--params`` the planner's report."""
    if args.params is None:
        given = [f"--{k.replace('_', '-')}" for k in PARAMS_OPTIONS if getattr(args, k) is not None]
        if given or args.allow != ",".join(planner.SAFE):
            sys.stderr.write(f"gradcomp plan: {', '.join(given) or '--allow'} needs --params\n")
            return 2
        return ring_table(args)
    return decide(args)


def ring_table(args) -> int:
    from gradcomp.collectives import cost_model

    names = split_list(args.compressors)
    if not names:
        sys.stderr.write("gradcomp plan: --compressors names no compressor\n")
        return 2
    link = cost_model.Link((args.bandwidth or 10e9) / 8, 20e-6 if args.latency is None else args.latency)
    try:
        records = cost_model.table(names, args.numel, args.world_sizes, link)
    except (ValueError, TypeError) as error:
        sys.stderr.write(f"gradcomp plan: {error}\n")
        return 2
    print(
        f"all-reduce of {args.numel:,} fp32 elements; link {link.bandwidth * 8 / 1e9:g} Gbit/s per rank, "
        f"{link.latency * 1e6:g} us a ring step; bytes one rank sends (ring model) and predicted ms"
    )
    header = ["compressor", "algorithm"] + [f"W={w}" for w in args.world_sizes]
    lines = []
    for (name, algorithm), group in _grouped(records).items():
        cells = [
            f"{r['bytes_sent'] / 1e6:.3g} MB {r['seconds'] * 1e3:.3g} ms{'*' if r['default'] else ''}"
            for r in group
        ]
        lines.append([name, algorithm, *cells])
    print(format_table(header, lines, left=()))
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


def _buckets(params: int, bucket_mb: float, itemsize: int = 4) -> list[int]:
    """The model's parameters of ``itemsize`` bytes in DDP buckets of ``bucket_mb`` MB
    (the last one short)."""
    per = max(1, int(bucket_mb * 2**20 // itemsize))
    return [per] * (params // per) + ([params % per] if params % per else [])


def decide(args) -> int:
    import torch

    from gradcomp.collectives import cost_model

    if args.params < 1:
        sys.stderr.write("gradcomp plan: --params must be at least 1\n")
        return 2
    try:
        profile = planner.Profile.load(args.profile)
        candidates = [planner.from_spec(c) for c in planner.checked_candidates(args.allow)]
    except (OSError, ValueError, TypeError) as error:
        sys.stderr.write(f"gradcomp plan: {error}\n")
        return 2
    inside = profile.link
    profile = dataclasses.replace(profile, nodes=None)  # a probe's nodes: only --node-size says them here
    if args.bandwidth is not None or args.latency is not None:
        profile = profile.with_link(None if args.bandwidth is None else args.bandwidth / 8, args.latency)
    world = args.world or 8
    if (args.intra_bandwidth is not None or args.intra_latency is not None) and args.node_size is None:
        sys.stderr.write("gradcomp plan: --intra-bandwidth and --intra-latency need --node-size\n")
        return 2
    if args.node_size is not None:
        if world % args.node_size:
            sys.stderr.write(f"gradcomp plan: --node-size {args.node_size} does not divide {world} ranks\n")
            return 2
        latency = inside.latency if args.intra_latency is None else args.intra_latency
        bandwidth = inside.bandwidth if args.intra_bandwidth is None else args.intra_bandwidth / 8
        inside = cost_model.Link(bandwidth, latency)
        nodes = planner.Nodes.on_links(args.node_size, world // args.node_size, inside, profile.link)
        profile = dataclasses.replace(profile, nodes=nodes)
    kind = args.dtype or "fp32"
    dtype = getattr(torch, DTYPES[kind])
    buckets = _buckets(args.params, args.bucket_mb, dtype.itemsize)
    link = profile.link
    print(
        f"{args.params:,} {kind} parameters in {len(buckets)} buckets of {args.bucket_mb:g} MB, "
        f"{world} ranks; "
        f"link {link.bandwidth * 8 / 1e9:.3g} Gbit/s per rank, {link.latency * 1e6:.3g} us a ring step; "
        f"compress and decode times of {profile.device} ({profile.note})"
    )
    if args.node_size is not None:
        print(
            f"nodes of {args.node_size} ranks: inside one {inside.bandwidth * 8 / 1e9:.3g} Gbit/s per rank, "
            f"{inside.latency * 1e6:.3g} us a ring step; the link above is each rank's share between nodes"
        )
    try:
        totals = []
        for compressor, algorithm, inter in planner.routes(candidates, world, profile.nodes):
            if not planner.saves(compressor, dtype):
                continue  # a cast to the gradients' own width
            once = {
                n: planner.predict(compressor, n, world, profile, algorithm, inter, dtype)
                for n in set(buckets)
            }
            totals.append((planner.label(compressor), once[buckets[0]].how, [once[n] for n in buckets]))
        plan = planner.best_plan(buckets, world, profile, candidates, dtypes=[dtype] * len(buckets))
    except (KeyError, ValueError) as error:
        sys.stderr.write(f"gradcomp plan: {error.args[0]}\n")
        return 2
    dense = sum(p.seconds for p in totals[0][2])
    rows = []
    for name, algorithm, predictions in totals:
        seconds = sum(p.seconds for p in predictions)
        rows.append(
            [
                name,
                algorithm,
                f"{sum(p.bytes_sent for p in predictions) / 1e6:.4g}",
                f"{sum(p.exchange_seconds for p in predictions) * 1e3:.4g}",
                f"{sum(p.codec_seconds for p in predictions) * 1e3:.4g}",
                f"{sum(p.overlap_seconds for p in predictions) * 1e3:.4g}",
                f"{seconds * 1e3:.4g}",
                f"{dense / seconds:.2f}x",
            ]
        )
    header = ["candidate", "algorithm", "MB sent/rank", "exchange ms", "codec ms", "overlap ms", "total ms"]
    header.append("vs dense")
    print(format_table(header, rows, left=()))
    chosen = sum(p.seconds for p in plan)
    picks: dict[tuple[str, str], int] = {}
    for p in plan:
        picks[(p.compressor, p.how)] = picks.get((p.compressor, p.how), 0) + 1
    what = ", ".join(
        f"{name} ({algorithm}) for {count} bucket{'s' * (count > 1)}"
        for (name, algorithm), count in picks.items()
    )
    print(f"auto picks: {what}: {chosen * 1e3:.4g} ms a step, {dense / chosen:.2f}x faster than dense")
    if args.compute_ms is not None:
        compute = args.compute_ms / 1e3
        print(
            f"with {args.compute_ms:g} ms of compute a step and no overlap: dense communication is "
            f"{dense / compute:.2f}x the compute; the step is at most {(compute + dense) / compute:.2f}x "
            f"faster with any compressor (Amdahl), and auto's plan predicts "
            f"{(compute + dense) / (compute + chosen):.2f}x"
        )
    return 0
