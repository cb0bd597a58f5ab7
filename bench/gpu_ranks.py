"""Ranks sharing one GPU: every path between ranks, 2 and 4 processes over Gloo on CUDA tensors.

NCCL refuses two ranks on one GPU; Gloo takes CUDA tensors (through the host), so
processes sharing the one GPU of a lent machine run every path of gradcomp that
crosses ranks, each rank with its own streams. Run by ``bench/gpu_check.sh``
(``--dry-run``: CPU tensors, the same code).

For each world size, each path trains a few steps three times on the same data:
compressed on the default backends, compressed with ``GRADCOMP_BACKEND=torch`` (the
specification's ops in torch's kernels), and dense. Checked:

* every rank ends with the same parameters (the replicas agree);
* the default backends give the torch backend's parameters bit for bit (``auto``
  excepted: it plans from measured codec times, which differ between backends);
* the compressed run ends within its bound of the dense one, relative to how far
  the dense one moved.

The paths: the DDP hook (int8, Top-K, auto); FSDP2 with the compressed
reduce-scatter (flat, and hierarchical with ``node_size=1``), the compressed
parameter all-gather, and custom HSDP through the all-reduce hook; CompressedAdam;
DiLoCo. First, every collective kind they use is tried on the device's tensors: a
path that fails with the error of a kind Gloo cannot run there is reported as not
covered, never as passed.

Writes the checks under "ranks" in ``<out>/gpu_check.json``; exits 1 if one fails.

    python bench/gpu_ranks.py --out bench/results
    python bench/gpu_ranks.py --dry-run --out /tmp/gc
"""

from __future__ import annotations

import argparse
import os
import sys

import gpu_setup
import torch
import torch.distributed as dist

import gradcomp
from gradcomp.collectives import c10d
from gradcomp.spawn import run_ranks

WORLD_SIZES = (2, 4)
STEPS = 3
WIDTH = {"cuda": 512, "cpu": 32}
# How far a compressed run may end from the dense one, as a fraction of how far the
# dense one moved from the start (a few steps: a loose bound; a corrupted or swapped
# shard lands far outside it).
BOUNDS = {"int8": 0.1, "topk": 1.5, "auto": 0.5, "int4": 0.5}
PATHS = (
    ("DDP hook, int8", "ddp", "int8"),
    ("DDP hook, topk", "ddp", "topk"),
    ("DDP hook, auto", "ddp", "auto"),
    ("FSDP2 reduce-scatter, int8", "fsdp", "int8"),
    ("FSDP2 hierarchical reduce-scatter, int8", "fsdp hierarchical", "int8"),
    ("FSDP2 parameter all-gather, int8", "fsdp parameters", "int8"),
    ("FSDP2 custom HSDP, int8", "fsdp hsdp", "int8"),
    ("CompressedAdam, int8", "adam", "int8"),
    ("DiLoCo, int4", "diloco", "int4"),
)


# ----------------------------------------------------------------------------- collectives


def collective_kinds(device: torch.device) -> dict[str, str | None]:
    """Every collective kind the paths use, tried once on ``device``'s tensors: kind ->
    None where it ran, else the first line of its error (on every rank alike)."""
    world = dist.get_world_size()
    x = torch.ones(4 * world, device=device)
    kinds = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "broadcast": lambda: dist.broadcast(x.clone(), 0),
        "all_gather_single": lambda: c10d.all_gather_single(torch.empty(4 * world * world, device=device), x),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
        "reduce_scatter_single": lambda: c10d.reduce_scatter_single(torch.empty(4, device=device), x),
        "barrier": dist.barrier,
    }
    found = {}
    for kind, run in kinds.items():
        try:
            run()
            found[kind] = None
        except (RuntimeError, NotImplementedError, ValueError) as error:
            found[kind] = str(error).strip().splitlines()[0][:200]
    gpu_setup.synchronize(device)
    return found


def not_covered(error: BaseException, kinds: dict[str, str | None]) -> str | None:
    """The kind Gloo cannot run on these tensors that ``error`` (or its cause) comes
    from, or None."""
    text = repr(error)
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
        text += repr(error)
    return next((kind for kind, message in kinds.items() if message and message in text), None)


# ----------------------------------------------------------------------------- the paths


def mlp(width: int, device: torch.device) -> torch.nn.Sequential:
    """Four Linear layers of ``width``, the same weights on every rank."""
    generator = torch.Generator().manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(4)]
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) / width**0.5)
    return torch.nn.Sequential(*layers).to(device)


def batches(rank: int, width: int, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(16, width, generator=generator).to(device) for _ in range(STEPS)]


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """The whole model's parameters on the host (an FSDP2 model's gathered from its shards)."""
    parts = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(full.detach().reshape(-1).float().cpu())
    return torch.cat(parts)


def train_ddp(compressor: str | None, model, data) -> None:
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)
    if compressor is not None:
        gradcomp.ddp.register(ddp, compressor, min_numel=0)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x in data:
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        optimizer.step()


def train_fsdp(how: str, compressor: str | None, model, data, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    replicate = None
    if how == "fsdp hsdp":
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        shard_mesh, replicate = mesh["shard"], mesh["replicate"].get_group()
    else:
        shard_mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    if compressor is not None:
        if how == "fsdp hsdp":
            gradcomp.fsdp.register(model, compressor, replicate_group=replicate)
        elif how == "fsdp parameters":
            gradcomp.fsdp.register(model, "bf16", parameters=compressor)
        elif how == "fsdp hierarchical":
            gradcomp.fsdp.register(model, compressor, scatter_algorithm="hierarchical", node_size=1)
        else:
            gradcomp.fsdp.register(model, compressor, residual="fp32")
    elif replicate is not None:  # dense custom HSDP: the replicas' mean by torch's all-reduce

        def mean(output: torch.Tensor) -> None:
            dist.all_reduce(output, group=replicate)
            output.div_(dist.get_world_size(replicate))

        for unit in (*model, model):
            unit.set_all_reduce_hook(mean)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def train_adam(compressor: str | None, model, data) -> None:
    # Dense: the same optimizer exchanging its updates uncompressed (a frozen second
    # moment moves the parameters otherwise than AdamW, whatever the compressor).
    optimizer = gradcomp.optim.CompressedAdam(
        model.parameters(), lr=1e-2, compressor=compressor or "none", warmup_steps=1
    )
    for x in data:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def train_diloco(compressor: str | None, model, data) -> None:
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = gradcomp.DiLoCo(model, inner, sync_every=STEPS, compressor=compressor or "none")
    for x in data:
        model(x).square().mean().backward()
        inner.step()
        inner.zero_grad()
        outer.step()


def train(path: str, compressor: str | None, rank: int, device: torch.device, backend: str | None):
    """``path``'s parameters after ``STEPS`` steps (``compressor`` None: dense), on ``backend``."""
    if backend is None:
        os.environ.pop("GRADCOMP_BACKEND", None)
    else:
        os.environ["GRADCOMP_BACKEND"] = backend
    model, data = mlp(WIDTH[device.type], device), batches(rank, WIDTH[device.type], device)
    try:
        if path == "ddp":
            train_ddp(compressor, model, data)
        elif path.startswith("fsdp"):
            train_fsdp(path, compressor, model, data, device)
        elif path == "adam":
            train_adam(compressor, model, data)
        else:
            train_diloco(compressor, model, data)
        gpu_setup.synchronize(device)
        return flat_parameters(model)
    finally:
        os.environ.pop("GRADCOMP_BACKEND", None)
        gradcomp.collectives.release_queues()


def replicas_agree(parameters: torch.Tensor, device: torch.device) -> bool:
    mine = parameters.to(device)
    first = mine.clone()
    dist.broadcast(first, 0)
    same = torch.tensor([float(torch.equal(first, mine))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def check_path(path: str, compressor: str, rank: int, device: torch.device) -> dict:
    start = flat_parameters(mlp(WIDTH[device.type], device))
    compressed = train(path, compressor, rank, device, None)
    dense = train(path, None, rank, device, None)
    moved = (dense - start).norm().item()
    distance = (compressed - dense).norm().item() / max(moved, 1e-30)
    result = {
        "replicas agree": replicas_agree(compressed, device),
        "distance to dense / dense's move": distance,
        "within bound": distance <= BOUNDS[compressor],
    }
    checks = [result["replicas agree"], result["within bound"]]
    if compressor != "auto":
        reference = train(path, compressor, rank, device, "torch")
        difference = (compressed - reference).abs().max().item()
        result["max |default - torch backend|"] = difference
        checks.append(difference == 0.0)
    result["ok"] = all(checks)
    return result


def _paths_on_rank(rank: int, world_size: int, device_type: str) -> dict:
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # every rank on the one GPU
    kinds = collective_kinds(device)
    results = {"collectives Gloo cannot run here": {k: v for k, v in kinds.items() if v}}
    for name, path, compressor in PATHS:
        try:
            results[name] = check_path(path, compressor, rank, device)
        except Exception as error:  # noqa: BLE001 - recorded; the next path still runs
            kind = not_covered(error, kinds)
            if kind is None:
                raise
            results[name] = {"covered": False, "why": f"Gloo cannot run {kind} on {device.type} tensors"}
            gradcomp.collectives.release_queues()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu_setup.add_options(parser)
    args = parser.parse_args(argv)
    device = gpu_setup.device_for(args.dry_run)
    settings = {"world sizes": WORLD_SIZES, "steps": STEPS, "width": WIDTH[device.type], "bounds": BOUNDS}
    report = gpu_setup.Report(args.out, "ranks", device, settings)
    for world in WORLD_SIZES:
        with report.check(f"{world} ranks, Gloo on {device.type.upper()} tensors") as entry:
            results = run_ranks(_paths_on_rank, world, device.type, timeout=300, group_timeout=120)
            entry.update(results)
            paths = [results[name] for name, _, _ in PATHS]
            entry["not covered"] = [name for name, _, _ in PATHS if results[name].get("covered") is False]
            entry["ok"] = all(result.get("ok", result.get("covered") is False) for result in paths)
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
