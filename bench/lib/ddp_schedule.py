"""How ``ddp_train.py``'s runs go on the ranks: rounds, interleaving, retries, deadlines, pooling.

A spawn runs every run of a round on the same ranks (one after another, or
``--interleave``: a timed step of each in turn), after a check of the link
in the first round and before the probe the static runs' predictions come
from. torch's PowerSGD runs in ranks of its own: its collectives, issued
from Future callbacks, can abort Gloo on a model of several buckets, and a
failed run is retried with the whole model in one bucket. The rounds'
records of a run pool into one (the median over every timed step).

Example:
    >>> link_check, probe, records = execute(runs, settings)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from gradcomp import planner
from gradcomp.collectives import queue_for, ring_all_reduce_bytes
from gradcomp.collectives.node_layout import nodes_for_auto
from gradcomp.spawn import RanksFailed
from lib import link, spawning
from lib.cluster import measure_levels
from lib.ddp_training import CLASSES, LABELS, Training
from lib.specs import compressor_of

ONE_BUCKET_MB = 4096.0


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
    limit = link.link_info()
    if limit:
        check["expected_seconds"] = link.loopback_seconds(crossing, limit)
    return check


def ranks(rank: int, world_size: int, runs: list[dict], settings: dict, link_check: bool) -> dict:
    """Body of the spawned ranks: optionally the link check, then each run in turn, then
    with the link check (the first round) the probe the static runs' predictions come from."""
    check = None
    if link_check:
        check = measure_levels(settings) or check_link(world_size, settings["link_check_bytes"])
    if settings["interleave"]:
        records = train_interleaved(rank, world_size, runs, settings)
    else:
        records = [train(rank, world_size, run, settings) for run in runs]
    probed = None
    if link_check:
        probed = probe_machine(runs, records, nodes=bool(settings["nodes"])).to_json()
    return dict(link_check=check, records=records, probe=probed)


def probe_machine(runs: list[dict], records: list[dict], nodes: bool = False) -> planner.Profile:
    """What the cost model knows of this machine, measured now on the run's own link and
    ranks (``planner.probe``): the link at the sizes auto times it at for these buckets,
    and the static gradcomp runs' codecs at the buckets' sizes; with ``nodes`` (an
    emulated cluster: its ranks have LOCAL_WORLD_SIZE), the levels of the hierarchy too."""
    buckets = next(r["bucket_numels"] for r in records if r.get("bucket_numels"))
    static = [compressor_of(run) for run in runs if run["kind"] == "gradcomp" and run["name"] != "auto"]
    static = list({planner.label(c): c for c in static}.values())  # flat and hierarchical share a codec
    hierarchy = nodes_for_auto(queue_for(None), None) if nodes else None  # None: a flat probe
    profile, _ = planner.probe(
        planner.link_sizes(buckets), static, codec_sizes=sorted(set(buckets)), hierarchy=hierarchy
    )
    return profile


def execute(runs: list[dict], settings: dict) -> tuple[dict, dict | None, list[dict]]:
    """Run everything, ``--rounds`` times; PowerSGD in processes of its own (a Gloo
    abort must not end the bench). Returns the link check, the probe (a profile's JSON)
    and a record per run.

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
            result = spawning.spawn(
                ranks, settings["spawn"], [run], settings, False, timeout=60 + 10 * dense_seconds
            )
        except RanksFailed as error:
            reason = spawning.reason(error)
            sys.stderr.write(f"{run['label']} failed: {reason}\n")
            failed[run["label"]] = dict(
                run=run["label"], kind=run["kind"], note=run.get("note", ""), failed=reason
            )
            return False
        measured.setdefault(run["label"], []).append(result["records"][0])
        return True

    ordinary = [run for run in runs if run["kind"] != "powersgd"]
    current = {run["label"]: run for run in runs if run["kind"] == "powersgd"}  # what each one runs as now
    link_check = None
    deadline = ranks_deadline(settings, len(ordinary), link.link_info())
    for round_ in range(settings["rounds"]):
        outcome = spawning.spawn(ranks, settings["spawn"], ordinary, settings, round_ == 0, timeout=deadline)
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


def ranks_deadline(settings: dict, runs: int, limit: dict | None) -> float:
    """Seconds the ranks get for ``runs`` runs in one go: 10 minutes, plus on a limited
    loopback a dense step's transfer (every rank's sends cross it) for each step of each
    run: at 50 Mbit/s a rank, a dense step of the 25M-parameter MLP alone takes 16 s."""
    if not limit:
        return 600.0
    features, width = settings["features"], settings["width"]
    params = features * width + width + width * width + width + width * CLASSES + CLASSES
    world = settings["spawn"]
    dense_step = link.loopback_seconds(2 * (world - 1) * 4 * params, limit)
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
