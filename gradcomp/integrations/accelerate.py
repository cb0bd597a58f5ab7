"""gradcomp with Hugging Face accelerate: each rank's residuals in ``save_state``.

``accelerator.prepare(model)`` wraps the model in ``DistributedDataParallel``
on several processes: register gradcomp's hook on what it returns. accelerate's
``register_for_checkpointing`` saves the main process's state only, and residuals
differ between ranks: :func:`checkpoint_residuals` has every rank write its own
file into the folder ``save_state`` writes, and read it back in ``load_state``.

Example:
    >>> accelerator = Accelerator()
    >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    >>> state = gradcomp.ddp.register(model, "int8")
    >>> checkpoint_residuals(accelerator, state)
    >>> for batch in loader:
    ...     with accelerator.accumulate(model):  # sends once per optimizer step
    ...         accelerator.backward(loss_fn(model(batch)))
    ...         optimizer.step(); optimizer.zero_grad()
    >>> accelerator.save_state("checkpoint")  # later: accelerator.load_state("checkpoint")
"""

from __future__ import annotations

from gradcomp import ddp


def checkpoint_residuals(accelerator, state) -> None:
    """Save ``state`` (a :class:`gradcomp.ddp.HookState` or :class:`gradcomp.fsdp.FSDPState`)
    with every ``accelerator.save_state`` and restore it with every ``load_state``, each
    rank its own file (``gradcomp_rank{r}.pt``) in the checkpoint's folder; a folder of
    another world size, or without them, is refused on loading."""
    accelerator.register_save_state_pre_hook(
        lambda models, weights, folder: ddp.save_rank_file(state, folder)
    )
    accelerator.register_load_state_pre_hook(lambda models, folder: ddp.load_rank_file(state, folder))
