"""The ``gradcomp`` command line (also ``python -m gradcomp``).

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
import math
import sys
import time

from gradcomp import demo, planner
from gradcomp.tables import format_table
from gradcomp.units import argument, parse_count, parse_duration, parse_rate, parse_size, split_list

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
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
        default=demo.DEFAULT_LINK,
        help="each rank's link in the last column, where each step is predicted on it (default "
        f"{demo.DEFAULT_LINK}): over loopback, faster than any network, compression does not pay",
    )
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
            "The scale model: for each world size, compressor and algorithm, the bytes one rank "
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
        choices=sorted(_DTYPES),
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
        return _plan(args) if args.params is None else _decide(args)
    if args.command == "probe":
        return _probe(args)
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
    print(demo.format_table(rows, args.link))
    print(f"finished in {time.perf_counter() - began:.0f} s")
    return 0


def _plan(args) -> int:
    from gradcomp.collectives import scale

    names = split_list(args.compressors)
    if not names:
        sys.stderr.write("gradcomp plan: --compressors names no compressor\n")
        return 2
    link = scale.Link((args.bandwidth or 10e9) / 8, 20e-6 if args.latency is None else args.latency)
    try:
        records = scale.table(names, args.numel, args.world_sizes, link)
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


def _decide(args) -> int:
    import torch

    from gradcomp.collectives import scale

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
        inside = scale.Link(bandwidth, latency)
        nodes = planner.Nodes.on_links(args.node_size, world // args.node_size, inside, profile.link)
        profile = dataclasses.replace(profile, nodes=nodes)
    kind = args.dtype or "fp32"
    dtype = getattr(torch, _DTYPES[kind])
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


def _probe(args) -> int:
    from gradcomp import spawn

    try:
        specs = split_list(args.compressors)
        planner.flat_routes(specs, None)  # unknown names and low-rank ones refused here
    except (ValueError, TypeError) as error:
        sys.stderr.write(f"gradcomp probe: {error}\n")
        return 2
    print(f"{demo.machine()}, {args.world_size} Gloo ranks on 127.0.0.1", flush=True)
    profile, rows = spawn.run_ranks(
        _probe_rank, args.world_size, args.sizes, specs, args.codec_sizes, args.repeat
    )
    print(
        format_table(
            ["collective", "elements", "bytes sent/rank", "ms (slowest rank)", "Gbit/s", "transport CPU ms"],
            [
                [
                    r["collective"],
                    f"{r['numel']:,}",
                    f"{r['bytes_sent']:,}",
                    f"{r['seconds'] * 1e3:.3g}",
                    f"{r['bytes_sent'] * 8 / r['seconds'] / 1e9:.3g}",
                    f"{r['cpu_seconds'] * 1e3:.3g}" if "cpu_seconds" in r else "-",
                ]
                for r in rows
            ],
            left=(),
        )
    )
    for name, link in (("all_reduce", profile.link), *profile.links.items()):
        step = "one way" if name == "pingpong" else "per ring step"
        cpu = link.cpu_seconds_per_byte
        print(
            f"fit, {name}: {link.latency * 1e6:.3g} us {step}, {link.bandwidth * 8 / 1e9:.3g} Gbit/s per rank"
            + (f"; the transport takes {cpu * 1e9:.3g} ms of the host's CPU a MB sent" if cpu else "")
        )
    print(
        format_table(
            ["compressor", "encode M elem/s", "decode M elem/s", "encode overhead us", "decode overhead us"],
            [
                [
                    name,
                    f"{c.encode.rate / 1e6:.4g}",
                    f"{c.decode.rate / 1e6:.4g}",
                    f"{c.encode.overhead * 1e6:.3g}",
                    f"{c.decode.overhead * 1e6:.3g}",
                ]
                for name, c in profile.codecs.items()
            ],
            left=(),
        )
    )
    reasons = planner.unsupported_fits(rows, {"all_reduce": profile.link, **profile.links})
    if reasons:
        sys.stderr.write(
            f"gradcomp probe: not writing {args.out}: the sizes measured cannot support these fits:\n"
            + "".join(f"  {reason}\n" for reason in reasons)
            + "Measure larger sizes, up to where a transfer takes milliseconds (--sizes 4K,64K,1M,4M)\n"
        )
        return 1
    profile.save(args.out)
    print(f"wrote {args.out}")
    return 0


def _probe_rank(rank, world_size, sizes: list[int], specs: list[str], codec_sizes: list[int], repeat: int):
    return planner.probe(sizes, specs, codec_sizes, repeat=repeat, pingpong=True)
