"""A node's shared-memory area for CPU tensors: local rank 0 names a file under
``SHARED_MEMORY_DIR``, makes it, and the node's ranks map it, then unlink it; the
hierarchical all-reduce's node stages read and write its rows."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import secrets

import torch
import torch.distributed as dist

from gradcomp.collectives.nodes import Hierarchy, Level

logger = logging.getLogger(__name__)

# Where a node's ranks share memory for CPU tensors.
SHARED_MEMORY_DIR = "/dev/shm"
_OFFER_BYTES = 512  # the shared file's path and token, as local rank 0 broadcasts them
_NAME = re.compile(r"gradcomp-\d+-[0-9a-f]{16}")  # the creator's process id and the token


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
    None on every rank if any cannot.

    Local rank 0 names a file in ``/dev/shm`` (ending in a random token) and
    tells the node's ranks first, then makes it (space reserved up front: a full
    tmpfs fails here, not with a bus error later) and holds a lock on it; the
    others open it by name without creating it and check the token (a rank with
    another ``/dev/shm`` must not map a file of its own). Every rank unlinks it
    once all have mapped it (the mappings stay; the memory goes with the last of
    them), or when a step fails (a peer died): a rank killed at any point leaves
    no file while one rank of the node lives. Files of creators that died with
    their whole node are removed at a later set-up on the host
    (:func:`remove_stale`)."""
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    path, token = _announce(intra)
    descriptor = None
    try:
        if intra.rank == 0 and path:
            descriptor = _create(path, token, nbytes)
        if not _everyone(intra, bool(path) and (intra.rank != 0 or descriptor is not None)):
            return None
        mapped = _attach(path, token, nbytes, count, dtype)
        return mapped if _everyone(intra, mapped is not None) else None
    finally:
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if descriptor is not None:
            os.close(descriptor)  # releases the lock once it is unlinked


def remove_stale(directory: str | None = None) -> None:
    """Remove the shared files in ``directory`` (default ``SHARED_MEMORY_DIR``) whose
    creator died before they were unlinked: a live creator holds a lock on its file
    until it unlinks it. Files of other users, or in use, are left alone."""
    directory = SHARED_MEMORY_DIR if directory is None else directory
    try:
        names = [name for name in os.listdir(directory) if _NAME.fullmatch(name)]
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):  # gone meanwhile, another user's, or locked: in use
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.stat(path, follow_symlinks=False).st_ino == os.fstat(descriptor).st_ino:
                    os.unlink(path)
            finally:
                os.close(descriptor)


def _announce(intra: Level) -> tuple[str, str]:
    """Local rank 0's choice of the file's path and token, told to every rank of the node
    before the file exists (so that each can remove it should a peer die): ``("", "")``
    on every rank where there is no room for it."""
    offer = ""
    if intra.rank == 0:
        remove_stale()
        token = secrets.token_hex(8)
        offer = f"{os.path.join(SHARED_MEMORY_DIR, f'gradcomp-{os.getpid()}-{token}')}\n{token}"
    encoded = torch.zeros(_OFFER_BYTES, dtype=torch.uint8)
    if len(offer.encode()) <= _OFFER_BYTES:
        encoded[: len(offer.encode())] = torch.tensor(list(offer.encode()), dtype=torch.uint8)
    dist.broadcast(encoded, src=dist.get_global_rank(intra.group, 0), group=intra.group)
    path, _, token = bytes(encoded[encoded != 0].tolist()).decode().partition("\n")
    return path, token


def _create(path: str, token: str, nbytes: int) -> int | None:
    """(local rank 0) Make the file of ``nbytes`` and its token, locked while it exists;
    its descriptor (the lock), or None where it cannot."""
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        logger.info("gradcomp: no shared memory for the node's stages (%s); using collectives", error)
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        if os.fstat(descriptor).st_nlink == 0:  # another set-up took it for stale before the lock
            raise OSError(f"{path} was removed as it was made")
        os.posix_fallocate(descriptor, 0, nbytes + len(token))
        os.pwrite(descriptor, token.encode(), nbytes)
    except OSError as error:
        logger.info("gradcomp: no shared memory for the node's stages (%s); using collectives", error)
        os.close(descriptor)
        return None
    return descriptor


def _attach(path: str, token: str, nbytes: int, count: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Map the file local rank 0 made (never made here), if it holds ``token``; else None."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            seen = os.pread(descriptor, len(token), nbytes).decode()
        finally:
            os.close(descriptor)
        if seen != token:
            raise OSError(f"{path} is not the file local rank 0 made (another /dev/shm?)")
        return torch.from_file(path, shared=True, size=count, dtype=dtype)
    except (RuntimeError, OSError, UnicodeDecodeError) as error:
        logger.info("gradcomp: cannot map the node's shared memory %s (%s); using collectives", path, error)
        return None


def _everyone(intra: Level, mine: bool) -> bool:
    """Whether ``mine`` holds on every rank of the node (one all-reduce)."""
    agreed = torch.tensor([int(mine)], dtype=torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=intra.group)
    return bool(agreed)
