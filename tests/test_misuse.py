"""What a new user gets wrong is said, in time, on Gloo ranks: a call made on one rank
only, a second fsdp.register, replicas nothing reduces between, CompressedAdam
beside DDP's own all-reduce, a model registered that nothing wrapped in DDP."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradcomp
from gradcomp.optim import CompressedAdam
from tests.utils import run_ranks

TIMEOUT = 4.0  # the group's: the user's timeout, which bounds every wait below


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _registered_on_rank_0_only(rank: int, world: int, what: str) -> tuple[str, float]:
    started = time.monotonic()
    if what == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(_model())
        try:
            if rank == 0:
                gradcomp.ddp.register(model, "int8", min_numel=0)
            model(torch.randn(8, 32)).sum().backward()  # rank 1: DDP's own all-reduce, alone
        except RuntimeError as error:
            return str(error), time.monotonic() - started
    elif rank == 0:
        try:
            CompressedAdam(_model().parameters(), compressor="sign")
        except RuntimeError as error:
            return str(error), time.monotonic() - started
    else:
        time.sleep(TIMEOUT + 2)  # rank 1 goes on without one; the store stays up on rank 0
    return "", time.monotonic() - started


@pytest.mark.slow
@pytest.mark.parametrize("what", ["ddp", "adam"])
def test_a_call_made_on_one_rank_only_is_named_within_the_users_timeout(what):
    message, seconds = run_ranks(_registered_on_rank_0_only, 2, what, group_timeout=TIMEOUT)
    assert "ranks [1] of the group [0, 1] did not call it" in message, message
    assert "gradcomp.ddp.register" in message if what == "ddp" else "CompressedAdam" in message
    assert seconds < TIMEOUT + 3


def _misused_fsdp(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for layer in model:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    with pytest.warns(UserWarning, match=r"shard groups \[\(0, 1\), \(2, 3\)\] each hold this model"):
        gradcomp.fsdp.register(model, "int8")
    with pytest.raises(RuntimeError, match="already called on this model"):
        gradcomp.fsdp.register(model, "int8")
    # With the replicas' group, nothing to warn about.
    again = _model()
    for layer in again:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(again, mesh=mesh["shard"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradcomp.fsdp.register(again, "int8", replicate_group=mesh["replicate"].get_group())


@pytest.mark.slow
def test_fsdp_replicas_nothing_reduces_between_warn_and_a_second_register_raises():
    run_ranks(_misused_fsdp, 4)


def _adam_beside_ddp(rank: int, world: int) -> None:
    inputs = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    model = torch.nn.parallel.DistributedDataParallel(_model())
    adam = CompressedAdam(model.parameters(), compressor="sign", warmup_steps=2)
    model(inputs).sum().backward()  # DDP all-reduces, dense
    with pytest.warns(UserWarning, match="all-reduced them already"):
        adam.step()
    adam.zero_grad()
    # Under no_sync the gradients are each rank's own: nothing to warn about.
    fine = torch.nn.parallel.DistributedDataParallel(_model())
    adam = CompressedAdam(fine.parameters(), compressor="sign", warmup_steps=2)
    with fine.no_sync():
        fine(inputs).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adam.step()
    dist.barrier()


@pytest.mark.slow
def test_compressed_adam_beside_ddps_own_all_reduce_warns():
    run_ranks(_adam_beside_ddp, 2)


def test_register_on_a_model_nothing_wrapped_says_why_and_what_to_do(monkeypatch):
    # Launched as one of 2 ranks (torchrun's WORLD_SIZE) but nothing set up torch.distributed:
    # accelerate on CPUs without Accelerator(cpu=True), a Trainer without use_cpu=True.
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TypeError) as raised:
        gradcomp.ddp.register(_model(), "int8")
    message = str(raised.value)
    assert message.startswith("gradcomp.ddp.register needs a DistributedDataParallel model, got Sequential")
    assert "one of WORLD_SIZE=2 ranks, but torch.distributed is not initialized" in message
    assert "Accelerator(cpu=True)" in message and "TrainingArguments(use_cpu=True)" in message
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(TypeError, match="torch.distributed is not initialized. Launch the ranks"):
        gradcomp.ddp.register(_model(), "int8")


def _registered_unwrapped(rank: int, world: int) -> list[str]:
    said = []
    for launched in ("2", "1"):
        os.environ["WORLD_SIZE"] = launched  # this process's own environment
        with pytest.raises(TypeError) as raised:
            gradcomp.ddp.register(_model(), "int8")
        said.append(str(raised.value))
    return said


@pytest.mark.slow
def test_register_on_one_rank_of_a_launch_of_two_says_its_group_has_one_rank():
    launched_two, alone = run_ranks(_registered_unwrapped, 1)
    assert "one of WORLD_SIZE=2 ranks, but its process group has 1 rank" in launched_two
    assert alone.endswith(
        "wrap it first, DistributedDataParallel(model), or register on the model a framework wrapped"
    )
