"""Compressed DDP training that survives a killed rank: run it under torchrun
with restarts, and it resumes from its last checkpoint.

    torchrun --standalone --nproc-per-node 2 --max-restarts 2 examples/elastic_train.py --dir ckpt

Every ``--every`` steps each rank saves the model, the optimizer and its own
hook state (residuals differ between ranks) into ``DIR/step-<n>/``; the
step is marked done once every rank has written. A restarted job loads the
newest complete step and goes on: it ends where an uninterrupted run with
the same checkpoints ends, bit for bit. ``--kill-rank R --kill-at-step S``
kills rank R at step S in the first attempt, to try it.
"""

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradcomp


def batch(step: int, rank: int, world_size: int):
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(32 * world_size, 16, generator=generator)
    labels = inputs[:, :4].argmax(1)
    return inputs[rank::world_size], labels[rank::world_size]


def newest_step(directory: str) -> int | None:
    done = [int(name[5:]) for name in os.listdir(directory) if name.startswith("step-")]
    done = [step for step in done if os.path.exists(os.path.join(directory, f"step-{step}", "done"))]
    return max(done, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="checkpoint folder (shared by the ranks)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-at-step", type=int, default=None)
    args = parser.parse_args()

    # The store outlives a restart: each attempt keys its rendezvous apart, or
    # the new ranks would read the dead ones' addresses.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank, world_size=world_size
    )
    first_attempt = attempt == "0"
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    model = DistributedDataParallel(net, bucket_cap_mb=0.02)
    state = gradcomp.ddp.register(model, "int8", min_numel=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    os.makedirs(args.dir, exist_ok=True)
    start = newest_step(args.dir)
    if start is not None:
        saved = torch.load(os.path.join(args.dir, f"step-{start}", f"rank{rank}.pt"), weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["hook"])
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    for step in range(start or 0, args.steps):
        if first_attempt and rank == args.kill_rank and step == args.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, labels = batch(step, rank, world_size)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        if (step + 1) % args.every == 0:
            folder = os.path.join(args.dir, f"step-{step + 1}")
            os.makedirs(folder, exist_ok=True)
            checkpoint = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "hook": state.state_dict(),
            }
            torch.save(checkpoint, os.path.join(folder, f"rank{rank}.pt"))
            dist.barrier()  # every rank has written: the step is complete
            if rank == 0:
                open(os.path.join(folder, "done"), "w").close()
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    if rank == 0:
        result = {"loss": loss.item(), "weights_sum": float(weights.double().sum()), "step": state.step}
        with open(os.path.join(args.dir, "result.json"), "w") as file:
            json.dump(result, file)
        print(json.dumps(result), flush=True)
    gradcomp.collectives.release_queues()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
