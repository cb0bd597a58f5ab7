"""``convergence.py --task lm``: a byte-level transformer with AdamW, where aggressive
compressors fall apart.

A GPT-style decoder (:mod:`lib.lm`) on Python's standard library sources;
final validation loss against dense, torch's fp16 and PowerSGD hooks beside
every gradcomp method, each run in ranks of its own (a failing run is
reported, the others go on). torch's PowerSGD hook runs with the whole model
in one bucket: on Gloo its collectives, issued from Future callbacks, abort on
a model of several buckets. Bytes per step are counted over the whole run,
dense steps included; torch PowerSGD's from the model's shapes by the rule
gradcomp's ``powersgd`` follows (its hook counts none). ``--adam`` runs
``gradcomp.optim.CompressedAdam`` (AdamW for a warm-up, then each rank's
update exchanged compressed with the second moment frozen), without DDP.

Example:
    >>> runs = lm_runs(["int8"], ["fp16_hook"], ["sign:warmup=60"], steps=600)
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
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import gradcomp
from gradcomp.collectives import cost_model, ring_all_reduce_bytes
from gradcomp.spawn import RanksFailed
from gradcomp.tables import format_table
from lib import lm, spawning
from lib.machine import machine
from lib.plots import figure
from lib.progress import Progress
from lib.results import Results, publish_curves
from lib.specs import parse_run

LM_COMPRESSORS = ("int8", "int4", "topk", "powersgd")
LM_BASELINES = ("fp16_hook", "powersgd_hook")
LM_LABELS = {"fp16_hook": "torch fp16 hook", "powersgd_hook": "torch PowerSGD rank 4"}
# The model and batches of --task lm (about 0.44M parameters; 150 ms a step on
# one core of a 2-core Xeon VM).
LM_MODEL = dict(width=128, layers=2, heads=4, context=64)  # --gpt changes it
CORPUS_NAMES = {"stdlib": "the Python standard library", "c10": "torch's c10 C++ headers"}
LM_BATCH, LM_EVAL_EVERY, LM_EVAL_BATCHES = 32, 50, 8
# Gradient-compression runs of --task lm whose final validation loss is to be
# within a bound of dense's (issue targets); other runs are reported only.
LM_TARGETS = {"int8": 0.01, "int4": 0.02, "powersgd": 0.03}
# And every run that sends at least FEW_BYTES times fewer bytes than dense
# (over the whole run): within FEW_BYTES_BOUND of dense, and better than torch's
# PowerSGD hook on both loss and bytes when that runs beside it.
FEW_BYTES, FEW_BYTES_BOUND = 16.0, 0.03
# Dense's best peak learning rate on this task, of 7.5e-4, 1e-3, 1.5e-3, 2e-3,
# 2.5e-3 and 3e-3 (bench/reports/convergence-cpu2-2026.md): every run uses it.
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


def lm_runs(
    specs: list[str],
    baselines: list[str],
    adam: list[str] = (),
    steps: int = 600,
    fsdp: bool = False,
    diloco: list[str] = (),
) -> list[dict]:
    """Dense, then torch's hooks, then every compressor (its default error
    feedback), then the CompressedAdam runs (of ``steps`` steps). With ``fsdp``, a
    spec may also hold ``gradcomp.fsdp.register``'s options and ``via``."""
    runs = [dict(label="dense", kind="dense", name=None, options={})]
    runs += [dict(label=LM_LABELS[b], kind=b, name=None, options={}) for b in baselines]
    for spec in specs:
        spec, sharded = _fsdp_options(spec) if fsdp else (spec, {})
        label, name, options = parse_run(spec)
        runs.append(dict(label=label, kind="gradcomp", name=name, options={**options, **sharded}))
        if sharded:
            runs[-1]["label"] = ",".join(filter(None, [label, *(f"{k}={v}" for k, v in sharded.items())]))
    return runs + [parse_adam(spec, steps) for spec in adam] + [parse_diloco(spec) for spec in diloco]


FSDP_OPTIONS = ("via", "residual", "scatter_algorithm", "node_size", "intra", "parameters")


def _fsdp_options(spec: str) -> tuple[str, dict]:
    """``spec`` without the FSDP options (``via``, ``residual``, ...), and those options."""
    name, _, rest = spec.strip().partition(":")
    kept, sharded = [], {}
    for item in filter(None, rest.split(",")):
        key, _, value = (part.strip() for part in item.partition("="))
        if key in FSDP_OPTIONS:
            sharded[key] = None if value == "none" else int(value) if key == "node_size" else value
        else:
            kept.append(item)
    return ":".join([name, ",".join(kept)]) if kept else name, sharded


# lr: the inner AdamW's peak learning rate (default --lr, dense's).
DILOCO_OPTIONS = (
    "sync_every", "outer_lr", "outer_momentum", "fragments", "overlap_steps", "lr", "follow_inner_lr",
    "total_steps", "node_size",
)  # fmt: skip
# node_size=L: each node of L ranks is one replica (DDP inside it), the hierarchical all-reduce between
DILOCO_INTEGERS = ("sync_every", "fragments", "overlap_steps", "node_size")
# total_steps=1: DiLoCo is given the run's steps, and its last exchange loads the replicas' average
DILOCO_FLAGS = ("follow_inner_lr", "total_steps")  # 1 or 0


def parse_diloco(spec: str) -> dict:
    """``"int4:sync_every=25,outer_lr=0.7"`` -> a DiLoCo run: its outer options apart
    from the compressor's (and ``algorithm``)."""
    name, _, rest = spec.strip().partition(":")
    outer, kept = {}, []
    for item in filter(None, rest.split(",")):
        key, _, value = (part.strip() for part in item.partition("="))
        if key in DILOCO_OPTIONS:
            try:
                if key in DILOCO_FLAGS:
                    outer[key] = {"1": True, "0": False}[value]
                else:
                    outer[key] = int(value) if key in DILOCO_INTEGERS else float(value)
            except (ValueError, KeyError):
                message = f"{key} must be a number (0 or 1 for {DILOCO_FLAGS}) (in {spec!r})"
                raise argparse.ArgumentTypeError(message) from None
        else:
            kept.append(item)
    _, name, options = parse_run(":".join([name, ",".join(kept)]) if kept else name)
    return dict(label=f"DiLoCo {spec.strip()}", kind="diloco", name=name, options=options, diloco=outer)


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
        settings["gradient"] = parse_run(settings["gradient"])[1:]
        if "algorithm" in settings["gradient"][1]:
            message = f"the gradient compressor takes the run's algorithm (in {spec!r})"
            raise argparse.ArgumentTypeError(message)
    _, name, options = parse_run(":".join([name, ",".join(kept)]))
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


def diloco_replica(net: torch.nn.Module, run: dict, rank: int, world_size: int) -> torch.nn.Module:
    """What a DiLoCo run trains: ``net`` on each rank; with ``node_size=L``, each node of L
    consecutive ranks one replica, under DDP over the node."""
    size = run["diloco"].get("node_size")
    if not size:
        return net
    nodes = [dist.new_group(list(range(first, first + size))) for first in range(0, world_size, size)]
    return DistributedDataParallel(net, process_group=nodes[rank // size])


def make_diloco(net, optimizer, run: dict, outer_options: dict, steps: int) -> gradcomp.DiLoCo:
    """The run's DiLoCo (``total_steps=1``: given the run's steps; ``node_size``: hierarchical)."""
    options = dict(outer_options, total_steps=steps if outer_options.get("total_steps") else None)
    if options.get("node_size"):
        options["algorithm"] = "hierarchical"
    return gradcomp.DiLoCo(net, optimizer, compressor=run["name"], **options, **run["options"])


def check_node_sizes(runs: list[dict], spawn: int, fail) -> None:
    """``fail`` unless every DiLoCo run's ``node_size`` cuts ``spawn`` ranks into 2 nodes or more."""
    for run in runs:
        size = (run.get("diloco") or {}).get("node_size")
        if size is not None and (size < 1 or spawn % size or spawn // size < 2):
            fail(f"DiLoCo's node_size={size} must divide --spawn {spawn} into 2 nodes or more")


def end_diloco(outer: gradcomp.DiLoCo) -> None:
    """After the run's last step: synchronise, so that every rank holds one model, unless
    DiLoCo ended the run itself (``total_steps``) or its last step did (one fragment,
    nothing in flight, H dividing the steps)."""
    if outer.total_steps is None and (
        outer.in_flight or len(outer.fragments) > 1 or outer.local_step % outer.sync_every
    ):
        outer.synchronize()


def diloco_bytes(outer: gradcomp.DiLoCo, numel: int, world_size: int, steps: int) -> tuple[float, float]:
    """(bytes a rank sent a step, DDP's): with nodes, those between nodes, against DDP's dense
    hierarchical all-reduce between them (a flat ring sends more)."""
    if not outer.node_size:
        return outer.bytes_sent / steps, ring_all_reduce_bytes(numel * 4, world_size)
    assert len(outer.fragments) == 1, "node_size: one fragment (every exchange the same size)"
    sent = outer.last_stats.bytes_sent_inter * outer.outer_step / steps
    return sent, ring_all_reduce_bytes(numel * 4 // outer.node_size, world_size // outer.node_size)


def lm_train(rank: int, world_size: int, run: dict, settings: dict) -> dict:
    """Train one --task lm run on every rank; rank 0's record."""
    train_data, validation, _ = lm.load_corpus(settings["corpus_bytes"], settings.get("corpus", "stdlib"))
    model_shape = settings.get("model") or LM_MODEL
    net = lm.GPT(**model_shape, seed=settings["seed"])
    if settings.get("init"):  # --init-steps: the dense start every run shares
        net.load_state_dict(torch.load(settings["init"], weights_only=True))
    one_bucket = run["kind"] == "powersgd_hook"
    adam = run["kind"] == "adam"
    diloco = run["kind"] == "diloco"
    steps, dense_steps = settings["steps"], settings["dense_steps"]
    state = None
    if settings.get("fsdp"):
        model, state = net, fsdp_register(net, run, world_size, dense_steps)
    elif diloco:
        model = diloco_replica(net, run, rank, world_size)
    elif adam:  # each rank its own model: the optimizer averages
        model = net
    else:
        model = DistributedDataParallel(net, bucket_cap_mb=ONE_BUCKET_MB if one_bucket else 25.0)
    outer_options = dict(run.get("diloco") or {})
    hyper = dict(lr=outer_options.pop("lr", settings["lr"]), **lm.ADAMW)
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
    outer = None
    if diloco:
        outer = make_diloco(net, optimizer, run, outer_options, steps)
    if run["kind"] == "fp16_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif one_bucket:
        # torch asks for at least 2 dense steps with error feedback and warm start.
        start = max(2, dense_steps)
        hook_state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=start)
        model.register_comm_hook(hook_state, powerSGD_hook.powerSGD_hook)
    elif run["kind"] == "gradcomp" and not settings.get("fsdp"):
        state = gradcomp.ddp.register(
            model, run["name"], warmup_steps=dense_steps, min_numel=0, measure_error=False, **run["options"]
        )
    warmup = max(1, steps // 20)
    scheduler = lm.schedule(optimizer, steps, warmup)
    # The start's steps draw their windows in an order of their own.
    order = torch.Generator().manual_seed(settings["seed"] + settings.get("order_offset", 0))
    context, batch = model_shape["context"], LM_BATCH

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
        if outer is not None:
            outer.step()
            if step + 1 == steps:
                end_diloco(outer)
        if (step + 1) % LM_EVAL_EVERY == 0 or step + 1 == steps:
            curve.append((step + 1, evaluate()))
    if settings.get("save"):  # --init-steps' dense start, for the runs to share
        if rank == 0:
            torch.save(net.state_dict(), settings["save"])
    shapes = [tuple(p.shape) for p in net.parameters()]
    numel = sum(p.numel() for p in net.parameters())
    dense_bytes = ring_all_reduce_bytes(numel * 4, world_size)
    if state is not None:
        sent = statistics.mean(s.bytes_sent for s in state.stats)
        dense_bytes = statistics.mean(s.dense_bytes for s in state.stats)
    elif diloco:
        sent, dense_bytes = diloco_bytes(outer, numel, world_size, steps)
    elif adam:
        sent = statistics.mean(adam_bytes)
    elif run["kind"] == "fp16_hook":
        sent = dense_bytes / 2
    elif one_bucket:
        factors = cost_model.cost("powersgd", numel, world_size, shapes=shapes).bytes_sent
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


def fsdp_register(net: torch.nn.Module, run: dict, world_size: int, dense_steps: int):
    """``--fsdp``: ``net``'s blocks and root sharded with FSDP2; a gradcomp run registered
    on them (``via=replicas``, the default: custom HSDP on 2 nodes, each unit sharded on a
    node's ranks; ``via=reduce_scatter``: the reduce-scatter of a shard group of every
    rank); its state, or None for the dense run (every rank one shard group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    options = dict(run["options"])
    via = options.pop("via", "replicas")
    if via not in ("replicas", "reduce_scatter"):
        raise ValueError(f"via must be replicas or reduce_scatter, got {via!r}")
    hsdp = run["kind"] == "gradcomp" and via == "replicas"
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        shard = mesh["shard"]
    else:
        shard = init_device_mesh("cpu", (world_size,))
    for block in net.blocks:
        fully_shard(block, mesh=shard)
    fully_shard(net, mesh=shard)
    if run["kind"] != "gradcomp":
        return None
    replicas = mesh["replicate"].get_group() if hsdp else None
    options.setdefault("warmup_steps", dense_steps)
    return gradcomp.fsdp.register(net, run["name"], replicate_group=replicas, **options)


def lm_derive(records: list[dict]) -> None:
    dense = next(r["validation_loss"] for r in records if r["kind"] == "dense")
    powersgd = next((r for r in records if r["kind"] == "powersgd_hook" and not r.get("failed")), None)
    for record in records:
        loss = record["validation_loss"]
        record["loss_vs_dense"] = (loss - dense) / dense if loss is not None else math.nan
        plain = not record["options"] and record["kind"] not in ("adam", "diloco")
        bound = LM_TARGETS.get(record["compressor"]) if plain else None
        record["target"] = "" if bound is None else lm_target(record["loss_vs_dense"], bound)
        ours = record["kind"] in ("gradcomp", "adam", "diloco") and not record.get("failed")
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
    return format_table(header, rows, left=(0, -1))


def lm_plot(records: list[dict], title: str, path: str) -> None:
    """Validation loss against steps, one line per run (torch's hooks dashed, CompressedAdam dotted)."""
    with figure(path, title, figsize=(9, 5.5)) as (_, axis):
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


def lm_describe(settings: dict, corpus: dict, parameters: int) -> str:
    dense = f", compressed runs dense for their first {settings['dense_steps']} steps" * bool(
        settings["dense_steps"]
    )
    model = settings.get("model") or LM_MODEL
    start = f", every run from the weights of {settings['init_steps']} dense steps" * bool(
        settings.get("init_steps")
    )
    return (
        f"byte-level GPT ({model['layers']} layers, width {model['width']}, {model['heads']} heads, "
        f"context {model['context']}, {parameters:,} parameters), {corpus['bytes']:,} bytes of "
        f"{CORPUS_NAMES[corpus.get('corpus', 'stdlib')]} ({corpus['validation_bytes']:,} held out), "
        f"{settings['steps']} steps of "
        f"{LM_BATCH} windows, AdamW lr {settings['lr']} (warm-up {max(1, settings['steps'] // 20)} steps, "
        f"cosine to a tenth) weight decay 0.1, seed {settings['seed']}{dense}{start}"
    )


def main_lm(args: argparse.Namespace, fail) -> int:
    """Run ``--task lm`` with the parsed options; ``fail(message)`` exits as the parser does."""
    if args.fsdp:
        args.baselines, args.adam = [], []
        if args.spawn % 2:
            fail("--fsdp runs 2 nodes: --spawn must be even")
    try:
        runs = lm_runs(args.compressors, args.baselines, args.adam, args.steps, args.fsdp, args.diloco)
    except argparse.ArgumentTypeError as error:
        fail(str(error))
    if args.steps < 1 or args.spawn < 2 or LM_BATCH % args.spawn:
        fail(f"need --steps >= 1 and --spawn >= 2 dividing the batch of {LM_BATCH}")
    if not 0 <= args.dense_steps < args.steps:
        fail("need 0 <= --dense-steps < --steps")
    check_node_sizes(runs, args.spawn, fail)
    settings = vars(args)
    settings["model"] = {**LM_MODEL, **(args.gpt or {})}
    if settings["model"]["width"] % settings["model"]["heads"]:
        fail("--gpt: width must be a multiple of heads")
    name = "convergence-lm-fsdp" if args.fsdp else "convergence-lm"
    if args.corpus != "stdlib":
        name += f"-{args.corpus}"
    results = Results(name, machine(args.spawn, "gloo"), settings, args.out)
    print(f"machine: {results.machine['machine']}", flush=True)
    _, _, corpus = lm.load_corpus(args.corpus_bytes, args.corpus)
    if args.init_steps < 0 or args.init_steps and args.fsdp:
        fail("need --init-steps >= 0, and none with --fsdp")
    progress = Progress(len(runs) + bool(args.init_steps), args.progress)
    records, start = [], None
    if args.init_steps:
        progress.update(0, f"start: {args.init_steps} dense steps")
        start = initial_weights(args, settings)
        settings["init"] = start["path"]
    for done, run in enumerate(runs, start=bool(args.init_steps)):
        progress.update(done, run["label"])
        # A second a step a rank, never less than ten minutes.
        timeout = max(600.0, args.steps * args.spawn)
        try:
            records.append(spawning.spawn(lm_rank, args.spawn, run, settings, timeout=timeout))
        except RanksFailed as failure:
            reason = spawning.reason(failure)
            sys.stderr.write(f"{run['label']} failed: {reason}\n")
            records.append(
                dict(
                    run=run["label"],
                    kind=run["kind"],
                    compressor=run["name"] or "",
                    options=run["options"],
                    failed=reason,
                    curve=[],
                    validation_loss=None,
                )
            )
    progress.close()
    lm_derive(records)
    parameters = next((r["parameters"] for r in records if "parameters" in r), 0)
    print(lm_describe(settings, corpus, parameters))
    print(lm_report(records))
    extra = dict(corpus=corpus, model=settings["model"])
    if start is not None:
        os.unlink(settings.pop("init"))
        extra["start"] = dict(
            steps=args.init_steps, validation_loss=start["validation_loss"], curve=start["curve"]
        )
    publish_curves(results, records, lm_plot, extra=extra)
    return 0


# --init-steps' dense start draws its windows from a generator seeded this far
# from --seed, so that the runs after it see other windows.
START_ORDER_OFFSET = 1_000_003


def initial_weights(args: argparse.Namespace, settings: dict) -> dict:
    """--init-steps: train dense DDP for that many steps (a schedule of its own, windows
    in an order of their own) and save its weights for every run to start from; its
    validation loss and curve, and the path."""
    handle, path = tempfile.mkstemp(prefix="gradcomp-lm-start-", suffix=".pt")
    os.close(handle)
    start = dict(settings, steps=args.init_steps, save=path, order_offset=START_ORDER_OFFSET)
    run = dict(label="start", kind="dense", name=None, options={})
    timeout = max(600.0, args.init_steps * args.spawn)
    record = spawning.spawn(lm_rank, args.spawn, run, start, timeout=timeout)
    return dict(path=path, validation_loss=record["validation_loss"], curve=record["curve"])


def lm_rank(rank: int, world_size: int, run: dict, settings: dict) -> dict:
    record = lm_train(rank, world_size, run, settings)
    dist.barrier()
    return record
