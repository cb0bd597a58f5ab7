"""Compressed gradients in torchft's fault-tolerant loop: replica groups that die, rejoin and heal.

torchft's :class:`~torchft.Manager` keeps training while replica groups come and go:
each step it forms a quorum, reconfigures its process group to the replicas in it,
and commits the step only if every replica's all-reduce went through. gradcomp's
compressors fit that loop through :class:`Compression`:

* its :meth:`~Compression.all_reduce` runs gradcomp's compressed all-reduce on the
  Manager's process group as the quorum made it, in the caller's thread;
* :meth:`~Compression.should_commit` asks the Manager and keeps the step's
  residuals where the step is committed, puts back those before it where it is not
  (torchft then discards the step, so its error must not count as delivered);
* the heal (a replica that restarts takes its state from a peer) carries the state
  every replica holds alike (PowerSGD's warm start) and zeroes the healed replica's
  residuals: they were its own undelivered gradient, and the model it takes from its
  peer holds everything delivered so far. A peer's residuals copied over would
  deliver that peer's error twice.

:func:`DistributedDataParallel` and :class:`OptimizerWrapper` are torchft's own, with
gradcomp's hook and commit::

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), ...)
    compression = Compression(manager, "int8")
    model = DistributedDataParallel(manager, module, compression)
    optimizer = OptimizerWrapper(manager, torch.optim.AdamW(model.parameters()), compression)
    for batch in batches:
        optimizer.zero_grad()          # the step's quorum
        loss(model(batch)).backward()  # compressed buckets
        optimizer.step()               # committed, or discarded with its residuals

Why gradcomp runs on the process group itself: torchft's groups are not members of
torch.distributed's world (no global ranks, no clones), and the Manager replaces the
communicator inside whenever the quorum changes. Each call reads the communicator
the Manager configured last; a new one starts the settings' agreement afresh, and
residuals a ``two_phase`` owner kept for chunks of the old quorum are handed to this
replica's own residual, to be sent at its next call. The flat algorithms run
(``dense``, ``allgather``, ``two_phase``); Gloo groups have no reduce-scatter, and a
replica group is one rank of the quorum, so there are no nodes to be hierarchical over.
"""

from __future__ import annotations

import torch

from gradcomp.collectives.replica_groups import Compression, communicator_of

__all__ = ["Compression", "DistributedDataParallel", "OptimizerWrapper", "communicator_of"]


def _bucket_hook(compression, bucket):  # unannotated: DDP reads the names as annotations
    buffer = bucket.buffer()
    compression.all_reduce(buffer, ("ddp", bucket.index()))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def DistributedDataParallel(manager, module: torch.nn.Module, compression: Compression, **ddp_options):
    """torchft's DistributedDataParallel with gradcomp's compressed buckets: torch's DDP on
    a process group of one (its own collectives go nowhere), its buckets fixed (as torchft
    fixes them, so that a healed replica's match its peers'), each bucket averaged over
    the quorum through ``compression`` when DDP hands it over."""
    from torchft.process_group import ProcessGroupDummy

    if compression.manager is not manager:
        raise ValueError("the Compression was made for another Manager")
    ddp_options.setdefault("find_unused_parameters", True)
    if not ddp_options["find_unused_parameters"]:
        raise ValueError(
            "torchft's DDP keeps find_unused_parameters=True: it keeps the buckets from changing"
        )
    model = torch.nn.parallel.DistributedDataParallel(
        module, process_group=ProcessGroupDummy(0, 1), **ddp_options
    )
    model.register_comm_hook(compression, _bucket_hook)
    return model


def OptimizerWrapper(manager, optimizer: torch.optim.Optimizer, compression: Compression):
    """torchft's OptimizerWrapper whose ``step()`` commits through ``compression``
    (:meth:`Compression.should_commit`): the optimizer steps and the residuals are kept
    only where every replica committed."""
    from torchft.optim import OptimizerWrapper as Wrapper

    if compression.manager is not manager:
        raise ValueError("the Compression was made for another Manager")

    class _Committing(Wrapper):
        def step(self, closure=None):
            if closure is not None:
                raise ValueError("torchft's optimizer wrapper takes no closure")
            if compression.should_commit():
                self.optim.step()

    return _Committing(manager, optimizer)
