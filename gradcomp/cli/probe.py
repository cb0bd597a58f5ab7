"""``gradcomp probe``: measure this machine's link and codecs on spawned Gloo ranks and
write the profile that ``plan`` and ``"auto"`` read, unless a fit says more than the
sizes measured."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from gradcomp import demo, planner
from gradcomp.tables import format_table
from gradcomp.units import argument, at_least, parse_size, split_list


def _sizes(text: str) -> list[int]:
    sizes = [argument(parse_size)(part) for part in split_list(text)]
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one size")
    return sizes


def add_parser(commands) -> None:
    """Add ``probe`` and its options to the top parser's subcommands."""
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
    probe.add_argument("--world-size", type=at_least(2), default=2, help="processes to spawn (default 2)")
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
    probe.add_argument("--repeat", type=at_least(1), default=5, help="timings per size (median; default 5)")
    probe.add_argument("--out", default="gradcomp-profile.json", help="where to write the profile")
    probe.set_defaults(run=run)


def run(args) -> int:
    """Run ``gradcomp probe``; returns the exit status."""
    from gradcomp import spawn

    try:
        specs = split_list(args.compressors)
        planner.flat_routes(specs, None)  # unknown names and low-rank ones refused here
    except (ValueError, TypeError) as error:
        sys.stderr.write(f"gradcomp probe: {error}\n")
        return 2
    print(f"{demo.machine()}, {args.world_size} Gloo ranks on 127.0.0.1", flush=True)
    profile, rows = spawn.run_ranks(
        probe_rank, args.world_size, args.sizes, specs, args.codec_sizes, args.repeat
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
    # The pingpong is for people (no algorithm is predicted on it): a fit of it that the
    # sizes cannot support is left out of the profile, not a reason to write none.
    pingpong = {k: v for k, v in profile.links.items() if k == "pingpong"}
    for reason in planner.unsupported_fits(rows, pingpong):
        print(f"not kept: {reason}")
        profile = dataclasses.replace(
            profile, links={k: v for k, v in profile.links.items() if k != "pingpong"}
        )
    used = {"all_reduce": profile.link, **{k: v for k, v in profile.links.items() if k != "pingpong"}}
    reasons = planner.unsupported_fits(rows, used)
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


def probe_rank(rank, world_size, sizes: list[int], specs: list[str], codec_sizes: list[int], repeat: int):
    return planner.probe(sizes, specs, codec_sizes, repeat=repeat, pingpong=True)
