"""gradcomp with accelerate (gradcomp.integrations.accelerate) and Lightning Fabric, on 2 Gloo ranks.

The real libraries on CPU ranks: the hook on what ``accelerator.prepare`` and
``fabric.setup`` return, accumulation sending once per optimizer step, and each rank's
residuals through ``save_state`` / ``load_state``: a resumed run ends where the
uninterrupted one does.
"""

from __future__ import annotations

import os

import pytest
import torch

import gradcomp
from tests.utils import run_ranks, same_on_all_ranks

accelerate = pytest.importorskip("accelerate", reason="the transformers extra is not installed")

STEPS, ACCUMULATE = 6, 2


def _environment(rank: int, world: int) -> None:
    # What torchrun sets: accelerate and Lightning read it (the process group already exists).
    ranks = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world, "NODE_RANK": 0}
    os.environ.update({name: str(value) for name, value in ranks.items()})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))


def _batch(rank: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + micro_step)
    return torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def _fsdp2_accelerator() -> accelerate.Accelerator:
    """An Accelerator with FSDP2 as on GPUs, on CPU ranks.

    accelerate chooses ``DistributedType.FSDP`` only for accelerator ranks
    (``AcceleratorState.__init__`` reads the FSDP plugin inside the branch for
    MULTI_GPU, MULTI_XPU, ...; on CPU it stays MULTI_CPU and wraps in DDP): this sets
    what that branch sets. ``prepare`` (``fully_shard`` of each layer, then the
    model), accumulation and the checkpoints are accelerate's own; sharded, as a full
    state dict's gather fails on Gloo CPU ranks."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="size_based_wrap",
        min_num_params=1000,
        state_dict_type="SHARDED_STATE_DICT",
    )
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE, fsdp_plugin=plugin)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as that branch does
    return accelerator


def _weights(model) -> torch.Tensor:
    """Every parameter whole (gathered from every rank where FSDP2 shards them)."""
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    return torch.cat([p.reshape(-1) for p in whole])


def _accelerated(rank, folder, start, stop, save_at, fsdp2=False, compressor="int8", **options):
    """Optimizer steps ``start`` to ``stop`` with accelerate (``ACCUMULATE`` micro-batches a
    step), compressed with ``compressor`` (None: dense); restored from ``folder`` where
    ``start`` > 0, saved there after ``save_at``."""
    from gradcomp.integrations.accelerate import register

    if fsdp2:
        accelerator = _fsdp2_accelerator()
    else:
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = None
    if compressor is not None:  # FSDP2: the reduce-scatter, with error feedback (residuals to checkpoint)
        settings = dict(residual="fp32") if fsdp2 else dict(min_numel=0)
        state = register(accelerator, model, compressor, **settings, **options)
    if start:
        accelerator.load_state(folder)
    for step in range(start, stop):
        for micro in range(ACCUMULATE):
            inputs, labels = _batch(rank, step * ACCUMULATE + micro)
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.cross_entropy(model(inputs), labels))
                optimizer.step()
                optimizer.zero_grad()
        if step + 1 == save_at:
            accelerator.save_state(folder)
    weights = _weights(model)
    gradcomp.collectives.release_queues()
    return weights, state


def _accelerate_run(rank: int, world: int, root: str, fsdp2: bool) -> None:
    _environment(rank, world)
    folder = os.path.join(root, "checkpoint")
    whole, state = _accelerated(rank, folder, 0, STEPS, save_at=3, fsdp2=fsdp2)
    assert same_on_all_ranks(whole)
    # One exchange an optimizer step, not one a micro-batch.
    assert state.step == STEPS and len(state.stats) == STEPS and state.last_stats.ratio > 3
    assert os.path.exists(os.path.join(folder, f"gradcomp_rank{rank}.pt"))
    resumed, again = _accelerated(rank, folder, 3, STEPS, save_at=None, fsdp2=fsdp2)
    assert again.step == STEPS
    assert torch.equal(whole, resumed), "the resumed run ended elsewhere than the uninterrupted one"


@pytest.mark.slow
@pytest.mark.parametrize("fsdp2", [False, True], ids=["ddp", "fsdp2"])
def test_accelerate_sends_once_a_step_and_resumes_with_every_ranks_residuals(tmp_path, fsdp2):
    run_ranks(_accelerate_run, 2, str(tmp_path), fsdp2)


def _fabric_run(rank: int, world: int, root: str) -> None:
    lightning = pytest.importorskip("lightning")
    from gradcomp.integrations.lightning import register_fabric

    _environment(rank, world)
    fabric = lightning.Fabric(accelerator="cpu", devices=world, strategy="ddp")
    fabric.launch()
    net = _model()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    state = register_fabric(model, "int8", min_numel=0)
    for step in range(3):
        inputs, labels = _batch(rank, step)
        optimizer.zero_grad()
        fabric.backward(torch.nn.functional.cross_entropy(model(inputs), labels))
        optimizer.step()
    assert state.step == 3 and state.last_stats.ratio > 3
    assert same_on_all_ranks(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    gradcomp.ddp.save_rank_file(state, root)
    again = gradcomp.ddp.HookState("int8", min_numel=0)
    gradcomp.ddp.load_rank_file(again, root)
    assert again.step == 3
    with pytest.raises(TypeError, match="on a DDP strategy"):
        register_fabric(_model(), "int8")


def _dense_checkpoint(rank: int, world: int, root: str) -> dict:
    import logging.handlers

    from gradcomp.integrations.lightning import register_fabric

    _environment(rank, world)
    warned = logging.handlers.BufferingHandler(100)
    logging.getLogger("gradcomp.ddp").addHandler(warned)
    folder = os.path.join(root, "dense")
    _accelerated(rank, folder, 0, 3, save_at=3, compressor=None)
    with pytest.raises(FileNotFoundError, match="missing_residuals='zero'"):
        _accelerated(rank, folder, 3, STEPS, save_at=None)
    weights, state = _accelerated(rank, folder, 3, STEPS, save_at=None, missing_residuals="zero")
    assert same_on_all_ranks(weights)
    # Fabric's route: the rank files directly.
    empty = os.path.join(root, "empty")
    again = register_fabric(torch.nn.parallel.DistributedDataParallel(_model()), "int8")
    with pytest.raises(FileNotFoundError, match="missing_residuals='zero'"):
        gradcomp.ddp.load_rank_file(again, empty)
    gradcomp.ddp.load_rank_file(again, empty, missing_residuals="zero")
    warnings = [record.getMessage() for record in warned.buffer]
    return {"steps": state.step, "warnings": sum("residuals at zero" in w for w in warnings)}


@pytest.mark.slow
def test_compression_begins_from_a_dense_checkpoint_only_when_asked(tmp_path):
    assert run_ranks(_dense_checkpoint, 2, str(tmp_path)) == {"steps": 3, "warnings": 2}


def _without_cpu_true(rank: int, world: int) -> None:
    from gradcomp.integrations.accelerate import register

    _environment(rank, world)
    # As under torchrun on CPUs: accelerate joins the process group (it exists here
    # already) but sets up no distributed run, and prepare returns the model as it is.
    accelerator = accelerate.Accelerator()
    assert accelerator.distributed_type == accelerate.utils.DistributedType.NO
    model = accelerator.prepare(_model())
    with pytest.raises(RuntimeError, match=r"2 processes were launched.*Accelerator\(cpu=True\)"):
        register(accelerator, model, "int8")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs, accelerate sets up DDP without cpu=True")
def test_processes_accelerate_did_not_join_are_told_to_pass_cpu_true():
    run_ranks(_without_cpu_true, 2)


@pytest.mark.slow
def test_fabric_registers_on_what_setup_returns(tmp_path):
    run_ranks(_fabric_run, 2, str(tmp_path))
