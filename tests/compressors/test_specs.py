"""One spec grammar everywhere, and option typos that name the nearest option.

``"topk@0.05"`` and ``"int4:block=128"`` are the same compressors as
``("topk", ratio=0.05)`` and ``("int4", block=128)`` in every entry point: the DDP
hook, FSDP2, the all-reduce, DiLoCo and CompressedAdam (each checked on 2 Gloo
ranks, bit for bit against the keyword form where it computes). An option that
neither an entry point nor its compressor takes raises one error, the same in each:
the entry point, the nearest option of either, both lists; before any collective.
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
    with pytest.raises(ValueError, match=r"no option 'blok' \(did you mean 'block'\?\)"):
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

    # the all-reduce: the same bits as the keyword form
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    by_spec, by_keyword = x.clone(), x.clone()
    gradcomp.all_reduce(by_spec, "int4:block=128", feedback=False)
    gradcomp.all_reduce(by_keyword, gradcomp.get_compressor("int4", block=128), feedback=False)
    assert torch.equal(by_spec, by_keyword)
    by_option = x.clone()
    gradcomp.all_reduce(by_option, "int4", feedback=False, block=128)
    assert torch.equal(by_option, by_keyword)

    # FSDP2's reduce-scatter
    mesh = init_device_mesh("cpu", (world,))
    sharded = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    fsdp_state = gradcomp.fsdp.register(sharded, "int4:block=128")
    assert fsdp_state.reduce_scatter.settings() == gradcomp.get_compressor("int4", block=128).settings()

    # DiLoCo
    net = torch.nn.Linear(16, 16)
    diloco = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 4, compressor="topk@0.05")
    assert diloco.compressor.settings() == keyword

    # CompressedAdam: a spec, or the options beside the name as DiLoCo takes them
    for adam in (
        CompressedAdam(net.parameters(), compressor="topk@0.05"),
        CompressedAdam(net.parameters(), compressor="topk", ratio=0.05),
    ):
        assert adam.param_groups[0]["compressor"].settings() == keyword
    dist.barrier()


@pytest.mark.slow
def test_every_entry_point_takes_the_spec_grammar():
    run_ranks(_every_entry_point, 2)


# Every entry point that takes a compressor by name, called as a user would, and a typo of
# one of its own options (with the name it stands for). No process group: the options are
# checked before the model, the tensor or any collective, so a typo raises on its rank.
def _ddp(**options):
    gradcomp.ddp.register(torch.nn.Linear(4, 4), "int8", **options)


def _fsdp(**options):
    gradcomp.fsdp.register(torch.nn.Linear(4, 4), "int8", **options)


def _all_reduce(**options):
    gradcomp.all_reduce(torch.ones(4), "int8", **options)


def _adam(**options):
    CompressedAdam(torch.nn.Linear(4, 4).parameters(), compressor="int8", **options)


def _diloco(**options):
    net = torch.nn.Linear(4, 4)
    DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 4, compressor="int8", **options)


ENTRY_POINTS = {
    "gradcomp.ddp.register": (_ddp, "warmup_step", "warmup_steps"),
    "gradcomp.fsdp.register": (_fsdp, "residul", "residual"),
    "gradcomp.all_reduce": (_all_reduce, "algoritm", "algorithm"),
    "gradcomp.optim.CompressedAdam": (_adam, "warmup_step", "warmup_steps"),
    "gradcomp.DiLoCo": (_diloco, "outer_lrr", "outer_lr"),
}


@pytest.mark.parametrize("whose", ["its own", "the compressor's"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_option_typo_names_the_entry_point_the_nearest_option_and_both_lists(entry, whose):
    assert not dist.is_initialized()  # the premise: nothing could reach a peer
    call, typo, meant = ENTRY_POINTS[entry]
    if whose != "its own":
        typo, meant = "blok", "block"
    with pytest.raises(ValueError) as raised:
        call(**{typo: 1})
    message = str(raised.value)
    assert message.startswith(f"{entry} has no option {typo!r} (did you mean {meant!r}?). "), message
    own = message.split(f"Options of {entry}: ")[1].split("; ")[0].split(", ")
    assert "compressor" in own and (meant in own) == (whose == "its own"), message
    assert not {"process_group", "residual_dtype"} & set(own)  # old names still taken, not offered
    assert message.endswith("; of compressor 'int8': block, stochastic, feedback, seed."), message


def test_an_option_of_no_one_names_every_typo_and_what_takes_none():
    with pytest.raises(ValueError) as raised:
        gradcomp.ddp.register(torch.nn.Linear(4, 4), "auto", trial_step=2, blok=3)
    message = str(raised.value)
    assert message.startswith(
        "gradcomp.ddp.register has no options 'trial_step' (did you mean 'trial_steps'?), 'blok'. "
    ), message
    assert message.endswith("; compressor='auto' takes no compressor options."), message
    with pytest.raises(ValueError, match="compressor=None takes no compressor options"):
        CompressedAdam(torch.nn.Linear(4, 4).parameters(), compressor=None, ratio=0.1)
    with pytest.raises(ValueError, match=r"the Int8 given \(made with its options; give the spec 'int8'"):
        gradcomp.all_reduce(torch.ones(4), gradcomp.get_compressor("int8"), block=128)
