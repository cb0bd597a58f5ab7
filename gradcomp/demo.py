"""Train one model with several compressors on one CPU machine and time each step at a slow link.

``world_size`` processes train the same MLP through
:class:`~torch.nn.parallel.DistributedDataParallel` over Gloo, once per run,
with the same seed and data every time; each rank takes its own shard of every
batch. Two setups:

* :data:`DEFAULT`: a 4.7M-parameter MLP on a synthetic 10-class task (fresh
  samples every step, no download), whose dense step sends 19 MB a rank: on a
  slow link its exchange outweighs its compute, and compression pays;
* :data:`SMALL`: an 85K-parameter MLP on scikit-learn's bundled digits, whose
  step sends so little that encoding costs more than the bytes save.

Each run trains on the unlimited loopback, where its step time (compute and
encoding), the bytes each rank sends and its loss on held-out samples are
measured. Given a network namespace (``link``), the ranks run in it and each
run then takes a few more steps with its loopback limited by ``tc`` to a slow
link's rate: the step measured there (:mod:`gradcomp.limited_link`).
:mod:`gradcomp.cli.verdict` turns the rows into the demo's verdict.

Example:
    >>> rows = run_demo(["dense", "int4"], DEFAULT)
    >>> rows[1].bytes_per_step / rows[0].bytes_per_step
    0.128...
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import gradcomp
from gradcomp import limited_link, planner, spawn
from gradcomp.collectives import ring_all_reduce_bytes

# Runs that do not go through gradcomp, with the bytes each gradient element costs on the wire.
TORCH_RUNS = {"dense": 4, "fp16_hook": 2}
# No compression, a 16-bit cast, 4-bit quantization and 1% sparsification: each a step further
# along bytes saved against encoding time and loss (int8 lies between bf16 and int4 on both).
DEFAULT_RUNS = ("dense", "bf16", "int4", "topk@0.01")
SMALL_RUNS = ("dense", "fp16_hook", "int8", "sign", "topk@0.01", "randk@0.01")
DEFAULT_LINK = "500mbit"
CLASSES = 10
TEST_SAMPLES = 2048  # held out of the synthetic task
DIGITS_SAMPLES = (1347, 450)  # scikit-learn's 1797 digits split 75/25


@dataclasses.dataclass(frozen=True)
class Setup:
    """Training settings shared by every run.

    Attributes:
        task: ``"synthetic"`` (Gaussian features labelled by a fixed random linear map,
            ``features`` of them) or ``"digits"`` (scikit-learn's, 64 features).
        train_samples: the synthetic task's training samples (one pass: ``train_samples /
            batch_size`` steps, each on samples no step saw before); None for digits.
        epochs: passes over the training set.
        batch_size: global batch (split evenly across ranks).
        width: hidden units of each of the MLP's two hidden layers.
        lr, momentum: of the SGD optimiser.
        bucket_cap_mb: DDP bucket size.
        measure_error: keep gradcomp's relative error (one more decoding pass a step).
        link_steps: steps each run takes behind the limited link, the first untimed.
        seed: model initialisation, data and shuffling.
    """

    task: str = "synthetic"
    train_samples: int | None = 60 * 128
    epochs: int = 1
    batch_size: int = 128
    features: int = 256
    width: int = 2048
    lr: float = 0.1
    momentum: float = 0.9
    bucket_cap_mb: float = 25.0
    measure_error: bool = False
    link_steps: int = 7
    seed: int = 0

    @property
    def steps(self) -> int:
        """Training steps of one run (behind the link's not counted)."""
        samples = DIGITS_SAMPLES[0] if self.task == "digits" else self.train_samples
        return self.epochs * (samples // self.batch_size)


DEFAULT = Setup()
# Small enough that the buckets' count, not their size, decides: several buckets of 10 KB.
SMALL = Setup(
    task="digits", train_samples=None, epochs=8, batch_size=64, width=256, lr=0.05,
    bucket_cap_mb=0.01, measure_error=True,
)  # fmt: skip


@dataclasses.dataclass
class Row:
    """One run's result, as rank 0 measured it (every rank sends the same amount).

    Attributes:
        label: the run's name: its spec (``topk@0.01``), or torch's hook by name.
        bytes_per_step: bytes one rank sends per step, counted for a ring
            schedule like nccl-tests' bus bandwidth (gradcomp:
            ``StepStats.bytes_sent`` averaged over steps; dense and torch's
            fp16 hook: a ring all-reduce of 4 or 2 bytes per element).
        ratio: dense bytes / ``bytes_per_step``.
        step_ms: median wall time of one training step on the unlimited loopback
            (forward, backward with its communication, optimiser step).
        compress_ms: mean ``StepStats.compress_seconds`` per step (NaN outside gradcomp).
        relative_error: mean ``StepStats.relative_error`` (NaN unless measured).
        buckets: DDP buckets of the last step (0 outside gradcomp).
        test_loss: cross-entropy on the held-out samples after training.
        test_accuracy: fraction of held-out samples classified correctly.
        link_step_ms: median step behind the limited link (NaN where none was given).
    """

    label: str
    bytes_per_step: float
    ratio: float
    step_ms: float
    compress_ms: float
    relative_error: float
    buckets: int
    test_loss: float
    test_accuracy: float
    link_step_ms: float = math.nan


def label_of(name: str) -> str:
    """How a run is called in the output: its spec (``topk@0.01``), or torch's hook by name."""
    return "torch fp16 hook" if name == "fp16_hook" else name


def check_runs(names: Sequence[str]) -> None:
    """Raise ValueError for a name that is neither a torch run nor a compressor spec
    (:func:`gradcomp.planner.from_spec`'s: ``int8``, ``topk@0.01``, ``int4:block=128``),
    and where ``dense``, the run every other is compared with, is missing."""
    known = [*TORCH_RUNS, *gradcomp.COMPRESSORS]
    unknown = [name for name in names if name not in TORCH_RUNS and not _is_spec(name)]
    if unknown:
        raise ValueError(f"unknown demo runs {unknown}; choose from {known} (name, name@value or name:k=v)")
    if "dense" not in names:
        raise ValueError(f"the demo compares every run with dense: add dense to the runs {list(names)}")


def _is_spec(name: str) -> bool:
    try:
        planner.from_spec(name)
    except (ValueError, TypeError):
        return False
    return True


# ----------------------------------------------------------------------------- data and model


def load_task(setup: Setup) -> dict[str, torch.Tensor]:
    """The training and held-out samples of ``setup.task``, from ``setup.seed``."""
    return load_digits(setup.seed) if setup.task == "digits" else synthetic_task(setup)


def synthetic_task(setup: Setup) -> dict[str, torch.Tensor]:
    """Gaussian features, each labelled by the largest of 10 outputs of a fixed random linear
    map of rank 32: a task an MLP learns within tens of steps, that needs no download."""
    generator = torch.Generator().manual_seed(setup.seed)
    projection = torch.randn(setup.features, 32, generator=generator)
    teacher = projection @ torch.randn(32, CLASSES, generator=generator)

    def samples(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.randn(count, setup.features, generator=generator)
        return features, (features @ teacher).argmax(1)

    x_train, y_train = samples(setup.train_samples)
    x_test, y_test = samples(TEST_SAMPLES)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def load_digits(seed: int) -> dict[str, torch.Tensor]:
    """Digits split 75/25 (stratified, fixed seed), features standardised on the training part."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    features, labels = sklearn_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        features, labels, test_size=0.25, random_state=seed, stratify=labels
    )
    scaler = StandardScaler().fit(x_train)
    return {
        "x_train": torch.tensor(scaler.transform(x_train), dtype=torch.float32),
        "y_train": torch.tensor(y_train, dtype=torch.int64),
        "x_test": torch.tensor(scaler.transform(x_test), dtype=torch.float32),
        "y_test": torch.tensor(y_test, dtype=torch.int64),
    }


def make_mlp(inputs: int, width: int, classes: int, seed: int) -> torch.nn.Module:
    """Two hidden ReLU layers, initialised from ``seed`` without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(inputs, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, classes),
        )


def inputs_of(setup: Setup) -> int:
    """The features a sample of ``setup.task`` has."""
    return 64 if setup.task == "digits" else setup.features


# ----------------------------------------------------------------------------- one training run


def _attach(model: DistributedDataParallel, name: str, setup: Setup) -> gradcomp.ddp.HookState | None:
    if name == "fp16_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if name in TORCH_RUNS:
        return None
    spec = planner.from_spec(name)
    return gradcomp.ddp.register(model, spec, min_numel=0, measure_error=setup.measure_error)


def _held_out(net: torch.nn.Module, data: dict) -> tuple[float, float]:
    """Loss and accuracy on the held-out samples, each rank evaluating its share."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = data["x_test"][rank::world_size], data["y_test"][rank::world_size]
    with torch.no_grad():
        logits = net(x)
        sums = torch.tensor(
            [F.cross_entropy(logits, y, reduction="sum").item(), (logits.argmax(1) == y).sum().item()],
            dtype=torch.float64,
        )
    dist.all_reduce(sums)
    return sums[0].item() / len(data["y_test"]), sums[1].item() / len(data["y_test"])


def _behind_link(step, link: tuple[str, dict], steps: int) -> float:
    """Median seconds of ``step()`` with the namespace's loopback limited (the first step untimed)."""
    name, settings = link
    dist.barrier()
    if dist.get_rank() == 0:
        limited_link.limit_loopback(name, settings)
    dist.barrier()
    try:
        return statistics.median([step() for _ in range(steps)][1:])
    finally:
        dist.barrier()  # every rank's last step is through before the limit goes
        if dist.get_rank() == 0:
            limited_link.limit_loopback(name, None)


def _batches(samples: int, setup: Setup, shuffle: torch.Generator, rank: int, world_size: int):
    """This rank's share of every batch, ``setup.epochs`` shuffled passes over ``samples``."""
    for _ in range(setup.epochs):
        order = torch.randperm(samples, generator=shuffle)
        for start in range(0, samples - setup.batch_size + 1, setup.batch_size):
            yield order[start : start + setup.batch_size][rank::world_size]


def train(name: str, data: dict, setup: Setup, link: tuple[str, dict] | None, progress: tqdm) -> Row:
    """Train one model with run ``name`` and measure it (runs on every rank); with ``link``
    (a namespace the ranks are in, and its limit), step on behind the limit and time it too;
    ``progress`` advances once a step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = data["x_train"], data["y_train"]
    net = make_mlp(x.shape[1], setup.width, CLASSES, setup.seed)
    model = DistributedDataParallel(net, bucket_cap_mb=setup.bucket_cap_mb)
    state = _attach(model, name, setup)
    optimizer = torch.optim.SGD(model.parameters(), lr=setup.lr, momentum=setup.momentum)
    shuffle = torch.Generator().manual_seed(setup.seed)

    def step(shard: torch.Tensor) -> float:
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[shard]), y[shard]).backward()
        optimizer.step()
        progress.update()
        return time.perf_counter() - began

    batches = list(_batches(len(x), setup, shuffle, rank, world_size))
    step_seconds = [step(batch) for batch in batches]
    test_loss, test_accuracy = _held_out(net, data)
    link_step_ms = math.nan
    if link is not None:  # steps on the last batch again: only their time counts
        link_step_ms = 1e3 * _behind_link(functools.partial(step, batches[-1]), link, setup.link_steps)
    numel = sum(p.numel() for p in net.parameters())
    if state is None:
        sent = ring_all_reduce_bytes(numel * TORCH_RUNS[name], world_size)
        dense = ring_all_reduce_bytes(numel * TORCH_RUNS["dense"], world_size)
        stats = dict(ratio=dense / sent, compress_ms=math.nan, relative_error=math.nan, buckets=0)
    else:
        sent = statistics.mean(s.bytes_sent for s in state.stats)
        stats = dict(
            ratio=sum(s.dense_bytes for s in state.stats) / sum(s.bytes_sent for s in state.stats),
            compress_ms=1e3 * statistics.mean(s.compress_seconds for s in state.stats),
            relative_error=statistics.mean(s.relative_error for s in state.stats),
            buckets=state.last_stats.buckets,
        )
    return Row(
        label=label_of(name),
        bytes_per_step=sent,
        step_ms=1e3 * statistics.median(step_seconds),
        test_loss=test_loss,
        test_accuracy=test_accuracy,
        link_step_ms=link_step_ms,
        **stats,
    )


def _ranks_train(
    rank: int, world_size: int, names: list[str], setup: Setup, link: tuple[str, dict] | None, show: bool
) -> list[dict]:
    data = load_task(setup)
    per_run = setup.steps + (setup.link_steps if link else 0)
    with tqdm(total=len(names) * per_run, unit="step", leave=False, disable=not (rank == 0 and show)) as bar:
        rows = []
        for i, name in enumerate(names):
            bar.set_description_str(f"[{i + 1}/{len(names)}] {label_of(name)}")
            rows.append(train(name, data, setup, link, bar))
    # What the runs left in reference cycles (their DDP models hold the queue's cloned
    # group) goes in gradcomp.spawn, after the queues stop and before the groups do.
    return [dataclasses.asdict(row) for row in rows]


# ----------------------------------------------------------------------------- driver


def run_demo(
    names: Sequence[str] = DEFAULT_RUNS,
    setup: Setup = DEFAULT,
    world_size: int = 2,
    link: tuple[str, dict] | None = None,
    show_progress: bool | None = None,
) -> list[Row]:
    """Train once per run in ``names`` on ``world_size`` spawned Gloo ranks.

    Args:
        names: ``"dense"`` (DDP without a hook; required, the others are compared with
            it), ``"fp16_hook"`` (torch's fp16 hook) or gradcomp compressor specs
            (``int8``, ``topk@0.01``).
        setup: model, data and schedule (:data:`DEFAULT` or :data:`SMALL`, or either
            with fields replaced).
        world_size: processes to spawn (at least 2).
        link: a network namespace's name (:class:`gradcomp.limited_link.Namespace`) and a
            limit for its loopback (:func:`gradcomp.limited_link.link_settings`): the ranks
            run in it, and each run takes ``setup.link_steps`` more steps behind the limit.
        show_progress: draw a progress bar (tqdm) on stderr while training
            (default: when stderr is a terminal).

    Returns:
        One :class:`Row` per name, in order.

    Raises:
        ValueError: an unknown name, no dense, or a setting out of range.
        gradcomp.spawn.RanksFailed: a rank failed (its traceback included).
    """
    names = list(names)
    check_runs(names)
    if world_size < 2 or setup.steps < 1 or setup.link_steps < 2:
        # One rank sends nothing: there would be no communication to compare.
        raise ValueError(
            f"world_size must be at least 2, a run at least one step and link_steps at least 2, "
            f"got {world_size}, {setup.steps} and {setup.link_steps}"
        )
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    options = {} if link is None else {"setup": functools.partial(limited_link.enter_namespace, link[0])}
    rows = spawn.run_ranks(
        _ranks_train, world_size, names, setup, link, show_progress, group_timeout=120.0, **options
    )
    return [Row(**row) for row in rows]


def machine() -> str:
    """The machine in one line: CPU count and torch version."""
    return f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}"


def parameters(setup: Setup) -> int:
    """The MLP's parameters."""
    inputs, width = inputs_of(setup), setup.width
    return inputs * width + width + width * width + width + width * CLASSES + CLASSES


def describe(setup: Setup, rows: list[Row]) -> str:
    """The model, data and optimiser of the runs in one line."""
    buckets = max((row.buckets for row in rows), default=0)
    in_buckets = f" in {buckets} DDP bucket{'s' if buckets > 1 else ''}" if buckets else ""
    if setup.task == "digits":
        data = f"digits {DIGITS_SAMPLES[0]} train / {DIGITS_SAMPLES[1]} test, {setup.epochs} epochs of"
    else:
        data = (
            f"synthetic {CLASSES}-class task, {setup.steps} steps of fresh samples ({TEST_SAMPLES} held out),"
        )
    return (
        f"MLP {inputs_of(setup)}-{setup.width}-{setup.width}-{CLASSES} ({parameters(setup):,} parameters"
        f"{in_buckets}), {data} global batch {setup.batch_size}, SGD lr {setup.lr} momentum {setup.momentum}"
    )
