"""Ranks sharing one GPU: every path between ranks, 2 and 4 processes over Gloo on CUDA tensors.

NCCL refuses two ranks on one GPU; Gloo takes CUDA tensors (through the host), so
processes sharing the one GPU of a lent machine run every path of gradcomp that
crosses ranks, each rank with its own streams. Run by ``bench/gpu_check.sh``
(``--dry-run``: CPU tensors, the same code).

For each world size, each path trains a few steps compressed on the default
backends; at 2 ranks also with ``GRADCOMP_BACKEND=torch`` (the specification's ops
in torch's kernels); and each kind of training once dense (plain DDP stands for the
dense DDP and FSDP2 paths: the same SGD on the ranks' mean gradient). Checked:

* every rank ends with the same parameters (the replicas agree);
* the default backends give the torch backend's parameters bit for bit (``auto``
  excepted: it plans from measured codec times, which differ between backends);
* the compressed run ends within its bound of the dense one, relative to how far
  the dense one moved.

Each path's result is saved as it ends; a rank that crashes costs its path alone
(``gpu_setup.run_items``), and a path the section's time (``SECONDS``, shared
between the world sizes by ``TIME_SHARE``) left no room for is reported as not
run. FSDP2's parameters are gathered on the host, never by ``full_tensor()`` (see
:func:`full_parameter`).

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

import sys
import time

import torch
import torch.distributed as dist
from lib import gpu_setup

import gradcomp
from gradcomp.collectives import c10d

WORLD_SIZES = (2, 4)
# The part of the section's time (SECONDS) by which each world size has begun its
# paths; 2 ranks have more paths to run (the torch backend's too).
TIME_SHARE = {2: 0.55, 4: 1.0}
# The world sizes whose paths also run on the torch backend (the compare section takes
# the backends at 1 and 2 ranks; the identity section every rank's bits at 4).
REFERENCE_WORLD_SIZES = (2,)
STEPS = 3
WIDTH = {"cuda": 512, "cpu": 32}
# Begin no path after this; the section's own limit in bench/gpu_check.sh is 100 s: this
# leaves room for a path begun just before it ends.
SECONDS = 85
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
# The dense training each path is measured against.
DENSE = {"adam": "adam", "diloco": "diloco"}  # every other path: "ddp"
KINDS = "collectives Gloo cannot run here"


# ----------------------------------------------------------------------------- collectives


def collective_kinds(device: torch.device) -> dict[str, str | None]:
    """Every collective kind the paths use, tried once on ``device``'s tensors: kind ->
    None where it ran, else the first line of its error (on every rank alike). Not the
    coalesced all-gather: Gloo's kills the process on CUDA tensors, and no path takes
    it (:func:`full_parameter`)."""
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
    return gpu_setup.seeded(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])).to(
        device
    )


def batches(rank: int, width: int, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(16, width, generator=generator).to(device) for _ in range(STEPS)]


def full_parameter(p: torch.Tensor) -> torch.Tensor:
    """``p`` whole on the host, flat, fp32; an FSDP2 parameter's shards gathered on CPU.

    Not ``p.full_tensor()``: a DTensor redistributes through funcol's
    ``all_gather_single``, the op ``_c10d_functional.all_gather_into_tensor``, which
    torch's C++ issues as a coalesced all-gather of one tensor (Functional.cpp:
    ``all_gather_into_tensor_coalesced`` -> ``ProcessGroup::allgather_into_tensor_coalesced``).
    Gloo's (``ProcessGroupGloo::allgather_coalesced``) has no CUDA work: it hands the
    device pointers to gloo's host all-gather, which kills the process
    (pytorch/pytorch#152645). The host copies of the shards go through Gloo's plain
    all-gather into one tensor instead.
    """
    if not hasattr(p, "to_local"):
        return p.detach().reshape(-1).float().cpu()
    (placement,) = p.placements  # FSDP2 without a replicate dimension: one mesh dimension
    assert placement.is_shard(0), placement
    group = p.device_mesh.get_group()
    world = dist.get_world_size(group)
    rows = -(-p.shape[0] // world)  # torch.chunk's rows a rank, as FSDP2 shards: the last ones fewer
    local = p.to_local().detach().float().cpu()
    padded = torch.zeros((rows, *p.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = torch.empty((world * rows, *p.shape[1:]))
    c10d.all_gather_single(gathered, padded, group=group)
    return gathered[: p.shape[0]].reshape(-1)


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """The whole model's parameters on the host (an FSDP2 model's gathered from its shards)."""
    return torch.cat([full_parameter(p) for p in model.parameters()])


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
    model, data = mlp(WIDTH[device.type], device), batches(rank, WIDTH[device.type], device)
    with gpu_setup.forced_backend(backend):
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


def replicas_agree(parameters: torch.Tensor) -> bool:
    """Whether every rank holds ``parameters`` (on the host) bit for bit."""
    first = parameters.clone()
    dist.broadcast(first, 0)
    same = torch.tensor([float(torch.equal(first, parameters))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def check_path(path: str, compressor: str, rank: int, device: torch.device, dense_runs: dict) -> dict:
    """``path`` with ``compressor`` against its dense training (kept in ``dense_runs``,
    run on first need) and, at the reference world sizes, the torch backend."""
    start = flat_parameters(mlp(WIDTH[device.type], device))
    compressed = train(path, compressor, rank, device, None)
    dense_path = DENSE.get(path, "ddp")
    if dense_path not in dense_runs:
        dense_runs[dense_path] = train(dense_path, None, rank, device, None)
    dense = dense_runs[dense_path]
    moved = (dense - start).norm().item()
    distance = (compressed - dense).norm().item() / max(moved, 1e-30)
    result = {
        "replicas agree": replicas_agree(compressed),
        "distance to dense / dense's move": distance,
        "within bound": distance <= BOUNDS[compressor],
    }
    checks = [result["replicas agree"], result["within bound"]]
    if compressor != "auto" and dist.get_world_size() in REFERENCE_WORLD_SIZES:
        reference = train(path, compressor, rank, device, "torch")
        difference = (compressed - reference).abs().max().item()
        result["max |default - torch backend|"] = difference
        checks.append(difference == 0.0)
    result["ok"] = all(checks)
    return result


def _paths_on_rank(rank: int, world_size: int, names: list[str], progress, device_type: str) -> None:
    device = gpu_setup.rank_device(device_type)
    kinds = collective_kinds(device)
    progress.end(KINDS, {k: v for k, v in kinds.items() if v})
    paths = {name: (path, compressor) for name, path, compressor in PATHS}
    dense_runs = {}
    for name in names:
        if not progress.begin(name):
            return
        try:
            result = check_path(*paths[name], rank, device, dense_runs)
        except Exception as error:  # noqa: BLE001 - recorded where Gloo is the cause; else the path fails
            kind = not_covered(error, kinds)
            if kind is None:
                raise
            result = {"covered": False, "why": f"Gloo cannot run {kind} on {device.type} tensors"}
            gradcomp.collectives.release_queues()
        progress.end(name, result)


def main(argv=None) -> int:
    args = gpu_setup.parser(__doc__).parse_args(argv)
    device = gpu_setup.device_for(args.dry_run)
    settings = {
        "world sizes": WORLD_SIZES,
        "torch backend compared at": REFERENCE_WORLD_SIZES,
        "steps": STEPS,
        "width": WIDTH[device.type],
        "bounds": BOUNDS,
        "seconds": SECONDS,
    }
    report = gpu_setup.Report(args.out, "ranks", device, settings)
    began, names = time.time(), [name for name, _, _ in PATHS]
    for world in WORLD_SIZES:
        name = f"{world} ranks, Gloo on {device.type.upper()} tensors"
        with report.check(name) as entry:
            deadline = began + SECONDS * TIME_SHARE[world]
            saved = gpu_setup.items_on_ranks(
                report, name, deadline, _paths_on_rank, world, names, device.type
            )
            results = {path: saved[path] for path in names}
            entry["not covered"] = [path for path, r in results.items() if r.get("covered") is False]
            entry["ok"] = all(r.get("ok", r.get("covered") is False) for r in results.values())
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
