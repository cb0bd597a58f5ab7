"""DiLoCo's step time on a slow link: its exchanges, blocking or streamed, against DDP and compute alone.

Every run trains the same byte-level GPT (:mod:`lib.lm`, same seed, each
rank its own batches from the Python standard library's sources) with AdamW
on spawned Gloo ranks laid out as ``nodes x ranks per node``. The runs:

* ``compute only``: each rank trains its own copy, no communication: the
  compute time of a step (the ranks sharing the cores as in the other runs);
* ``DDP fp32``: ``DistributedDataParallel`` over every rank, each step;
* ``DiLoCo``: each rank trains on its own, every ``--sync-every`` steps the
  ranks average their pseudo-gradients through gradcomp's compressed
  all-reduce (``--compressor``) and take the outer step; training waits for
  the exchange;
* ``DiLoCo, F fragments, overlap T``: Streaming DiLoCo: ``--fragments`` parts
  exchanged in turn, each exchange running beside the next ``--overlap-steps``
  inner steps.

A run's step time is the mean over whole periods of ``--sync-every`` steps
(what its exchanges cost spread over the steps they serve) of the slowest
rank: ``--periods`` periods after one untimed period; DDP's steps all cost
alike, so it takes ``--ddp-steps`` timed steps after one untimed. The runs
take turns in each of ``--rounds`` rounds, the order rotating, each built
afresh; their times pool over the rounds. Bytes a step: what a rank sent,
averaged over the timed steps (DDP's from the ring all-reduce's count).

Targets: the fragmented, overlapped run's step time within 1.1x of compute
only (the exchange hidden); the DDP run's ratio beside it.

Examples:
    python bench/diloco_train.py --nodes 2 --ranks-per-node 2 --inter-bandwidth 100mbit   # needs root
    python bench/diloco_train.py --spawn 2 --width 64 --layers 1 --sync-every 4 --periods 1 --ddp-steps 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from lib import lm, spawning
from lib.cluster import add_cluster_options, add_link_check_option, describe_check, measure_levels
from lib.options import add_common_options
from lib.plots import figure
from lib.results import publish, ratio
from torch.nn.parallel import DistributedDataParallel

import gradcomp
from gradcomp.collectives import ring_all_reduce_bytes
from gradcomp.tables import format_cell, format_table

COMPUTE, DDP = "compute only", "DDP fp32"
TARGET = 1.1  # the streamed run's step time, at most this times compute only's


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    top.add_argument("--sync-every", type=int, default=25, help="inner steps a synchronisation (default 25)")
    top.add_argument("--fragments", type=int, default=4, help="the streamed run's fragments (default 4)")
    top.add_argument(
        "--overlap-steps", type=int, default=2, help="steps the streamed run's exchanges overlap (default 2)"
    )
    top.add_argument("--compressor", default="int4", help="the pseudo-gradients' compressor (default int4)")
    top.add_argument("--periods", type=int, default=2, help="timed periods of sync-every steps (default 2)")
    top.add_argument("--ddp-steps", type=int, default=4, help="DDP's timed steps (default 4)")
    top.add_argument("--rounds", type=int, default=2, help="rounds of every run, pooled (default 2)")
    lm.add_gpt_options(top, width=256, layers=4, heads=4)
    add_link_check_option(top, "16MiB")
    add_common_options(top, spawn_default=4)
    add_cluster_options(top)
    return top


def runs(settings: dict) -> list[tuple[str, dict | None]]:
    """(label, DiLoCo's options or None) in turn order; DDP and compute only by label."""
    h, f, t = settings["sync_every"], settings["fragments"], settings["overlap_steps"]
    blocking = dict(sync_every=h)
    streamed = dict(sync_every=h, fragments=f, overlap_steps=t)
    return [
        (COMPUTE, None),
        (DDP, None),
        (f"DiLoCo {settings['compressor']}, H={h}", blocking),
        (f"DiLoCo {settings['compressor']}, H={h}, {f} fragments, overlap {t}", streamed),
    ]


class Training:
    """One run on every rank: its model (DDP or DiLoCo as the run asks), AdamW, its batches."""

    def __init__(self, rank: int, world_size: int, run: tuple, settings: dict, data):
        self.rank, self.world_size, self.settings, self.data = rank, world_size, settings, data
        self.label, diloco = run
        self.net = lm.gpt(settings)
        self.parameters = sum(p.numel() for p in self.net.parameters())
        self.model = DistributedDataParallel(self.net) if self.label == DDP else self.net
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=settings["lr"], **lm.ADAMW)
        self.outer = None
        if diloco is not None:
            self.outer = gradcomp.DiLoCo(
                self.net,
                self.optimizer,
                compressor=settings["compressor"],
                outer_lr=0.5,
                outer_momentum=0.5,
                **diloco,
            )
        self.done = 0

    def steps(self, count: int) -> float:
        """``count`` steps; the seconds they took on this rank."""
        dist.barrier()
        began = time.perf_counter()
        for _ in range(count):
            settings = self.settings
            seed = 1_000_003 * (self.done + 1) + self.rank
            starts = lm.random_starts(self.data, settings["batch_size"], settings["context"], seed)
            self.optimizer.zero_grad(set_to_none=True)
            lm.loss_of(self.model, *lm.windows(self.data, starts, settings["context"])).backward()
            self.optimizer.step()
            if self.outer is not None:
                self.outer.step()
            self.done += 1
        return time.perf_counter() - began

    def timed(self) -> dict:
        """One untimed period (or DDP step), then the timed ones: the slowest rank's mean step."""
        settings = self.settings
        per = 1 if self.label == DDP else settings["sync_every"]
        count = settings["ddp_steps"] if self.label == DDP else settings["periods"] * settings["sync_every"]
        self.steps(per)
        sent_before = self.outer.bytes_sent if self.outer is not None else 0
        seconds = torch.tensor([self.steps(count) / count], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        if self.outer is not None:
            sent = (self.outer.bytes_sent - sent_before) / count
            self.outer.synchronize()  # nothing of this run left in flight beside the next
        elif self.label == DDP:
            sent = ring_all_reduce_bytes(4 * self.parameters, self.world_size)
        else:
            sent = 0
        return dict(run=self.label, parameters=self.parameters, step_seconds=float(seconds), bytes=sent)


def ranks(rank: int, world_size: int, settings: dict) -> dict:
    """Body of the spawned ranks: the link check on a cluster, then every round's runs in turn."""
    check = measure_levels(settings)
    train, _, _ = lm.load_corpus(settings["corpus_bytes"])
    order = runs(settings)
    rounds = []
    for round_index in range(settings["rounds"]):
        shift = round_index % len(order)
        records = {}
        for run in order[shift:] + order[:shift]:
            records[run[0]] = Training(rank, world_size, run, settings, train).timed()
        rounds.append([records[label] for label, _ in order])
    return dict(link_check=check, rounds=rounds)


def pool(rounds: list[list[dict]]) -> list[dict]:
    """One record a run: the mean of its rounds' step times, and the ratios to compute only."""
    records = []
    for parts in zip(*rounds, strict=True):
        seconds = [part["step_seconds"] for part in parts]
        records.append(
            dict(
                run=parts[0]["run"],
                parameters=parts[0]["parameters"],
                step_ms=1e3 * statistics.mean(seconds),
                step_ms_rounds=[round(1e3 * s, 1) for s in seconds],
                bytes_per_step=statistics.mean(part["bytes"] for part in parts),
                rounds=len(parts),
            )
        )
    compute = records[0]["step_ms"]
    for record in records:
        record["x_compute"] = ratio(record["step_ms"], compute)
    return records


def verdict(records: list[dict]) -> str:
    streamed, ddp = records[-1], records[1]
    met = "met" if streamed["x_compute"] <= TARGET else "MISSED"
    return (
        f"target: {streamed['run']} within {TARGET}x of compute only: {streamed['x_compute']:.2f}x, {met} "
        f"(DDP fp32: {ddp['x_compute']:.2f}x)"
    )


def format_report(records: list[dict]) -> str:
    header = ["run", "step ms", "x compute only", "rounds ms", "bytes/step a rank"]
    rows = [
        [
            r["run"],
            format_cell(r["step_ms"], ".0f"),
            format_cell(r["x_compute"], ".2f"),
            " / ".join(f"{ms:.0f}" for ms in r["step_ms_rounds"]),
            format_cell(r["bytes_per_step"], ",.0f"),
        ]
        for r in records
    ]
    return format_table(header, rows, left=(0,))


def describe(settings: dict, records: list[dict], world_size: int) -> str:
    return (
        f"byte-level GPT ({settings['layers']} blocks of width {settings['width']}, "
        f"{settings['heads']} heads, "
        f"context {settings['context']}, {records[0]['parameters']:,} parameters), batch "
        f"{settings['batch_size']} windows per rank, AdamW lr {settings['lr']:g}; {world_size} ranks; "
        f"DiLoCo {settings['compressor']} every {settings['sync_every']} steps, outer lr 0.5, "
        "Nesterov momentum 0.5; "
        f"{settings['periods']} timed periods ({settings['ddp_steps']} DDP steps) after one, "
        f"{settings['rounds']} rounds in turn; step: mean of the slowest rank"
    )


def plot(records: list[dict], title: str, path: str) -> None:
    with figure(path, title, ncols=1, figsize=(8, 5)) as (_, axes):
        labels = [r["run"] for r in records]
        axes.bar(range(len(records)), [r["step_ms"] for r in records], color="#5b8ff9")
        axes.axhline(
            records[0]["step_ms"] * TARGET, color="#d9534f", linestyle="--", label=f"{TARGET}x compute"
        )
        axes.set_xticks(range(len(records)), labels, rotation=20, ha="right", fontsize=8)
        axes.set_ylabel("mean step time (ms)")
        axes.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.nodes:
        args.spawn = args.nodes * args.ranks_per_node
    if min(args.sync_every, args.fragments, args.periods, args.ddp_steps, args.rounds) < 1 or args.spawn < 2:
        parser().error("--spawn needs 2 ranks or more; --sync-every, --fragments, --periods, --ddp-steps, "
                       "--rounds at least 1")  # fmt: skip
    if not 0 <= args.overlap_steps < args.sync_every:
        parser().error("--overlap-steps must be in [0, --sync-every)")
    settings = vars(args)
    results, outcome = spawning.spawn_on_cluster("diloco_train", ranks, args, settings)
    if outcome is None:
        return 1
    records = pool(outcome["rounds"])
    print(describe(settings, records, args.spawn))
    if outcome["link_check"]:
        print(describe_check(outcome["link_check"], results.machine, args.inter_bandwidth))
    print(format_report(records))
    line = verdict(records)
    print(line)
    publish(results, records, plot, extra=dict(link_check=outcome["link_check"], target=line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
