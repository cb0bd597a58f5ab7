"""A node's shared-memory area for CPU tensors: local rank 0 creates a file under
``SHARED_MEMORY_DIR``, maps it, and offers it to the node's other ranks, which map it
too; the hierarchical all-reduce's node stages read and write its rows."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets

import torch
import torch.distributed as dist

from gradcomp.collectives.nodes import Hierarchy, Level

logger = logging.getLogger(__name__)

# Where a node's ranks share memory for CPU tensors.
SHARED_MEMORY_DIR = "/dev/shm"
_OFFER_BYTES = 512  # the shared file's path and token, as local rank 0 broadcasts them


@dataclasses.dataclass
class SharedArea:
    """A node's shared memory for tensors of one length and dtype: a row per
    local rank and one for the result (``rows``), and for 16-bit tensors this
    rank's shard in fp32 (``shard``, private; None for the others, whose
    shard is summed in the result row)."""

    rows: torch.Tensor
    shard: torch.Tensor | None


def shared_area(hierarchy: Hierarchy, length: int, dtype: torch.dtype) -> SharedArea | None:
    """The node's shared area for CPU tensors of ``length`` (made on first
    use, with the node's ranks), or None where the node cannot share memory
    (its ranks on different hosts, no ``/dev/shm``, not enough room there):
    then the node's stages run as collectives."""
    intra = hierarchy.intra
    if intra.world_size == 1 or not hierarchy.shared_memory:
        return None
    key = (length, dtype)
    area = hierarchy.areas.get(key)
    if area is None:
        rows = map_shared(intra, (intra.world_size + 1) * length, dtype)
        if rows is None:
            hierarchy.shared_memory = False  # decided by every rank of the node alike
            return None
        narrow = dtype in (torch.float16, torch.bfloat16)
        shard = torch.empty(length // intra.world_size, dtype=torch.float32) if narrow else None
        area = hierarchy.areas[key] = SharedArea(rows.view(intra.world_size + 1, length), shard)
    return area


def map_shared(intra: Level, count: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``count`` elements of ``dtype`` mapped by every rank of the node, or
    None on every rank if any cannot. Local rank 0 makes a file in
    ``/dev/shm`` (space reserved up front: a full tmpfs fails here, not with
    a bus error later) ending in a random token; the others open it by name
    without creating it and check the token (a rank with another ``/dev/shm``
    must not map a file of its own), and it is unlinked once all agree."""
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    offer = ""
    if intra.rank == 0:
        token = secrets.token_hex(8)
        path = os.path.join(SHARED_MEMORY_DIR, f"gradcomp-{os.getpid()}-{token}")
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(descriptor, 0, nbytes + len(token))
                os.pwrite(descriptor, token.encode(), nbytes)
            finally:
                os.close(descriptor)
            offer = f"{path}\n{token}"
        except Exception as error:  # noqa: BLE001 - any failure: every rank takes collectives
            logger.info("gradcomp: no shared memory for the node's stages (%s); using collectives", error)
            with contextlib.suppress(OSError):
                os.unlink(path)
    encoded = torch.zeros(_OFFER_BYTES, dtype=torch.uint8)
    if len(offer.encode()) <= _OFFER_BYTES:
        encoded[: len(offer.encode())] = torch.tensor(list(offer.encode()), dtype=torch.uint8)
    dist.broadcast(encoded, src=dist.get_global_rank(intra.group, 0), group=intra.group)
    offer = bytes(encoded[encoded != 0].tolist()).decode()
    name, _, token = offer.partition("\n")
    mapped = None
    if name:
        try:
            descriptor = os.open(name, os.O_RDONLY)  # never created here
            try:
                seen = os.pread(descriptor, len(token), nbytes).decode()
            finally:
                os.close(descriptor)
            if seen != token:
                raise OSError(f"{name} is not the file local rank 0 made (another /dev/shm?)")
            mapped = torch.from_file(name, shared=True, size=count, dtype=dtype)
        except (RuntimeError, OSError, UnicodeDecodeError) as error:
            logger.info(
                "gradcomp: cannot map the node's shared memory %s (%s); using collectives", name, error
            )
    agreed = torch.tensor([int(mapped is not None)], dtype=torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=intra.group)
    if intra.rank == 0 and name:
        os.unlink(name)  # the mappings stay; the memory goes with the last of them
    return mapped if int(agreed) else None
