"""``gradcomp plan``: the ring model's table and plot (``--numel``), or the planner's
report for a model (``--params``): every candidate predicted, and what auto picks."""

from __future__ import annotations

import dataclasses
import sys

from gradcomp import planner
from gradcomp.tables import format_table
from gradcomp.units import split_list

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype


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
