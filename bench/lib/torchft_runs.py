"""The replica groups of ``bench/torchft_train.py``: one group's process (a torchft Manager,
its DDP loop or :mod:`lib.torchft_diloco`'s, a JSON line a step, then a final line), and the
driver that starts a run's groups beside a lighthouse of its own, kills and restarts one
where the run says so, and turns their lines into the run's record.

A replica group is the script run again with ``--replica CONFIG``, which calls
:func:`replica_main`.

Example:
    >>> record = run_one(dict(label="gradcomp int8", kind="gradcomp", spec="int8"), settings, scratch)
"""

from __future__ import annotations

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

from gradcomp.collectives import ring_all_reduce_bytes
from lib import lm, torchft_diloco
from lib.convergence_lm import LM_BATCH, LM_EVAL_BATCHES, LM_EVAL_EVERY, LM_LR, LM_MODEL
from lib.torchft_diloco import emit, wait_for

REPLICAS = 2
DILOCO_KINDS = ("torchft_diloco", "diloco")
# A replica group gone is noticed by the lighthouse after this long without a heartbeat.
HEARTBEAT_MS = 2000
# Long enough that a quorum never forms while a live replica is still evaluating.
JOIN_MS = 30000
# The script a replica group's process runs, with --replica.
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchft_train.py")


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
        command = [sys.executable, SCRIPT, "--replica", json.dumps(config)]
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
