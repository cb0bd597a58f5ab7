"""FSDP2 training steps of a GPT: dense custom HSDP against gradcomp's compressed replicas and reduce-scatter.

Every run trains the same byte-level GPT (:mod:`lib.lm`, same seed, the same
batches from the Python standard library's sources) with AdamW for
``--steps`` steps on spawned Gloo ranks laid out as ``nodes x ranks per
node``, each block a ``fully_shard`` unit, then the root. The runs:

* ``compute only``: the same model without FSDP on every rank, trained on
  that rank's batch with no communication at all: the compute time of a
  step (forward, backward and AdamW over the whole model on each rank, the
  ranks sharing the cores as in the other runs);
* ``HSDP fp32``, ``HSDP bf16``: custom HSDP, each unit sharded on a node's
  ranks (FSDP's own reduce-scatter and all-gather inside the node), the
  shards all-reduced between the nodes by ``gradcomp.fsdp.register`` with
  the dense ``"none"`` (fp32) or ``"bf16"`` compressor;
* ``HSDP int8``, ``HSDP int4``: the same, compressed between the nodes;
* ``reduce-scatter int8``: the units sharded over a 1-D mesh of every rank,
  FSDP's reduce-scatter compressed (no replicate group); its all-gathers of
  the fp32 parameters cross the nodes too.

gradcomp's runs are registered with ``warmup_steps=0``. A step is timed
after a barrier; its time is the slowest rank's, and the table gives the
median over the timed steps (the steps after ``--warmup-steps``) of every
round. Communication time = step time - the compute-only step time.

Bytes between nodes a step: the HSDP runs' ``state.last_stats.bytes_sent_inter``
(what a rank sends to its replica); for the reduce-scatter run, a rank sends
each peer one row of ``bytes_sent / (world - 1)`` bytes, and ``world - ranks
per node`` of its peers are on other nodes. On an emulated cluster the
bytes node 0's link actually sent in the step are measured as well (its
``/proc/net/dev`` counter: every collective, headers included).

The runs are interleaved: in each of ``--rounds`` rounds every run is built
afresh and takes its untimed steps, then a timed step of each run in turn,
the order rotating by one each time, so that a machine whose speed drifts
slows every run alike.

Examples:
    python bench/fsdp_train.py --nodes 2 --ranks-per-node 2 --inter-bandwidth 1gbit   # needs root
    python bench/fsdp_train.py --spawn 2 --layers 1 --width 64 --steps 4   # loopback: 2 "nodes" of a rank
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist
from lib import lm, spawning
from lib.cluster import (
    NODE_INTERFACE,
    add_cluster_options,
    add_link_check_option,
    describe_check,
    measure_levels,
)
from lib.options import add_common_options
from lib.plots import figure
from lib.progress import Progress
from lib.results import publish, ratio
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradcomp
from gradcomp.tables import format_cell, format_table

# (label, compressor, layout, register's options): layout "hsdp" shards in a node and
# all-reduces between nodes, "flat" shards over every rank, None is the compute-only run.
HIERARCHICAL = {"scatter_algorithm": "hierarchical"}
RUNS = (
    ("compute only", None, None, {}),
    ("HSDP fp32", "none", "hsdp", {}),
    ("HSDP bf16", "bf16", "hsdp", {}),
    ("HSDP int8", "int8", "hsdp", {}),
    ("HSDP int4", "int4", "hsdp", {}),
    ("reduce-scatter int8", "int8", "flat", {}),
    ("hier. reduce-scatter int8", "int8", "flat", HIERARCHICAL),
    ("hier. reduce-scatter int8, int8 weights", "int8", "flat", {**HIERARCHICAL, "parameters": "int8"}),
)
BASELINE = "HSDP fp32"
# The targets of int8 HSDP against the dense HSDP runs: (against, what, at least).
TARGETS = (
    ("HSDP fp32", "inter_bytes", 3.9),
    ("HSDP bf16", "inter_bytes", 1.9),
    ("HSDP fp32", "comm_ms", 2.0),
)
VALIDATION_BATCHES = 4


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    top.add_argument("--steps", type=int, default=20, help="training steps per run and round (default 20)")
    top.add_argument("--warmup-steps", type=int, default=3, help="first steps left untimed (default 3)")
    top.add_argument("--rounds", type=int, default=2, help="rounds of every run, pooled (default 2)")
    lm.add_gpt_options(top, width=384, layers=6, heads=6, layer_help=", each an FSDP unit")
    add_link_check_option(top, "16MiB")
    add_common_options(top, spawn_default=4)
    add_cluster_options(top)
    return top


def layout(settings: dict) -> tuple[int, int]:
    """(nodes, ranks per node): the emulated cluster's, else 2 nodes of half the ranks on loopback."""
    if settings["nodes"]:
        return settings["nodes"], settings["ranks_per_node"]
    return 2, settings["spawn"] // 2


def sent_between_nodes() -> float:
    """Bytes this rank's node has sent on its link so far (its namespace's counter; NaN off a cluster)."""
    with open("/proc/self/net/dev") as file:
        for line in file:
            name, _, counters = line.partition(":")
            if name.strip() == NODE_INTERFACE:
                return float(counters.split()[8])
    return math.nan


class Training:
    """One run on every rank: the model (sharded and registered as the run asks), AdamW,
    and what each step took."""

    def __init__(self, rank: int, world_size: int, run: tuple, settings: dict, meshes: dict, data):
        self.rank, self.world_size, self.settings, self.data = rank, world_size, settings, data
        self.label, compressor, kind, options = run
        self.model = lm.gpt(settings)
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.state = None
        if kind is not None:
            for block in self.model.blocks:
                fully_shard(block, mesh=meshes[kind])
            fully_shard(self.model, mesh=meshes[kind])
            replicas = meshes["replicate"] if kind == "hsdp" else None
            if options.get("scatter_algorithm") == "hierarchical":
                options = {**options, "node_size": layout(settings)[1]}
            self.state = gradcomp.fsdp.register(
                self.model, compressor, replicate_group=replicas, warmup_steps=0, **options
            )
        self.flat = kind == "flat" and not options.get("scatter_algorithm")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings["lr"], **lm.ADAMW)
        self.done, self.seconds, self.inter_bytes, self.wire_bytes = 0, [], [], []

    def step(self) -> None:
        settings, world_size = self.settings, self.world_size
        batch = settings["batch_size"]
        starts = lm.random_starts(
            self.data, batch * world_size, settings["context"], 1_000_003 * (self.done + 1)
        )
        inputs, targets = lm.windows(self.data, starts[self.rank :: world_size], settings["context"])
        dist.barrier()
        wire_before = sent_between_nodes()
        began = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        lm.loss_of(self.model, inputs, targets).backward()
        self.optimizer.step()
        self.seconds.append(time.perf_counter() - began)
        self.wire_bytes.append(sent_between_nodes() - wire_before)
        self.inter_bytes.append(self.bytes_between_nodes())
        self.done += 1

    def bytes_between_nodes(self) -> float:
        """What this rank sent to ranks of other nodes in the last step (the payloads)."""
        if self.state is None:
            return 0.0
        stats = self.state.last_stats
        if not self.flat:  # counted by gradcomp: the replicas' all-reduce, a hierarchical reduce-scatter
            return float(stats.bytes_sent_inter)
        nodes, ranks_per_node = layout(self.settings)
        peers_elsewhere = self.world_size - ranks_per_node
        return stats.bytes_sent / (self.world_size - 1) * peers_elsewhere

    def record(self, validation) -> dict:
        """This round's figures (every rank's slowest step times), and the validation loss
        after the steps (NaN for compute only: each rank trained its own copy)."""
        warmup = self.settings["warmup_steps"]
        slowest = torch.tensor(self.seconds[warmup:], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        loss = math.nan
        if self.state is not None:
            settings = self.settings
            loss = lm.validation_loss(
                self.model, validation, settings["context"], VALIDATION_BATCHES, settings["batch_size"]
            )
        stats = self.state.last_stats if self.state is not None else None
        return dict(
            run=self.label,
            parameters=self.parameters,
            step_seconds=slowest.tolist(),
            inter_bytes=self.inter_bytes[warmup:],
            wire_bytes=self.wire_bytes[warmup:],
            bytes_sent=stats.bytes_sent if stats else 0,
            dense_bytes=stats.dense_bytes if stats else 0,
            units=stats.buckets if stats else 0,
            compressors=sorted(set(stats.compressors.values())) if stats else [],
            loss=loss,
        )


def ranks(rank: int, world_size: int, settings: dict) -> dict:
    """Body of the spawned ranks: the link check on a cluster, then every round's runs interleaved."""
    nodes, ranks_per_node = layout(settings)
    check = measure_levels(settings)
    mesh = init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
    meshes = dict(
        hsdp=mesh["shard"],
        replicate=mesh["replicate"].get_group(),
        flat=init_device_mesh("cpu", (world_size,)),
    )
    train, validation, _ = lm.load_corpus(settings["corpus_bytes"])
    progress = Progress(
        settings["rounds"] * len(RUNS) * settings["steps"], settings["progress"] if rank == 0 else False
    )
    rounds = []
    for round_index in range(settings["rounds"]):
        trainings = [Training(rank, world_size, run, settings, meshes, train) for run in RUNS]
        for training in trainings:
            while training.done < settings["warmup_steps"]:
                training.step()
        for turn in range(settings["steps"] - settings["warmup_steps"]):
            shift = turn % len(trainings)
            for training in trainings[shift:] + trainings[:shift]:
                training.step()
                done = round_index * len(RUNS) * settings["steps"] + sum(t.done for t in trainings)
                progress.update(done, f"round {round_index + 1}: {training.label}")
        rounds.append([training.record(validation) for training in trainings])
        del trainings
    progress.close()
    return dict(link_check=check, rounds=rounds)


def pool(rounds: list[list[dict]]) -> list[dict]:
    """One record a run: its timed steps of every round together, medians and means."""
    records = []
    for parts in zip(*rounds, strict=True):
        last = parts[-1]
        seconds = [s for part in parts for s in part["step_seconds"]]
        inter = [b for part in parts for b in part["inter_bytes"]]
        wire = [b for part in parts for b in part["wire_bytes"]]
        records.append(
            dict(
                run=last["run"],
                parameters=last["parameters"],
                units=last["units"],
                compressors=", ".join(last["compressors"]),
                step_ms=1e3 * statistics.median(seconds),
                step_ms_all=[round(1e3 * s, 1) for s in seconds],
                inter_bytes=statistics.mean(inter),
                wire_bytes=statistics.mean(wire),
                bytes_sent=last["bytes_sent"],
                dense_bytes=last["dense_bytes"],
                loss=last["loss"],
                rounds=len(parts),
            )
        )
    return records


def derive(records: list[dict]) -> list[str]:
    """Communication time and the ratios to dense fp32 HSDP on each record; the targets' verdicts."""
    by_run = {r["run"]: r for r in records}
    compute, baseline = by_run["compute only"]["step_ms"], by_run[BASELINE]
    for record in records:
        record["comm_ms"] = record["step_ms"] - compute
    for record in records:
        sends = record is not by_run["compute only"]  # compute only sends nothing: no ratios
        for what in ("inter_bytes", "wire_bytes", "comm_ms"):
            record[f"{what.removesuffix('_ms')}_x_fp32"] = (
                ratio(baseline[what], record[what]) if sends else math.nan
            )
        record["step_x_fp32"] = ratio(baseline["step_ms"], record["step_ms"])
    verdicts = []
    int8 = by_run["HSDP int8"]
    for against, what, least in TARGETS:
        factor = ratio(by_run[against][what], int8[what])
        met = "met" if factor >= least else "MISSED"
        name = "bytes between nodes" if what == "inter_bytes" else "communication time"
        verdicts.append(f"target: HSDP int8 {name} >= {least:g}x fewer than {against}: {factor:.2f}x, {met}")
    return verdicts


def format_report(records: list[dict]) -> str:
    header = ["run", "MB/step inter", "x fp32", "wire MB/step", "x fp32", "step ms", "comm ms",
              "comm x fp32", "step x fp32", "val loss", "reductions"]  # fmt: skip
    rows = [
        [
            r["run"],
            format_cell(r["inter_bytes"] / 1e6, ".2f"),
            format_cell(r["inter_bytes_x_fp32"], ".2f"),
            format_cell(r["wire_bytes"] / 1e6, ".2f"),
            format_cell(r["wire_bytes_x_fp32"], ".2f"),
            format_cell(r["step_ms"], ".0f"),
            format_cell(r["comm_ms"], ".0f"),
            format_cell(r["comm_x_fp32"], ".2f"),
            format_cell(r["step_x_fp32"], ".2f"),
            format_cell(r["loss"], ".3f"),
            r["compressors"] or "-",
        ]
        for r in records
    ]
    return format_table(header, rows, left=(0, -1))


def describe(settings: dict, records: list[dict]) -> str:
    nodes, ranks_per_node = layout(settings)
    return (
        f"byte-level GPT ({settings['layers']} blocks of width {settings['width']}, "
        f"{settings['heads']} heads, context {settings['context']}, {records[0]['parameters']:,} "
        f"parameters; {records[-1]['units']} FSDP units), batch {settings['batch_size']} windows per rank, "
        f"AdamW lr {settings['lr']:g}; "
        f"{nodes} nodes x {ranks_per_node} ranks; {settings['steps']} steps a run and round "
        f"({settings['warmup_steps']} untimed), {settings['rounds']} rounds, runs interleaved; step: median "
        "of the slowest rank; MB/step inter: payload bytes one rank sends to other nodes; wire MB/step: "
        "bytes node 0's link sent (measured, every collective, headers included)"
    )


def plot(records: list[dict], title: str, path: str) -> None:
    """Stacked bars: compute and communication time per run; bytes between nodes beside."""
    with figure(path, title, ncols=2, figsize=(13, 5)) as (_, (times, sizes)):
        labels, positions = [r["run"] for r in records], range(len(records))
        compute = [records[0]["step_ms"]] * len(records)
        comm = [max(r["comm_ms"], 0) for r in records]
        times.bar(positions, compute, color="#9aa5b1", label="compute (compute-only run)")
        times.bar(positions, comm, bottom=compute, color="#d9534f", label="communication (step - compute)")
        times.set_xticks(list(positions), labels, rotation=30, ha="right", fontsize=8)
        times.set_ylabel("median step time (ms)")
        times.legend(fontsize=8)
        sizes.bar(positions, [r["inter_bytes"] / 1e6 for r in records], color="#5b8ff9")
        sizes.set_xticks(list(positions), labels, rotation=30, ha="right", fontsize=8)
        sizes.set_ylabel("MB a rank sends to other nodes a step")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.nodes:
        args.spawn = args.nodes * args.ranks_per_node
    if args.nodes is not None and (args.nodes < 2 or args.ranks_per_node < 1):
        parser().error("--nodes needs at least 2 nodes and --ranks-per-node at least 1")
    if (
        args.spawn < 2
        or args.spawn % 2
        or args.steps <= args.warmup_steps
        or args.warmup_steps < 1
        or args.rounds < 1
    ):
        parser().error(
            "need an even --spawn >= 2, --warmup-steps >= 1, --steps > --warmup-steps, --rounds >= 1"
        )
    settings = vars(args)
    results, outcome = spawning.spawn_on_cluster("fsdp_train", ranks, args, settings)
    if outcome is None:
        return 1
    records = pool(outcome["rounds"])
    verdicts = derive(records)
    print(describe(settings, records))
    if outcome["link_check"]:
        print(describe_check(outcome["link_check"], results.machine, args.inter_bandwidth))
    print(format_report(records))
    print("\n".join(verdicts))
    publish(results, records, plot, extra=dict(link_check=outcome["link_check"], targets=verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
