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
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
from lib import lm, torchft_diloco
from lib.convergence_lm import (
    LM_BATCH,
    LM_EVAL_BATCHES,
    LM_EVAL_EVERY,
    LM_LR,
    LM_MODEL,
    LM_TARGETS,
    initial_weights,
)
from lib.machine import machine
from lib.options import add_output_options
from lib.results import Results, publish
from lib.torchft_diloco import emit, wait_for

from gradcomp.collectives import ring_all_reduce_bytes
from gradcomp.tables import format_table

REPLICAS = 2
DENSE, QUANTIZE = "torchft DDP (dense fp32)", "torchft should_quantize=True"
DILOCO_KINDS = ("torchft_diloco", "diloco")
TORCHFT_DILOCO = "torchft DiLoCo (fp32)"
# A replica group gone is noticed by the lighthouse after this long without a heartbeat.
HEARTBEAT_MS = 2000
# Long enough that a quorum never forms while a live replica is still evaluating.
JOIN_MS = 30000


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


# ----------------------------------------------------------------------------- a replica group


def _weights_hash(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()[:16]


def _quantized_ddp(manager, module: torch.nn.Module):
    """torchft's DDP whose hook asks the Manager for its quantized all-reduce."""
    from torchft.ddp import DistributedDataParallel

    class QuantizedDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer(), should_quantize=True)
            work.wait()
            future = work.get_future()
            return getattr(future, "_fut", None) or future  # an errored step's is a plain Future

    return QuantizedDDP(manager, module)


def replica_main(config: dict) -> None:
    """One replica group: train ``config['steps']`` steps (committed steps, or DiLoCo's inner
    steps), a JSON line a step (DiLoCo: an exchange), then a final line."""
    from torchft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)  # one core a replica
    began = time.perf_counter()
    index, steps = config["replica"], config["steps"]
    train, validation, _ = lm.load_corpus(config["corpus_bytes"])
    context = LM_MODEL["context"]
    order = torch.Generator().manual_seed(config["seed"])  # convergence.py --task lm's batches
    starts = [torch.randint(0, len(train) - context - 1, (LM_BATCH,), generator=order) for _ in range(steps)]
    net = lm.GPT(**LM_MODEL, seed=config["seed"])
    if config.get("init"):  # --init-steps: the dense start every run shares
        net.load_state_dict(torch.load(config["init"], weights_only=True))
    inner = torch.optim.AdamW(net.parameters(), lr=LM_LR, **lm.ADAMW)
    factor = lm.schedule(inner, steps, max(1, steps // 20)).lr_lambdas[0]
    heals = []

    def load(state: dict) -> None:
        net.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        heals.append(True)

    def save() -> dict:
        return {"model": net.state_dict(), "optim": inner.state_dict()}

    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=30)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load,
        state_dict=save,
        min_replica_size=1,
        use_async_quorum=False,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=config["lighthouse"],
        replica_id=f"replica_{index}",
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=120),
    )

    def forward_backward(model: torch.nn.Module, step: int) -> None:
        """Step ``step``'s learning rate, and this replica's half of its windows."""
        for group in inner.param_groups:
            group["lr"] = LM_LR * factor(step)
        inputs, targets = lm.windows(train, starts[step][index::REPLICAS], context)
        lm.loss_of(model, inputs, targets).backward()

    def evaluate() -> float:
        return lm.validation_loss(net, validation, context, LM_EVAL_BATCHES, LM_BATCH)

    curve = [(0, evaluate())]
    emit(ready=index)
    wait_for(config.get("gate"))
    if config["kind"] in DILOCO_KINDS:
        done = torchft_diloco.train(
            config, manager, net, inner, lambda step: forward_backward(net, step), evaluate, heals
        )
        exchanges = done.pop("exchanges")
        done.update(attempts=exchanges.commits + exchanges.discards, commits=exchanges.commits)
        done.update(errors=[], trace=None)
    else:
        done = _train_ddp(config, manager, net, inner, forward_backward, evaluate, heals)
    curve += done["curve"]
    if curve[-1][0] != done["step"]:
        curve.append((done["step"], evaluate()))
    emit(
        final=index,
        step=done["step"],
        attempts=done["attempts"],
        commits=done["commits"],
        discards=done["attempts"] - done["commits"],
        heals=len(heals),
        validation_loss=curve[-1][1],
        curve=curve,
        weights=_weights_hash(net),
        parameters=sum(p.numel() for p in net.parameters()),
        bytes_sent=done["bytes_sent"],
        dense_bytes=done["dense_bytes"],
        errors=done["errors"][:1],
        error_trace=done["trace"],
        seconds=time.perf_counter() - began,
    )
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)


def _train_ddp(config, manager, net, inner, forward_backward, evaluate, heals) -> dict:
    """The DDP runs: torchft's, gradcomp's, or torchft's asking for its quantized all-reduce."""
    from torchft.ddp import DistributedDataParallel as TorchftDDP
    from torchft.optim import OptimizerWrapper as TorchftOptimizer

    from gradcomp.integrations import torchft as ft

    steps, kind = config["steps"], config["kind"]
    compression = None
    if kind == "gradcomp":
        compression = ft.Compression(manager, config["spec"])
        model = ft.DistributedDataParallel(manager, net, compression)
        optimizer = ft.OptimizerWrapper(manager, inner, compression)
    else:
        model = _quantized_ddp(manager, net) if kind == "quantize" else TorchftDDP(manager, net)
        optimizer = TorchftOptimizer(manager, inner)
    attempts, commits, errors, trace, curve = 0, 0, [], None, []
    while manager.current_step() < steps and (kind != "quantize" or attempts < config["attempts"]):
        if manager.current_step() == config.get("hold_at"):
            wait_for(config["hold_gate"])
        heals_before = len(heals)
        optimizer.zero_grad(set_to_none=True)  # the step's quorum; a heal lands here
        step = manager.current_step()
        if step == config.get("die_at"):
            emit(dying=step)
            os._exit(1)
        forward_backward(model, step)
        error = manager.errored()
        optimizer.step()
        attempts += 1
        committed = manager.current_step() > step
        commits += committed
        if error is not None:
            errors.append(f"{type(error.original_exception).__name__}: {error.original_exception}")
            trace = trace or error.stack_trace.strip().splitlines()[-12:]
        if committed and ((step + 1) % LM_EVAL_EVERY == 0 or step + 1 == steps):
            curve.append((step + 1, evaluate()))
        emit(
            step=step,
            committed=committed,
            participants=manager.num_participants(),
            healed=len(heals) > heals_before,
            error=errors[-1] if error is not None else None,
        )
    return dict(
        step=manager.current_step(),
        attempts=attempts,
        commits=commits,
        curve=curve,
        bytes_sent=compression.bytes_sent if compression else None,
        dense_bytes=compression.dense_bytes if compression else None,
        errors=errors,
        trace=trace,
    )


# ----------------------------------------------------------------------------- the driver


class _Replica:
    """A replica group's process and the JSON lines it printed."""

    def __init__(self, config: dict, log: str):
        command = [sys.executable, os.path.abspath(__file__), "--replica", json.dumps(config)]
        self.log = log
        with open(log, "a") as stderr:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
        self.records: list[dict] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.records.append(json.loads(line))

    def ready(self) -> bool:
        return any("ready" in r for r in self.records)

    def wait(self, seconds: float) -> int:
        code = self.process.wait(seconds)
        self.reader.join(seconds)
        return code

    def steps(self) -> list[dict]:
        return [r for r in self.records if "step" in r and "final" not in r]

    def final(self) -> dict:
        found = [r for r in self.records if "final" in r]
        if not found:
            with open(self.log) as file:
                raise RuntimeError(f"replica failed:\n{file.read()[-3000:]}")
        return found[0]


def _until(condition, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the replicas did not get there in time")
        time.sleep(0.02)


def run_one(run: dict, settings: dict, scratch: str) -> dict:
    """Train ``run`` on 2 replica groups and a lighthouse of its own; its record."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=JOIN_MS, heartbeat_timeout_ms=HEARTBEAT_MS
    )
    folder = tempfile.mkdtemp(prefix="run-", dir=scratch)
    gate, rejoined = os.path.join(folder, "go"), os.path.join(folder, "rejoined")
    base = dict(
        lighthouse=lighthouse.address(),
        steps=settings["steps"],
        kind=run["kind"],
        spec=run.get("spec"),
        corpus_bytes=settings["corpus_bytes"],
        seed=settings["seed"],
        attempts=settings["quantize_attempts"],
        init=settings.get("init"),
        sync_every=settings["sync_every"],
        follow_inner_lr=run.get("follow_inner_lr", True),
        average=run.get("average", True),
    )
    die_at = run.get("die_at")
    hold = dict(hold_at=die_at + settings["rejoin_after"], hold_gate=rejoined) if die_at is not None else {}
    replicas = []
    try:
        replicas = [
            _Replica(dict(base, replica=0, gate=gate, **hold), os.path.join(folder, "r0.log")),
            _Replica(dict(base, replica=1, gate=gate, die_at=die_at), os.path.join(folder, "r1.log")),
        ]
        _until(lambda: all(replica.ready() for replica in replicas))
        began = time.perf_counter()
        open(gate, "w").close()
        killed = None
        if die_at is not None:
            if replicas[1].wait(3600) != 1:
                raise RuntimeError(f"replica 1 was to die at step {die_at}: {replicas[1].final()}")
            killed = replicas[1]
            replicas[1] = _Replica(dict(base, replica=1), os.path.join(folder, "r1-restarted.log"))
            _until(replicas[1].ready)
            open(rejoined, "w").close()
        for replica in replicas:
            replica.wait(3600)
        seconds = time.perf_counter() - began
        finals = [replica.final() for replica in replicas]
    finally:
        for replica in replicas:
            if replica.process.poll() is None:
                replica.process.kill()
        lighthouse.shutdown()
    return _record(run, finals, [r.steps() for r in replicas], killed, seconds)


def _record(run: dict, finals: list[dict], steps: list[list[dict]], killed, seconds: float) -> dict:
    first = finals[0]
    record = dict(
        run=run["label"],
        kind=run["kind"],
        spec=run.get("spec") or "",
        steps=first["step"],
        parameters=first["parameters"],
        validation_loss=first["validation_loss"],
        validation_losses=[f["validation_loss"] for f in finals],
        weights_equal=len({f["weights"] for f in finals}) == 1,
        committed=[f["commits"] for f in finals],
        discarded=[f["discards"] for f in finals],
        seconds=seconds,
        curve=first["curve"],
        errors=first["errors"],
        error_trace=first["error_trace"],
    )
    dense_step = ring_all_reduce_bytes(4 * first["parameters"], REPLICAS)
    if run["kind"] in DILOCO_KINDS:  # an inner step's share of the run's exchanges, against DDP's step
        sent = first["bytes_sent"] if run["kind"] == "diloco" else first["attempts"] * dense_step
        record["bytes_per_step"] = sent / first["step"]
        record["dense_bytes_per_step"], record["ratio"] = dense_step, dense_step * first["step"] / sent
    elif run["kind"] == "gradcomp":
        record["bytes_per_step"] = first["bytes_sent"] / max(1, first["commits"])
        record["dense_bytes_per_step"] = first["dense_bytes"] / max(1, first["commits"])
        record["ratio"] = first["dense_bytes"] / first["bytes_sent"]
    else:
        record["bytes_per_step"] = dense_step if run["kind"] == "dense" else None
        record["dense_bytes_per_step"], record["ratio"] = dense_step, 1.0 if run["kind"] == "dense" else None
    if killed is not None:
        before = killed.steps()
        record["killed"] = dict(
            die_at=run["die_at"],
            steps_before=len(before),
            restarted_first_step=steps[1][0]["step"] if steps[1] else None,
            restarted_healed=bool(steps[1] and steps[1][0]["healed"]),
            alone=[r["step"] for r in steps[0] if r["committed"] and r["participants"] == 1],
            survivor_discarded=[r["step"] for r in steps[0] if not r["committed"]],
        )
        # The dead replica's commits and the restarted one's together: replica 1's steps.
        record["committed"][1] += sum(r["committed"] for r in before)
        record["discarded"][1] += sum(not r["committed"] for r in before)
    return record


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
