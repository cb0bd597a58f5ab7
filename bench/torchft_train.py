"""torchft's fault-tolerant loop, dense and compressed: the LM task on 2 replica groups.

Each run trains the byte-level GPT of ``convergence.py --task lm`` (:mod:`lib.lm`,
its model, corpus, batches, AdamW, learning rate and schedule) on 2 torchft replica
groups, one process each, Gloo between them, a lighthouse in this process; every
step forms a quorum (``use_async_quorum=False``) and is committed or discarded by
the Manager. A step's batch of 32 windows is the LM task's (the same generator),
half to each replica, chosen by the Manager's step, so that a restarted replica
trains on the step it joins at. The runs:

* ``torchft DDP``: torchft's own ``DistributedDataParallel`` and ``OptimizerWrapper``
  (a dense fp32 all-reduce a bucket), the baseline;
* one per ``--compressors`` spec through ``gradcomp.integrations.torchft``
  (``Compression``, its ``DistributedDataParallel`` and ``OptimizerWrapper``);
* ``--kill SPEC``: that run again, replica 1 ended by ``os._exit`` at the start of
  step ``--kill-at`` (a fraction of the steps; after the quorum, before the
  all-reduces), replica 0 going on alone, and a new replica 1 started, which replica
  0 waits for ``--rejoin-after`` steps later; it heals from replica 0;
* ``torchft should_quantize=True``: torchft's DDP hook asking ``Manager.allreduce``
  for its quantized all-reduce, tried for ``--quantize-attempts`` steps (it needs an
  accelerator; the Manager reports the error and discards the step);
* ``--sync-every H``: torchft's own DiLoCo (fp32), gradcomp's DiLoCo through
  ``manager=`` for each ``--diloco`` compressor (its defaults, and torchft's outer step),
  and ``--kill-diloco``'s run again with replica 1 killed inside the exchange nearest
  ``--kill-at`` (:mod:`lib.torchft_diloco`); ``--init-steps N`` starts every run from N
  dense steps (``convergence.py --task lm --init-steps``' start).

Reported per run: the final validation loss (replica 0's; every replica's weights
are compared bit for bit) against the torchft DDP run's and, for the killed run,
against its uninterrupted twin's; the bytes a replica sends a step
(``Compression.bytes_sent`` over committed steps, and its ``dense_bytes``; for torchft's
dense all-reduce the ring's 2 (W-1)/W * 4 * parameters); steps committed and
discarded on each replica; the run's wall time.

Examples:
    python bench/torchft_train.py
    python bench/torchft_train.py --steps 300 --compressors int8 int4 --kill int8
    python bench/torchft_train.py --init-steps 600 --compressors --kill '' --quantize-attempts 0 \
        --sync-every 75 --suffix=-diloco
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from lib.convergence_lm import LM_BATCH, LM_LR, LM_MODEL, LM_TARGETS, initial_weights
from lib.machine import machine
from lib.options import add_output_options
from lib.results import Results, publish
from lib.torchft_runs import REPLICAS, replica_main, run_one

from gradcomp.tables import format_table

DENSE, QUANTIZE = "torchft DDP (dense fp32)", "torchft should_quantize=True"
TORCHFT_DILOCO = "torchft DiLoCo (fp32)"


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=600, help="committed steps a run (default 600)")
    parser.add_argument(
        "--compressors", nargs="*", default=["int8", "int4"], help="gradcomp specs (default int8 int4)"
    )
    parser.add_argument(
        "--kill", default="int8", help="the spec run again with a replica killed ('' for none; default int8)"
    )
    parser.add_argument(
        "--kill-at", type=float, default=0.4, help="the killed step, a fraction of --steps (default 0.4)"
    )
    parser.add_argument(
        "--rejoin-after", type=int, default=5, help="steps replica 0 trains alone (default 5)"
    )
    parser.add_argument(
        "--quantize-attempts",
        type=int,
        default=3,
        help="steps torchft's quantized all-reduce is tried (0: not at all; default 3)",
    )
    parser.add_argument(
        "--init-steps",
        type=int,
        default=0,
        help="every run starts from the weights of this many dense steps, convergence.py --task lm "
        "--init-steps' start (default 0: from scratch)",
    )
    parser.add_argument(
        "--sync-every",
        type=int,
        default=0,
        help="H: runs torchft's DiLoCo and gradcomp's with an exchange every H inner steps (default 0: none)",
    )
    parser.add_argument(
        "--diloco",
        nargs="*",
        default=["int4"],
        help="gradcomp DiLoCo's compressors, each run with its defaults and with torchft's outer "
        "step (follow_inner_lr=False, no total_steps) (default int4)",
    )
    parser.add_argument(
        "--kill-diloco",
        default="int4",
        help="the gradcomp DiLoCo compressor run again with replica 1 killed inside the exchange "
        "nearest --kill-at ('' for none; default int4)",
    )
    parser.add_argument("--suffix", default="", help="the end of the result files' names (default none)")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000, help="bytes of text (default 2M)")
    parser.add_argument("--seed", type=int, default=0, help="model and batch seed (default 0)")
    parser.add_argument("--replica", help=argparse.SUPPRESS)  # a replica group's process
    add_output_options(parser)
    return parser


def plan(args: argparse.Namespace) -> list[dict]:
    runs = [dict(label=DENSE, kind="dense")]
    runs += [dict(label=f"gradcomp {spec}", kind="gradcomp", spec=spec) for spec in args.compressors]
    if args.kill:
        die_at = round(args.kill_at * args.steps)
        label = f"gradcomp {args.kill}, replica 1 killed at step {die_at}, back {args.rejoin_after} later"
        runs.append(
            dict(label=label, kind="gradcomp", spec=args.kill, die_at=die_at, twin=f"gradcomp {args.kill}")
        )
    if args.quantize_attempts:
        runs.append(dict(label=QUANTIZE, kind="quantize"))
    return runs + diloco_plan(args)


def diloco_plan(args: argparse.Namespace) -> list[dict]:
    """--sync-every H: torchft's DiLoCo; gradcomp's, with its defaults and with torchft's outer
    step; and one run again with replica 1 killed inside an exchange."""
    every = args.sync_every
    if not every:
        return []
    runs = [dict(label=f"{TORCHFT_DILOCO}, H = {every}", kind="torchft_diloco")]
    for spec in args.diloco:
        runs.append(dict(label=f"gradcomp DiLoCo {spec}, H = {every}", kind="diloco", spec=spec))
        runs.append(
            dict(
                label=f"gradcomp DiLoCo {spec}, H = {every}, torchft's outer step",
                kind="diloco",
                spec=spec,
                follow_inner_lr=False,
                average=False,
            )
        )
    if args.kill_diloco:
        die_at = max(1, round(args.kill_at * args.steps / every)) * every
        label = (
            f"gradcomp DiLoCo {args.kill_diloco}, H = {every}, replica 1 killed in the exchange at "
            f"step {die_at}, back {args.rejoin_after} steps later"
        )
        twin = f"gradcomp DiLoCo {args.kill_diloco}, H = {every}"
        runs.append(dict(label=label, kind="diloco", spec=args.kill_diloco, die_at=die_at, twin=twin))
    return runs


def derive(records: list[dict], runs: list[dict]) -> list[str]:
    """Losses against the dense run's (and a killed run's against its twin's); the verdicts."""
    by_label = {r["run"]: r for r in records}
    dense = by_label[DENSE]["validation_loss"]
    verdicts = []
    for run, record in zip(runs, records, strict=True):
        trained = record["committed"][0] > 0
        record["loss_vs_dense"] = record["validation_loss"] / dense - 1 if trained else None
        reference = next((r for r in records if r["kind"] == "torchft_diloco"), None)
        if run["kind"] == "diloco" and reference is not None:
            record["loss_vs_torchft_diloco"] = record["validation_loss"] / reference["validation_loss"] - 1
        twin = by_label.get(run.get("twin"))
        if twin is None:
            continue
        record["loss_vs_uninterrupted"] = record["validation_loss"] / twin["validation_loss"] - 1
        bound = LM_TARGETS.get(run["spec"].split(":")[0], 0.01)
        met = abs(record["loss_vs_uninterrupted"]) <= bound
        verdicts.append(
            f"target: {run['label']} within {100 * bound:g}% of the uninterrupted run: "
            f"{100 * record['loss_vs_uninterrupted']:+.2f}%, {'met' if met else 'missed'}"
        )
    return verdicts


def table(records: list[dict]) -> str:
    def percent(value):
        return "" if value is None else f"{100 * value:+.2f}%"

    rows = [
        [
            r["run"],
            "/".join(map(str, r["committed"])),
            "/".join(map(str, r["discarded"])),
            "" if r["bytes_per_step"] is None else f"{r['bytes_per_step']:,.0f}",
            "" if r["ratio"] is None else f"{r['ratio']:.2f}",
            f"{r['validation_loss']:.4f}",
            percent(r["loss_vs_dense"]),
            percent(r.get("loss_vs_torchft_diloco")),
            percent(r.get("loss_vs_uninterrupted")),
            "yes" if r["weights_equal"] else "NO",
            f"{r['seconds']:.0f}",
        ]
        for r in records
    ]
    header = ["run", "committed", "discarded", "bytes/step", "x fewer", "val loss", "vs dense",
              "vs torchft DiLoCo", "vs uninterrupted", "same weights", "wall s"]  # fmt: skip
    return format_table(header, rows, left=(0,))


def main() -> int:
    args = options().parse_args()
    if args.replica is not None:
        replica_main(json.loads(args.replica))
        return 0
    if args.steps < 2 or not 0 < args.kill_at < 1 or args.rejoin_after < 1:
        options().error("need --steps >= 2, 0 < --kill-at < 1 and --rejoin-after >= 1")
    if not 0 <= args.sync_every <= args.steps or args.init_steps < 0:
        options().error("need 0 <= --sync-every <= --steps and --init-steps >= 0")
    runs = plan(args)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "progress", "replica")}
    settings["model"] = LM_MODEL
    facts = machine(REPLICAS, "gloo")
    results = Results("torchft_train", facts, settings, directory=args.out, suffix=args.suffix)
    print(facts["machine"], "| replica groups:", REPLICAS)
    records, start = [], None
    with tempfile.TemporaryDirectory(prefix="gradcomp-torchft-") as scratch:
        if args.init_steps:
            # convergence.py --task lm --init-steps' start: torch's DDP on 2 Gloo ranks, a
            # schedule and an order of windows of its own
            lm_settings = dict(corpus_bytes=args.corpus_bytes, seed=args.seed, dense_steps=0, lr=LM_LR)
            start = initial_weights(
                argparse.Namespace(init_steps=args.init_steps, spawn=REPLICAS),
                dict(lm_settings, model=LM_MODEL),
            )
            os.replace(start.pop("path"), os.path.join(scratch, "start.pt"))
            settings["init"] = os.path.join(scratch, "start.pt")
            print(
                f"start: {args.init_steps} dense steps, val loss {start['validation_loss']:.4f}", flush=True
            )
        for run in runs:
            record = run_one(run, settings, scratch)
            records.append(record)
            print(
                f"{run['label']}: committed {record['committed']}, discarded {record['discarded']}, "
                f"val loss {record['validation_loss']:.4f}, {record['seconds']:.0f} s"
                + (f", error: {record['errors'][0][:200]}" if record["errors"] else ""),
                flush=True,
            )
    settings.pop("init", None)  # a temporary file's path
    verdicts = derive(records, runs)
    print(
        f"byte-level GPT {LM_MODEL}, {records[0]['parameters']:,} parameters, {args.steps} steps of "
        f"{LM_BATCH} windows ({LM_BATCH // REPLICAS} a replica), AdamW lr {LM_LR}, "
        f"{REPLICAS} torchft replica groups on Gloo"
    )
    print(table(records))
    for line in verdicts:
        print(line)
    curves = {record["run"]: record.pop("curve") for record in records}
    publish(results, records, extra=dict(curves=curves, verdicts=verdicts, start=start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
