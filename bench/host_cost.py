"""Host cost per bucket: gradcomp's DDP hook against DDP's own all-reduce where kernel time vanishes.

On a fast link (NVLink carries a 25 MB bucket in tens of microseconds) a
hook that spends hundreds of microseconds of Python per bucket is bound by
the host. This script measures that cost on a model made of many tiny
buckets: ``--buckets`` parameters of ``--bucket-numel`` fp32 elements each,
with ``bucket_cap_mb`` one parameter's bytes, so that DDP gives every
parameter a bucket of its own (checked from DDP's logging data after its
rebuild, and from the hook's statistics). The forward pass scales a one-row
input by each parameter in turn: forward and backward kernels take
microseconds, and a step's time is the host's (DDP's reducer, the hook's
Python, the worker thread, the transport).

The configurations, each a model of its own in every rank, trained with SGD:

* ``ddp``: DDP's own all-reduce, no hook (the baseline);
* ``torch_allreduce``, ``torch_fp16``: PyTorch's own Python hooks
  (``default_hooks.allreduce_hook``, ``fp16_compress_hook``): what any
  Python hook costs over DDP's C++ path, and what PyTorch's compressing
  hook costs ("vs fp16 hook": a run's step time above it, per bucket);
* ``int8``, ``topk``: ``gradcomp.ddp.register(model, name, min_numel=0,
  warmup_steps=0, measure_error=False)``: every bucket compressed from the
  first step (the default ``min_numel`` would keep buckets under 1,024
  elements dense), Top-K with its default ratio (1%).

``--device cuda``: the models, their gradients and the codecs on the GPU (rank
``r`` on GPU ``r`` modulo the GPUs there are: the ranks may share one), the
exchange still Gloo's (through host copies: DDP's own all-reduce too). The
codec ops' time is then the host's, launching their kernels: what a bucket's
path costs the host when kernel time vanishes, the figure the goal is about.
Each step ends with a synchronize, so that its time holds the device's work.
Read its figures knowing that: ranks sharing a GPU take turns on it, and each
Gloo operation on CUDA tensors waits on the host for its copies, so process
switches land in the step time (more for a hook that launches more kernels a
bucket); and CUDA's default is to spin while the host waits for the device,
so the CPU-time columns then hold those waits too (the step times do not
depend on it).

Timing: ``--warmup-steps`` untimed steps of each configuration, then
``--rounds`` rounds; a round runs ``--steps`` steps of each configuration
in turn, the order rotating by one from round to round, so that a machine
whose speed drifts slows every configuration alike. Each step (zero_grad,
forward, backward, optimizer step) starts after a barrier; its time is the
slowest rank's; a configuration's step time is the median over all its
timed steps. Extra host time per bucket = (step time - DDP's) / buckets;
the goal (issue 36) is at most 100 us. CPU time per step (the mean over the
timed steps and the ranks): the process's (every thread: Gloo's too), the
training thread's and gradcomp's worker thread's.

Profile: then, on rank 0, ``--profile-steps`` more steps of each
configuration under ``cProfile``, one profiler per thread (the training
thread, which runs the hook, and gradcomp's worker thread, which runs each
bucket's job and the futures' callbacks; started from a job the worker
runs). Each profiler reads its thread's CPU time; divided by the buckets profiled: each function's own and
cumulative microseconds per bucket, the top ``--top`` by each, and the
hook's microseconds per call. Own time in the blocking primitives
(:data:`WAITS`: the worker's idle queue, a collective's wait) is waiting,
not work: a thread's busy time leaves it out (on the CPU clock a wait costs
next to nothing anyway). The training thread's figures include what DDP
does without a hook too (the forward pass, the autograd engine and DDP's
reducer in ``run_backward``, the optimizer): the ``ddp`` run's profile is
their baseline. The profiler slows Python calls down (each call and return is
recorded): its figures say where the time goes, the unprofiled steps how
much there is. ``cProfile`` profiles one thread at a time only up to Python
3.11 (from 3.12 it is process-wide): on a newer Python the profile is
skipped, with a note.

Example:
    python bench/host_cost.py
    python bench/host_cost.py --buckets 64 --bucket-numel 1024 --rounds 5 --steps 30
    python bench/host_cost.py --device cuda --rounds 3 --steps 20
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import functools
import math
import os
import pstats
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
from lib import spawning
from lib.ddp_training import bucket_numels
from lib.machine import ROOT, machine
from lib.options import add_common_options
from lib.plots import figure
from lib.progress import Progress
from lib.results import Results, publish, ratio
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import gradcomp
from gradcomp import ops
from gradcomp.collectives import queue_for
from gradcomp.spawn import RanksFailed
from gradcomp.tables import format_cell, format_table

CONFIGS = ("ddp", "torch_allreduce", "torch_fp16", "int8", "topk")
LABELS = {
    "ddp": "DDP all-reduce (no hook)",
    "torch_allreduce": "torch allreduce_hook",
    "torch_fp16": "torch fp16_compress_hook",
    "int8": "gradcomp int8",
    "topk": "gradcomp topk 1%",
}
# PyTorch's own Python hooks: what any hook costs (allreduce_hook does in Python what DDP
# does without a hook) and what PyTorch's compressing one costs.
TORCH_HOOKS = {
    "torch_allreduce": default_hooks.allreduce_hook,
    "torch_fp16": default_hooks.fp16_compress_hook,
}
GRADCOMP = ("int8", "topk")
COLOURS = {
    "ddp": "#777777",
    "torch_allreduce": "#aaaaaa",
    "torch_fp16": "#f0ad4e",
    "int8": "#d9534f",
    "topk": "#5b8bd9",
}
GOAL_US = 100.0  # issue 36: gradcomp's host time per bucket at most this far above DDP's own
# Blocking primitives: own time spent in them is waiting (the worker's idle queue, a lock, a
# collective's or a future's wait), not work.
WAITS = (
    "<method 'get' of '_queue.SimpleQueue' objects>",
    "<method 'acquire' of '_thread.lock' objects>",
    "<built-in method torch._C._distributed_c10d.wait>",  # Work.wait
    "<built-in method torch._C.wait>",  # Future.wait
    "<built-in method time.sleep>",
)
THREADS = ("main", "worker")
# CPU time read per timed step: the process's, the training thread's, the worker's and
# the worker's in the codec ops (CodecClock).
CPU_CLOCKS = ("process", "main", "worker", "codec")
# The profile's clock: the profiled thread's CPU time (what the host spends; a thread
# waiting or preempted by the other rank's costs nothing).
PROFILE_CLOCK = time.thread_time
# The integer options: (option, default, what it counts).
COUNTS = (
    ("--buckets", 64, "DDP buckets of the model"),
    ("--bucket-numel", 1024, "fp32 elements of each bucket"),
    ("--steps", 30, "timed steps of each configuration a round"),
    ("--rounds", 5, "rounds, the configurations in turn"),
    ("--warmup-steps", 5, "untimed steps of each configuration first (at least 3: DDP's logging data "
     "holds its rebuilt buckets from the third step)"),
    ("--profile-steps", 5, "steps of each configuration profiled on rank 0 after the timing (0: none)"),
    ("--top", 25, "functions listed per thread and order"),
)  # fmt: skip


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Ranks are spawned Gloo processes on 127.0.0.1 (each with its share of the cores).",
    )
    for option, default, meaning in COUNTS:
        top.add_argument(option, type=int, default=default, help=f"{meaning} (default {default})")
    top.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the models, gradients and codecs are (default cpu; the exchange is Gloo's either way)",
    )
    top.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    add_common_options(top)
    return top


# ----------------------------------------------------------------------------- the model


class TinyBuckets(torch.nn.Module):
    """``count`` parameters of ``numel`` elements; the forward pass scales its input by
    ``1 + p`` for each parameter ``p`` in turn (one elementwise kernel each way)."""

    def __init__(self, count: int, numel: int, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.scales = torch.nn.ParameterList(
            torch.nn.Parameter(0.01 * torch.randn(numel, generator=generator)) for _ in range(count)
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for scale in self.scales:
            inputs = torch.addcmul(inputs, inputs, scale)
        return inputs


class Configuration:
    """One configuration's model, hook and optimizer on this rank, and its timings."""

    def __init__(self, name: str, rank: int, settings: dict):
        self.name = name
        self.device = device_of(rank, settings)
        net = TinyBuckets(settings["buckets"], settings["bucket_numel"]).to(self.device)
        cap_mb = settings["bucket_numel"] * 4 / 2**20  # one parameter's bytes: a bucket each
        device_ids = [self.device] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(net, device_ids=device_ids, bucket_cap_mb=cap_mb)
        self.state = None
        if name in TORCH_HOOKS:
            self.model.register_comm_hook(None, TORCH_HOOKS[name])  # None: the default group
        elif name != "ddp":
            self.state = gradcomp.ddp.register(
                self.model, name, min_numel=0, warmup_steps=0, measure_error=False
            )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=settings["lr"])
        generator = torch.Generator().manual_seed(1000 + rank)
        self.inputs = torch.randn(1, settings["bucket_numel"], generator=generator).to(self.device)
        self.rounds: list[list[float]] = []  # each round's step seconds
        self.cpu = dict.fromkeys(CPU_CLOCKS, 0.0)  # CPU seconds, timed steps

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model(self.inputs).square().mean().backward()
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's time holds the device's work


def device_of(rank: int, settings: dict) -> torch.device:
    """This rank's device: the CPU, or GPU ``rank`` modulo the GPUs there are."""
    if settings["device"] == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


class CodecClock:
    """The worker thread's CPU time inside the codec ops (on a CPU their kernels, on a GPU
    their launches): each op of every backend that runs on ``device`` registered again,
    timed on ``worker``. The rest of the worker's CPU time is gradcomp's own path (jobs,
    payloads, statistics)."""

    def __init__(self, worker: threading.Thread, device: torch.device):
        self.worker, self.seconds, self.inside = worker, 0.0, False
        self.backends = [name for name in ops.BACKENDS if ops.runs_on(name, device)]
        for name in self.backends:
            timed = {op: self._timed(function) for op, function in ops.functions(name).items()}
            ops.register_backend(name, ops.availability(name), timed)

    def _timed(self, function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            if threading.current_thread() is not self.worker or self.inside:
                return function(*args, **kwargs)  # (an op inside another counts once)
            began, self.inside = time.thread_time(), True
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - began
                self.inside = False

        return run


class Clocks:
    """CPU clocks of this process, its training thread, gradcomp's worker thread and the
    worker's codec ops."""

    def __init__(self, worker: threading.Thread, device: torch.device):
        self.worker = time.pthread_getcpuclockid(worker.ident)
        self.codec = CodecClock(worker, device)

    def read(self) -> dict:
        return {
            "process": time.process_time(),
            "main": time.thread_time(),
            "worker": time.clock_gettime(self.worker),
            "codec": self.codec.seconds,
        }


def timed_step(config: Configuration, clocks: Clocks) -> None:
    dist.barrier()
    before = clocks.read()
    began = time.perf_counter()
    config.step()
    config.rounds[-1].append(time.perf_counter() - began)
    after = clocks.read()
    for key in config.cpu:
        config.cpu[key] += after[key] - before[key]


# ----------------------------------------------------------------------------- ranks


def ranks(rank: int, world_size: int, settings: dict) -> dict:
    """Body of the spawned ranks: warm-up, the interleaved rounds, the profile (rank 0);
    returns the records and the profile."""
    device = device_of(rank, settings)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the training thread's GPU (DDP's, the synchronize's)
    q = queue_for(None)  # made here, in the same order on every rank (a collective)
    worker = q.submit(threading.current_thread, torch.device("cpu")).wait()
    clocks = Clocks(worker, device)
    configs = [Configuration(name, rank, settings) for name in CONFIGS]
    steps, rounds = settings["steps"], settings["rounds"]
    total = len(configs) * (settings["warmup_steps"] + rounds * steps + settings["profile_steps"])
    progress = Progress(total, settings["progress"] if rank == 0 else False)
    done = 0
    for config in configs:
        for _ in range(settings["warmup_steps"]):
            config.step()
        check_buckets(config, settings)
        done += settings["warmup_steps"]
    for round_ in range(rounds):
        turn = round_ % len(configs)
        for config in configs[turn:] + configs[:turn]:
            config.rounds.append([])
            for _ in range(steps):
                timed_step(config, clocks)
                done += 1
                progress.update(done, f"round {round_ + 1}/{rounds} {config.name}")
    records = [record(config, settings, world_size) for config in configs]
    profile = None
    if settings["profile_steps"] and can_profile_threads():
        profile = {}
        for config in configs:
            profile[config.name] = profile_run(config, q, rank, settings)
            done += settings["profile_steps"]
            progress.update(done, f"profile {config.name}")
    progress.close()
    return dict(records=records, profile=profile)


def check_buckets(config: Configuration, settings: dict) -> None:
    """DDP's buckets after its rebuild, and the hook's last step, are as the settings ask."""
    expected = [settings["bucket_numel"]] * settings["buckets"]
    sizes = bucket_numels(config.model)
    if sizes != expected:
        raise ValueError(f"{config.name}: DDP made buckets of {sizes} elements, expected {expected}")
    if config.state is not None:
        config.state.flush()
        last = config.state.stats[-1]
        if (last.buckets, last.compressed_buckets) != (settings["buckets"],) * 2:
            raise ValueError(
                f"{config.name}: the hook saw {last.buckets} buckets and compressed "
                f"{last.compressed_buckets}, expected {settings['buckets']} of each"
            )


def record(config: Configuration, settings: dict, world_size: int) -> dict:
    """The configuration's record (every rank takes part: its collectives are the same)."""
    seconds = [s for round_ in config.rounds for s in round_]
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    cpu = torch.tensor([config.cpu[key] for key in CPU_CLOCKS], dtype=torch.float64)
    dist.all_reduce(cpu)
    process, main, worker, codec = (cpu / world_size / len(seconds)).tolist()  # per step, mean over ranks
    steps = settings["steps"]
    per_round = [slowest[i : i + steps].tolist() for i in range(0, len(seconds), steps)]
    how = ""
    if config.state is not None:
        config.state.flush()
        how = ", ".join(sorted(set(config.state.stats[-1].compressors.values())))
    elif config.name in TORCH_HOOKS:
        how = f"torch {TORCH_HOOKS[config.name].__name__}"
    return dict(
        config=config.name,
        run=LABELS[config.name],
        how=how or "torch all_reduce",
        device=settings["device"],
        buckets=len(bucket_numels(config.model)),
        bucket_numel=settings["bucket_numel"],
        timed_steps=len(seconds),
        step_ms=1e3 * statistics.median(slowest.tolist()),
        step_ms_rounds=[round(1e3 * statistics.median(r), 3) for r in per_round],
        cpu_ms=1e3 * process,
        main_cpu_ms=1e3 * main,
        worker_cpu_ms=1e3 * worker,
        codec_cpu_ms=1e3 * codec,
        path_cpu_ms=1e3 * (worker - codec),
        other_cpu_ms=1e3 * (process - main - worker),
    )


# ----------------------------------------------------------------------------- profile


def can_profile_threads() -> bool:
    """Whether cProfile profiles the thread that enables it only (up to Python 3.11)."""
    return sys.version_info < (3, 12)


def profile_run(config: Configuration, q, rank: int, settings: dict) -> dict | None:
    """``--profile-steps`` steps of ``config``, profiled on rank 0 (one profiler for the
    training thread, one for the worker's, enabled by a job it runs); its summary."""
    profilers = {thread: cProfile.Profile(PROFILE_CLOCK) for thread in THREADS}
    cpu = torch.device("cpu")
    if rank == 0:
        q.submit(profilers["worker"].enable, cpu).wait()
    for _ in range(settings["profile_steps"]):
        dist.barrier()
        if rank == 0:
            profilers["main"].enable()
        config.step()
        if rank == 0:
            profilers["main"].disable()
    if rank != 0:
        return None
    q.submit(profilers["worker"].disable, cpu).wait()
    buckets = settings["profile_steps"] * settings["buckets"]
    stats = {thread: pstats.Stats(profilers[thread]).stats for thread in THREADS}
    summary = {thread: summarize(stats[thread], buckets, settings["top"]) for thread in THREADS}
    _, calls, _, cumulative, _ = stats["main"].get(function_key(gradcomp.ddp.hook), (0, 0, 0.0, 0.0, {}))
    summary["hook_calls"] = calls
    summary["hook_us_per_call"] = 1e6 * cumulative / calls if calls else math.nan
    summary["buckets_profiled"] = buckets
    return summary


def function_key(function) -> tuple[str, int, str]:
    """The key ``pstats`` files ``function`` under."""
    code = function.__code__
    return code.co_filename, code.co_firstlineno, code.co_name


def summarize(stats: dict, buckets: int, top: int) -> dict:
    """A thread's profile per bucket: its busy and waiting microseconds, and the
    ``top`` functions by own and by cumulative time."""
    rows = []
    for key, (_, calls, own, cumulative, _) in stats.items():
        rows.append(
            dict(
                function=where(key),
                calls_per_bucket=calls / buckets,
                own_us_per_bucket=1e6 * own / buckets,
                cumulative_us_per_bucket=1e6 * cumulative / buckets,
                waits=key[2] in WAITS,
            )
        )
    waiting = sum(r["own_us_per_bucket"] for r in rows if r["waits"])
    total = sum(r["own_us_per_bucket"] for r in rows)
    calls = sum(r["calls_per_bucket"] for r in rows)
    return dict(
        busy_us_per_bucket=total - waiting,
        waiting_us_per_bucket=waiting,
        calls_per_bucket=calls,
        by_own=sorted(rows, key=lambda r: -r["own_us_per_bucket"])[:top],
        by_cumulative=sorted(rows, key=lambda r: -r["cumulative_us_per_bucket"])[:top],
    )


def where(key: tuple[str, int, str]) -> str:
    """``gradcomp/ddp.py:961(hook)``, ``torch/optim/sgd.py:80(step)`` or a builtin's name."""
    filename, line, name = key
    if filename == "~":
        return name
    if filename.startswith(ROOT + os.sep):
        filename = os.path.relpath(filename, ROOT)
    else:
        for marker in ("site-packages" + os.sep, "dist-packages" + os.sep, "lib" + os.sep):
            if marker in filename:
                filename = filename.rsplit(marker, 1)[1]
                break
    return f"{filename}:{line}({name})"


# ----------------------------------------------------------------------------- report


def derive(records: list[dict], profile: dict | None) -> None:
    """Ratios and per-bucket figures against DDP's own all-reduce; the profile's totals."""
    ddp = next(r for r in records if r["config"] == "ddp")
    fp16 = next(r for r in records if r["config"] == "torch_fp16")
    for r in records:
        buckets = r["buckets"]
        r["x_ddp"] = ratio(r["step_ms"], ddp["step_ms"])
        r["step_us_per_bucket"] = 1e3 * r["step_ms"] / buckets
        r["extra_us_per_bucket"] = 1e3 * (r["step_ms"] - ddp["step_ms"]) / buckets
        r["extra_us_per_bucket_rounds"] = [
            round(1e3 * (mine - base) / buckets, 1)
            for mine, base in zip(r["step_ms_rounds"], ddp["step_ms_rounds"], strict=True)
        ]
        r["extra_cpu_us_per_bucket"] = 1e3 * (r["cpu_ms"] - ddp["cpu_ms"]) / buckets
        r["over_torch_fp16_us_per_bucket"] = 1e3 * (r["step_ms"] - fp16["step_ms"]) / buckets
        r["goal_us_per_bucket"] = GOAL_US
        r["within_goal"] = r["config"] == "ddp" or r["extra_us_per_bucket"] <= GOAL_US
        for key in ("main", "worker", "codec", "path", "other"):
            r[f"{key}_cpu_us_per_bucket"] = 1e3 * r[f"{key}_cpu_ms"] / buckets
        mine = (profile or {}).get(r["config"])
        r["hook_us_per_call"] = mine["hook_us_per_call"] if mine else math.nan
        for thread in THREADS:
            for kind in ("busy", "waiting"):
                value = mine[thread][f"{kind}_us_per_bucket"] if mine else math.nan
                r[f"profile_{thread}_{kind}_us_per_bucket"] = value


def format_report(records: list[dict]) -> str:
    header = ["run", "step ms", "x DDP", "us/bucket", "extra us/bucket", "goal", "vs fp16 hook"]
    header += ["CPU ms/step"]
    header += ["extra CPU us/bucket", "main", "worker", "codec ops", "the rest", "other"]
    rows = []
    for r in records:
        baseline = r["config"] == "ddp"
        rows.append(
            [
                r["run"],
                f"{r['step_ms']:.2f}",
                f"{r['x_ddp']:.2f}x",
                f"{r['step_us_per_bucket']:.0f}",
                "-" if baseline else f"{r['extra_us_per_bucket']:+.0f}",
                "-" if r["config"] not in GRADCOMP else ("met" if r["within_goal"] else "NOT met"),
                f"{r['over_torch_fp16_us_per_bucket']:+.0f}",
                f"{r['cpu_ms']:.2f}",
                "-" if baseline else f"{r['extra_cpu_us_per_bucket']:+.0f}",
                f"{r['main_cpu_us_per_bucket']:.0f}",
                f"{r['worker_cpu_us_per_bucket']:.0f}",
                f"{r['codec_cpu_us_per_bucket']:.0f}",
                f"{r['path_cpu_us_per_bucket']:.0f}",
                f"{r['other_cpu_us_per_bucket']:.0f}",
            ]
        )
    groups = [("", 7), ("CPU time", 2), ("by thread", 2), ("of the worker's", 2), ("", 1)]
    return format_table(header, rows, groups)


def format_profile_totals(records: list[dict]) -> str:
    header = ["run", "hook us/call", "main busy", "main waiting", "worker busy", "worker waiting"]
    rows = [
        [
            r["run"],
            format_cell(r["hook_us_per_call"], ".0f"),
            *(
                format_cell(r[f"profile_{thread}_{kind}_us_per_bucket"], ".0f")
                for thread in THREADS
                for kind in ("busy", "waiting")
            ),
        ]
        for r in records
    ]
    return format_table(header, rows, [("", 2), ("profiled us per bucket (cpu clock)", 4)])


def format_functions(rows: list[dict], order: str) -> str:
    header = ["function", "calls/bucket", "own us/bucket", "cumulative us/bucket"]
    cells = [
        [
            r["function"] + (" [waits]" if r["waits"] else ""),
            f"{r['calls_per_bucket']:.2f}",
            f"{r['own_us_per_bucket']:.1f}",
            f"{r['cumulative_us_per_bucket']:.1f}",
        ]
        for r in rows
    ]
    return f"by {order} time:\n" + format_table(header, cells)


def describe(settings: dict) -> str:
    return (
        f"{settings['device']} tensors, {settings['buckets']} buckets of {settings['bucket_numel']} fp32 "
        "elements (one parameter "
        f"each, scaling a one-row input), SGD lr {settings['lr']}; {settings['warmup_steps']} untimed "
        f"steps of each run, then {settings['rounds']} rounds of {settings['steps']} steps of each, "
        "the order rotating; median step of the slowest rank; CPU time: mean per step over the timed "
        f"steps and the ranks; goal: at most {GOAL_US:.0f} us per bucket above DDP's own"
        + (
            "; on the GPU the CPU times hold the host's spins while it waits for the device"
            if settings["device"] == "cuda"
            else ""
        )
    )


def report(records: list[dict], profile: dict | None, settings: dict) -> str:
    lines = [describe(settings), format_report(records)]
    for r in records:
        if r["config"] != "ddp":
            rounds = ", ".join(f"{value:+.0f}" for value in r["extra_us_per_bucket_rounds"])
            lines.append(f"{r['run']} ({r['how']}): extra us per bucket, round by round: {rounds}")
    if profile is None:
        reason = "cProfile is process-wide from Python 3.12" if settings["profile_steps"] else "off"
        lines.append(f"profile: skipped ({reason})")
        return "\n".join(lines)
    lines += [
        f"profile (rank 0, {settings['profile_steps']} steps of each run under cProfile, one profiler "
        "per thread, cpu clock; slowed down by the profiler):",
        format_profile_totals(records),
    ]
    for name in GRADCOMP:
        for thread in THREADS:
            lines.append(f"\n{LABELS[name]}, {thread} thread, per bucket")
            for order in ("own", "cumulative"):
                lines.append(format_functions(profile[name][thread][f"by_{order}"], order))
    return "\n".join(lines)


def plot(records: list[dict], title: str, path: str) -> None:
    """Host microseconds per bucket of each run, with the goal above DDP's own."""
    with figure(path, title, figsize=(7, 4.5)) as (_, axis):
        labels = [r["run"] for r in records]
        per_bucket = [r["step_us_per_bucket"] for r in records]
        axis.bar(labels, per_bucket, color=[COLOURS[r["config"]] for r in records])
        for x, value in enumerate(per_bucket):
            axis.text(x, value, f"{value:.0f} us", ha="center", va="bottom")
        goal = per_bucket[0] + GOAL_US
        axis.axhline(goal, color="black", linestyle="--", linewidth=1, label=f"goal: DDP + {GOAL_US:.0f} us")
        axis.tick_params(axis="x", labelsize=7, labelrotation=15)
        axis.set_ylabel("step time per bucket (us), median of the slowest rank")
        axis.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if min(args.buckets, args.bucket_numel, args.steps, args.rounds) < 1 or args.warmup_steps < 3:
        parser().error("need --buckets, --bucket-numel, --steps, --rounds >= 1 and --warmup-steps >= 3")
    if args.profile_steps < 0 or args.top < 1 or args.spawn < 2:
        parser().error("need --profile-steps >= 0, --top >= 1 and --spawn >= 2")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser().error("--device cuda needs a CUDA GPU; none is visible here")
    settings = vars(args)
    date = datetime.date.today().isoformat()
    # Where a GPU is visible the names say where the tensors were (the machine's name is the GPU's).
    suffix = f"-{args.device}-{date}" if torch.cuda.is_available() or args.device != "cpu" else f"-{date}"
    results = Results("host_cost", machine(args.spawn, "gloo"), settings, args.out, suffix)
    print(f"machine: {results.machine['machine']}, gradcomp {results.machine['revision']}", flush=True)
    try:
        outcome = spawning.spawn(ranks, args.spawn, settings)
    except RanksFailed as error:
        sys.stderr.write(f"host_cost failed: {error}\n")
        return 1
    records, profile = outcome["records"], outcome["profile"]
    derive(records, profile)
    print(report(records, profile, settings))
    publish(results, records, plot, extra=dict(profile=profile, waits=list(WAITS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
