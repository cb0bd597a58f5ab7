"""Adam that owns its communication: compressed updates after a warm-up.

After a warm-up, Adam's second moment changes slowly; freezing it makes the
update linear in the momentum, so each rank can fold its own gradient into
the shared momentum and the ranks exchange their updates compressed, with
error feedback, instead of the gradient.

:class:`CompressedAdam` runs in two phases, the same on every rank:

* **warm-up** (steps ``1 .. warmup_steps``): the gradients are averaged
  (densely, or through ``gradient_compressor``) and the update is AdamW's,
  operation for operation;
* **compressed** (later steps): the second moment ``v`` is frozen at the
  warm-up's end, so the denominator ``d = sqrt(v / (1 - b2^warmup)) + eps``
  is a constant; each rank forms ``m_i = b1 m + (1 - b1) g_i`` from the
  shared momentum ``m`` and its own gradient, the ranks average ``m_i / d``
  (each rank's update) through ``compressor``, error feedback keeping what
  it dropped on each rank, and every rank applies the average and keeps
  ``m = average * d``.

A parameter group with ``compressor=None`` never freezes: its gradients are
averaged at every step and it stays AdamW (keep embeddings and norms exact
this way).

Gradients are the ranks' own: call ``backward`` without DDP's all-reduce
(no DDP, or inside ``no_sync()``) and let ``step()`` communicate. Clip or
scale gradients with that in mind: before ``step()`` they are not averaged.

The package, one concern a module: :mod:`~gradcomp.optim.compressed_adam`
(:class:`CompressedAdam`: the step, each bucket's exchange, a non-finite step
skipped), :mod:`~gradcomp.optim.phases` (the warm-up's and the frozen phase's
arithmetic), :mod:`~gradcomp.optim.layout` (the buckets),
:mod:`~gradcomp.optim.agreement` (the ranks' check at the first step) and
:mod:`~gradcomp.optim.checkpoint` (the saved state).
"""

from gradcomp.optim.compressed_adam import CompressedAdam

__all__ = ["CompressedAdam"]
