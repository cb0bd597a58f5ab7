"""torch.distributed's collectives into one tensor, under the names this torch gives them.

torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` and
``reduce_scatter_tensor`` to ``reduce_scatter_single``, and warns (FutureWarning) at
every call of the old names; torch 2.11 has only the old ones. FSDP2's comms call
them once a unit a step: the new name where torch has it, else the old one.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
