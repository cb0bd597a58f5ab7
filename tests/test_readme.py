"""The README's Python snippets, run as a user would (adapted to CPUs and Gloo where they say so)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from utils import run_ranks, same_on_all_ranks

import gradcomp

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks() -> list[str]:
    with open(README) as file:
        return re.findall(r"```python\n(.*?)```", file.read(), flags=re.S)


def _run_snippets(rank: int, world_size: int, blocks: list[str], directory: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    os.chdir(directory)
    ddp, _, adam, calls, auto, hierarchical = blocks
    # The DDP example, on CPUs: the group is up already, and there is no GPU to move to.
    on_cpu = ddp.replace('dist.init_process_group("nccl")', "pass").replace(
        "net.cuda(), device_ids=[local_rank]", "net"
    )
    assert on_cpu.count("pass") == 1 and "cuda" not in on_cpu.replace('"gloo" on CPUs', "")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    generator = torch.Generator().manual_seed(rank)
    loader = [
        (torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator))
    ] * 12
    scope = {
        "net": net,
        "local_rank": rank,
        "loader": loader,
        "loss_fn": torch.nn.functional.cross_entropy,
        "optimizer": torch.optim.SGD(net.parameters(), lr=0.05),
    }
    exec(on_cpu, scope)
    assert scope["state"].last_stats.ratio > 3  # compressed after the 10 dense steps
    assert os.path.exists(f"hook-rank{rank}.pt")

    # CompressedAdam, on CPUs, its warm-up shortened to fit the 12 batches.
    on_cpu = adam.replace("net.cuda()", "net").replace("warmup_steps=120", "warmup_steps=4")
    assert "cuda" not in on_cpu and "warmup_steps=4" in on_cpu
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    scope.update(net=net, gradcomp=gradcomp)
    exec(on_cpu, scope)
    numel = sum(p.numel() for p in net.parameters())
    dense = gradcomp.collectives.ring_all_reduce_bytes(numel * 4, world_size)
    assert 0 < scope["optimizer"].last_bytes_sent < dense / 20  # sign updates after the warm-up
    assert same_on_all_ranks(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))

    scope = {"gradcomp": gradcomp, "grad": torch.randn(4096, generator=generator)}
    exec(calls, scope)
    assert scope["stats"].ratio > 3 and scope["work"].is_completed()
    assert scope["chosen"].compressor in gradcomp.planner.SAFE and scope["chosen"].algorithm
    assert scope["approx"].shape == scope["grad"].shape and scope["payload"].nbytes < 4096

    # "auto": dense for 2 steps, then a plan measured on this group, the same on every rank.
    model = DistributedDataParallel(torch.nn.Linear(256, 256))
    scope = {"gradcomp": gradcomp, "model": model}
    exec(auto, scope)
    for _ in range(3):
        model(torch.randn(8, 256, generator=generator)).sum().backward()
    plan = scope["state"].plan
    assert len(plan) == 1 and plan[0].numel == 256 * 256 + 256 and plan[0].compressor in gradcomp.planner.SAFE
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, plan)
    assert all(p == plan for p in everyone)

    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    scope = {"gradcomp": gradcomp, "model": model}
    exec(hierarchical, scope)
    model(torch.randn(8, 64)).sum().backward()
    assert scope["state"].last_stats.bytes_sent > 0


@pytest.mark.slow
def test_readme_snippets_run(tmp_path):
    blocks = python_blocks()
    assert len(blocks) == 6, "a README snippet was added or removed: run it here too"
    run_ranks(_run_snippets, 2, blocks, str(tmp_path))


def test_readme_lightning_snippet_builds_a_trainer_with_the_callback():
    lightning = pytest.importorskip("lightning", reason="the Lightning extra is not installed")
    scope = {"lightning": lightning}
    exec(python_blocks()[1], scope)
    callbacks = [type(c).__name__ for c in scope["trainer"].callbacks]
    assert "GradientCompression" in callbacks
