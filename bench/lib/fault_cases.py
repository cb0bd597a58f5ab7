"""The fault matrix's cases on ranks: disagreeing settings, dead and stalled peers,
uneven DiLoCo, NaN gradients, a rank killed in the shared-memory set-up.

A case returns a :class:`~lib.fault_ranks.Row`; rank bodies are module functions (the
ranks are spawned processes) and return JSON.
"""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import warnings

import torch

import gradcomp
from lib import fault_ranks
from lib.fault_ranks import (
    HANG,
    LEAKED,
    RAISED_EVERYWHERE,
    SILENT,
    SKIPPED,
    SURVIVORS_RAISED,
    UNCLEAR,
    Row,
    digest,
    every_rank_raises,
    logged_warnings,
    mark,
    started,
)

# ----------------------------------------------------------------------------- disagreeing ranks


def _disagree(rank, world_size, directory, agreed, mine):
    """Every rank runs the ``agreed`` calls (name, options) in turn, then its own: ``mine[rank]``."""
    x = torch.arange(4096, dtype=torch.float32).sin() * (rank + 1)
    for name, options in agreed:
        gradcomp.all_reduce(x.clone(), name, **options)
    name, options = mine[rank]
    mark(directory, rank)
    y = x.clone()
    gradcomp.all_reduce(y, name, **options)
    return digest([y])


DISAGREEMENTS = {
    "settings, both used before": ([("int4", {}), ("qsgd", {})], [("int4", {}), ("qsgd", {})]),
    "wire size, both used before": ([("int8", {}), ("int4", {})], [("int8", {}), ("int4", {})]),
    "wire size, first use": ([], [("int8", {}), ("int4", {})]),
    "random-K step per rank": ([], [("randk@0.1", {"step": 0}), ("randk@0.1", {"step": 1})]),
    "random-K name per rank": ([], [("randk@0.1", {"name": "a"}), ("randk@0.1", {"name": "b"})]),
    "Top-K ratio per rank": ([], [("topk@0.01", {}), ("topk@0.02", {})]),
}


def disagreement(label: str, timeout: float) -> Row:
    agreed, mine = DISAGREEMENTS[label]
    with tempfile.TemporaryDirectory() as directory:
        endings = fault_ranks.run(_disagree, 2, (directory, agreed, mine), 3 * timeout, timeout)
        outcome, seconds, detail = every_rank_raises(endings, started(directory))
    fault = ", ".join(f"rank {r} {name} {options or ''}".strip() for r, (name, options) in enumerate(mine))
    return Row(f"ranks disagree: {label}", fault, RAISED_EVERYWHERE, outcome, seconds, detail)


# ----------------------------------------------------------------------------- dead and stalled peers


def _train_and_fail(rank, world_size, directory, signal_number, at_step):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    model = torch.nn.parallel.DistributedDataParallel(net)
    gradcomp.ddp.register(model, "int8")
    generator = torch.Generator().manual_seed(rank)
    for step in range(at_step + 50):
        if rank == world_size - 1 and step == at_step:
            mark(directory, rank)
            os.kill(os.getpid(), signal_number)
        model(torch.randn(32, 64, generator=generator)).square().mean().backward()
    return "trained past the fault"


def dead_peer(signal_number: int, timeout: float) -> Row:
    name = signal.Signals(signal_number).name
    with tempfile.TemporaryDirectory() as directory:
        endings = fault_ranks.run(
            _train_and_fail, 3, (directory, signal_number, 5), 6 * timeout, timeout, awaited=2
        )
        survivors = endings[:-1]
        outcome, seconds, detail = every_rank_raises(survivors, started(directory))
    if outcome == RAISED_EVERYWHERE:
        outcome = SURVIVORS_RAISED if seconds <= timeout + 5 else HANG
    stopped = "stopped (SIGSTOP)" if signal_number == signal.SIGSTOP else "killed (SIGKILL)"
    return Row(
        f"peer {stopped} during a step",
        f"DDP int8 hook, 3 ranks, rank 2 {name} at step 5",
        f"{SURVIVORS_RAISED} within the group timeout ({timeout:.0f} s)",
        outcome,
        seconds,
        detail,
    )


# ----------------------------------------------------------------------------- training loops


def _uneven_diloco(rank, world_size, directory):
    torch.manual_seed(0)
    net = torch.nn.Linear(32, 8)
    inner = torch.optim.SGD(net.parameters(), lr=0.01)
    outer = gradcomp.DiLoCo(net, inner, sync_every=4, compressor="int8")
    generator = torch.Generator().manual_seed(rank)
    for _ in range(6 + rank):  # an uneven shard: rank 1 has one batch more
        net(torch.randn(8, 32, generator=generator)).square().mean().backward()
        inner.step()
        inner.zero_grad()
        outer.step()
    mark(directory, rank)
    outer.synchronize()
    return digest(net.parameters())


def uneven_diloco(timeout: float) -> Row:
    with tempfile.TemporaryDirectory() as directory:
        endings = fault_ranks.run(_uneven_diloco, 2, (directory,), 3 * timeout, timeout)
        outcome, seconds, detail = every_rank_raises(endings, started(directory))
    return Row(
        "DiLoCo ranks synchronise at other steps",
        "rank 0 at step 6, rank 1 at step 7",
        RAISED_EVERYWHERE,
        outcome,
        seconds,
        detail[:160],
    )


def _nan_gradient(rank, world_size, directory, optimizer):
    torch.manual_seed(0)
    net = torch.nn.Linear(32, 8)
    if optimizer == "CompressedAdam":
        inner = gradcomp.optim.CompressedAdam(net.parameters(), lr=1e-2, warmup_steps=2)
        outer = None
    else:
        inner = torch.optim.SGD(net.parameters(), lr=0.01)
        outer = gradcomp.DiLoCo(net, inner, sync_every=2, compressor="int8")
    generator = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught, logged_warnings() as logged:
        warnings.simplefilter("always")
        for step in range(6):
            net(torch.randn(8, 32, generator=generator)).square().mean().backward()
            if rank == 1 and step == 3:
                mark(directory, rank)
                net.weight.grad[0, 0] = float("nan")
            inner.step()
            inner.zero_grad()
            if outer is not None:
                outer.step()
    finite = all(bool(p.isfinite().all()) for p in net.parameters())
    return {"finite": finite, "digest": digest(net.parameters()), "warned": bool(caught or logged)}


def nan_gradient(optimizer: str, timeout: float) -> Row:
    with tempfile.TemporaryDirectory() as directory:
        endings = fault_ranks.run(_nan_gradient, 2, (directory, optimizer), 3 * timeout, timeout)
        outcome, seconds, detail = every_rank_raises(endings, started(directory))
    if outcome == SILENT:  # every rank returned: a skip is safe only if it was said and left equal replicas
        values = [e.value for e in endings]
        equal = len({v["digest"] for v in values}) == 1
        if all(v["finite"] for v in values) and equal:
            outcome = SKIPPED if all(v["warned"] for v in values) else UNCLEAR
        finite, warned = [v["finite"] for v in values], [v["warned"] for v in values]
        detail = f"finite {finite}, equal replicas {equal}, warned {warned}"
    return Row(
        f"NaN gradient under {optimizer}",
        "rank 1's gradient NaN at step 3",
        f"{SKIPPED} or {RAISED_EVERYWHERE}",
        outcome,
        seconds,
        detail[:160],
    )


# ----------------------------------------------------------------------------- shared memory


def _hierarchical_kill(rank, world_size, directory):
    x = torch.ones(1 << 20)
    if rank == world_size - 1:  # killed as it maps the node's shared file, after local rank 0 made it

        def killed(*args, **kwargs):
            mark(directory, rank)
            os.kill(os.getpid(), signal.SIGKILL)

        torch.from_file = killed
    gradcomp.all_reduce(x, "int8", algorithm="hierarchical", node_size=2)
    return "reduced"


def shared_memory_kill(timeout: float) -> Row:
    pattern = "/dev/shm/gradcomp-*"
    before = set(glob.glob(pattern))
    with tempfile.TemporaryDirectory() as directory:
        endings = fault_ranks.run(_hierarchical_kill, 4, (directory,), 6 * timeout, timeout, awaited=3)
        outcome, seconds, detail = every_rank_raises(endings[:3], started(directory))
    leaked = sorted(set(glob.glob(pattern)) - before)
    for path in leaked:
        os.remove(path)
    if outcome == RAISED_EVERYWHERE:
        outcome = SURVIVORS_RAISED if not leaked else LEAKED
        detail = f"left {', '.join(leaked)}" if leaked else detail
    return Row(
        "peer killed in the shared-memory set-up",
        "hierarchical int8, 2 nodes of 2, rank 3 SIGKILL as it maps the file",
        f"{SURVIVORS_RAISED}, nothing left in /dev/shm",
        outcome,
        seconds,
        detail[:160],
    )
