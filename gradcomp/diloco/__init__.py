"""DiLoCo: local steps, then a compressed average of the weights' change and an outer step.

Each rank trains on its own for ``sync_every`` inner steps. Then the ranks
average their pseudo-gradients (the anchor, the weights every rank held after
the last synchronisation, minus this rank's weights) through gradcomp's
compressed all-reduce with error feedback, and an outer optimizer (SGD with
Nesterov momentum) moves the anchor; every rank takes the new anchor as its
weights. Replicas are identical after every synchronisation: every rank decodes
the same average and applies the same outer step.

With ``fragments=F`` (Streaming DiLoCo) the parameters are F parts that
synchronise in turn, one about every ``sync_every / F`` steps, each still every
``sync_every``; with ``overlap_steps=T`` a part's exchange runs on gradcomp's
worker while training goes on, and its outer step lands T inner steps later,
on top of what the rank learnt meanwhile. The anchors are then identical on
every rank at every step, the weights after :meth:`DiLoCo.synchronize`.

The package, one concern a module: :mod:`~gradcomp.diloco.outer_loop`
(:class:`DiLoCo`: the steps counted, exchanges started and landed),
:mod:`~gradcomp.diloco.fragments` (which parameters a fragment holds, its turn,
an exchange on its way), :mod:`~gradcomp.diloco.outer_sgd` (the outer step's
arithmetic and the inner learning rates it follows) and
:mod:`~gradcomp.diloco.checkpoint` (the saved state, its schema, a restart on
another world size).
"""

from gradcomp.diloco.checkpoint import SCHEMA_VERSION
from gradcomp.diloco.outer_loop import DiLoCo

__all__ = ["DiLoCo", "SCHEMA_VERSION"]
