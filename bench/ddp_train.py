"""End to end: DDP training steps of a ~25M-parameter MLP with each way of communicating.

Every run trains the same model (same seed, same synthetic data, SGD with
momentum) for ``--steps`` steps on spawned Gloo ranks and reports the median
step time over the steps after ``--warmup-steps`` (each step after a
barrier; a step's time is the slowest rank's). The runs:

* ``compute only``: a no-op comm hook that returns each bucket unchanged
  (no communication at all): the compute time of a step in this run;
* ``dense``: DDP without a hook (fp32 all-reduce);
* ``torch fp16 hook``: ``default_hooks.fp16_compress_hook``;
* ``torch PowerSGD``: ``powerSGD_hook`` with rank 4, ``start_powerSGD_iter=2``
  (torch's defaults otherwise: error feedback, warm start). It issues its
  collectives from ``Future`` callbacks, whose order can differ between ranks
  when a model spans several buckets; Gloo then aborts the process. So it
  runs in processes of its own, a failure is reported as such, and it is
  retried with the whole model in one bucket;
* each gradcomp compressor: ``gradcomp.ddp.register`` with the compressor's
  defaults (error feedback on for biased ones) and ``measure_error=False``
  (the diagnostic pass is not part of training).

``--rounds N`` runs the whole list N times in turn and takes the median over
all N rounds' timed steps, so that a machine whose speed drifts over minutes
slows every run alike.

Communication time = step time - the compute-only step time, so it holds
all a hook costs: compression on the CPU as well as the transfers. Bytes
per step are what one rank sends under the ring model (as gradcomp's
``StepStats.bytes_sent``): gradcomp from ``state.stats``; dense and fp16
``2 (W-1)/W * numel * 4 or 2``; PowerSGD ``2 (W-1)/W * 4 *`` the elements it
all-reduces per step (its P and Q factors plus the tensors it leaves
uncompressed), from ``PowerSGDState.total_numel_after_compression``.

After the first round's runs the ranks probe the link they run on and the
static runs' codecs at the model's bucket sizes (``planner.probe``, as
``python -m gradcomp probe`` does), and the cost model's predicted
communication for each static run comes from that profile (``--no-probe``:
from the stored profile, on the run's link): a shared machine's speed
drifts from day to day (bench/README.md), and a profile stored on another
day does not tell how good the model is. On an emulated cluster the probe
measures both levels too (the node's dense stages, and the links between
nodes with every local rank's group at once), so the hierarchical runs are
predicted as well.

On an emulated cluster (``--nodes``, root only; see ``common.EmulatedCluster``)
the default runs are dense, torch's fp16 hook, flat int8 (``two_phase``),
hierarchical int8, int4 and Top-K 1% and auto (which weighs hierarchical
there), and a check of the emulation comes
first: a dense all-reduce between two nodes must run at the limit, one
inside a node well above it.

Examples:
    python bench/ddp_train.py
    python bench/ddp_train.py --bandwidth 1gbit            # needs root
    python bench/ddp_train.py --nodes 2 --ranks-per-node 2 --inter-bandwidth 1gbit   # needs root
    python bench/ddp_train.py --compressors int8 topk:ratio=0.001 --steps 20
    python bench/ddp_train.py --compressors int8 --profile traces/     # a trace of each run's last step
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import gradcomp
from gradcomp import planner
from gradcomp.collectives import queue_for, ring_all_reduce_bytes
from gradcomp.collectives.hierarchical import nodes_for_auto
from gradcomp.demo import make_mlp

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
LABELS = {
    "compute": "compute only",
    "dense": "dense",
    "fp16_hook": "torch fp16 hook",
    "powersgd": "torch PowerSGD r4",
}
# Bytes on the wire per gradient element of the runs that do not report their own.
WIRE_BYTES = {"compute": 0, "dense": 4, "fp16_hook": 2}
ONE_BUCKET_MB = 4096.0
CLASSES = 10
LATENT = 16


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
    top.add_argument(
        "--link-check-bytes",
        type=common.parse_size,
        default=common.parse_size("64MiB"),
        help="size of the dense all-reduce that measures the link first (default 64MiB)",
    )
    top.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="leave out the probe of the link and the codecs after the first round's runs, which "
        "the cost model's predictions for the static runs come from (then from the stored "
        "profile, on this run's link)",
    )
    top.add_argument(
        "--profile",
        metavar="DIR",
        help="write a PyTorch profiler trace of each run's last step (rank 0, every thread, "
        "gradcomp's ranges included) into DIR",
    )
    common.add_common_options(top)
    common.add_bandwidth_option(top)
    common.add_cluster_options(top)
    return top


# ----------------------------------------------------------------------------- runs


def plan(args: argparse.Namespace) -> list[dict]:
    """The runs in table order: compute only, dense, torch baselines, gradcomp compressors."""
    runs = [dict(kind=kind, label=LABELS[kind]) for kind in ("compute", "dense")]
    if "fp16_hook" in args.baselines:
        runs.append(dict(kind="fp16_hook", label=LABELS["fp16_hook"]))
    if "powersgd" in args.baselines:
        runs.append(dict(kind="powersgd", label=LABELS["powersgd"]))
    for spec in args.compressors:
        label, name, options = common.parse_compressor(spec)
        runs.append(dict(kind="gradcomp", label=label, name=name, options=options))
    return runs


def _no_communication(state, bucket):
    # No annotations: DDP compares them with dist.GradBucket, and this module's are strings.
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def attach(model: DistributedDataParallel, run: dict):
    """Register the run's hook; returns its state (None for dense)."""
    if run["kind"] == "compute":
        model.register_comm_hook(None, _no_communication)
    elif run["kind"] == "fp16_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif run["kind"] == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    elif run["kind"] == "gradcomp":
        return gradcomp.ddp.register(model, run["name"], measure_error=False, **run["options"])
    return None


def samples(seed: int, count: int, settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` samples: inputs spread from a 16-dimensional latent, labels from a linear
    teacher on that latent (a task the MLP learns in a few steps, so the loss tells runs apart)."""
    fixed = torch.Generator().manual_seed(7)
    mixing = torch.randn(LATENT, settings["features"], generator=fixed) / 4
    teacher = torch.randn(LATENT, CLASSES, generator=fixed)
    latent = torch.randn(count, LATENT, generator=torch.Generator().manual_seed(seed))
    return latent @ mixing, (latent @ teacher).argmax(dim=1)


def batch(step: int, rank: int, world_size: int, settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of step ``step``'s global batch."""
    inputs, labels = samples(1_000_003 * (step + 1), settings["batch_size"] * world_size, settings)
    return inputs[rank::world_size], labels[rank::world_size]


def held_out_loss(net: torch.nn.Module, settings: dict) -> float:
    """Cross-entropy on 2048 held-out samples."""
    with torch.no_grad():
        inputs, labels = samples(12345, 2048, settings)
        return F.cross_entropy(net(inputs), labels).item()


class Training:
    """One run on every rank: ``steps`` steps (the first ``warmup`` untimed), then the
    loss on a held-out batch (taken after ``settings["steps"]`` steps in every run)."""

    def __init__(self, rank: int, world_size: int, run: dict, settings: dict):
        self.rank, self.world_size, self.run, self.settings = rank, world_size, run, settings
        self.net = make_mlp(settings["features"], settings["width"], CLASSES, seed=0)
        cap = run.get("bucket_cap_mb", settings["bucket_cap_mb"])
        self.model = DistributedDataParallel(self.net, bucket_cap_mb=cap)
        self.state = attach(self.model, run)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=settings["lr"], momentum=0.9)
        self.steps, self.warmup = settings["steps"], settings["warmup_steps"]
        if run.get("name") == "auto" and self.state.trial_steps:
            # Where the model cannot tell its plan from another, auto tries both: from the step
            # that plans (2 here), its turns of trial_steps + 1 steps and the switch to the
            # contender if it won. Untimed, like the warm-up.
            extra = len(gradcomp.ddp.TRIAL_TURNS) * (self.state.trial_steps + 1) + 2
            self.steps, self.warmup = self.steps + extra, self.warmup + extra
        self.progress = common.Progress(self.steps, settings["progress"] if rank == 0 else False)
        self.position = f"{run['position']}/{settings['total_runs']}"
        self.done, self.seconds, self.psgd_before = 0, [], 0
        self.loss = math.nan

    def step(self) -> None:
        run, settings, step = self.run, self.settings, self.done
        if step == self.warmup and run["kind"] == "powersgd":
            self.psgd_before = self.state.total_numel_after_compression
        inputs, labels = batch(step, self.rank, self.world_size, settings)
        dist.barrier()
        profiling = settings["profile"] and self.rank == 0 and step == self.steps - 1
        profiler = (
            torch.profiler.profile(experimental_config=gradcomp.profiling.all_threads())
            if profiling
            else contextlib.nullcontext()
        )
        began = time.perf_counter()
        with profiler:
            self.optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(self.model(inputs), labels).backward()
            self.optimizer.step()
        self.seconds.append(time.perf_counter() - began)
        if profiling:
            os.makedirs(settings["profile"], exist_ok=True)
            slug = re.sub(r"[^A-Za-z0-9]+", "-", run["label"]).strip("-")
            profiler.export_chrome_trace(os.path.join(settings["profile"], f"ddp_train-{slug}.json"))
        self.done += 1
        self.progress.update(self.done, f"[{self.position}] {run['label']}")
        if self.done == settings["steps"] and run["kind"] != "compute":  # auto's trial: more steps
            self.loss = held_out_loss(self.net, settings)

    def run_until(self, steps: int) -> None:
        while self.done < steps:
            self.step()

    def record(self) -> dict:
        """The run's record, once every step is done."""
        run, state, world_size = self.run, self.state, self.world_size
        self.progress.close()
        slowest = torch.tensor(self.seconds[self.warmup :], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        numel = sum(p.numel() for p in self.net.parameters())
        timed = self.steps - self.warmup
        inter = math.nan
        if run["kind"] == "gradcomp":
            state.flush()  # every bucket's statistics recorded
            kept = state.stats[-timed:]
            sent = statistics.mean(s.bytes_sent for s in kept)
            if run["options"].get("algorithm") == "hierarchical" or run.get("name") == "auto":
                inter = statistics.mean(s.bytes_sent_inter for s in kept)  # auto: 0 unless hierarchical
            compress_ms = 1e3 * statistics.mean(s.compress_seconds for s in kept)
        elif run["kind"] == "powersgd":
            elements = (state.total_numel_after_compression - self.psgd_before) / timed
            sent, compress_ms = ring_all_reduce_bytes(round(4 * elements), world_size), math.nan
        else:
            sent, compress_ms = ring_all_reduce_bytes(numel * WIRE_BYTES[run["kind"]], world_size), math.nan
        note, planned, ready = run.get("note", ""), math.nan, None
        if run.get("name") == "auto":  # what the planner picked, bucket by bucket
            picks = collections.Counter(f"{p.compressor} {p.how}" for p in state.plan or [])
            note = "auto: " + ", ".join(f"{pick} x{count}" for pick, count in picks.items())
            for trial in state.trials:  # what it tried, and the milliseconds a step of each
                tried = [", ".join(plan) for plan in trial["plans"]]
                times = " vs ".join(f"{t:.0f}" for t in trial["step_ms"])
                kept = ("first", "second")[trial["kept"]]
                note += f" (tried {' against '.join(tried)}: {times} ms, kept the {kept})"
            if state.plan:  # what the hook measured in this run; each bucket's whole time, no overlap
                planned = 1e3 * sum(p.seconds for p in state.plan)
                ready = state.ready_offsets  # when the buckets were handed over, which the plan weighed
        return dict(
            run=run["label"],
            kind=run["kind"],
            name=run.get("name", ""),
            options=run.get("options", {}),
            note=note,
            failed="",
            parameters=numel,
            buckets=bucket_count(self.model),
            bucket_numels=bucket_numels(self.model),
            step_ms=1e3 * statistics.median(slowest.tolist()),
            step_ms_all=[round(1e3 * s, 2) for s in slowest.tolist()],
            bytes_per_step=sent,
            inter_bytes_per_step=inter,
            dense_bytes_per_step=ring_all_reduce_bytes(numel * 4, world_size),
            compress_ms=compress_ms,
            planned_comm_ms=planned,
            ready_offsets=ready,
            loss=self.loss,
        )


def train(rank: int, world_size: int, run: dict, settings: dict) -> dict:
    """One run on every rank, step after step: its record."""
    training = Training(rank, world_size, run, settings)
    training.run_until(training.steps)
    return training.record()


def train_interleaved(rank: int, world_size: int, runs: list[dict], settings: dict) -> list[dict]:
    """Every run at once: each one's untimed steps in turn (auto's trial among them),
    then a timed step of each run, the order rotating by one each time, so that
    whatever slows the machine for a while slows every run alike."""
    trainings = [Training(rank, world_size, run, settings) for run in runs]
    for training in trainings:
        training.run_until(training.warmup)
    timed = settings["steps"] - settings["warmup_steps"]  # as many in every run
    for turn in range(timed):
        for training in trainings[turn % len(trainings) :] + trainings[: turn % len(trainings)]:
            training.step()
    return [training.record() for training in trainings]


def bucket_count(model: DistributedDataParallel) -> int:
    """DDP's bucket count after its rebuild after the first step (from DDP's logging data;
    0 if unavailable)."""
    return len(bucket_numels(model))


def bucket_numels(model: DistributedDataParallel) -> list[int]:
    """The fp32 elements of each of DDP's buckets after its rebuild (from DDP's logging data;
    empty if unavailable)."""
    logging_data = getattr(model, "_get_ddp_logging_data", dict)()
    sizes = str(logging_data.get("rebuilt_bucket_sizes", logging_data.get("bucket_sizes", "")))
    return [int(size) // 4 for size in sizes.split(",") if size.strip()]


def check_link(world_size: int, nbytes: int, iters: int = 3) -> dict:
    """Time a dense all-reduce of ``nbytes`` (median of the slowest rank) to measure the link."""
    tensor = torch.ones(nbytes // 4)
    seconds = []
    for iteration in range(1 + iters):
        dist.barrier()
        began = time.perf_counter()
        dist.all_reduce(tensor)
        if iteration:
            seconds.append(time.perf_counter() - began)
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    median = statistics.median(slowest.tolist())
    # Every rank's ring traffic crosses the one loopback.
    crossing = world_size * ring_all_reduce_bytes(nbytes, world_size)
    check = dict(bytes=nbytes, seconds=median, loopback_gbit_per_s=crossing * 8 / median / 1e9)
    link = common.link_info()
    if link:
        check["expected_seconds"] = crossing * 8 / link["bits_per_second"]
    return check


def ranks(rank: int, world_size: int, runs: list[dict], settings: dict, link_check: bool) -> dict:
    """Body of the spawned ranks: optionally the link check, then each run in turn, then
    with the link check (the first round) the probe the static runs' predictions come from."""
    check = None
    if link_check and settings["nodes"]:
        check = common.measure_levels(settings["link_check_bytes"], settings["ranks_per_node"])
    elif link_check:
        check = check_link(world_size, settings["link_check_bytes"])
    if settings["interleave"]:
        records = train_interleaved(rank, world_size, runs, settings)
    else:
        records = [train(rank, world_size, run, settings) for run in runs]
    probed = None
    if link_check and settings["probe"]:
        probed = probe_machine(runs, records, nodes=bool(settings["nodes"])).to_json()
    return dict(link_check=check, records=records, probe=probed)


def probe_machine(runs: list[dict], records: list[dict], nodes: bool = False) -> planner.Profile:
    """What the cost model knows of this machine, measured now on the run's own link and
    ranks (``planner.probe``): the link at the sizes auto times it at for these buckets,
    and the static gradcomp runs' codecs at the buckets' sizes; with ``nodes`` (an
    emulated cluster: its ranks have LOCAL_WORLD_SIZE), the levels of the hierarchy too."""
    buckets = next(r["bucket_numels"] for r in records if r.get("bucket_numels"))
    static = [_compressor_of(run) for run in runs if run["kind"] == "gradcomp" and run["name"] != "auto"]
    static = list({planner.label(c): c for c in static}.values())  # flat and hierarchical share a codec
    hierarchy = nodes_for_auto(queue_for(None), None) if nodes else None  # None: a flat probe
    profile, _ = planner.probe(
        planner.link_sizes(buckets), static, codec_sizes=sorted(set(buckets)), hierarchy=hierarchy
    )
    return profile


def _compressor_of(run: dict):
    """The compressor a run (or its record) reduces through: ``none`` for dense."""
    options = {k: v for k, v in run.get("options", {}).items() if k not in common.HOOK_OPTIONS}
    return gradcomp.get_compressor(run.get("name") or "none", **options)


# ----------------------------------------------------------------------------- driver and report


def execute(runs: list[dict], settings: dict) -> tuple[dict, dict | None, list[dict]]:
    """Run everything, ``--rounds`` times; PowerSGD in processes of its own (a Gloo
    abort must not end the bench). Returns the link check, the probe (a profile's JSON;
    None without one) and a record per run.

    A PowerSGD run that fails is reported as failed and replaced, from then
    on, by the same run with the whole model in one bucket. Misordered
    collectives can also hang instead of aborting, so PowerSGD's ranks get a
    deadline: a minute plus ten times the dense run's duration.
    """
    measured: dict[str, list[dict]] = {}  # label -> its record from every round
    failed: dict[str, dict] = {}
    probed = None

    def attempt(run: dict, dense_seconds: float) -> bool:
        try:
            result = common.spawn(
                ranks, settings["spawn"], [run], settings, False, timeout=60 + 10 * dense_seconds
            )
        except common.RanksFailed as error:
            sys.stderr.write(f"{run['label']} failed: {error.reason}\n")
            failed[run["label"]] = dict(
                run=run["label"], kind=run["kind"], note=run.get("note", ""), failed=error.reason
            )
            return False
        measured.setdefault(run["label"], []).append(result["records"][0])
        return True

    ordinary = [run for run in runs if run["kind"] != "powersgd"]
    current = {run["label"]: run for run in runs if run["kind"] == "powersgd"}  # what each one runs as now
    link_check = None
    deadline = ranks_deadline(settings, len(ordinary), common.link_info())
    for round_ in range(settings["rounds"]):
        outcome = common.spawn(ranks, settings["spawn"], ordinary, settings, round_ == 0, timeout=deadline)
        link_check = link_check or outcome["link_check"]
        probed = probed or outcome["probe"]
        for record in outcome["records"]:
            measured.setdefault(record["run"], []).append(record)
        dense_seconds = measured[LABELS["dense"]][-1]["step_ms"] / 1e3 * settings["steps"]
        for label, run in current.items():
            while run is not None and not attempt(run, dense_seconds):
                run = None if run.get("bucket_cap_mb") == ONE_BUCKET_MB else _one_bucket(run, runs)
            current[label] = run
    records = {label: pool(rounds) for label, rounds in measured.items()}
    return link_check, probed, [failed.get(run["label"]) or records[run["label"]] for run in runs]


def ranks_deadline(settings: dict, runs: int, link: dict | None) -> float:
    """Seconds the ranks get for ``runs`` runs in one go: 10 minutes, plus on a limited
    loopback a dense step's transfer (every rank's sends share the limit) for each step of
    each run: at 100 Mbit/s a dense step of the 25M-parameter MLP alone takes 16 s."""
    if not link:
        return 600.0
    features, width = settings["features"], settings["width"]
    params = features * width + width + width * width + width + width * CLASSES + CLASSES
    world = settings["spawn"]
    dense_step = 2 * (world - 1) * 4 * params * 8 / link["bits_per_second"]
    return 600.0 + runs * settings["steps"] * dense_step


def _one_bucket(run: dict, runs: list[dict]) -> dict:
    """``run`` with the whole model in one bucket, listed right after it."""
    retry = {
        **run,
        "label": f"{run['label']}, 1 bucket",
        "bucket_cap_mb": ONE_BUCKET_MB,
        "note": f"bucket_cap_mb={ONE_BUCKET_MB:g} (whole model in one bucket)",
    }
    runs.insert(runs.index(run) + 1, retry)
    return retry


def pool(rounds: list[dict]) -> dict:
    """One record from the same run's records of several rounds: the median over all
    their timed steps (and of their compress times)."""
    record = dict(rounds[0])
    steps = [ms for r in rounds for ms in r["step_ms_all"]]
    record.update(
        step_ms=statistics.median(steps),
        step_ms_all=steps,
        compress_ms=statistics.median(r["compress_ms"] for r in rounds),
        rounds=len(rounds),
    )
    return record


def derive(records: list[dict]) -> None:
    """Add communication time and the ratios to each record, from the same run's baselines."""
    by_kind = {record["kind"]: record for record in records if not record["failed"]}
    compute = by_kind["compute"]["step_ms"]
    dense = by_kind["dense"]
    dense_comm = dense["step_ms"] - compute
    fp16 = by_kind.get("fp16_hook")
    fp16_comm = fp16["step_ms"] - compute if fp16 else math.nan
    for record in records:
        if record["failed"]:
            continue
        comm = record["step_ms"] - compute
        record["compute_ms"] = compute
        record["comm_ms"] = comm if record["kind"] != "compute" else 0.0
        record["ratio"] = common.ratio(record["dense_bytes_per_step"], record["bytes_per_step"])
        if record["kind"] != "compute":
            record["comm_speedup_vs_dense"] = common.ratio(dense_comm, comm)
            record["comm_speedup_vs_fp16_hook"] = common.ratio(fp16_comm, comm)
            record["step_speedup_vs_dense"] = common.ratio(dense["step_ms"], record["step_ms"])
    # A hierarchical run against the flat run of the same compressor, if there is one.
    flat = {
        r["name"]: r["comm_ms"]
        for r in records
        if r["kind"] == "gradcomp" and not r["failed"] and r["options"].get("algorithm") != "hierarchical"
    }
    for record in records:
        if record["kind"] == "gradcomp" and not record["failed"]:
            hierarchical = record["options"].get("algorithm") == "hierarchical"
            reference = flat.get(record["name"]) if hierarchical else None
            record["comm_speedup_vs_flat"] = common.ratio(reference, record["comm_ms"])


def add_predictions(records: list[dict], world_size: int, probed: dict | None = None) -> None:
    """The planner's predicted communication a step of dense and each static gradcomp run,
    against the observed (step minus compute-only): from ``probed`` (the profile measured in
    the run, on its link) where given, else from the stored profile on this run's link (a
    limited loopback carries every rank's sends: each rank gets the limit over the ranks;
    unlimited: the profile's own link). auto's is its plan's own (the link and codecs the
    hook measured in the run), where it planned. Each bucket's whole time: on CPUs the
    reductions compete with the backward pass for the cores, and crediting the overlap
    (``planner.exposed_seconds`` with auto's ``ready_offsets``) missed more
    (bench/README.md)."""
    for record in records:
        if record.get("name") == "auto" and not math.isnan(record.get("planned_comm_ms", math.nan)):
            record["predicted_comm_ms"] = record["planned_comm_ms"]
            record["model_error"] = common.ratio(record["planned_comm_ms"], record["comm_ms"]) - 1
    if probed is not None:
        profile, source = planner.Profile.from_json(probed), PROBED
    else:
        try:
            profile, source = planner.Profile.load(), STORED
        except FileNotFoundError:
            return
        link = common.link_info()
        if link:
            profile = profile.with_link(link["bits_per_second"] / 8 / world_size)
    for record in records:
        if record["failed"] or record["kind"] not in ("dense", "gradcomp") or record["name"] == "auto":
            continue
        algorithm, inter = record["options"].get("algorithm"), record["options"].get("inter_algorithm")
        try:
            compressor = _compressor_of(record)
            seconds = sum(
                planner.predict(compressor, n, world_size, profile, algorithm, inter).seconds
                for n in record["bucket_numels"]
            )
        except (KeyError, ValueError):  # not measured in the profile, or not modelled
            continue
        record["predicted_comm_ms"] = 1e3 * seconds
        record["model_error"] = common.ratio(1e3 * seconds, record["comm_ms"]) - 1
        record["predicted_from"] = source


# Where a static run's predicted communication came from.
PROBED, STORED = "a probe in the run", "the stored profile"


def format_report(records: list[dict]) -> str:
    levels = any(not math.isnan(r.get("inter_bytes_per_step", math.nan)) for r in records)
    header = [
        "run",
        "bytes/step",
        *(["inter bytes/step", "comm x flat"] if levels else []),
        "ratio",
        "step ms",
        "comm ms",
        "comm x dense",
        "comm x fp16",
        "step x dense",
        "compress ms",
        "model ms",
        "loss",
        "buckets",
        "note",
    ]
    rows = []
    for r in records:
        if r["failed"]:
            rows.append(
                [r["run"], *["-"] * (len(header) - 2), f"failed: {r['failed']}; {r['note']}".strip("; ")]
            )
            continue
        rows.append(
            [
                r["run"],
                f"{r['bytes_per_step']:,.0f}",
                *(
                    [
                        common.fmt(r.get("inter_bytes_per_step"), ",.0f"),
                        common.fmt(r.get("comm_speedup_vs_flat"), ".2f", "x"),
                    ]
                    if levels
                    else []
                ),
                common.fmt(r["ratio"], ".1f"),
                f"{r['step_ms']:.0f}",
                f"{r['comm_ms']:.0f}",
                common.fmt(r.get("comm_speedup_vs_dense"), ".2f", "x"),
                common.fmt(r.get("comm_speedup_vs_fp16_hook"), ".2f", "x"),
                common.fmt(r.get("step_speedup_vs_dense"), ".2f", "x"),
                common.fmt(r["compress_ms"], ".0f"),
                _predicted(r),
                common.fmt(r["loss"], ".4f"),
                str(r["buckets"]),
                r["note"],
            ]
        )
    return common.format_table(header, rows, left=(0, -1))


def describe_model(records: list[dict]) -> str:
    """How many static runs the cost model predicted within its target, in a line ("" if none)."""
    static = [r for r in records if not r["failed"] and r.get("name") != "auto"]
    predicted = [r for r in static if not math.isnan(r.get("predicted_comm_ms", math.nan))]
    if not predicted:
        return ""
    within = sum(abs(r["model_error"]) <= MODEL_TARGET for r in predicted)
    sources = " and ".join(sorted({r.get("predicted_from") or STORED for r in predicted}))
    return (
        f"cost model ({sources}): {within} of {len(predicted)} static runs predicted within "
        f"{MODEL_TARGET:.0%} of the observed communication"
    )


def _predicted(record: dict) -> str:
    if math.isnan(record.get("predicted_comm_ms", math.nan)):
        return "-"
    return f"{record['predicted_comm_ms']:.0f} ({record['model_error']:+.0%})"


def plot(records: list[dict], title: str, path: str) -> None:
    """Stacked bars: compute and communication time per run, bytes ratio on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(max(8, 1.1 * len(records)), 5))
    labels = [r["run"] for r in records]
    positions = range(len(records))
    compute = [0 if r["failed"] else r["compute_ms"] for r in records]
    comm = [0 if r["failed"] else max(r["comm_ms"], 0) for r in records]
    axis.bar(positions, compute, color="#9aa5b1", label="compute (compute-only run)")
    axis.bar(positions, comm, bottom=compute, color="#d9534f", label="communication (step - compute)")
    for x, r in zip(positions, records, strict=True):
        axis.text(x, 0 if r["failed"] else r["step_ms"], _bar_label(r), ha="center", va="bottom", fontsize=7)
    axis.set_ylim(0, 1.15 * max(r.get("step_ms", 0) for r in records))
    axis.set_xticks(list(positions), labels, rotation=30, ha="right", fontsize=8)
    _save(figure, axis, title, path)


def _save(figure, axis, title: str, path: str) -> None:
    """Label the step-time axis, title the figure and write it."""
    import matplotlib.pyplot as plt

    axis.set_ylabel("median step time (ms)")
    axis.legend(fontsize=8)
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _bar_label(record: dict) -> str:
    if record["failed"]:
        return "failed"
    if record["kind"] in ("compute", "dense"):
        return f"{record['step_ms']:.0f} ms"
    return f"{record['step_ms']:.0f} ms\n{record['ratio']:.0f}x fewer bytes"


def describe(settings: dict, records: list[dict]) -> str:
    parameters = next(r["parameters"] for r in records if not r["failed"])
    interleaved = (
        "runs interleaved (each run's untimed steps in turn, then a timed step of each, in rotating order); "
        if settings.get("interleave")
        else ""
    )
    return (
        f"MLP {settings['features']}-{settings['width']}-{settings['width']}-{CLASSES} "
        f"({parameters:,} parameters, bucket_cap_mb {settings['bucket_cap_mb']:g}), synthetic "
        f"data (a linear teacher on a {LATENT}-dim latent), batch {settings['batch_size']} per rank, "
        f"SGD lr {settings['lr']} momentum 0.9, "
        f"{settings['steps']} steps ({settings['warmup_steps']} untimed; auto runs its trial's "
        f"steps on top, untimed), median of the slowest rank; {interleaved}"
        "loss: cross-entropy on 2048 held-out samples after the steps (auto: after as many)"
    )


def describe_link(check: dict) -> str:
    text = (
        f"link check: dense all_reduce of {common.format_size(check['bytes'])} took "
        f"{check['seconds']:.3f} s = {check['loopback_gbit_per_s']:.2f} Gbit/s through the loopback "
        "(all ranks' traffic together)"
    )
    if "expected_seconds" in check:
        text += f"; the limit allows at best {check['expected_seconds']:.3f} s"
    return text


def describe_probe(profile: planner.Profile) -> str:
    """The in-run probe the static runs' predictions come from, in a line."""
    codecs = ", ".join(
        f"{name} {codec.encode.rate / 1e6:.0f}/{codec.decode.rate / 1e6:.0f}"
        for name, codec in profile.codecs.items()
    )
    text = (
        f"probe (after the first round's runs): all_reduce {profile.link.bandwidth * 8 / 1e9:.3g} Gbit/s "
        f"per rank, {profile.link.latency * 1e6:.3g} us a ring step"
    )
    links = {"all_reduce": profile.link, **profile.links}
    nodes = profile.nodes
    if nodes is not None:
        text += (
            f"; between nodes all_reduce {nodes.link.bandwidth * 8 / 1e9:.3g} Gbit/s per rank, "
            f"{nodes.link.latency * 1e6:.3g} us a ring step; the node's stages "
            f"{nodes.stages.rate / 1e6:.0f}M elements/s"
        )
        links |= {
            f"{name} between nodes": link for name, link in {"all_reduce": nodes.link, **nodes.links}.items()
        }
    per_byte = {name: link.cpu_seconds_per_byte for name, link in links.items()}
    cpu = ", ".join(f"{name} {seconds * 1e9:.2g}" for name, seconds in per_byte.items() if seconds)
    text += f"; the transport's CPU ms a MB sent: {cpu}" if cpu else ""
    return text + (f"; codecs, encode/decode M elements/s: {codecs}" if codecs else "")


def describe_levels(check: dict, rate_bits: float) -> str:
    """The emulation check in words: each level's rate against the limit."""
    inter, limit = check["inter_gbit_per_s"], rate_bits / 1e9
    verdict = "matches the limit" if 0.75 <= inter / limit <= 1.05 else "DOES NOT match the limit"
    text = (
        f"emulation check: dense all_reduce of {common.format_size(check['bytes'])} between two nodes "
        f"{check['inter_seconds']:.3f} s = {inter:.2f} Gbit/s sent per rank, "
        f"limit {limit:g} Gbit/s: {verdict}"
    )
    if "intra_gbit_per_s" in check:
        intra = check["intra_gbit_per_s"]
        seconds = check["intra_seconds"]
        text += f"; inside a node {seconds:.3f} s = {intra:.2f} Gbit/s ({intra / limit:.1f}x the limit)"
    return text


# ----------------------------------------------------------------------------- a sweep of links

# What auto may choose by default: the dense run stands for "none".
AUTO_TARGET_BEST, AUTO_TARGET_DENSE, MODEL_TARGET = 1.05, 1.03, 0.25


def sweep(args: argparse.Namespace, rates: list[str], argv: list[str]) -> int:
    """The whole bench once per rate, each in a process (and a limited namespace) of its
    own (``none``: the unlimited loopback); then, per rate, each run against the best
    static choice among auto's candidates, and the cost model against the observed."""
    base = _without_option(argv, "--bandwidth")
    facts = common.machine(args.spawn, "gloo")
    documents = []
    for rate in rates:
        limited = rate != "none"
        print(f"== link: {rate} ==", flush=True)
        command = [sys.executable, os.path.abspath(__file__), *base]
        command += ["--bandwidth", rate] if limited else []
        code = subprocess.run(command).returncode
        if code:
            return code
        written = common.Results("ddp_train", facts, {}, args.out, suffix=f"-{rate}" if limited else "")
        with open(written.path("json")) as file:
            documents.append((rate, json.load(file)))
    rows = sweep_rows(documents)
    print(format_sweep(rows))
    results = common.Results("ddp_train", facts, {**vars(args), "rates": rates}, args.out, suffix="-sweep")
    paths = results.write(rows, extra=dict(sources=[document["command"] for _, document in documents]))
    png = results.path("png")
    plot_sweep(rows, f"ddp_train across links: {results.machine['machine']}", png)
    print(f"wrote {', '.join([*paths, png])}")
    return 0


def _without_option(argv: list[str], option: str) -> list[str]:
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(option + "="):
            kept.append(item)
    return kept


def sweep_rows(documents: list[tuple[str, dict]]) -> list[dict]:
    """A row per link and run: step and communication time, the model's prediction, and
    for auto its picks against the best static choice among its candidates and dense."""
    rows = []
    for rate, document in documents:
        records = [r for r in document["records"] if not r["failed"] and r["kind"] != "compute"]
        auto = next((r for r in records if r["name"] == "auto"), None)
        allow = planner.checked_candidates((auto or {}).get("options", {}).get("allow"))
        names = {planner.candidate(spec).name for spec in allow} | {""}  # "": dense, no hook
        static = [r for r in records if r["kind"] in ("dense", "gradcomp") and r["name"] in names]
        best = min(static, key=lambda r: r["step_ms"]) if static else None
        dense = next((r for r in records if r["kind"] == "dense"), None)
        for record in records:
            row = dict(
                link=rate,
                run=record["run"],
                step_ms=record["step_ms"],
                comm_ms=record["comm_ms"],
                predicted_comm_ms=record.get("predicted_comm_ms", math.nan),
                model_error=record.get("model_error", math.nan),
                predicted_from=record.get("predicted_from", ""),
                note=record["note"],
                candidate=record in static,
                auto=record is auto,
            )
            if record is auto and best is not None and dense is not None:
                row.update(
                    best_static=best["run"],
                    x_best_static=record["step_ms"] / best["step_ms"],
                    x_dense=record["step_ms"] / dense["step_ms"],
                )
            rows.append(row)
    return rows


def format_sweep(rows: list[dict]) -> str:
    """The runs of every link, then per link what auto chose and whether the targets hold."""
    header = ["link", "run", "step ms", "comm ms", "model ms", "note"]
    table = [
        [
            r["link"],
            r["run"],
            f"{r['step_ms']:.0f}",
            f"{r['comm_ms']:.0f}",
            _predicted(r),
            r["note"],
        ]
        for r in rows
    ]
    lines = [common.format_table(header, table, left=(0, 1, -1))]
    for r in rows:
        if "x_best_static" not in r:
            continue
        verdict = "met" if r["x_best_static"] <= AUTO_TARGET_BEST else "NOT met"
        line = (
            f"{r['link']}: {r['note']}; {r['step_ms']:.0f} ms = {r['x_best_static']:.2f}x the best static "
            f"choice ({r['best_static']}; target <= {AUTO_TARGET_BEST}x: {verdict}), "
            f"{r['x_dense']:.2f}x dense"
        )
        if r["link"] == "none":
            verdict = "met" if r["x_dense"] <= AUTO_TARGET_DENSE else "NOT met"
            line += f" (target on the unlimited link <= {AUTO_TARGET_DENSE}x: {verdict})"
        lines.append(line)
    for runs in ("static", "auto"):
        predicted = [
            r
            for r in rows
            if not math.isnan(r["predicted_comm_ms"]) and r.get("auto", False) == (runs == "auto")
        ]
        sources = {r.get("predicted_from") or STORED for r in predicted}
        source = "its own measurements" if runs == "auto" else " and ".join(sorted(sources))
        if predicted:
            # A step no slower than compute-only leaves no communication to compare with:
            # counted, not within.
            within = sum(abs(r["model_error"]) <= MODEL_TARGET for r in predicted)
            line = (
                f"cost model ({source}): {within} of {len(predicted)} {runs} runs predicted within "
                f"{MODEL_TARGET:.0%} of the observed communication"
            )
            unobserved = sum(math.isnan(r["model_error"]) for r in predicted)
            if unobserved:
                line += f" ({unobserved} with no communication observed: step within compute-only)"
            lines.append(line)
    return "\n".join(lines)


def plot_sweep(rows: list[dict], title: str, path: str) -> None:
    """Step time per link for every run (log scale), auto drawn bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    figure, axis = plt.subplots(figsize=(8, 5))
    for run in dict.fromkeys(r["run"] for r in rows):
        points = [(links.index(r["link"]), r["step_ms"]) for r in rows if r["run"] == run]
        auto = run.startswith("auto")
        axis.plot(*zip(*points, strict=True), marker="o", linewidth=3 if auto else 1.2, label=run)
    axis.set_xticks(range(len(links)), links)
    axis.set_yscale("log")
    axis.set_xlabel("link (tc limit on the loopback; none: unlimited)")
    _save(figure, axis, title, path)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rates = [rate.strip().lower() for rate in (args.bandwidth or "").split(",") if rate.strip()]
    if len(rates) > 1:
        if args.nodes:
            parser().error("--bandwidth limits one namespace's loopback; with --nodes use --inter-bandwidth")
        try:
            [common.parse_rate(rate) for rate in rates if rate != "none"]
        except argparse.ArgumentTypeError as error:
            parser().error(str(error))
        return sweep(args, rates, sys.argv[1:] if argv is None else argv)
    args.bandwidth = None if rates == ["none"] else args.bandwidth
    cluster_mode = bool(args.nodes)
    if cluster_mode:
        if args.bandwidth:
            parser().error("--bandwidth limits one namespace's loopback; with --nodes use --inter-bandwidth")
        if args.nodes < 2 or args.ranks_per_node < 1:
            parser().error("--nodes needs at least 2 nodes and --ranks-per-node at least 1")
        common.parse_rate(args.inter_bandwidth)
        args.spawn = args.nodes * args.ranks_per_node
    common.maybe_run_limited(args)
    if args.compressors is None:
        args.compressors = list(CLUSTER_COMPRESSORS if cluster_mode else DEFAULT_COMPRESSORS)
    if args.baselines is None:
        args.baselines = list(CLUSTER_BASELINES if cluster_mode else BASELINES)
    args.compressors = common.split_list(args.compressors)
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
    facts = common.machine(args.spawn, "gloo")
    suffix = f"-{args.nodes}x{args.ranks_per_node}-{args.inter_bandwidth}" if cluster_mode else None
    results = common.Results("ddp_train", facts, settings, args.out, suffix=suffix)
    print(f"machine: {results.machine['machine']}", flush=True)
    try:
        with common.cluster_from(args) as cluster:
            if cluster:
                facts["link"] = cluster.describe()
                facts["machine"] += f", {args.nodes} emulated nodes, {args.inter_bandwidth} between them"
            check, probed, records = execute(runs, settings)
    except common.RanksFailed as error:
        sys.stderr.write(f"ddp_train failed: {error}\n")
        return 1
    derive(records)
    if probed is not None or not cluster_mode:  # the stored profile knows no emulated cluster
        add_predictions(records, args.spawn, probed)
    print(describe(settings, records))
    if cluster_mode:
        print(f"cluster: {facts['link']}")
        print(describe_levels(check, common.parse_rate(args.inter_bandwidth)))
    else:
        print(describe_link(check))
    print(format_report(records))
    if probed is not None:
        print(describe_probe(planner.Profile.from_json(probed)))
    summary = describe_model(records)
    if summary:
        print(summary)
    paths = results.write(records, extra=dict(link_check=check, probe=probed))
    png = results.path("png")
    plot(records, f"ddp_train: {results.machine['machine']}", png)
    print(f"wrote {', '.join([*paths, png])}")
    print(f"load average (1/5/15 min): {results.load_start} at start, {common.loadavg()} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
