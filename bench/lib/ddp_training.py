"""One run of ``ddp_train.py`` on every rank: the model, the data, the hook, the steps, the record.

Every run trains the same MLP (gradcomp's demo model, same seed) on the same
synthetic batches with SGD and momentum; what differs is how DDP communicates
(:func:`attach`). A step's time is taken after a barrier; the record pools the
timed steps (the slowest rank's), the bytes a step, the compress time, the
loss on held-out samples after ``--steps`` steps, and for ``auto`` what it
planned and tried.

Example:
    >>> training = Training(rank, world_size, run, settings)
    >>> training.run_until(training.steps)
    >>> record = training.record()
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import re
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import gradcomp
from gradcomp.collectives import ring_all_reduce_bytes
from gradcomp.demo import make_mlp
from lib.progress import Progress

LABELS = {
    "compute": "compute only",
    "dense": "dense",
    "fp16_hook": "torch fp16 hook",
    "powersgd": "torch PowerSGD r4",
}
# Bytes on the wire per gradient element of the runs that do not report their own.
WIRE_BYTES = {"compute": 0, "dense": 4, "fp16_hook": 2}
CLASSES = 10
LATENT = 16


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
        if run.get("name") == "auto":
            extra = self.state.settle_steps  # untimed, like the warm-up
            self.steps, self.warmup = self.steps + extra, self.warmup + extra
        self.progress = Progress(self.steps, settings["progress"] if rank == 0 else False)
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
            buckets=len(bucket_numels(self.model)),
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


def bucket_numels(model: DistributedDataParallel) -> list[int]:
    """The fp32 elements of each of DDP's buckets after its rebuild (from DDP's logging data;
    empty if unavailable)."""
    logging_data = getattr(model, "_get_ddp_logging_data", dict)()
    sizes = str(logging_data.get("rebuilt_bucket_sizes", logging_data.get("bucket_sizes", "")))
    return [int(size) // 4 for size in sizes.split(",") if size.strip()]
