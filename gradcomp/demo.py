"""Train a small MLP with every compressor on one CPU machine and compare them.

``world_size`` processes train the same model on scikit-learn's bundled
digits data set through :class:`~torch.nn.parallel.DistributedDataParallel`
over Gloo, once per compressor, with the same seed and data every time. Each
rank takes its own shard of every batch. The result is one row per
compressor: bytes each rank sent per step, the ratio to dense, the median
step time, the final training loss and the test accuracy. On one machine the
ranks talk over loopback, faster than any network, where compression does not
pay; a column predicts each step on a slower link (``link``): the measured
step plus the time its bytes take at that rate, one way, each rank sending at once.
``gradcomp demo --bandwidth RATE`` also measures it: every run trains again with
the ranks behind links of RATE (:mod:`gradcomp.limited_link`).

Example:
    >>> rows = run_demo(["dense", "int8"], epochs=2)
    >>> print(format_table(rows))
"""

from __future__ import annotations

import dataclasses
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
from gradcomp import planner, spawn
from gradcomp.collectives import ring_all_reduce_bytes
from gradcomp.tables import format_cell
from gradcomp.tables import format_table as format_rows
from gradcomp.units import parse_rate

# Runs that do not go through gradcomp, with the bytes each gradient element costs on the wire.
TORCH_RUNS = {"dense": 4, "fp16_hook": 2}
DEFAULT_RUNS = ("dense", "fp16_hook", "int8", "sign", "topk@0.01", "randk@0.01")


@dataclasses.dataclass(frozen=True)
class Setup:
    """Training settings shared by every run.

    Attributes:
        epochs: passes over the training set.
        batch_size: global batch (split evenly across ranks).
        width: hidden units of each of the MLP's two hidden layers.
        lr, momentum: of the SGD optimiser.
        bucket_cap_mb: DDP bucket size; small, so that the model spans several buckets.
        seed: model initialisation, data split and shuffling.
    """

    epochs: int = 8
    batch_size: int = 64
    width: int = 256
    lr: float = 0.05
    momentum: float = 0.9
    bucket_cap_mb: float = 0.01
    seed: int = 0


@dataclasses.dataclass
class Row:
    """One run's result, as rank 0 measured it (every rank sends the same amount).

    Attributes:
        label: the run's name in the table.
        bytes_per_step: bytes one rank sends per step, counted for a ring
            schedule like nccl-tests' bus bandwidth (gradcomp:
            ``StepStats.bytes_sent`` averaged over steps; dense and torch's
            fp16 hook: a ring all-reduce of 4 or 2 bytes per element).
        ratio: dense bytes / ``bytes_per_step``.
        step_ms: median wall time of one training step (forward, backward
            with its communication, optimiser step).
        compress_ms: mean ``StepStats.compress_seconds`` per step (NaN outside gradcomp).
        relative_error: mean ``StepStats.relative_error`` (NaN outside gradcomp).
        buckets: DDP buckets of the last step (0 outside gradcomp).
        train_loss: cross-entropy on the whole training set after training.
        test_accuracy: fraction of test digits classified correctly.
    """

    label: str
    bytes_per_step: float
    ratio: float
    step_ms: float
    compress_ms: float
    relative_error: float
    buckets: int
    train_loss: float
    test_accuracy: float


def label_of(name: str) -> str:
    """How a run is called in the table: its spec (``topk@0.01``), or torch's hook by name."""
    return "torch fp16 hook" if name == "fp16_hook" else name


def check_runs(names: Sequence[str]) -> None:
    """Raise ValueError for a name that is neither a torch run nor a compressor spec
    (:func:`gradcomp.planner.from_spec`'s: ``int8``, ``topk@0.01``, ``int4:block=128``)."""
    known = [*TORCH_RUNS, *gradcomp.COMPRESSORS]
    unknown = [name for name in names if name not in TORCH_RUNS and not _is_spec(name)]
    if unknown:
        raise ValueError(f"unknown demo runs {unknown}; choose from {known} (name, name@value or name:k=v)")
    if not names:
        raise ValueError(f"no demo runs given; choose from {known}")


def _is_spec(name: str) -> bool:
    try:
        planner.from_spec(name)
    except (ValueError, TypeError):
        return False
    return True


# ----------------------------------------------------------------------------- data and model


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


# ----------------------------------------------------------------------------- one training run


def _attach(model: DistributedDataParallel, name: str) -> gradcomp.ddp.HookState | None:
    if name == "fp16_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if name in TORCH_RUNS:
        return None
    return gradcomp.ddp.register(model, planner.from_spec(name), min_numel=0, measure_error=True)


def train(name: str, position: str, data: dict, setup: Setup, progress: tqdm | None = None) -> Row:
    """Train one model with run ``name`` and measure it (runs on every rank);
    ``progress`` advances once an epoch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = data["x_train"], data["y_train"]
    net = make_mlp(x.shape[1], setup.width, int(y.max()) + 1, setup.seed)
    model = DistributedDataParallel(net, bucket_cap_mb=setup.bucket_cap_mb)
    state = _attach(model, name)
    optimizer = torch.optim.SGD(model.parameters(), lr=setup.lr, momentum=setup.momentum)
    shuffle = torch.Generator().manual_seed(setup.seed)
    step_seconds = []
    if progress is not None:
        progress.set_description_str(f"[{position}] {label_of(name)}")
    for _ in range(setup.epochs):
        order = torch.randperm(len(x), generator=shuffle)
        for start in range(0, len(x) - setup.batch_size + 1, setup.batch_size):
            shard = order[start : start + setup.batch_size][rank::world_size]
            began = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[shard]), y[shard]).backward()
            optimizer.step()
            step_seconds.append(time.perf_counter() - began)
        if progress is not None:
            progress.update()
    with torch.no_grad():
        train_loss = F.cross_entropy(net(x), y).item()
        test_accuracy = (net(data["x_test"]).argmax(1) == data["y_test"]).float().mean().item()
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
        train_loss=train_loss,
        test_accuracy=test_accuracy,
        **stats,
    )


def _ranks_train(
    rank: int, world_size: int, names: list[str], setup: Setup, show_progress: bool
) -> list[dict]:
    data = load_digits(setup.seed)
    with tqdm(
        total=len(names) * setup.epochs, unit="epoch", leave=False, disable=not (rank == 0 and show_progress)
    ) as bar:
        rows = [train(name, f"{i + 1}/{len(names)}", data, setup, bar) for i, name in enumerate(names)]
    return [dataclasses.asdict(row) for row in rows]


# ----------------------------------------------------------------------------- driver and report


def run_demo(
    names: Sequence[str] = DEFAULT_RUNS,
    epochs: int = Setup.epochs,
    world_size: int = 2,
    show_progress: bool | None = None,
) -> list[Row]:
    """Train once per run in ``names`` on ``world_size`` spawned Gloo ranks.

    Args:
        names: ``"dense"`` (DDP without a hook), ``"fp16_hook"`` (torch's
            fp16 hook) or gradcomp compressor specs (``int8``, ``topk@0.01``).
        epochs: passes over the training set.
        world_size: processes to spawn (at least 2).
        show_progress: draw a progress bar (tqdm) on stderr while training
            (default: when stderr is a terminal).

    Returns:
        One :class:`Row` per name, in order.

    Raises:
        ValueError: an unknown name or a setting out of range.
        gradcomp.spawn.RanksFailed: a rank failed (its traceback included).
    """
    names = list(names)
    check_runs(names)
    if world_size < 2 or epochs < 1:
        # One rank sends nothing: there would be no communication to compare.
        raise ValueError(
            f"world_size must be at least 2 and epochs at least 1, got {world_size} and {epochs}"
        )
    setup = Setup(epochs=epochs)
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    rows = spawn.run_ranks(_ranks_train, world_size, names, setup, show_progress, group_timeout=120.0)
    return [Row(**row) for row in rows]


def machine() -> str:
    """The machine in one line: CPU count and torch version."""
    return f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}"


def describe(setup: Setup, rows: list[Row]) -> str:
    """The model, data and optimiser of the runs in one line."""
    data = load_digits(setup.seed)
    inputs, classes = data["x_train"].shape[1], int(data["y_train"].max()) + 1
    parameters = sum(p.numel() for p in make_mlp(inputs, setup.width, classes, setup.seed).parameters())
    buckets = max((row.buckets for row in rows), default=0)
    in_buckets = f" in {buckets} DDP buckets" if buckets else ""
    return (
        f"MLP {inputs}-{setup.width}-{setup.width}-{classes} ({parameters:,} parameters{in_buckets}), "
        f"digits {len(data['x_train'])} train / {len(data['x_test'])} test, "
        f"SGD lr {setup.lr} momentum {setup.momentum}, global batch {setup.batch_size}, epochs {setup.epochs}"
    )


DEFAULT_LINK = "1gbit"


def predicted_step_ms(row: Row, bits_per_second: float) -> float:
    """``row``'s step on a link of ``bits_per_second`` a rank: the step measured over
    loopback plus the time its bytes take at that rate (loopback's own time for them,
    already in the measured step, is left in: an upper bound by that much)."""
    return row.step_ms + 1e3 * row.bytes_per_step * 8 / bits_per_second


def format_table(
    rows: list[Row], link: str | None = DEFAULT_LINK, measured: tuple[str, list[Row]] | None = None
) -> str:
    """The rows as a fixed-width text table; with ``link`` (a rate such as ``"1gbit"``), a
    column of each step predicted on it (:func:`predicted_step_ms`); with ``measured``
    (a rate and the same runs' rows trained behind links of that rate), their steps."""
    if measured is not None and [r.label for r in measured[1]] != [r.label for r in rows]:
        raise ValueError("measured holds other runs than rows")
    header = (
        "compressor",
        "bytes/step",
        "ratio",
        "step ms",
        "compress ms",
        "rel. error",
        "train loss",
        "test acc",
    )
    if link is not None:
        header += (f"step ms at {link} (predicted)",)
        rate = parse_rate(link)
    if measured is not None:
        header += (f"step ms at {measured[0]} (measured)",)
    lines = [
        (
            row.label,
            f"{row.bytes_per_step:,.0f}",
            f"{row.ratio:.1f}",
            f"{row.step_ms:.2f}",
            format_cell(row.compress_ms),
            format_cell(row.relative_error, ".3f"),
            f"{row.train_loss:.5f}",
            f"{100 * row.test_accuracy:.1f}%",
            *((f"{predicted_step_ms(row, rate):.2f}",) if link is not None else ()),
            *((f"{measured[1][i].step_ms:.2f}",) if measured is not None else ()),
        )
        for i, row in enumerate(rows)
    ]
    return format_rows(header, lines)
