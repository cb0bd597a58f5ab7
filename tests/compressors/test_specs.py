"""One spec grammar everywhere, and option typos that name the nearest option.

``"topk@0.05"`` and ``"int4:block=128"`` are the same compressors as
``("topk", ratio=0.05)`` and ``("int4", block=128)`` in every entry point: the DDP
hook, FSDP2, the all-reduce, DiLoCo and CompressedAdam (each checked on 2 Gloo
ranks, bit for bit against the keyword form where it computes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradcomp
from gradcomp.diloco import DiLoCo
from gradcomp.optim import CompressedAdam
from tests.utils import run_ranks


@pytest.mark.parametrize(
    ("spec", "name", "options"),
    [
        ("topk@0.05", "topk", {"ratio": 0.05}),
        ("int4:block=128", "int4", {"block": 128}),
        ("INT8:block=64,stochastic=true", "int8", {"block": 64, "stochastic": True}),
        ("powersgd@2", "powersgd", {"rank": 2}),
        ("topk:ratio=0.01,index_dtype=int32", "topk", {"ratio": 0.01, "index_dtype": "int32"}),
    ],
)
def test_a_spec_is_the_compressor_its_options_make(spec, name, options):
    assert gradcomp.get_compressor(spec).settings() == gradcomp.get_compressor(name, **options).settings()
    assert gradcomp.planner.from_spec(spec).settings() == gradcomp.get_compressor(spec).settings()


def test_bad_specs_say_why_and_the_nearest_name():
    with pytest.raises(ValueError, match=r"unknown compressor 'topkk' \(did you mean 'topk'\?\)"):
        gradcomp.get_compressor("topkk")
    with pytest.raises(ValueError, match=r"no option \['blok'\] \(did you mean 'block'\?\)"):
        gradcomp.get_compressor("int8:blok=3")
    with pytest.raises(ValueError, match="given both in the spec"):
        gradcomp.get_compressor("topk@0.05", ratio=0.1)
    with pytest.raises(ValueError, match="take name@value"):
        gradcomp.get_compressor("sign@3")
    with pytest.raises(ValueError, match="expected key=value"):
        gradcomp.get_compressor("int8:block")
    with pytest.raises(TypeError, match="a compressor is a spec"):
        gradcomp.get_compressor(8)


def _every_entry_point(rank: int, world: int) -> None:
    torch.manual_seed(0)
    keyword = gradcomp.get_compressor("topk", ratio=0.05).settings()

    # DDP hook
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    state = gradcomp.ddp.register(model, "topk@0.05", min_numel=0)
    assert state.compressor.settings() == keyword
    typo = r"register has no option \['warmup_step'\] \(did you mean 'warmup_steps'\?\)"
    with pytest.raises(ValueError, match=typo):
        gradcomp.ddp.register(model, "int8", warmup_step=10)

    # the all-reduce: the same bits as the keyword form
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    by_spec, by_keyword = x.clone(), x.clone()
    gradcomp.all_reduce(by_spec, "int4:block=128", feedback=False)
    gradcomp.all_reduce(by_keyword, gradcomp.get_compressor("int4", block=128), feedback=False)
    assert torch.equal(by_spec, by_keyword)

    # FSDP2's reduce-scatter
    mesh = init_device_mesh("cpu", (world,))
    sharded = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    fsdp_state = gradcomp.fsdp.register(sharded, "int4:block=128")
    assert fsdp_state.reduce_scatter.settings() == gradcomp.get_compressor("int4", block=128).settings()
    with pytest.raises(ValueError, match=r"no option \['residul'\] \(did you mean 'residual'\?\)"):
        gradcomp.fsdp.register(sharded, "int8", residul="fp32")

    # DiLoCo
    net = torch.nn.Linear(16, 16)
    diloco = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 4, compressor="topk@0.05")
    assert diloco.compressor.settings() == keyword
    typo = r"DiLoCo has no option \['outer_lrr'\] \(did you mean 'outer_lr'\?\)"
    with pytest.raises(ValueError, match=typo):
        DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 4, outer_lrr=0.5)

    # CompressedAdam: a spec, or the options beside the name as DiLoCo takes them
    for adam in (
        CompressedAdam(net.parameters(), compressor="topk@0.05"),
        CompressedAdam(net.parameters(), compressor="topk", ratio=0.05),
    ):
        assert adam.param_groups[0]["compressor"].settings() == keyword
    with pytest.raises(ValueError, match=r"no option \['warmup_step'\] \(did you mean 'warmup_steps'\?\)"):
        CompressedAdam(net.parameters(), compressor="sign", warmup_step=3)
    with pytest.raises(ValueError, match="with compressor=None"):
        CompressedAdam(net.parameters(), compressor=None, ratio=0.1)
    dist.barrier()


@pytest.mark.slow
def test_every_entry_point_takes_the_spec_grammar_and_names_the_nearest_option():
    run_ranks(_every_entry_point, 2)
