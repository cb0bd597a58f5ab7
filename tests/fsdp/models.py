"""The model, meshes and batches the FSDP2 tests shard and train, and how they hold
the gradients: against an unsharded copy, and across a group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

BATCH = 8


WIDTHS = (16, 256, 256, 4)  # shards of thousands of elements: whole blocks matter little


def net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for inputs, outputs in zip(WIDTHS, WIDTHS[1:], strict=False):
        layers += [torch.nn.Linear(inputs, outputs), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def sharded(mesh, mp_policy=None) -> torch.nn.Sequential:
    model = net()
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def meshes(world: int, hsdp: bool):
    """(the mesh each unit is sharded on, the replicate group or None)."""
    if not hsdp:
        return init_device_mesh("cpu", (world,)), None
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return mesh["shard"], mesh["replicate"].get_group()


def batches(step: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(world)]


def reference_grads(reference: torch.nn.Module, batches) -> list[torch.Tensor]:
    """The gradient of the mean of every rank's loss, on an unsharded copy."""
    reference.zero_grad()
    loss = sum(torch.nn.functional.mse_loss(reference(x), y) for x, y in batches) / len(batches)
    loss.backward()
    return [p.grad.clone() for p in reference.parameters()]


def grad_error(model: torch.nn.Module, expected: list[torch.Tensor]) -> float:
    """The relative error of the model's gradients, all parameters together."""
    full = torch.cat([p.grad.full_tensor().float().reshape(-1) for p in model.parameters()])
    expected = torch.cat([e.reshape(-1) for e in expected])
    return ((full - expected).norm() / expected.norm()).item()


def local_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.to_local().reshape(-1).float() for p in model.parameters()])


def same_in_group(tensor: torch.Tensor, group) -> bool:
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, tensor, group=group)
    return all(torch.equal(t, tensor) for t in everyone)
