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
import statistics
import sys
import time

import common
import lm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import gradcomp
from gradcomp.collectives import ring_all_reduce_bytes, scale
from gradcomp.demo import load_digits, make_mlp

DEFAULT_COMPRESSORS = ("int8", "int4", "sign", "topk", "randk")
LM_COMPRESSORS = ("int8", "int4", "topk", "powersgd")
LM_BASELINES = ("fp16_hook", "powersgd_hook")
LM_LABELS = {"fp16_hook": "torch fp16 hook", "powersgd_hook": "torch PowerSGD rank 4"}
# The model and batches of --task lm (about 0.44M parameters; 150 ms a step on
# one core of a 2-core Xeon VM).
LM_MODEL = dict(width=128, layers=2, heads=4, context=64)
LM_BATCH, LM_EVAL_EVERY, LM_EVAL_BATCHES = 32, 50, 8
# Gradient-compression runs of --task lm whose final validation loss is to be
# within a bound of dense's (issue targets); other runs are reported only.
LM_TARGETS = {"int8": 0.01, "int4": 0.02, "powersgd": 0.03}
# And every run that sends at least FEW_BYTES times fewer bytes than dense
# (over the whole run): within FEW_BYTES_BOUND of dense, and better than torch's
# PowerSGD hook on both loss and bytes when that runs beside it.
FEW_BYTES, FEW_BYTES_BOUND = 16.0, 0.03
# Dense's best peak learning rate on this task, of 7.5e-4, 1e-3, 1.5e-3, 2e-3,
# 2.5e-3 and 3e-3 (bench/results/convergence-lm-cpu2-w2-lr*.csv): every run uses it.
LM_LR = 2e-3
# CompressedAdam's default run: sign updates after int4-averaged AdamW steps.
LM_ADAM = ("sign:gradient=int4",)
# Its AdamW steps before the second moment freezes, unless a run says: a fifth
# of the run (frozen after a tenth, with nothing lost on the wire, the second
# moment cost +5.9% at lr 3e-3; after a fifth +0.9%).
LM_ADAM_WARMUP = 0.2
ADAM_OPTIONS = ("warmup", "gradient", "exact")
EXACT = ("vectors", "embeddings")
ONE_BUCKET_MB = 4096.0
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
        "--epochs", type=int, default=150, help="mlp: passes over the training set (default 150)"
    )
    top.add_argument("--steps", type=int, default=600, help="lm: optimizer steps (default 600)")
    top.add_argument(
        "--corpus-bytes", type=int, default=2_000_000, help="lm: bytes of text, a tenth held out (default 2M)"
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
    classes = int(y.max()) + 1
    if settings["task"] == "vision":
        net = make_cnn(settings["width"], classes, settings["seed"])
    else:
        net = make_mlp(x.shape[1], settings["width"], classes, settings["seed"])
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
    args.compressors = common.split_list(list(default) if args.compressors is None else args.compressors)
    if args.adam is not None and args.task != "lm":
        parser().error("--adam is for --task lm")
    if args.adam is None:
        args.adam = list(LM_ADAM) if args.task == "lm" else []
    args.adam = common.split_list(args.adam)
    if args.lr is None:
        args.lr = LM_LR if args.task == "lm" else 0.01
    if args.width is None:
        args.width = 16 if args.task == "vision" else 256
    if args.task == "lm":
        return main_lm(args)
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
    benchmark = "convergence" if args.task == "mlp" else f"convergence-{args.task}"
    results = common.Results(benchmark, common.machine(args.spawn, "gloo"), settings, args.out)
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
    write(results, records, plot, benchmark)
    return 0


def write(results: common.Results, records: list[dict], draw, title: str, extra: dict | None = None) -> None:
    """Write the records (their curves apart, in the JSON) and ``draw``'s PNG; say where."""
    curves = {record["run"]: record.pop("curve") for record in records}
    paths = results.write(records, extra=dict(curves=curves, **(extra or {})))
    for record in records:
        record["curve"] = curves[record["run"]]
    png = results.path("png")
    draw(records, f"{title}: {results.machine['machine']}", png)
    print(f"wrote {', '.join([*paths, png])}")
    print(f"load average (1/5/15 min): {results.load_start} at start, {common.loadavg()} at end")


# ----------------------------------------------------------------------------- --task lm


def lm_runs(specs: list[str], baselines: list[str], adam: list[str] = (), steps: int = 600) -> list[dict]:
    """Dense, then torch's hooks, then every compressor (its default error
    feedback), then the CompressedAdam runs (of ``steps`` steps)."""
    runs = [dict(label="dense", kind="dense", name=None, options={})]
    runs += [dict(label=LM_LABELS[b], kind=b, name=None, options={}) for b in baselines]
    for spec in specs:
        label, name, options = common.parse_compressor(spec)
        runs.append(dict(label=label, kind="gradcomp", name=name, options=options))
    return runs + [parse_adam(spec, steps) for spec in adam]


def parse_adam(spec: str, steps: int = 600) -> dict:
    """``"sign:warmup=60,block=512"`` -> a CompressedAdam run (its options apart from the compressor's)."""
    name, _, rest = spec.strip().partition(":")
    warmup = max(1, round(LM_ADAM_WARMUP * steps))
    settings, kept = dict(warmup=warmup, gradient=None, exact=None), []
    for item in filter(None, rest.split(",")):
        key = item.partition("=")[0].strip()
        if key in ADAM_OPTIONS:
            settings[key] = item.partition("=")[2].strip()
        else:
            kept.append(item)
    try:
        settings["warmup"] = int(settings["warmup"])
    except ValueError:
        raise argparse.ArgumentTypeError(f"warmup must be an integer (in {spec!r})") from None
    if settings["exact"] not in (None, *EXACT):
        raise argparse.ArgumentTypeError(f"exact must be one of {EXACT} (in {spec!r})")
    if settings["gradient"] is not None:  # kept parsed: (name, options)
        settings["gradient"] = common.parse_compressor(settings["gradient"])[1:]
        if "algorithm" in settings["gradient"][1]:
            message = f"the gradient compressor takes the run's algorithm (in {spec!r})"
            raise argparse.ArgumentTypeError(message)
    _, name, options = common.parse_compressor(":".join([name, ",".join(kept)]))
    label = f"CompressedAdam {spec.strip()}"
    if "warmup=" not in spec:
        label += f" (warm-up {settings['warmup']})"
    return dict(label=label, kind="adam", name=name, options=options, adam=settings)


def adam_groups(net: torch.nn.Module, exact: str | None) -> list[dict]:
    """One compressed group, and with ``exact`` one AdamW group of the vectors (and the embeddings)."""
    if exact is None:
        return [dict(params=list(net.parameters()))]
    embeddings = {id(m.weight) for m in net.modules() if isinstance(m, torch.nn.Embedding)}

    def is_exact(p: torch.Tensor) -> bool:
        return p.dim() < 2 or (exact == "embeddings" and id(p) in embeddings)

    params = list(net.parameters())
    return [
        dict(params=[p for p in params if not is_exact(p)]),
        dict(params=[p for p in params if is_exact(p)], compressor=None),
    ]


def lm_train(rank: int, world_size: int, run: dict, settings: dict) -> dict:
    """Train one --task lm run on every rank; rank 0's record."""
    train_data, validation, _ = lm.load_corpus(settings["corpus_bytes"])
    net = lm.GPT(**LM_MODEL, seed=settings["seed"])
    one_bucket = run["kind"] == "powersgd_hook"
    adam = run["kind"] == "adam"
    model = net if adam else DistributedDataParallel(net, bucket_cap_mb=ONE_BUCKET_MB if one_bucket else 25.0)
    steps, dense_steps = settings["steps"], settings["dense_steps"]
    state = None
    hyper = dict(lr=settings["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    if adam:  # the optimizer averages: no DDP
        options = dict(run["options"])
        algorithm = options.pop("algorithm", None)
        gradient = run["adam"]["gradient"]
        if gradient is not None:
            gradient = gradcomp.get_compressor(gradient[0], **gradient[1])
        optimizer = gradcomp.optim.CompressedAdam(
            adam_groups(net, run["adam"]["exact"]),
            compressor=gradcomp.get_compressor(run["name"], **options),
            gradient_compressor=gradient,
            warmup_steps=run["adam"]["warmup"],
            algorithm=algorithm,
            **hyper,
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **hyper)
    if run["kind"] == "fp16_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif one_bucket:
        # torch asks for at least 2 dense steps with error feedback and warm start.
        start = max(2, dense_steps)
        hook_state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=start)
        model.register_comm_hook(hook_state, powerSGD_hook.powerSGD_hook)
    elif run["kind"] == "gradcomp":
        state = gradcomp.ddp.register(
            model, run["name"], warmup_steps=dense_steps, min_numel=0, measure_error=False, **run["options"]
        )
    warmup = max(1, steps // 20)
    scheduler = lm.schedule(optimizer, steps, warmup)
    order = torch.Generator().manual_seed(settings["seed"])
    context, batch = LM_MODEL["context"], LM_BATCH

    def evaluate() -> float:
        return lm.validation_loss(net, validation, context, LM_EVAL_BATCHES, batch)

    curve, step_seconds, adam_bytes = [(0, evaluate())], [], []
    for step in range(steps):
        starts = torch.randint(0, len(train_data) - context - 1, (batch,), generator=order)
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        lm.loss_of(model, *lm.windows(train_data, starts[rank::world_size], context)).backward()
        optimizer.step()
        scheduler.step()
        step_seconds.append(time.perf_counter() - began)
        if adam:
            adam_bytes.append(optimizer.last_bytes_sent)
        if (step + 1) % LM_EVAL_EVERY == 0 or step + 1 == steps:
            curve.append((step + 1, evaluate()))
    shapes = [tuple(p.shape) for p in net.parameters()]
    numel = sum(p.numel() for p in net.parameters())
    dense_bytes = ring_all_reduce_bytes(numel * 4, world_size)
    if state is not None:
        sent = statistics.mean(s.bytes_sent for s in state.stats)
    elif adam:
        sent = statistics.mean(adam_bytes)
    elif run["kind"] == "fp16_hook":
        sent = dense_bytes / 2
    elif one_bucket:
        factors = scale.cost("powersgd", numel, world_size, shapes=shapes).bytes_sent
        sent = (start * dense_bytes + (steps - start) * factors) / steps
    else:
        sent = dense_bytes
    return dict(
        run=run["label"],
        kind=run["kind"],
        compressor=run["name"] or "",
        options=run["options"],
        adam=run.get("adam"),
        steps=steps,
        parameters=numel,
        bytes_per_step=sent,
        ratio=dense_bytes / sent,
        step_ms=1e3 * statistics.median(step_seconds),
        validation_loss=curve[-1][1],
        curve=curve,
    )


def lm_derive(records: list[dict]) -> None:
    dense = next(r["validation_loss"] for r in records if r["kind"] == "dense")
    powersgd = next((r for r in records if r["kind"] == "powersgd_hook" and not r.get("failed")), None)
    for record in records:
        loss = record["validation_loss"]
        record["loss_vs_dense"] = (loss - dense) / dense if loss is not None else math.nan
        plain = not record["options"] and record["kind"] != "adam"
        bound = LM_TARGETS.get(record["compressor"]) if plain else None
        record["target"] = "" if bound is None else lm_target(record["loss_vs_dense"], bound)
        ours = record["kind"] in ("gradcomp", "adam") and not record.get("failed")
        if ours and record["ratio"] >= FEW_BYTES and not record["target"]:
            record["target"] = few_bytes_target(record, powersgd)


def few_bytes_target(record: dict, powersgd: dict | None) -> str:
    """The target of a run sending >= FEW_BYTES times fewer bytes: within the
    bound of dense, and (when it ran) better than torch's PowerSGD on loss and bytes."""
    verdict = lm_target(record["loss_vs_dense"], FEW_BYTES_BOUND)
    verdict = verdict.replace("within", f"{FEW_BYTES:g}x+, within")
    if powersgd is None or not verdict.startswith("met"):
        return verdict
    loss, bytes_sent, theirs = (
        record["validation_loss"],
        record["bytes_per_step"],
        powersgd["validation_loss"],
    )
    if (loss < theirs or not math.isfinite(theirs)) and bytes_sent < powersgd["bytes_per_step"]:
        return verdict + "; beats torch PowerSGD"
    return "missed: not below torch PowerSGD in both loss and bytes"


def lm_target(difference: float, bound: float) -> str:
    if not math.isfinite(difference):
        return f"missed (within {100 * bound:g}%): no finite loss"
    if difference <= bound:
        return f"met (within {100 * bound:g}%)"
    return f"missed (within {100 * bound:g}%): {100 * difference:+.1f}%"


def lm_report(records: list[dict]) -> str:
    header = ["run", "bytes/step", "ratio", "step ms", "validation loss", "vs dense", "target"]
    rows = [
        [r["run"], f"{r['bytes_per_step']:,.0f}", f"{r['ratio']:.1f}", f"{r['step_ms']:.0f}"]
        + [f"{r['validation_loss']:.4f}", f"{100 * r['loss_vs_dense']:+.2f}%", r["target"]]
        if not r.get("failed")
        else [r["run"], "", "", "", "", "", f"failed: {r['failed']}"]
        for r in records
    ]
    return common.format_table(header, rows, left=(0, -1))


def lm_plot(records: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 5.5))
    for record in records:
        if record.get("failed"):
            continue
        steps, losses = zip(*record["curve"], strict=True)
        style = dict(color="black", linewidth=2.5) if record["kind"] == "dense" else {}
        if record["kind"].endswith("hook"):
            style["linestyle"] = "--"
        elif record["kind"] == "adam":
            style["linestyle"] = ":"
        axis.plot(steps, losses, label=f"{record['run']} ({record['ratio']:.1f}x)", **style)
    axis.set_xlabel("step")
    axis.set_ylabel("validation cross-entropy (nats per byte)")
    axis.set_ylim(top=min(3.5, axis.get_ylim()[1]))
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def lm_describe(settings: dict, corpus: dict, parameters: int) -> str:
    dense = f", compressed runs dense for their first {settings['dense_steps']} steps" * bool(
        settings["dense_steps"]
    )
    model = LM_MODEL
    return (
        f"byte-level GPT ({model['layers']} layers, width {model['width']}, {model['heads']} heads, "
        f"context {model['context']}, {parameters:,} parameters), {corpus['bytes']:,} bytes of the Python "
        f"standard library ({corpus['validation_bytes']:,} held out), {settings['steps']} steps of "
        f"{LM_BATCH} windows, AdamW lr {settings['lr']} (warm-up {max(1, settings['steps'] // 20)} steps, "
        f"cosine to a tenth) weight decay 0.1, seed {settings['seed']}{dense}"
    )


def main_lm(args: argparse.Namespace) -> int:
    try:
        runs = lm_runs(args.compressors, args.baselines, args.adam, args.steps)
    except argparse.ArgumentTypeError as error:
        parser().error(str(error))
    if args.steps < 1 or args.spawn < 2 or LM_BATCH % args.spawn:
        parser().error(f"need --steps >= 1 and --spawn >= 2 dividing the batch of {LM_BATCH}")
    if not 0 <= args.dense_steps < args.steps:
        parser().error("need 0 <= --dense-steps < --steps")
    settings = vars(args)
    results = common.Results("convergence-lm", common.machine(args.spawn, "gloo"), settings, args.out)
    print(f"machine: {results.machine['machine']}", flush=True)
    _, _, corpus = lm.load_corpus(args.corpus_bytes)
    progress = common.Progress(len(runs), args.progress)
    records = []
    for done, run in enumerate(runs):
        progress.update(done, run["label"])
        # A second a step a rank, never less than ten minutes.
        timeout = max(600.0, args.steps * args.spawn)
        try:
            records.append(common.spawn(lm_rank, args.spawn, run, settings, timeout=timeout))
        except common.RanksFailed as error:
            sys.stderr.write(f"{run['label']} failed: {error.reason}\n")
            records.append(
                dict(
                    run=run["label"],
                    kind=run["kind"],
                    compressor=run["name"] or "",
                    options=run["options"],
                    failed=error.reason,
                    curve=[],
                    validation_loss=None,
                )
            )
    progress.close()
    lm_derive(records)
    parameters = next((r["parameters"] for r in records if "parameters" in r), 0)
    print(lm_describe(settings, corpus, parameters))
    print(lm_report(records))
    write(results, records, lm_plot, "convergence, lm", extra=dict(corpus=corpus, model=LM_MODEL))
    return 0


def lm_rank(rank: int, world_size: int, run: dict, settings: dict) -> dict:
    record = lm_train(rank, world_size, run, settings)
    dist.barrier()
    return record


if __name__ == "__main__":
    sys.exit(main())
