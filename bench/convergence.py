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

``--task vision`` trains a small CNN on the same digits, as 8x8 images,
with the same settings and runs.

``--task lm`` asks the same of a transformer trained with AdamW, where the
aggressive compressors fall apart: a GPT-style byte-level decoder on
Python's standard library sources (:mod:`lm`), final validation loss against
dense, torch's fp16 and PowerSGD hooks beside every gradcomp method, each run
in ranks of its own (a failing run is reported, the others go on). torch's
PowerSGD hook runs with the whole model in one bucket: on Gloo its
collectives, issued from Future callbacks, abort on a model of several
buckets; gradcomp's runs keep DDP's buckets. Bytes per step are counted over
the whole run, dense steps included; torch PowerSGD's from the model's
shapes by the same rule as gradcomp's ``powersgd`` (its hook counts none).
``--adam`` adds runs of ``gradcomp.optim.CompressedAdam`` (AdamW for a
warm-up, then each rank's momentum exchanged compressed with the second
moment frozen), without DDP: the optimizer does the exchange.

Examples:
    python bench/convergence.py
    python bench/convergence.py --task lm
    python bench/convergence.py --task lm --compressors powersgd:rank=2 --dense-steps 60
    python bench/convergence.py --task lm --compressors --baselines --adam sign:warmup=60 int4
    python bench/convergence.py --compressors randk --dense-steps 420
    python bench/convergence.py --epochs 20 --compressors int8 topk:ratio=0.1
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lib import lm, spawning
from lib.convergence_lm import (
    LM_ADAM,
    LM_BASELINES,
    LM_COMPRESSORS,
    LM_LR,
    LM_MODEL,
    START_ORDER_OFFSET,
    check_node_sizes,
    diloco_bytes,
    diloco_replica,
    end_diloco,
    main_lm,
    make_diloco,
    parse_diloco,
)
from lib.machine import machine
from lib.options import add_common_options
from lib.plots import figure
from lib.progress import Progress
from lib.results import Results, publish_curves
from lib.specs import parse_run
from torch.nn.parallel import DistributedDataParallel

import gradcomp
from gradcomp.collectives import ring_all_reduce_bytes
from gradcomp.demo import load_digits, make_mlp
from gradcomp.spawn import RanksFailed
from gradcomp.tables import format_table
from gradcomp.units import split_list

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
        "--task",
        choices=("mlp", "vision", "lm"),
        default="mlp",
        help="mlp: an MLP on digits with SGD; vision: a small CNN on the same 8x8 digit images; "
        "lm: a byte-level transformer with AdamW (default mlp)",
    )
    top.add_argument(
        "--compressors",
        nargs="*",
        default=None,
        metavar="NAME[:k=v,...]",
        help=f"compressors; mlp runs each with and without error feedback (default: "
        f"{' '.join(DEFAULT_COMPRESSORS)}; lm: {' '.join(LM_COMPRESSORS)}; topk and randk keep 1%%)",
    )
    top.add_argument(
        "--baselines",
        nargs="*",
        default=list(LM_BASELINES),
        choices=LM_BASELINES,
        help="lm: torch hooks to run beside gradcomp's (default: both)",
    )
    top.add_argument(
        "--adam",
        nargs="*",
        default=None,
        metavar="NAME[:k=v,...]",
        help="lm: CompressedAdam runs exchanging updates through NAME (its options, and warmup=N "
        "AdamW steps first (default: a fifth of --steps), gradient=NAME for the warm-up's gradients "
        "(default dense), exact=vectors|embeddings for AdamW on biases and norms (and the embeddings)); "
        f"default: {' '.join(LM_ADAM)}",
    )
    top.add_argument(
        "--diloco",
        nargs="*",
        default=[],
        metavar="NAME[:k=v,...]",
        help="DiLoCo runs, pseudo-gradients through NAME (its options, and sync_every=H, "
        "outer_lr, outer_momentum, fragments, overlap_steps, follow_inner_lr=0|1, total_steps=0|1 (1: DiLoCo "
        "is given the run's steps and ends with the replicas' average), and lr, the inner "
        "optimizer's); each rank trains on its own between synchronisations (lm: AdamW; mlp and "
        "vision: SGD)",
    )
    top.add_argument(
        "--epochs", type=int, default=150, help="mlp: passes over the training set (default 150)"
    )
    top.add_argument("--steps", type=int, default=600, help="lm: optimizer steps (default 600)")
    top.add_argument(
        "--init-steps",
        type=int,
        default=0,
        help="every run starts from the weights of N dense DDP steps (their own schedule and "
        "data order), as DiLoCo starts from a pretrained model (default 0: from scratch)",
    )
    top.add_argument(
        "--fsdp",
        action="store_true",
        help="lm: shard the model with FSDP2 and compress through gradcomp.fsdp: each compressor "
        "between the replicas of 2 nodes (custom HSDP), or with via=reduce_scatter in the "
        "reduce-scatter of all ranks; dense is plain FSDP2; no torch hooks, no CompressedAdam",
    )
    top.add_argument(
        "--corpus-bytes", type=int, default=2_000_000, help="lm: bytes of text, a tenth held out (default 2M)"
    )
    top.add_argument(
        "--corpus",
        choices=lm.CORPORA,
        default="stdlib",
        help="lm: the Python standard library's sources (default), or c10: torch's c10 C++ headers",
    )
    top.add_argument(
        "--gpt",
        type=gpt_shape,
        default=None,
        metavar="width=W,layers=L,heads=A,context=C",
        help="lm: the GPT's shape, any of its keys (default "
        + ",".join(f"{k}={v}" for k, v in LM_MODEL.items())
        + ")",
    )
    top.add_argument(
        "--batch-size", type=int, default=64, help="global batch, split across ranks (default 64)"
    )
    top.add_argument(
        "--width", type=int, default=None, help="mlp: hidden units per layer (256); vision: channels (16)"
    )
    top.add_argument(
        "--lr", type=float, default=None, help=f"peak learning rate (default: mlp SGD 0.01, lm AdamW {LM_LR})"
    )
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
    add_common_options(top)
    return top


def gpt_shape(text: str) -> dict:
    """``"width=96,layers=3"`` -> the GPT's shape keys given, as integers."""
    shape = {}
    for item in filter(None, text.split(",")):
        key, _, value = (part.strip() for part in item.partition("="))
        if key not in LM_MODEL or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(
                f"--gpt takes {sorted(LM_MODEL)} as key=positive integer, got {item!r}"
            )
        shape[key] = int(value)
    return shape


def plan(specs: list[str], diloco: list[str] = ()) -> list[dict]:
    """Dense first, then every compressor with and without error feedback, then the DiLoCo runs."""
    runs = [dict(label="dense", name=None, options={}, feedback=None)]
    for spec in specs:
        label, name, options = parse_run(spec)
        for feedback in (True, False):
            shown = f"{label} ({'feedback' if feedback else 'no feedback'})"
            runs.append(dict(label=shown, name=name, options=options, feedback=feedback))
    return runs + [dict(parse_diloco(spec), feedback=None) for spec in diloco]


def train(rank: int, world_size: int, run: dict, data: dict, settings: dict, progress, done: int) -> dict:
    """Train one run on every rank; rank 0's record (losses after each epoch included)."""
    x, y = data["x_train"], data["y_train"]
    classes = int(y.max()) + 1
    if settings["task"] == "vision":
        net = make_cnn(settings["width"], classes, settings["seed"])
    else:
        net = make_mlp(x.shape[1], settings["width"], classes, settings["seed"])
    if settings.get("init"):  # --init-steps: the dense start every run shares
        net.load_state_dict(torch.load(settings["init"], weights_only=True))
    diloco = run.get("kind") == "diloco"
    model = diloco_replica(net, run, rank, world_size) if diloco else DistributedDataParallel(net)
    outer_options = dict(run.get("diloco") or {})
    state = None
    if run["name"] is not None and not diloco:
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
        lr=outer_options.pop("lr", settings["lr"]),
        momentum=settings["momentum"],
        weight_decay=settings["weight_decay"],
    )
    batch = settings["batch_size"]
    steps_per_epoch = len(x) // batch
    steps = min(settings["epochs"] * steps_per_epoch, settings.get("max_steps") or math.inf)
    outer = None
    if diloco:
        outer = make_diloco(net, optimizer, run, outer_options, steps)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    # A dense start (--init-steps) shuffles in an order of its own.
    shuffle = torch.Generator().manual_seed(settings["seed"] + settings.get("order_offset", 0))
    curve, step_seconds = [], []
    for epoch in range(settings["epochs"]):
        order = torch.randperm(len(x), generator=shuffle)
        for start in range(0, steps_per_epoch * batch, batch):
            if len(step_seconds) == steps:
                break
            shard = order[start : start + batch][rank::world_size]
            began = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[shard]), y[shard]).backward()
            optimizer.step()
            schedule.step()
            step_seconds.append(time.perf_counter() - began)
            if outer is not None:
                outer.step()
        curve.append(evaluate(net, data)[0])
        progress.update(done + epoch + 1, run["label"])
    if outer is not None:
        end_diloco(outer)
    if settings.get("save") and rank == 0:  # --init-steps' dense start, for the runs to share
        torch.save(net.state_dict(), settings["save"])
    train_loss, accuracy, test_loss = evaluate(net, data)
    numel = sum(p.numel() for p in net.parameters())
    dense_bytes = ring_all_reduce_bytes(numel * 4, world_size)
    if outer is not None:
        sent, dense_bytes = diloco_bytes(outer, numel, world_size, len(step_seconds))
    else:
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
    progress = Progress(len(runs) * epochs, settings["progress"] if rank == 0 else False)
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
    return format_table(header, rows, left=(0, -1))


def plot(records: list[dict], title: str, path: str) -> None:
    """Train loss after each epoch: runs with error feedback on the left, without on the right."""
    with figure(path, title, ncols=2, figsize=(13, 5), sharey=True) as (_, axes):
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


def make_cnn(channels: int, classes: int, seed: int) -> torch.nn.Module:
    """Two 3x3 convolutions (``channels``, then twice as many), a 2x2 max-pool and
    a linear layer, on the 8x8 digit images; initialised from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 8, 8)),
            torch.nn.Conv2d(1, channels, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(channels, 2 * channels, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(2 * channels * 16, classes),
        )


def describe(settings: dict, records: list[dict]) -> str:
    steps = settings["dense_steps"]
    dense = f", compressed runs dense for their first {steps} steps" if steps else ""
    if settings.get("init_steps"):
        dense += f", every run from the weights of {settings['init_steps']} dense steps"
    width = settings["width"]
    model = (
        f"MLP 64-{width}-{width}-10"
        if settings["task"] == "mlp"
        else f"CNN conv{width}-conv{2 * width}-pool-10"
    )
    return (
        f"{model}, digits 1347 train / 450 test, "
        f"{settings['epochs']} epochs = {records[0]['steps']} steps, global batch {settings['batch_size']}, "
        f"SGD lr {settings['lr']} (cosine to 0) momentum {settings['momentum']} "
        f"weight decay {settings['weight_decay']}, "
        f"seed {settings['seed']}{dense}; train loss: cross-entropy on the whole training set after training"
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    default = LM_COMPRESSORS if args.task == "lm" else DEFAULT_COMPRESSORS
    args.compressors = split_list(list(default) if args.compressors is None else args.compressors)
    if args.adam is not None and args.task != "lm":
        parser().error("--adam is for --task lm")
    if args.adam is None:
        args.adam = list(LM_ADAM) if args.task == "lm" else []
    args.adam = split_list(args.adam)
    if args.lr is None:
        args.lr = LM_LR if args.task == "lm" else 0.01
    if args.width is None:
        args.width = 16 if args.task == "vision" else 256
    if args.task == "lm":
        return main_lm(args, parser().error)
    try:
        runs = plan(args.compressors, args.diloco)
    except argparse.ArgumentTypeError as error:
        parser().error(str(error))
    check_node_sizes(runs, args.spawn, parser().error)
    if args.init_steps < 0:
        parser().error("need --init-steps >= 0")
    if args.epochs < 1 or args.spawn < 2 or args.batch_size < args.spawn:
        parser().error("need --epochs >= 1, --spawn >= 2 and --batch-size >= --spawn")
    if args.dense_steps < 0:
        parser().error("need --dense-steps >= 0")
    if not 0 <= args.momentum < 1:
        parser().error("need 0 <= --momentum < 1")
    settings = vars(args)
    benchmark = "convergence" if args.task == "mlp" else f"convergence-{args.task}"
    results = Results(benchmark, machine(args.spawn, "gloo"), settings, args.out)
    print(f"machine: {results.machine['machine']}", flush=True)
    # Every run in one spawn: allow a second an epoch a run a rank (a 2-core
    # machine takes about a third of that), and never less than ten minutes.
    timeout = max(600.0, len(runs) * args.epochs * args.spawn)
    extra = {}
    try:
        if args.init_steps:
            extra["start"] = initial_weights(settings)
        records = spawning.spawn(ranks, args.spawn, runs, settings, timeout=timeout)
    except RanksFailed as error:
        sys.stderr.write(f"convergence failed: {error}\n")
        return 1
    finally:
        if settings.get("init"):
            os.unlink(settings.pop("init"))
    derive(records)
    print(describe(settings, records))
    print(format_report(records))
    publish_curves(results, records, plot, extra=extra)
    return 0


def initial_weights(settings: dict) -> dict:
    """--init-steps for the mlp and vision tasks: dense DDP trains that many steps (its own
    cosine schedule, batches in an order of their own) and saves its weights, which every
    run then starts from (``settings["init"]``); the start's losses."""
    handle, path = tempfile.mkstemp(prefix="gradcomp-convergence-start-", suffix=".pt")
    os.close(handle)
    steps_per_epoch = 1347 // settings["batch_size"]  # the digits' training images
    epochs = -(-settings["init_steps"] // steps_per_epoch)
    start = dict(settings, epochs=epochs, max_steps=settings["init_steps"], save=path)
    start.update(order_offset=START_ORDER_OFFSET, progress=False)
    dense = dict(label="start", name=None, options={}, feedback=None)
    (record,) = spawning.spawn(ranks, settings["spawn"], [dense], start, timeout=600.0)
    settings["init"] = path
    return dict(steps=settings["init_steps"], train_loss=record["train_loss"], test_loss=record["test_loss"])


# ----------------------------------------------------------------------------- --task lm


if __name__ == "__main__":
    sys.exit(main())
