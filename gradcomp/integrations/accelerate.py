"""gradcomp with Hugging Face accelerate: the hook on what ``prepare`` returns, each
rank's residuals in ``save_state``.

``accelerator.prepare(model)`` wraps the model in ``DistributedDataParallel``
(or shards it with FSDP2) on several processes: :func:`register` compresses
what it returns. accelerate's ``register_for_checkpointing`` saves the main
process's state only, and residuals differ between ranks:
:func:`checkpoint_residuals` has every rank write its own file into the folder
``save_state`` writes, and read it back in ``load_state``.

Example:
    >>> accelerator = Accelerator()  # on CPUs, Accelerator(cpu=True)
    >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    >>> state = register(accelerator, model, "int8")  # residuals in save_state too
    >>> for batch in loader:
    ...     with accelerator.accumulate(model):  # sends once per optimizer step
    ...         accelerator.backward(loss_fn(model(batch)))
    ...         optimizer.step(); optimizer.zero_grad()
    >>> accelerator.save_state("checkpoint")  # later: accelerator.load_state("checkpoint")
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from gradcomp import ddp, fsdp
from gradcomp.ddp.checkpoint import check_missing_residuals
from gradcomp.integrations import common


def register(
    accelerator, model: torch.nn.Module, compressor="int8", missing_residuals: str = "raise", **options
):
    """Compress the gradient exchange of ``model``, what ``accelerator.prepare`` returned,
    and keep every rank's residuals in the accelerator's checkpoints
    (:func:`checkpoint_residuals`); the state.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: what ``prepare`` returned: a ``DistributedDataParallel`` (compiled or not)
            or, under accelerate's FSDP2 plugin, the sharded model.
        compressor: a compressor name or object, or ``"auto"`` (DDP).
        missing_residuals: what ``load_state`` does with a checkpoint that holds no
            gradcomp state (saved by a dense run): ``"raise"`` (default) refuses it;
            ``"zero"`` warns and begins compressing from it, residuals at zero.
        **options: :func:`gradcomp.ddp.register`'s options (:func:`gradcomp.fsdp.register`'s
            under FSDP2), the hook's and the compressor's.

    Returns:
        The :class:`gradcomp.ddp.HookState`, or the :class:`gradcomp.fsdp.FSDPState` under FSDP2.

    Raises:
        ValueError: an option that neither the hook nor the compressor takes.
        RuntimeError: accelerate did not set up a distributed run (several processes on
            CPUs without ``Accelerator(cpu=True)``, or one process), or DeepSpeed, which
            exchanges gradients itself.

    Example:
        >>> state = register(accelerator, model, "int8", warmup_steps=10)
    """
    from accelerate.utils import DistributedType

    check_missing_residuals(missing_residuals)
    kind = accelerator.distributed_type
    sharded = kind == DistributedType.FSDP
    hook_options = common.FSDP_OPTIONS if sharded else common.DDP_OPTIONS
    common.check_options(
        compressor, options, hook_options, "gradcomp.integrations.accelerate.register", ("missing_residuals",)
    )
    if kind == DistributedType.NO:
        launched = common.launched_processes()
        raise RuntimeError(
            f"{launched} processes were launched (WORLD_SIZE) but accelerate did not set up distributed "
            "training (distributed_type NO), so each would train alone: on CPUs pass Accelerator(cpu=True) "
            "(or set ACCELERATE_USE_CPU=true)"
            if launched > 1
            else "accelerate runs one process (distributed_type NO): there is no gradient exchange to "
            "compress; launch several (accelerate launch, torchrun)"
        )
    if kind == DistributedType.DEEPSPEED:
        raise RuntimeError(
            "gradcomp compresses DDP's and FSDP2's gradient exchange; DeepSpeed exchanges gradients itself"
        )
    model = common.uncompiled(model)  # accelerate compiles the DDP it built (TorchDynamoPlugin)
    if sharded and isinstance(model, FSDPModule):
        state = fsdp.register(model, compressor, **options)
    else:
        state = ddp.register(model, compressor, **options)
    checkpoint_residuals(accelerator, state, missing_residuals)
    return state


def checkpoint_residuals(accelerator, state, missing_residuals: str = "raise") -> None:
    """Save ``state`` (a :class:`gradcomp.ddp.HookState` or :class:`gradcomp.fsdp.FSDPState`)
    with every ``accelerator.save_state`` and restore it with every ``load_state``, each
    rank its own file (``gradcomp_rank{r}.pt``) in the checkpoint's folder; a folder of
    another world size is refused on loading, and one without them as
    ``missing_residuals`` says (:func:`gradcomp.ddp.load_rank_file`): ``"raise"``
    (default) or ``"zero"`` (begin compressing from it, residuals at zero). :func:`register`
    calls it."""
    check_missing_residuals(missing_residuals)
    accelerator.register_save_state_pre_hook(
        lambda models, weights, folder: ddp.save_rank_file(state, folder)
    )
    accelerator.register_load_state_pre_hook(
        lambda models, folder: ddp.load_rank_file(state, folder, missing_residuals)
    )
