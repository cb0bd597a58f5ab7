"""A real torchft Manager of one replica group, on a lighthouse of its own (for tests that
need a Manager but not several replica groups)."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def one_replica_group(load: Callable[[dict], None], save: Callable[[], dict], name: str) -> Iterator:
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=10)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load,
        state_dict=save,
        min_replica_size=1,
        use_async_quorum=False,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=lighthouse.address(),
        replica_id=f"{name}_{os.getpid()}",
        timeout=timeout,
    )
    try:
        yield manager
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()
