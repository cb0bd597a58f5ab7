"""The hierarchical all-reduce on 4 Gloo ranks cut into emulated nodes (``node_size``)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

import gradcomp
from gradcomp.collectives import (
    c10d,
    chunk_bounds,
    cost_model,
    group_timeout,
    hierarchical,
    key_of,
    queue_for,
    shared_memory,
)
from gradcomp.compressors import mix_seed
from tests.collectives.bounds import DTYPE_SLACK, ERROR_BOUND
from tests.utils import gather, run_ranks, same_on_all_ranks

pytestmark = pytest.mark.slow  # every test spawns ranks

NAMES = ("none", "bf16", "int8", "int4", "sign", "topk", "randk")


def _input(rank: int, numel: int, dtype, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7919 * rank + numel + salt)
    return torch.randn(numel, generator=generator).to(dtype)


def _matches_dense(rank: int, world_size: int, shared: bool) -> None:
    # CPU tensors take the node's shared memory; `shared=False` makes them take collectives.
    for node_size in (1, 2, 4) if shared else (2,):
        hierarchy = gradcomp.collectives.hierarchy_for(queue_for(None), node_size)
        hierarchy.shared_memory = shared
        nodes, local = world_size // node_size, rank % node_size
        for name in NAMES:
            compressor = gradcomp.get_compressor(name)
            for numel in (1, 1000, 4097):
                for dtype in (torch.float32, torch.bfloat16):
                    where = f"node_size={node_size}/{name}/{numel}/{dtype}"
                    x = _input(rank, numel, dtype)
                    exact = torch.stack([t.double() for t in gather(x)]).mean(0)
                    result = x.clone()
                    stats = gradcomp.all_reduce(
                        result, compressor, algorithm="hierarchical", node_size=node_size, feedback=False
                    )
                    assert result.dtype == dtype and same_on_all_ranks(result), where
                    error = float((result.double() - exact).norm() / exact.norm().clamp_min(1e-12))
                    if nodes == 1:  # nothing crosses a node: the dense average
                        assert error <= 1e-6 + DTYPE_SLACK[dtype], f"{where}: {error}"
                    elif numel > 1 or name in ("none", "bf16", "int8"):
                        bound = ERROR_BOUND[name] + DTYPE_SLACK[dtype]
                        assert error <= bound, f"{where}: relative error {error:.4f} > {bound}"
                    # Bytes: an all-to-all and an all-gather of shards inside the node; between
                    # nodes, the flat all-reduce of this rank's shard (in fp32 for 16-bit tensors).
                    # Sparse payloads gathered between nodes cross the node's shared memory as
                    # every node's payload of the shard (width: a payload's bytes), not shards.
                    shard = -(-numel // node_size)
                    shard_bytes = (node_size - 1) * shard * x.element_size()
                    inner = gradcomp.collectives.default_algorithm(compressor, nodes)
                    if shared and nodes > 1 and node_size > 1 and compressor.sparse and inner == "allgather":
                        width = stats.bytes_sent_inter // (nodes - 1)
                        assert stats.bytes_sent_intra == shard_bytes + (node_size - 1) * nodes * width, where
                    elif not shared and node_size > 1:  # the all-to-all's shards carry fingerprints
                        per = 8 // x.element_size()
                        header = (-(-shard // per) * per - shard + per) * x.element_size()
                        assert stats.bytes_sent_intra == 2 * shard_bytes + (node_size - 1) * header, where
                    else:
                        assert stats.bytes_sent_intra == 2 * shard_bytes, where
                    if nodes == 1:
                        assert stats.bytes_sent_inter == 0 and stats.inter_algorithm == "", where
                    else:
                        assert stats.inter_algorithm == inner, where
                        if local == 0 and rank == 0:  # the cost model counts the inner rank 0's bytes
                            model = cost_model.cost(compressor, shard, nodes, inner, torch.float32)
                            assert stats.bytes_sent_inter == model.bytes_sent, where
                    assert stats.bytes_sent == stats.bytes_sent_intra + stats.bytes_sent_inter, where
                    dense = 2 * (world_size - 1) * numel * x.element_size() // world_size
                    assert stats.dense_bytes == dense and stats.algorithm == "hierarchical", where
        assert hierarchy.shared_memory == shared and bool(hierarchy.areas) == (shared and node_size > 1)


@pytest.mark.parametrize("shared", [True, False], ids=["shared_memory", "collectives"])
def test_hierarchical_matches_the_dense_average_on_every_layout(shared):
    run_ranks(_matches_dense, 4, shared)


def _shared_memory_matches_collectives(rank: int, world_size: int) -> None:
    # The node's stages through shared memory (result summed in the result row; sparse
    # payloads shared and decoded by every rank) give the collectives' bits, residuals included.
    hierarchy = gradcomp.collectives.hierarchy_for(queue_for(None), 2)
    # randk: summed by a dense all-reduce between nodes, or gathered (its indices follow
    # each shard's seed: decoded by the shard's rank).
    for name, inter in [
        ("none", None),
        ("int8", None),
        ("topk", None),
        ("randk", None),
        ("randk", "allgather"),
    ]:
        for dtype in (torch.float32, torch.bfloat16):
            # 1: rank 1's shard is all padding; 3: but for one element; 4097: the last is one short.
            for numel in (1, 3, 1000, 4097):
                results, memories = {}, {}
                for shared in (True, False):
                    hierarchy.shared_memory = shared
                    memory = memories[shared] = gradcomp.ErrorFeedback()
                    for step in range(2):
                        result = _input(rank, numel, dtype, salt=step)
                        gradcomp.all_reduce(
                            result,
                            name,
                            algorithm="hierarchical",
                            node_size=2,
                            inter_algorithm=inter,
                            feedback=memory,
                            name="g",
                            step=step,
                        )
                    results[shared] = result
                where = f"{name}/{inter}/{dtype}/{numel}"
                assert torch.equal(results[True], results[False]) and same_on_all_ranks(results[True]), where
                for key in memories[True].keys():
                    assert torch.equal(memories[True].get(key), memories[False].get(key)), where
    hierarchy.shared_memory = True
    assert any(key[0] == "payloads" for key in hierarchy.areas)  # sparse payloads went through it


def test_shared_memory_gives_the_collectives_bits():
    run_ranks(_shared_memory_matches_collectives, 4)


def _feedback_conserved(rank: int, world_size: int, inter_algorithm: str) -> None:
    # With node means m_k and the shard residuals e = old - new (what a node's
    # shard sent beyond its input), W * result = sum of inputs + L * sum of e
    # placed at each rank's shard, minus W * the owners' residual changes
    # (two_phase between nodes): nothing the compression dropped is lost.
    node_size, numel = 2, 2051
    shard = -(-numel // node_size)
    local, node = rank % node_size, rank // node_size
    nodes = world_size // node_size
    for name in ("int8", "sign", "topk", "int2"):
        compressor = gradcomp.get_compressor(name)
        if inter_algorithm == "two_phase" and name == "topk":
            continue  # its own test file checks Top-K's two_phase conservation
        memory = gradcomp.ErrorFeedback()
        key = mix_seed(key_of("g"), hierarchical._SHARD_KEY, local)
        for step in range(3):
            x = _input(rank, numel, torch.float32, salt=step)
            before = {k: memory.get(k).clone() for k in memory.keys()}
            result = x.clone()
            gradcomp.all_reduce(
                result,
                compressor,
                algorithm="hierarchical",
                node_size=node_size,
                inter_algorithm=inter_algorithm,
                feedback=memory,
                name="g",
            )
            placed = torch.zeros(shard * node_size, dtype=torch.float64)
            old = before.get(key, torch.zeros(shard))
            placed[local * shard : (local + 1) * shard] = (old - memory.get(key)).double()
            owner = ("two_phase", key)
            if owner in memory:
                start, end = chunk_bounds(shard, nodes, getattr(compressor, "block", 1))[node]
                change = memory.get(owner) - before.get(owner, torch.zeros_like(memory.get(owner)))
                placed[local * shard + start : local * shard + end] -= nodes * change.double()
            expected = (
                torch.stack(gather(x.double())).sum(0)
                + node_size * torch.stack(gather(placed)).sum(0)[:numel]
            )
            torch.testing.assert_close(
                result.double() * world_size, expected, rtol=1e-5, atol=1e-4, msg=f"{name}/{inter_algorithm}"
            )


@pytest.mark.parametrize("inter_algorithm", ["allgather", "two_phase"])
def test_hierarchical_error_feedback_loses_nothing(inter_algorithm):
    run_ranks(_feedback_conserved, 4, inter_algorithm)


def _layouts(rank: int, world_size: int) -> None:
    x = _input(rank, 3000, torch.float32)
    exact = torch.stack(gather(x)).mean(0)
    # No node_size and no LOCAL_WORLD_SIZE: by host name, one node here: the dense average.
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    result = x.clone()
    stats = gradcomp.all_reduce(result, "int4", algorithm="hierarchical")
    torch.testing.assert_close(result, exact, rtol=1e-6, atol=1e-6)
    assert stats.bytes_sent_inter == 0
    q = queue_for(None)
    assert q.hierarchies[None].source == "host names" and q.hierarchies[None].nodes == [[0, 1, 2, 3]]
    # node_size that does not divide the group: refused on every rank, before any collective.
    with pytest.raises(
        ValueError, match=r"node_size=3 does not divide the group's 4 ranks \(nodes would hold \[3, 1\]"
    ):
        gradcomp.all_reduce(x.clone(), "int8", algorithm="hierarchical", node_size=3)
    # Ranks that disagree on node_size: every rank raises, naming each rank's.
    with pytest.raises(ValueError, match="ranks disagree on the hierarchical all-reduce's node_size"):
        gradcomp.all_reduce(x.clone(), "int8", algorithm="hierarchical", node_size=2 if rank else 1)
    # Options that do not fit.
    with pytest.raises(ValueError, match="apply to algorithm='hierarchical'"):
        gradcomp.all_reduce(x.clone(), "int8", algorithm="two_phase", node_size=2)
    with pytest.raises(ValueError, match="needs a summable compressor"):
        gradcomp.all_reduce(x.clone(), "int8", algorithm="hierarchical", inter_algorithm="dense")
    with pytest.raises(ValueError, match="positive integer"):
        gradcomp.all_reduce(x.clone(), "int8", algorithm="hierarchical", node_size=0)
    # The group is still usable after the refusals; torchrun's LOCAL_WORLD_SIZE sets the nodes.
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    q.hierarchies.pop(None)
    result = x.clone()
    stats = gradcomp.all_reduce(result, "int8", algorithm="hierarchical")
    layout = q.hierarchies[None]
    assert layout.source == "LOCAL_WORLD_SIZE=2" and layout.nodes == [[0, 1], [2, 3]]
    assert stats.bytes_sent_inter > 0 and same_on_all_ranks(result)
    # The levels' groups inherit the group's timeout.
    for level in (layout.intra, layout.inter):
        assert group_timeout(level.group) == group_timeout(q.group)
    assert layout.shared_memory and layout.areas  # CPU tensors went through shared memory
    # A node that cannot share memory (here: no such folder) takes collectives, on every rank alike.
    shared_memory.SHARED_MEMORY_DIR = "/nonexistent-gradcomp-test"
    fallback = gradcomp.collectives.hierarchy_for(q, 2)
    result = x.clone()
    gradcomp.all_reduce(result, "none", algorithm="hierarchical", node_size=2)
    torch.testing.assert_close(result, exact, rtol=1e-6, atol=1e-6)
    assert not fallback.shared_memory and not fallback.areas
    # Uneven nodes by LOCAL_WORLD_SIZE: refused, naming the sizes.
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    q.hierarchies.pop(None)
    with pytest.raises(ValueError, match=r"by LOCAL_WORLD_SIZE=3 the group's nodes hold \[3, 1\] ranks"):
        gradcomp.all_reduce(x.clone(), "int8", algorithm="hierarchical")
    os.environ.pop("LOCAL_WORLD_SIZE")


def test_node_layouts_are_found_or_refused_clearly():
    run_ranks(_layouts, 4)


def _ddp_hierarchical(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    losses = {}
    for algorithm in ("dense", "flat", "hierarchical"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(32, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 4),
        )
        model = DistributedDataParallel(net, bucket_cap_mb=0.03)
        state = None
        if algorithm == "flat":
            state = gradcomp.ddp.register(model, "int8", min_numel=0)
        elif algorithm == "hierarchical":
            state = gradcomp.ddp.register(model, "int8", algorithm="hierarchical", node_size=2, min_numel=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
        generator = torch.Generator().manual_seed(100 + rank)
        for _ in range(40):
            inputs = torch.randn(32, 32, generator=generator)
            loss = torch.nn.functional.cross_entropy(model(inputs), (inputs @ teacher).argmax(1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        flat = torch.cat([p.detach().view(-1) for p in net.parameters()])
        assert same_on_all_ranks(flat), f"replicas differ: {algorithm}"
        inputs = torch.randn(512, 32, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            losses[algorithm] = torch.nn.functional.cross_entropy(
                net(inputs), (inputs @ teacher).argmax(1)
            ).item()
        if algorithm == "hierarchical":
            stats = state.last_stats
            assert stats.buckets > 1 and stats.compressed_buckets == stats.buckets
            assert (
                stats.bytes_sent_inter > 0
                and stats.bytes_sent == stats.bytes_sent_intra + stats.bytes_sent_inter
            )
    return losses


def test_ddp_hook_with_hierarchical_trains_like_flat():
    losses = run_ranks(_ddp_hierarchical, 4)
    assert losses["dense"] < 0.5, losses  # it learned (from ln 4 = 1.39)
    assert abs(losses["hierarchical"] - losses["dense"]) <= 0.01 + 0.05 * losses["dense"], losses
    assert abs(losses["hierarchical"] - losses["flat"]) <= 0.01 + 0.05 * losses["flat"], losses


def _interleaved_hosts(rank: int, world_size: int) -> None:
    # Nodes by host name, their ranks interleaved: host A holds ranks 0 and 3, host B 1
    # and 2. Local rank 1's ranks between nodes are 3 (node A, the first) and 2: torch's
    # group of them is in rank order, the other way round.
    from gradcomp.collectives.reduce_scatter import hierarchical_reduce_scatter

    os.environ.pop("LOCAL_WORLD_SIZE", None)
    socket.gethostname = lambda: "host-" + "ABBA"[rank]
    q = queue_for(None)
    hierarchy = gradcomp.collectives.hierarchy_for(q, None)
    assert hierarchy.source == "host names" and hierarchy.nodes == [[0, 3], [1, 2]]
    # The reduce-scatter: every rank's shard against torch's (fp32 sums of four values).
    shard = 1000
    rows = _input(rank, world_size * shard, torch.float32)
    expected = torch.empty(shard)
    c10d.reduce_scatter_single(expected, rows.clone())
    output = torch.empty(shard)
    none = gradcomp.get_compressor("none")
    hierarchical_reduce_scatter(output, rows.clone(), none, hierarchy, divisor=1)
    torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)
    # The all-reduce, whose algorithms between nodes own chunks by the group's rank.
    for inter_algorithm in ("allgather", "two_phase"):
        x = _input(rank, 5000, torch.float32)
        exact = torch.stack(gather(x)).mean(0)
        gradcomp.all_reduce(x, "int8", algorithm="hierarchical", inter_algorithm=inter_algorithm)
        assert same_on_all_ranks(x)
        relative = ((x - exact).norm() / exact.norm()).item()
        assert relative < ERROR_BOUND["int8"], (inter_algorithm, relative)


def test_nodes_by_host_name_with_interleaved_ranks_reduce_to_the_right_ranks():
    run_ranks(_interleaved_hosts, 4)
