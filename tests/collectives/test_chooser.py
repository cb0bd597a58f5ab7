"""``gradcomp.all_reduce(t, "auto")``: a choice per size that every rank agrees on."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

import gradcomp
from gradcomp import planner, spawn
from gradcomp.collectives import cost_model
from tests.planner.profiles import FREE, GBIT, profile

# ----------------------------------------------------------------------------- all_reduce(t, "auto")


def _all_reduce_auto_body(rank, world_size):
    import gradcomp
    from gradcomp.collectives import shared_chooser

    generator = torch.Generator().manual_seed(rank)
    big, small = torch.randn(2**18, generator=generator), torch.randn(1000, generator=generator)
    # Injected: a slow link (every rank's differs; the slowest decides), codecs slow to start.
    auto = planner.Auto(allow=("int8", "int4"), profile=profile((0.01 + rank) * GBIT, overhead=20e-3))
    memory = gradcomp.ErrorFeedback()
    results = {}
    for name, x in (("big", big), ("small", small), ("big again", big)):
        out = x.clone()
        stats = gradcomp.all_reduce(out, auto, feedback=memory, name=name.split()[0])
        mean = x.clone()
        dist.all_reduce(mean)
        mean /= world_size
        everyone = [torch.empty_like(out) for _ in range(world_size)]
        dist.all_gather(everyone, out)
        static = x.clone()
        gradcomp.all_reduce(static, stats.compressor, algorithm=stats.algorithm, feedback=False)
        results[name] = dict(
            how=(stats.compressor, stats.algorithm),
            as_static=torch.equal(out, static),
            error=((out - mean).norm() / mean.norm()).item(),
            same=all(torch.equal(everyone[0], e) for e in everyone),
            sent=stats.bytes_sent,
            dense=stats.dense_bytes,
        )
    # Measured: the shared planner of "auto" probes the group once, then plans each size
    # (an empty tensor first: sent dense, nothing measured for it).
    measured = [gradcomp.all_reduce(x.clone(), "auto") for x in (torch.empty(0), small, big, small)]
    shared = shared_chooser("auto")
    return dict(
        results=results,
        plans={key: (p.compressor, p.algorithm) for key, p in auto.plans[next(iter(auto.plans))].items()},
        residuals=sorted(map(str, memory.keys())),
        measured=[(s.compressor, s.algorithm) for s in measured],
        probed=len(shared.profiles),
        shared_sizes=sorted(n for n, _ in next(iter(shared.plans.values()))),
    )


@pytest.mark.slow
def test_all_reduce_auto_chooses_per_size_and_every_rank_agrees():
    result = spawn.run_ranks(_all_reduce_auto_body, 2, timeout=180)
    slowest = planner.combine([profile(0.01 * GBIT, overhead=20e-3), profile(1.01 * GBIT, overhead=20e-3)])
    big, small = (planner.best_plan([n], 2, slowest, ("int8", "int4"))[0] for n in (2**18, 1000))
    assert big.compressor == "int4" and small.compressor == "none"  # the premise
    f32 = torch.float32
    assert result["plans"] == {(2**18, f32): ("int4", big.algorithm), (1000, f32): ("none", "dense")}
    runs = result["results"]
    assert runs["big"]["how"] == runs["big again"]["how"] == ("int4", big.algorithm)
    assert runs["small"]["how"] == ("none", "dense") and runs["small"]["error"] < 1e-6
    # The first calls are what the chosen compressor and algorithm give (bit for bit);
    # the second big one adds the first's residuals.
    assert runs["big"]["as_static"] and runs["small"]["as_static"] and not runs["big again"]["as_static"]
    for run in runs.values():  # int4 two-phase quantizes twice
        assert run["same"] and run["error"] < 0.3
    assert runs["big"]["sent"] < runs["big"]["dense"] / 6
    # Error feedback under the call's name: int4 keeps the big tensor's residuals, dense none.
    from gradcomp.collectives import key_of

    assert str(key_of("big")) in result["residuals"]
    assert not any(str(key_of("small")) in key for key in result["residuals"])
    assert result["probed"] == 1 and result["shared_sizes"] == [0, 1000, 2**18]
    assert result["measured"][0] == ("none", "dense")
    assert all(c in planner.SAFE and a for c, a in result["measured"])
    assert result["measured"][1] == result["measured"][3]


def _all_reduce_auto_disagreeing_body(rank, world_size):
    x = torch.ones(4096)
    # Ranks that allow other candidates, or of which one plans from a profile and the other
    # measures, would issue other collectives: every rank raises instead, naming each rank's.
    for auto, named in (
        (planner.Auto(allow=("int8",) if rank else ("int4",), profile=profile(GBIT)), "allow"),
        (planner.Auto(profile=profile(GBIT) if rank else None), "profile='measured'"),
    ):
        with pytest.raises(
            ValueError,
            match=f"ranks disagree on the all-reduce's compressor='auto' settings:\\n  rank 0: .*{named}",
        ):
            # A step given: a call that fails counts on no rank's step counter (the default
            # step), which every later call's fingerprint holds.
            gradcomp.all_reduce(x.clone(), auto, step=0)
        gradcomp.collectives.release_queues()
    # The same settings agree (and the shared "auto" is one instance, found by its name).
    same = planner.Auto(allow=("int8",), profile=profile(GBIT))
    gradcomp.all_reduce(x.clone(), same)
    gradcomp.all_reduce(x.clone(), "auto")
    from gradcomp.collectives import chooser

    shared = chooser.shared_chooser("auto")
    gradcomp.all_reduce(x.clone(), "auto")
    return shared is chooser.shared_chooser("auto") and list(chooser._SHARED) == ["auto"]


@pytest.mark.slow
def test_all_reduce_auto_ranks_with_other_settings_raise():
    assert spawn.run_ranks(_all_reduce_auto_disagreeing_body, 2, timeout=120) is True


def _all_reduce_auto_nodes_body(rank, world_size):
    import gradcomp

    x = torch.randn(2**16, generator=torch.Generator().manual_seed(rank))
    # Injected: a slow link between nodes that take no time inside.
    slow = cost_model.Link(0.01 * GBIT, 20e-6)
    nodes = dataclasses.replace(profile(0.01 * GBIT), world_size=4, nodes=planner.Nodes(2, 2, FREE, slow))
    auto = planner.Auto(allow=("int8",), profile=nodes)
    out = x.clone()
    stats = gradcomp.all_reduce(out, auto, node_size=2, feedback=False)
    plan = next(iter(auto.plans.values()))[(2**16, torch.float32, 2)]  # planned for nodes of 2
    static = x.clone()
    inter = plan.inter_algorithm
    gradcomp.all_reduce(
        static, "int8", algorithm="hierarchical", node_size=2, inter_algorithm=inter, feedback=False
    )
    everyone = [torch.empty_like(out) for _ in range(world_size)]
    dist.all_gather(everyone, out)
    # Measured: the first call times the nodes' levels too.
    measured = planner.Auto(allow=("int8",))
    gradcomp.all_reduce(x.clone(), measured, node_size=2)
    # An injected profile of other nodes than the group's is refused on every rank.
    other = planner.Auto(
        allow=("int8",), profile=dataclasses.replace(nodes, nodes=planner.Nodes(4, 1, FREE, slow))
    )
    with pytest.raises(ValueError, match="nodes hold 1 x 4 ranks, the group holds 2 x 2"):
        gradcomp.all_reduce(x.clone(), other, node_size=2)
    # Nodes of 3 and 1 ranks by LOCAL_WORLD_SIZE: hierarchical cannot run there, auto plans flat.
    gradcomp.collectives.release_queues()  # after the refusal above
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    flat = gradcomp.all_reduce(x.clone(), planner.Auto(allow=("int8",), profile=profile(0.01 * GBIT)))
    return dict(
        how=(stats.compressor, stats.algorithm, stats.inter_algorithm, plan.how),
        as_static=torch.equal(out, static),
        same=all(torch.equal(everyone[0], e) for e in everyone),
        nodes=next(iter(measured.profiles.values())).nodes,
        flat=(flat.compressor, flat.algorithm),
    )


@pytest.mark.slow
def test_all_reduce_auto_weighs_hierarchical_on_several_nodes():
    result = spawn.run_ranks(_all_reduce_auto_nodes_body, 4, timeout=180)
    compressor, algorithm, inter, how = result["how"]
    assert (compressor, algorithm) == ("int8", "hierarchical") and how == f"hierarchical({inter})"
    assert result["as_static"] and result["same"]
    nodes = result["nodes"]
    assert (nodes.size, nodes.count) == (2, 2) and nodes.stages.rate > 0 and nodes.link.bandwidth > 0
    assert result["flat"][0] == "int8" and result["flat"][1] != "hierarchical"


def test_all_reduce_auto_refuses_what_it_chooses_itself():
    import gradcomp

    for bad in ({"algorithm": "allgather"}, {"inter_algorithm": "allgather"}):
        with pytest.raises(ValueError, match="chooses the algorithm"):
            gradcomp.all_reduce(torch.ones(4), "auto", **bad)
    with pytest.raises(ValueError, match="node_size must be a positive integer"):
        gradcomp.all_reduce(torch.ones(4), "auto", node_size=0)
    with pytest.raises(ValueError, match="unknown compressor"):
        planner.Auto(allow=("int3",))
    with pytest.raises(TypeError, match="Profile"):
        planner.Auto(profile="fast")
