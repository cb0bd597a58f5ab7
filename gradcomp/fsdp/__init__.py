"""Compressed FSDP2: gradcomp's compressors in the reductions of a model sharded with
``torch.distributed.fsdp.fully_shard``.

Two plug points of FSDP2, per unit (each module ``fully_shard`` was applied to):

* the **all-reduce between replicas** (custom HSDP): with each unit sharded on
  a node's ranks, ``FSDPModule.set_all_reduce_hook`` hands gradcomp each unit's
  reduce-scattered gradient shard, which it all-reduces compressed across the
  ``replicate_group`` (the ranks holding the same shard on the other nodes):
  the only traffic between nodes;
* the **reduce-scatter** itself (``FSDPModule.set_custom_reduce_scatter``):
  each destination rank's row encoded with its error feedback, one
  all-to-all, the received rows decoded and summed in fp32.

Both run in the caller's thread on the stream FSDP calls them on (FSDP orders
them), in the same order on every rank: no worker thread.

Example:
    >>> mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    >>> for block in model.blocks:
    ...     fully_shard(block, mesh=mesh["shard"])
    >>> fully_shard(model, mesh=mesh["shard"])
    >>> state = gradcomp.fsdp.register(model, "int8", replicate_group=mesh["replicate"].get_group())
"""

from __future__ import annotations

from gradcomp.ddp.checkpoint import Checkpointable
from gradcomp.fsdp.comms import CompressedParameterGather, CompressedReduceScatter, register
from gradcomp.fsdp.state import RESIDUALS, FSDPOptions, FSDPState

__all__ = [
    "RESIDUALS",
    "Checkpointable",
    "CompressedParameterGather",
    "CompressedReduceScatter",
    "FSDPOptions",
    "FSDPState",
    "register",
]
