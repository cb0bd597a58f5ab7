"""torchft Managers for the tests: one replica group's (the replica processes of
``torchft_replica.py`` make theirs with :func:`replica_group_manager`), and one on a
lighthouse of its own for tests that need a Manager but not several replica groups."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator

TIMEOUT = datetime.timedelta(seconds=10)


def replica_group_manager(
    lighthouse: str,
    replica_id: str,
    load: Callable[[dict], None],
    save: Callable[[], dict],
    min_replica_size: int = 1,
    use_async_quorum: bool = False,
):
    """A Manager for a replica group of one process, with a store of its own, on Gloo."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=load,
        state_dict=save,
        min_replica_size=min_replica_size,
        use_async_quorum=use_async_quorum,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=replica_id,
        timeout=TIMEOUT,
        quorum_timeout=datetime.timedelta(seconds=30),
    )
    manager.gradcomp_test_store = store  # the store's server lives as long as the Manager
    return manager


@contextlib.contextmanager
def one_replica_group(load: Callable[[dict], None], save: Callable[[], dict], name: str) -> Iterator:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    manager = replica_group_manager(lighthouse.address(), f"{name}_{os.getpid()}", load, save)
    try:
        yield manager
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()
