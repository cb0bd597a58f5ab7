"""One torchft replica group (one process) training a small model with gradcomp's compressed
DDP; run by tests/integrations/test_torchft.py.

Usage: python torchft_replica.py LIGHTHOUSE REPLICA STEPS COMPRESSOR OUT [--die-at STEP]
    [--gate FILE] [--hold-at STEP --hold-gate FILE] [--async-quorum]

``--die-at``: the process exits at that step's start, after the quorum, before its
all-reduces (a replica lost mid-step). ``--gate``: the first step waits for FILE (the
driver makes it once every replica is up, so that the first quorum holds them all);
``--hold-at``: that step waits for ``--hold-gate`` (a restarted replica is up).

Each step's batch depends on the replica and the step only. One JSON line a step on
stdout: the step the Manager was at, whether it committed, the quorum's size, a hash
of the weights, the residuals' squared norm and count, the bytes sent so far. At the
end the weights go to OUT (``torch.save``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(32, 16, generator=generator)
    return x, (x[:, :4] * 2 - x[:, 4:8]).sin()


def weights_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()[:16]


def wait_for(path: str | None, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while path is not None and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.02)


def main() -> None:
    from torchft_setup import replica_group_manager  # beside this script, which runs as one

    from gradcomp.integrations.torchft import Compression, DistributedDataParallel, OptimizerWrapper

    parser = argparse.ArgumentParser()
    parser.add_argument("lighthouse")
    parser.add_argument("replica", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("compressor")
    parser.add_argument("out")
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--gate")
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--hold-gate")
    parser.add_argument("--async-quorum", action="store_true")
    parser.add_argument("--diloco", type=int, default=0, help="sync_every: gradcomp's DiLoCo instead of DDP")
    args = parser.parse_args()

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    inner = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    heals = []

    def load(state: dict) -> None:
        module.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        heals.append(True)

    def save() -> dict:
        return {"model": module.state_dict(), "optim": inner.state_dict()}

    manager = replica_group_manager(
        args.lighthouse, f"replica_{args.replica}", load, save, 2, args.async_quorum
    )
    if args.diloco:
        diloco(args, manager, module, inner, heals)
    compression = Compression(manager, args.compressor)
    model = DistributedDataParallel(manager, module, compression)
    optimizer = OptimizerWrapper(manager, inner, compression)
    print(json.dumps({"ready": args.replica}), flush=True)
    wait_for(args.gate)
    while manager.current_step() < args.steps:
        if manager.current_step() == args.hold_at:
            wait_for(args.hold_gate)
        heals_before = len(heals)
        residuals = compression.feedback.state_dict()["residuals"]
        before = sum(float(r.double().square().sum()) for r in residuals.values())
        optimizer.zero_grad()
        step = manager.current_step()
        if step == args.die_at:
            print(json.dumps({"dying": step}), flush=True)
            os._exit(1)
        x, y = batch(args.replica, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        residuals = compression.feedback.state_dict()["residuals"]
        record = {
            "step": step,
            "committed": manager.current_step() > step,
            "participants": manager.num_participants(),
            "weights": weights_hash(module),
            "residual_sq_before": before,
            "residual_sq": sum(float(r.double().square().sum()) for r in residuals.values()),
            "residuals": len(residuals),
            "healed": len(heals) > heals_before,
            "heals": len(heals),
            "bytes_sent": compression.bytes_sent,
            "dense_bytes": compression.dense_bytes,
        }
        print(json.dumps(record), flush=True)
    finish(args, manager, module)


def finish(args, manager, module: torch.nn.Module) -> None:
    torch.save({name: p.detach().clone() for name, p in module.named_parameters()}, args.out)
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)


def diloco(args, manager, module: torch.nn.Module, inner: torch.optim.Optimizer, heals: list) -> None:
    """The run with gradcomp's DiLoCo: ``--die-at`` is an exchange's inner step, where the
    process exits inside the exchange, after the quorum, before its all-reduce."""
    import gradcomp
    from gradcomp.integrations.torchft import Compression

    reduce = Compression.all_reduce

    def dying(self, tensor, name, op="avg"):
        if outer_steps.local_step == args.die_at:
            print(json.dumps({"dying": args.die_at}), flush=True)
            os._exit(1)
        return reduce(self, tensor, name, op)

    Compression.all_reduce = dying
    outer_steps = argparse.Namespace(local_step=0)
    print(json.dumps({"ready": args.replica}), flush=True)
    wait_for(args.gate)
    outer = gradcomp.DiLoCo(
        module,
        inner,
        sync_every=args.diloco,
        compressor=args.compressor,
        manager=manager,
        total_steps=args.steps,
    )
    outer_steps = outer
    feedback, replicas = outer.feedback, outer.replicas

    def record(**fields) -> None:
        residuals = feedback.state_dict()["residuals"].values()
        fields.update(
            participants=manager.num_participants(),
            weights=weights_hash(module),
            anchor=hashlib.sha256(b"".join(a.numpy().tobytes() for a in outer.anchor)).hexdigest()[:16],
            residual_sq=sum(float(r.double().square().sum()) for r in residuals),
            bytes_sent=replicas.compression.bytes_sent,
            dense_bytes=replicas.compression.dense_bytes,
        )
        print(json.dumps(fields), flush=True)

    # Where it joined: the run's start, or (healed) its peers' exchange at that inner step.
    record(joined=outer.local_step, healed=bool(heals), commits=replicas.commits)
    while outer.local_step < args.steps:
        if outer.local_step == args.hold_at:
            wait_for(args.hold_gate)
        x, y = batch(args.replica, outer.local_step)
        torch.nn.functional.mse_loss(module(x), y).backward()
        inner.step()
        inner.zero_grad()
        commits, discards = replicas.commits, replicas.discards
        before = sum(float(r.double().square().sum()) for r in feedback.state_dict()["residuals"].values())
        outer.step()
        if (replicas.commits, replicas.discards) != (commits, discards):  # an exchange
            record(step=outer.local_step, committed=replicas.commits > commits, residual_sq_before=before)
    finish(args, manager, module)


if __name__ == "__main__":
    main()
