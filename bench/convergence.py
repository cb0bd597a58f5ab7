"""Convergence: does training with a compressor end where dense training ends?

The same MLP (64-256-256-10, gradcomp's demo model) trains on scikit-learn's
bundled digits data set (1347 train / 450 test images, no download) on
spawned Gloo ranks, with the same seed, split and batch order every time:
once with DDP's dense all-reduce, then with each compressor through
``gradcomp.ddp.register``, once with error feedback (``feedback=True``) and
once without (``feedback=False``). SGD with momentum, weight decay and a
cosine learning-rate decay to zero over ``--epochs`` epochs. The defaults
make the comparison one of where runs end, not of how fast they start:
150 epochs (3150 steps, so random-K at 1% sends every coordinate about 31
times), after which the dense loss has been flat for tens of epochs, and a
peak learning rate of 0.01, at which every compressor trains stably (at
0.05, random-K at 1% with error feedback diverges: its residual releases
about 100 steps of gradient at once).

Reported per run: the final cross-entropy on the whole training set, its
relative difference from the dense run's, the test accuracy and test
cross-entropy, the squared norm of the weights (weight decay's half of the
objective: a run can reach a lower training loss with larger weights), and
the bytes one rank sends per step (ring model); the loss after every epoch
goes to a PNG.

``--dense-steps N`` reduces a compressed run's first N steps dense (the
hook's ``warmup_steps``, as PowerSGD's ``start_powerSGD_iter`` does); its
bytes per step then average over the dense and the compressed steps.

Examples:
    python bench/convergence.py
    python bench/convergence.py --compressors randk --dense-steps 420
    python bench/convergence.py --epochs 20 --compressors int8 topk:ratio=0.1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import gradcomp
from gradcomp.collectives import ring_all_reduce_bytes
from gradcomp.demo import load_digits, make_mlp

DEFAULT_COMPRESSORS = ("int8", "int4", "sign", "topk", "randk")
# Runs whose final loss should be within TOLERANCE of dense's (the project's targets).
TARGETS = ("int8 (feedback)", "topk (feedback)", "randk (feedback)")
TOLERANCE = 0.02


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Ranks are spawned Gloo processes on 127.0.0.1; each takes its share of every batch.",
    )
    top.add_argument(
        "--compressors",
        nargs="+",
        default=list(DEFAULT_COMPRESSORS),
        metavar="NAME[:k=v,...]",
        help=f"compressors, each run with and without error feedback "
        f"(default: {' '.join(DEFAULT_COMPRESSORS)}; topk and randk keep 1%%)",
    )
    top.add_argument("--epochs", type=int, default=150, help="passes over the training set (default 150)")
    top.add_argument(
        "--batch-size", type=int, default=64, help="global batch, split across ranks (default 64)"
    )
    top.add_argument("--width", type=int, default=256, help="hidden units per layer (default 256)")
    top.add_argument("--lr", type=float, default=0.01, help="peak SGD learning rate (default 0.01)")
    top.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    top.add_argument("--weight-decay", type=float, default=1e-3, help="SGD weight decay (default 1e-3)")
    top.add_argument("--seed", type=int, default=0, help="model, split and shuffling seed (default 0)")
    top.add_argument(
        "--dense-steps",
        type=int,
        default=0,
        help="compressed runs reduce their first N steps dense, through the hook's warmup_steps "
        "(like PowerSGD's start_powerSGD_iter); their bytes/step average over every step (default 0)",
    )
    common.add_common_options(top)
    return top


def plan(specs: list[str]) -> list[dict]:
    """Dense first, then every compressor with and without error feedback."""
    runs = [dict(label="dense", name=None, options={}, feedback=None)]
    for spec in specs:
        label, name, options = common.parse_compressor(spec)
        for feedback in (True, False):
            shown = f"{label} ({'feedback' if feedback else 'no feedback'})"
            runs.append(dict(label=shown, name=name, options=options, feedback=feedback))
    return runs


def train(rank: int, world_size: int, run: dict, data: dict, settings: dict, progress, done: int) -> dict:
    """Train one run on every rank; rank 0's record (losses after each epoch included)."""
    x, y = data["x_train"], data["y_train"]
    net = make_mlp(x.shape[1], settings["width"], int(y.max()) + 1, settings["seed"])
    model = DistributedDataParallel(net)
    state = None
    if run["name"] is not None:
        options = {**run["options"], "feedback": run["feedback"]}
        state = gradcomp.ddp.register(
            model,
            run["name"],
            warmup_steps=settings["dense_steps"],
            min_numel=0,
            measure_error=False,
            **options,
        )
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=settings["lr"],
        momentum=settings["momentum"],
        weight_decay=settings["weight_decay"],
    )
    batch = settings["batch_size"]
    steps_per_epoch = len(x) // batch
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, settings["epochs"] * steps_per_epoch)
    shuffle = torch.Generator().manual_seed(settings["seed"])
    curve, step_seconds = [], []
    for epoch in range(settings["epochs"]):
        order = torch.randperm(len(x), generator=shuffle)
        for start in range(0, steps_per_epoch * batch, batch):
            shard = order[start : start + batch][rank::world_size]
            began = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[shard]), y[shard]).backward()
            optimizer.step()
            schedule.step()
            step_seconds.append(time.perf_counter() - began)
        curve.append(evaluate(net, data)[0])
        progress.update(done + epoch + 1, run["label"])
    train_loss, accuracy, test_loss = evaluate(net, data)
    numel = sum(p.numel() for p in net.parameters())
    dense_bytes = ring_all_reduce_bytes(numel * 4, world_size)
    sent = statistics.mean(s.bytes_sent for s in state.stats) if state else dense_bytes
    return dict(
        run=run["label"],
        compressor=run["name"] or "dense",
        options=run["options"],
        feedback=run["feedback"],
        steps=len(step_seconds),
        bytes_per_step=sent,
        ratio=dense_bytes / sent,
        step_ms=1e3 * statistics.median(step_seconds),
        train_loss=train_loss,
        test_accuracy=accuracy,
        test_loss=test_loss,
        weight_sq=sum(float(p.detach().double().square().sum()) for p in net.parameters()),
        curve=curve,
    )


def evaluate(net: torch.nn.Module, data: dict) -> tuple[float, float, float]:
    """(cross-entropy on the whole training set, accuracy and cross-entropy on the test set)."""
    with torch.no_grad():
        loss = F.cross_entropy(net(data["x_train"]), data["y_train"]).item()
        logits = net(data["x_test"])
        accuracy = (logits.argmax(1) == data["y_test"]).float().mean().item()
        test_loss = F.cross_entropy(logits, data["y_test"]).item()
    return loss, accuracy, test_loss


def ranks(rank: int, world_size: int, runs: list[dict], settings: dict) -> list[dict]:
    data = load_digits(settings["seed"])
    epochs = settings["epochs"]
    progress = common.Progress(len(runs) * epochs, settings["progress"] if rank == 0 else False)
    records = [
        train(rank, world_size, run, data, settings, progress, i * epochs) for i, run in enumerate(runs)
    ]
    progress.close()
    dist.barrier()
    return records


# ----------------------------------------------------------------------------- report


def derive(records: list[dict]) -> None:
    dense = records[0]["train_loss"]
    for record in records:
        record["loss_vs_dense"] = (record["train_loss"] - dense) / dense
        record["target"] = target(record) if record["run"] in TARGETS else ""


def target(record: dict) -> str:
    """``met`` within TOLERANCE of dense's loss either way, else how far off and which way."""
    difference = record["loss_vs_dense"]
    if not math.isfinite(difference):
        return "missed: the loss is not finite (diverged)"
    if abs(difference) <= TOLERANCE:
        return "met"
    side = "lower" if difference < 0 else "higher"
    return f"missed: {100 * abs(difference):.1f}% {side} than dense"


def format_report(records: list[dict]) -> str:
    header = ["run", "bytes/step", "ratio", "step ms", "train loss", "vs dense", "test acc", "test loss"]
    header += ["|w|^2", f"target: loss within {100 * TOLERANCE:g}% of dense"]
    rows = [
        [
            r["run"],
            f"{r['bytes_per_step']:,.0f}",
            f"{r['ratio']:.1f}",
            f"{r['step_ms']:.1f}",
            f"{r['train_loss']:.5f}",
            f"{100 * r['loss_vs_dense']:+.2f}%",
            f"{100 * r['test_accuracy']:.1f}%",
            f"{r['test_loss']:.4f}",
            f"{r['weight_sq']:.1f}",
            r["target"],
        ]
        for r in records
    ]
    return common.format_table(header, rows, left=(0, -1))


def plot(records: list[dict], title: str, path: str) -> None:
    """Train loss after each epoch: runs with error feedback on the left, without on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for axis, feedback in zip(axes, (True, False), strict=True):
        for record in records:
            if record["feedback"] not in (None, feedback):
                continue
            epochs = range(1, len(record["curve"]) + 1)
            style = dict(color="black", linewidth=2.5) if record["feedback"] is None else {}
            axis.plot(epochs, record["curve"], label=record["run"], **style)
        axis.set_yscale("log")
        axis.set_xlabel("epoch")
        axis.set_title("with error feedback" if feedback else "without error feedback", fontsize=10)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    axes[0].set_ylabel("cross-entropy on the training set")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def describe(settings: dict, records: list[dict]) -> str:
    steps = settings["dense_steps"]
    dense = f", compressed runs dense for their first {steps} steps" if steps else ""
    return (
        f"MLP 64-{settings['width']}-{settings['width']}-10, digits 1347 train / 450 test, "
        f"{settings['epochs']} epochs = {records[0]['steps']} steps, global batch {settings['batch_size']}, "
        f"SGD lr {settings['lr']} (cosine to 0) momentum {settings['momentum']} "
        f"weight decay {settings['weight_decay']}, "
        f"seed {settings['seed']}{dense}; train loss: cross-entropy on the whole training set after training"
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.compressors = common.split_list(args.compressors)
    try:
        runs = plan(args.compressors)
    except argparse.ArgumentTypeError as error:
        parser().error(str(error))
    if args.epochs < 1 or args.spawn < 2 or args.batch_size < args.spawn:
        parser().error("need --epochs >= 1, --spawn >= 2 and --batch-size >= --spawn")
    if args.dense_steps < 0:
        parser().error("need --dense-steps >= 0")
    if not 0 <= args.momentum < 1:
        parser().error("need 0 <= --momentum < 1")
    settings = vars(args)
    results = common.Results("convergence", common.machine(args.spawn, "gloo"), settings, args.out)
    print(f"machine: {results.machine['machine']}", flush=True)
    # Every run in one spawn: allow a second an epoch a run a rank (a 2-core
    # machine takes about a third of that), and never less than ten minutes.
    timeout = max(600.0, len(runs) * args.epochs * args.spawn)
    try:
        records = common.spawn(ranks, args.spawn, runs, settings, timeout=timeout)
    except common.RanksFailed as error:
        sys.stderr.write(f"convergence failed: {error}\n")
        return 1
    derive(records)
    print(describe(settings, records))
    print(format_report(records))
    curves = {record["run"]: record.pop("curve") for record in records}
    paths = results.write(records, extra=dict(curves=curves))
    for record in records:
        record["curve"] = curves[record["run"]]
    png = results.path("png")
    plot(records, f"convergence: {results.machine['machine']}", png)
    print(f"wrote {', '.join([*paths, png])}")
    print(f"load average (1/5/15 min): {results.load_start} at start, {common.loadavg()} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
