"""FSDP2's tensors kept alive for the streams gradcomp reads them on, checked against the fake.

FSDP2 calls the all-reduce hook on its all-reduce stream with the unit's reduce-scatter
output, which it allocated on its reduce-scatter stream and keeps alive only for native
HSDP (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, ``foreach_reduce``): once
it has cast the output (a reduce dtype other than the parameters') or added it into
``.grad``, the block goes back to the reduce-scatter stream's pool, and the next unit's
reduce-scatter may overwrite it while gradcomp's compressed all-reduce still reads it.
The hook records it on the stream it runs on (``record_stream``), as it records a held-
back shard that ``load_state_dict`` made on another stream before dropping it. Here FSDP
runs on CPU; each hook call is made, as FSDP makes it, with a fake all-reduce stream
current (tests/fake_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

import gradcomp
from gradcomp.fsdp.comms import _param_groups
from tests.fake_cuda import install_fake
from tests.fsdp import models
from tests.utils import run_ranks

fsdp = pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402


def _on_all_reduce_stream(model, fake) -> list[tuple]:
    """Each unit's hook called with a fake all-reduce stream current, as FSDP calls it;
    the list gets (stream, storage of the hook's input) for every call."""
    calls, stream = [], fake.Stream()
    for module in model.modules():
        if not isinstance(module, fsdp.FSDPModule):
            continue
        for group in _param_groups(module._get_fsdp_state()):
            hook = group._all_reduce_hook

            def on_stream(output, _hook=hook):
                calls.append((stream, output.untyped_storage().data_ptr()))
                with fake.stream(stream):
                    _hook(output)

            group._all_reduce_hook = on_stream
    return calls


def _recorded(fake, stream, storage) -> bool:
    return ("record_stream", stream, storage) in fake.log


def _backward(model, step: int, rank: int, world: int) -> None:
    x, y = models.batches(step, world)[rank]
    torch.nn.functional.mse_loss(model(x), y).backward()


def _hook_keeps_what_it_reads(rank: int, world: int) -> None:
    shard_mesh, replicas = models.meshes(world, hsdp=True)
    fake = install_fake()
    for policy in (None, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
        model = models.sharded(shard_mesh, policy)
        state = gradcomp.fsdp.register(model, "int8", replicate_group=replicas)
        calls = _on_all_reduce_stream(model, fake)
        fake.log.clear()
        _backward(model, 0, rank, world)
        _backward(model, 1, rank, world)  # accumulated into .grad, no zero_grad
        assert calls and all(_recorded(fake, *call) for call in calls), (policy, fake.log)
        # A held-back shard restored by load_state_dict, added on the all-reduce stream
        # and dropped: recorded there first.
        model.set_requires_all_reduce(False, recurse=True)
        _backward(model, 2, rank, world)
        saved = state.state_dict()
        assert saved["partial"]
        state.load_state_dict(saved)
        restored = [t.untyped_storage().data_ptr() for t in state.partial.values()]
        model.set_requires_all_reduce(True, recurse=True)
        fake.log.clear()
        _backward(model, 3, rank, world)
        assert not state.partial
        (stream,) = {call[0] for call in calls}
        assert all(_recorded(fake, stream, storage) for storage in restored), (policy, fake.log)


@pytest.mark.slow
def test_the_replicate_hook_records_fsdps_tensors_on_its_stream():
    run_ranks(_hook_keeps_what_it_reads, 2)
