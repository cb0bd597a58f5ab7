"""The small model and task the DDP tests train, and how they train it."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: F401 (for the tests)

BUCKET_MB = 0.02  # one bucket per hidden layer of the model below


def make_model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(32, 128), torch.nn.ReLU()]
    for _ in range(5):
        layers += [torch.nn.Linear(128, 128), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(128, 10)).to(dtype)
    torch.random.set_rng_state(generator_state)
    return model


def batches(rank: int, world_size: int, steps: int, batch: int = 32):
    """A learnable task: labels are the argmax of a fixed linear map; each rank its own shard."""
    generator = torch.Generator().manual_seed(42)
    teacher = torch.randn(32, 10, generator=generator)
    for _ in range(steps):
        inputs = torch.randn(batch * world_size, 32, generator=generator)
        labels = (inputs @ teacher).argmax(dim=1)
        yield inputs[rank::world_size], labels[rank::world_size]


def train(model, rank, world_size, steps, dtype=torch.float32, lr=3e-3, accumulate=1):
    # Adam's eps underflows in pure 16-bit parameters; plain SGD does not.
    if dtype == torch.float32:
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    data = list(batches(rank, world_size, steps * accumulate))
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulate):
            inputs, labels = data[step * accumulate + micro]
            # DDP reads no_sync() in forward: it must wrap forward and backward.
            context = model.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
            with context:
                loss = torch.nn.functional.cross_entropy(model(inputs.to(dtype)).float(), labels)
                loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def flat_parameters(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
