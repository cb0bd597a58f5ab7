"""Compressed all-reduce against torch.distributed.all_reduce, nccl-tests style.

For each message size (fp32 tensors, doubling from ``--min-bytes`` to
``--max-bytes``) the dense baseline, ``dist.all_reduce`` of the fp32 tensor,
is timed in the same run as every compressor, each through
``gradcomp.all_reduce`` with its default algorithm (or ``--algorithms all``:
every valid one). Error feedback follows each compressor's default (on for
the biased ones: int8, int4, sign, topk, randk), with a fresh residual
memory per size, as a training run would use them, and no error
measurement (``all_reduce``'s default).

Timing: ``--warmup`` untimed iterations, then ``--iters`` timed ones, each
after a barrier and with the input restored; an iteration's time is the
slowest rank's, and the table shows the median over iterations.

Columns, per nccl-tests: ``algbw = size / time``, ``busbw = algbw * 2 (W-1) / W``
(GB = 1e9 bytes). For a compressor: its time, the bytes one rank sends
(``ReduceStats.bytes_sent``, ring model), the effective bandwidth
``size / time`` (the dense message moved per second) and the speedup over
the dense all-reduce.

Examples:
    python bench/allreduce.py --spawn 2
    torchrun --nproc-per-node 8 bench/allreduce.py --compressors int8 topk:ratio=0.001
    python bench/allreduce.py --spawn 2 --bandwidth 1gbit --max-bytes 16MiB
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from lib import spawning
from lib.link import add_bandwidth_option, maybe_run_limited
from lib.machine import machine
from lib.options import add_common_options
from lib.plots import figure
from lib.progress import Progress
from lib.results import Results, publish
from lib.specs import parse_run

import gradcomp
from gradcomp.collectives import ALGORITHMS, check_algorithm, ring_all_reduce_bytes
from gradcomp.spawn import RanksFailed
from gradcomp.tables import format_table
from gradcomp.units import argument, format_size, parse_size, split_list

DEFAULT_COMPRESSORS = ("none", "fp16", "int8", "int4", "sign", "topk", "randk")
CPU_SIZES = ("64KiB", "64MiB")
GPU_SIZES = ("1MiB", "1GiB")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Runs under torchrun (env://, NCCL on GPUs, else Gloo) or spawns Gloo ranks with --spawn.",
    )
    top.add_argument(
        "--compressors",
        nargs="+",
        default=list(DEFAULT_COMPRESSORS),
        metavar="NAME[:k=v,...]",
        help=f"compressors to time, space- or comma-separated, options after a colon "
        f"(default: {' '.join(DEFAULT_COMPRESSORS)}; topk and randk keep 1%%)",
    )
    top.add_argument(
        "--algorithms",
        default="default",
        help="'default' (each compressor's own), 'all' (every valid one), or a comma-separated "
        f"subset of {','.join(ALGORITHMS)} (invalid pairs are skipped)",
    )
    top.add_argument(
        "--min-bytes",
        type=argument(parse_size),
        help=f"smallest message (default {CPU_SIZES[0]} on CPU, {GPU_SIZES[0]} on GPU)",
    )
    top.add_argument(
        "--max-bytes",
        type=argument(parse_size),
        help=f"largest message (default {CPU_SIZES[1]} on CPU, {GPU_SIZES[1]} on GPU)",
    )
    top.add_argument("--warmup", type=int, default=3, help="untimed iterations per cell (default 3)")
    top.add_argument("--iters", type=int, default=10, help="timed iterations per cell (default 10)")
    add_common_options(top, spawn_default=None)
    add_bandwidth_option(top)
    return top


def methods(specs: list[str], algorithms: str, world_size: int | None = None) -> list[dict]:
    """One entry per (compressor, algorithm) to time, in the order given; the
    default algorithms are those of ``world_size`` ranks."""
    chosen = []
    for spec in specs:
        label, name, options = parse_run(spec)
        compressor = gradcomp.get_compressor(name, **options)
        if algorithms == "default":
            candidates = [None]
        elif algorithms == "all":
            candidates = list(ALGORITHMS)
        else:
            candidates = split_list([algorithms])
        for algorithm in candidates:
            try:
                resolved = check_algorithm(compressor, algorithm, world_size)
            except ValueError:
                continue
            shown = label if algorithms == "default" else f"{label}/{resolved}"
            chosen.append(dict(label=shown, name=name, options=options, algorithm=resolved))
    return chosen


def message_sizes(smallest: int, largest: int) -> list[int]:
    """Doubling sizes from ``smallest`` to ``largest``, each a whole number of fp32 elements."""
    sizes, size = [], max(4, smallest - smallest % 4)
    while size <= largest:
        sizes.append(size)
        size *= 2
    return sizes


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run, reset, warmup: int, iters: int, device: torch.device) -> tuple[float, list]:
    """Median over ``iters`` iterations of the slowest rank's time, and ``run``'s timed results."""
    seconds, results = [], []
    for iteration in range(warmup + iters):
        reset()
        _synchronize(device)
        dist.barrier()
        began = time.perf_counter()
        result = run()
        _synchronize(device)
        if iteration >= warmup:
            seconds.append(time.perf_counter() - began)
            results.append(result)
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist()), results


def measure(rank: int, world_size: int, settings: dict, device: torch.device) -> list[dict]:
    """Time every cell on every rank; returns the records (the same on every rank)."""
    chosen = methods(settings["compressors"], settings["algorithms"], world_size)
    sizes = message_sizes(settings["min_bytes"], settings["max_bytes"])
    progress = Progress(len(sizes) * (1 + len(chosen)), settings["progress"] if rank == 0 else False)
    records = []
    for size in sizes:
        generator = torch.Generator(device=device).manual_seed(1000 * rank + size % 997)
        source = torch.randn(size // 4, generator=generator, device=device)
        dense = time_dense(source, world_size, settings, device)
        records.append(dense)
        progress.update(len(records), f"{format_size(size)} dense")
        for method in chosen:
            records.append(time_compressed(source, method, dense, settings, device))
            progress.update(len(records), f"{format_size(size)} {method['label']}")
    progress.close()
    return records


def time_dense(source: torch.Tensor, world_size: int, settings: dict, device: torch.device) -> dict:
    """The baseline cell: ``dist.all_reduce`` of the fp32 tensor."""
    work = torch.empty_like(source)
    seconds, _ = timed(lambda: dist.all_reduce(work), lambda: work.copy_(source), **_loop(settings, device))
    size = source.numel() * 4
    algbw = size / seconds / 1e9
    return dict(
        size_bytes=size,
        numel=source.numel(),
        method="dense",
        compressor="torch.distributed.all_reduce",
        algorithm="",
        feedback=False,
        time_us=1e6 * seconds,
        bytes_sent=ring_all_reduce_bytes(size, world_size),
        dense_bytes_sent=ring_all_reduce_bytes(size, world_size),
        algbw_GBps=algbw,
        busbw_GBps=algbw * 2 * (world_size - 1) / world_size,
        effective_GBps=algbw,
        speedup=1.0,
    )


def time_compressed(source: torch.Tensor, method: dict, dense: dict, settings: dict, device) -> dict:
    """One compressor/algorithm cell, with a fresh residual memory when the compressor uses one."""
    compressor = gradcomp.get_compressor(method["name"], **method["options"])
    memory = gradcomp.ErrorFeedback() if compressor.needs_feedback else False
    work = torch.empty_like(source)

    def run():
        return gradcomp.all_reduce(
            work, compressor, algorithm=method["algorithm"], feedback=memory, name="bench"
        )

    seconds, stats = timed(run, lambda: work.copy_(source), **_loop(settings, device))
    # topk's payload varies a little: the mean over iterations, the largest over ranks.
    sent = torch.tensor([statistics.mean(s.bytes_sent for s in stats)], dtype=torch.float64, device=device)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    size = dense["size_bytes"]
    return dict(
        size_bytes=size,
        numel=source.numel(),
        method=method["label"],
        compressor=repr(compressor),
        algorithm=method["algorithm"],
        feedback=bool(memory),
        time_us=1e6 * seconds,
        bytes_sent=round(sent.item()),
        dense_bytes_sent=stats[0].dense_bytes,
        algbw_GBps=size / seconds / 1e9,
        busbw_GBps=float("nan"),
        effective_GBps=size / seconds / 1e9,
        speedup=dense["time_us"] / (1e6 * seconds),
    )


def _loop(settings: dict, device: torch.device) -> dict:
    return dict(warmup=settings["warmup"], iters=settings["iters"], device=device)


def spawned(rank: int, world_size: int, settings: dict) -> list[dict]:
    return measure(rank, world_size, settings, torch.device("cpu"))


# ----------------------------------------------------------------------------- report


def _time(us: float) -> str:
    return f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def format_report(records: list[dict]) -> str:
    """One row per size: the dense baseline, then time, bytes sent, GB/s and speedup per method."""
    labels = list(dict.fromkeys(r["method"] for r in records if r["method"] != "dense"))
    header = ["size", "time(us)", "algbw", "busbw"]
    groups = [("", 1), ("dense fp32 all_reduce", 3)]
    for label in labels:
        header += ["time(us)", "sent", "GB/s", "speedup"]
        groups.append((label, 4))
    rows = []
    for size in dict.fromkeys(r["size_bytes"] for r in records):
        cells = {r["method"]: r for r in records if r["size_bytes"] == size}
        dense = cells["dense"]
        row = [
            format_size(size),
            _time(dense["time_us"]),
            f"{dense['algbw_GBps']:.3f}",
            f"{dense['busbw_GBps']:.3f}",
        ]
        for label in labels:
            cell = cells[label]
            row += [
                _time(cell["time_us"]),
                format_size(cell["bytes_sent"]),
                f"{cell['effective_GBps']:.3f}",
                f"{cell['speedup']:.2f}x",
            ]
        rows.append(row)
    return format_table(header, rows, groups)


def plot(records: list[dict], title: str, path: str) -> None:
    """Time and speedup over dense against message size, one line per method."""
    with figure(path, title, ncols=2, figsize=(13, 5)) as (_, (left, right)):
        for label in dict.fromkeys(r["method"] for r in records):
            cells = [r for r in records if r["method"] == label]
            sizes = [r["size_bytes"] for r in cells]
            style = dict(color="black", linewidth=2.5) if label == "dense" else {}
            left.plot(sizes, [r["time_us"] for r in cells], marker="o", label=label, **style)
            right.plot(sizes, [r["speedup"] for r in cells], marker="o", label=label, **style)
        for axis, ylabel in ((left, "time (us), median of the slowest rank"), (right, "speedup over dense")):
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("message size (bytes, fp32)")
            axis.set_ylabel(ylabel)
            axis.grid(True, which="both", alpha=0.3)
        left.legend(fontsize=8)


def report(records: list[dict], settings: dict, results: Results) -> None:
    facts = results.machine
    print(f"# machine: {facts['machine']}")
    smallest, largest = (format_size(settings[key]) for key in ("min_bytes", "max_bytes"))
    print(
        f"# fp32 messages {smallest}..{largest}, "
        f"warmup {settings['warmup']}, iters {settings['iters']}, median of the slowest rank; "
        "error feedback: each compressor's default (on for biased ones); GB = 1e9 bytes"
    )
    print(format_report(records))
    publish(results, records, plot, prefix="# ")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    maybe_run_limited(args)
    torchrun = spawning.torchrun_world()
    if torchrun is None and args.spawn is None:
        args.spawn = 2
    on_gpu = torchrun is not None and torch.cuda.is_available()
    defaults = GPU_SIZES if on_gpu else CPU_SIZES
    args.min_bytes = args.min_bytes or parse_size(defaults[0])
    args.max_bytes = args.max_bytes or parse_size(defaults[1])
    args.compressors = split_list(args.compressors)
    try:
        if not methods(args.compressors, args.algorithms):
            raise argparse.ArgumentTypeError(f"no valid compressor/algorithm pair in {args.algorithms!r}")
    except argparse.ArgumentTypeError as error:
        parser().error(str(error))
    if args.max_bytes < args.min_bytes or args.iters < 1 or args.warmup < 0:
        parser().error("need --min-bytes <= --max-bytes, --iters >= 1 and --warmup >= 0")
    settings = vars(args)
    if torchrun is None:
        results = Results("allreduce", machine(args.spawn, "gloo"), settings, args.out)
        try:
            records = spawning.spawn(spawned, args.spawn, settings)
        except RanksFailed as error:
            sys.stderr.write(f"allreduce failed: {error}\n")
            return 1
        report(records, settings, results)
        return 0
    backend, device = spawning.init_torchrun()
    rank, world_size = torchrun
    results = Results("allreduce", machine(world_size, backend), settings, args.out)
    try:
        records = measure(rank, world_size, settings, device)
        if rank == 0:
            report(records, settings, results)
    finally:
        gradcomp.collectives.release_queues()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
