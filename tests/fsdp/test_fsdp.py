"""Compressed FSDP2 (gradcomp.fsdp) on Gloo ranks with a "cpu" device mesh.

Two emulated nodes of two ranks: each unit sharded on a node's 2 ranks (mesh["shard"]),
the replicas of a shard in the other node (mesh["replicate"]). Every gradient is held
against the full-batch gradient of an unsharded copy of the model, computed on each rank.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

import gradcomp
from gradcomp.collectives import hierarchy_for
from gradcomp.collectives.inline import InlineGroup
from gradcomp.collectives.reduce_scatter import (
    compressed_reduce_scatter,
    hierarchical_reduce_scatter,
    padded_row,
)
from tests.utils import run_ranks

fsdp = pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from tests.fsdp import models  # noqa: E402

# ---------------------------------------------------------------- without ranks


def test_options_are_checked_when_made():
    with pytest.raises(ValueError, match="residual"):
        gradcomp.fsdp.FSDPOptions(residual="fp8")
    with pytest.raises(ValueError, match="hierarchical"):
        gradcomp.fsdp.FSDPOptions(algorithm="hierarchical")
    with pytest.raises(ValueError, match="warmup_steps"):
        gradcomp.fsdp.FSDPOptions(warmup_steps=-1)


def test_a_model_without_fully_shard_is_refused():
    with pytest.raises(TypeError, match="fully_shard"):
        gradcomp.fsdp.register(models.net(), "int8")


# ---------------------------------------------------------------- custom HSDP


def _step_errors(model, reference, rank: int, world: int, steps: int = 2):
    """Each step's relative error of the model's gradients against the reference's."""
    for step in range(steps):
        model.zero_grad()
        batches = models.batches(step, world)
        x, y = batches[rank]
        torch.nn.functional.mse_loss(model(x), y).backward()
        yield step, models.grad_error(model, models.reference_grads(reference, batches))


def _hsdp_gradients(rank: int, world: int) -> None:
    """Dense replicas equal the reference to rounding; int8 and int4 within their bounds;
    every replica holds the same shard bits; the bytes between nodes are the replicas'."""
    # Bounds of the first step; the second adds the first one's residual: twice the bound.
    # Top-K's error is near 1 at 1%: it is here for its replicas, not its bound.
    for compressor, bound in (("none", 1e-6), ("int8", 0.03), ("int4", 0.3), ("topk", float("inf"))):
        shard_mesh, replicas = models.meshes(world, hsdp=True)
        model, reference = models.sharded(shard_mesh), models.net()
        state = gradcomp.fsdp.register(model, compressor, replicate_group=replicas)
        for step, error in _step_errors(model, reference, rank, world):
            assert error <= bound * (1 + step), f"{compressor} step {step}: relative error {error:.3g}"
            assert models.same_in_group(models.local_grads(model), replicas), f"{compressor}: replicas differ"
        stats = state.last_stats
        assert stats.step == 1 and state.step == 2 and stats.buckets == 3
        assert stats.bytes_sent == stats.bytes_sent_inter > 0 and stats.bytes_sent_intra == 0
        if compressor == "int8":
            assert stats.dense_bytes / stats.bytes_sent >= 3.9 * 0.95  # fp32 shards of a few KB
            assert set(stats.compressors.values()) == {"int8 allgather"}


@pytest.mark.slow
def test_hsdp_replicas_identical_and_within_each_compressors_bound():
    run_ranks(_hsdp_gradients, 4)


def _accumulation_and_warmup(rank: int, world: int) -> None:
    """Microbatches without sync send nothing; set_requires_all_reduce(False) holds the shards
    back and the replicas' all-reduce sends them once; warm-up steps go dense."""
    shard_mesh, replicas = models.meshes(world, hsdp=True)
    model, reference = models.sharded(shard_mesh), models.net()
    state = gradcomp.fsdp.register(model, "none", replicate_group=replicas, warmup_steps=1)
    # A step of three microbatches: the first without any reduction, the second reduce-scattered
    # but not all-reduced, the third all of it.
    micro = [models.batches(10 + m, world) for m in range(3)]
    reference.zero_grad()
    for m, batches in enumerate(micro):
        model.set_requires_gradient_sync(m == 2)
        if m == 1:
            model.set_requires_gradient_sync(True)
            model.set_requires_all_reduce(False)
        x, y = batches[rank]
        torch.nn.functional.mse_loss(model(x), y).backward()
        loss = sum(torch.nn.functional.mse_loss(reference(bx), by) for bx, by in batches) / world
        loss.backward()
    expected = [p.grad for p in reference.parameters()]
    assert models.grad_error(model, expected) <= 1e-6
    assert models.same_in_group(models.local_grads(model), replicas)
    assert not state.partial, "held-back shards were sent"
    # Only the last microbatch sent between nodes (a step), dense in the warm-up; all three units.
    assert state.step == 1 and state.last_stats.bytes_sent_inter > 0 and state.last_stats.buckets == 3
    assert all(how == "none dense" for how in state.last_stats.compressors.values())


@pytest.mark.slow
def test_accumulation_sends_once_and_holds_back_what_it_must():
    run_ranks(_accumulation_and_warmup, 4)


# ---------------------------------------------------------------- the reduce-scatter


def _reduce_scatter_gradients(rank: int, world: int) -> None:
    cases = (("bf16", None, 0.005), ("int8", "fp32", 0.03), ("int8", "bf16", 0.03), ("int8", None, 0.03))
    for compressor, residual, bound in cases:
        shard_mesh, _ = models.meshes(world, hsdp=False)
        model, reference = models.sharded(shard_mesh), models.net()
        state = gradcomp.fsdp.register(model, compressor, residual=residual)
        for step, error in _step_errors(model, reference, rank, world):
            assert error <= bound * (1 + step), (
                f"{compressor} residual={residual}: relative error {error:.3g}"
            )
        kept = {state.scatter_feedback.get(key).dtype for key in state.scatter_feedback.keys()}
        if residual is None or compressor == "bf16":
            assert not kept
        else:
            assert kept == {torch.float32 if residual == "fp32" else torch.bfloat16}
        stats = state.last_stats
        ratio = {"bf16": 2, "int8": 3.9}[compressor]
        assert stats.dense_bytes / stats.bytes_sent >= ratio * 0.95
        assert stats.bytes_sent_inter == 0  # the nodes are not known without a replicate group


@pytest.mark.slow
def test_reduce_scatter_within_bounds_for_each_residual():
    run_ranks(_reduce_scatter_gradients, 4)


def _hierarchical_scatter(rank: int, world: int) -> None:
    """A shard group over 2 nodes of 2 ranks: bf16 inside a node, int8 between; one
    compressed row a rank crosses between nodes where the flat reduce-scatter sends two."""
    shard_mesh, _ = models.meshes(world, hsdp=False)
    batches = models.batches(0, world)
    x, y = batches[rank]
    crossed = {}
    for algorithm in ("hierarchical", "flat"):
        model, reference = models.sharded(shard_mesh), models.net()
        state = gradcomp.fsdp.register(model, "int8", scatter_algorithm=algorithm, node_size=2)
        torch.nn.functional.mse_loss(model(x), y).backward()
        assert models.grad_error(model, models.reference_grads(reference, batches)) <= 0.03
        stats = state.last_stats
        crossed[algorithm] = stats.bytes_sent_inter
        if algorithm == "hierarchical":
            assert set(stats.compressors.values()) == {"int8 hierarchical_reduce_scatter"}
            assert 0 < stats.bytes_sent_inter and 0 < stats.bytes_sent_intra
            assert stats.bytes_sent == stats.bytes_sent_inter + stats.bytes_sent_intra
    # The flat reduce-scatter knows no nodes (0): a rank sends a row to each of the other node's 2.
    assert crossed["flat"] == 0
    flat_crossing = 2 * state.last_stats.bytes_sent // (world - 1)
    assert crossed["hierarchical"] <= 0.51 * flat_crossing


@pytest.mark.slow
def test_hierarchical_reduce_scatter_sends_one_row_between_nodes():
    run_ranks(_hierarchical_scatter, 4)


def _divide_by(model: torch.nn.Module, factor: float) -> None:
    for module in model.modules():  # the factor is each unit's own
        if isinstance(module, fsdp.FSDPModule):
            module.set_gradient_divide_factor(factor)


def _divide_factor_and_mixed_precision(rank: int, world: int) -> None:
    # A divide factor of 1: FSDP asks for a PREMUL_SUM by 1 (Gloo has none): the sum of the ranks'.
    shard_mesh, _ = models.meshes(world, hsdp=False)
    model, reference = models.sharded(shard_mesh), models.net()
    gradcomp.fsdp.register(model, "bf16")
    _divide_by(model, 1.0)
    batches = models.batches(0, world)
    x, y = batches[rank]
    torch.nn.functional.mse_loss(model(x), y).backward()
    expected = [g * world for g in models.reference_grads(reference, batches)]
    assert models.grad_error(model, expected) <= 0.005
    # The same with custom HSDP: the replicas only sum, the factor is the whole world's (the
    # reduce-scatter gradcomp's: FSDP's own asks Gloo for a PREMUL_SUM, which it has not).
    shard_mesh, replicas = models.meshes(world, hsdp=True)
    model = models.sharded(shard_mesh)
    gradcomp.fsdp.register(model, "none", replicate_group=replicas, reduce_scatter="bf16")
    _divide_by(model, float(world))
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert models.grad_error(model, models.reference_grads(reference, batches)) <= 0.005
    # bf16 parameters, gradients reduced in fp32 and in bf16.
    for reduce_dtype, bound in ((torch.float32, 0.05), (torch.bfloat16, 0.05)):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        shard_mesh, replicas = models.meshes(world, hsdp=True)
        model = models.sharded(shard_mesh, policy)
        gradcomp.fsdp.register(model, "int8", replicate_group=replicas, reduce_scatter="bf16")
        # A bf16 output against an fp32 target: torch 2.11's mse_loss backward refuses the mix.
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        assert models.grad_error(model, models.reference_grads(reference, batches)) <= bound
        assert models.same_in_group(models.local_grads(model), replicas)


@pytest.mark.slow
def test_divide_factor_and_mixed_precision():
    run_ranks(_divide_factor_and_mixed_precision, 4)


def _conservation(rank: int, world: int) -> None:
    """The reduce-scatter's error feedback loses nothing: over the ranks, what was sent
    plus what the residuals kept is what went in."""
    group = dist.group.WORLD
    shard = 1000  # not a multiple of the block: a partial block a row
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(world * shard, generator=g)
    row = padded_row(gradcomp.get_compressor("int4"), shard)
    residual = torch.zeros(world, row)
    out = torch.empty(shard)
    c = gradcomp.get_compressor("int4")
    stats = compressed_reduce_scatter(out, x.clone(), c, group, residual=residual)
    totals = torch.cat([x, residual.view(-1)])
    dist.all_reduce(totals)
    totals = [totals[: x.numel()], totals[x.numel() :]]
    outs = [torch.empty(shard) for _ in range(world)]
    dist.all_gather(outs, out)
    sent = torch.cat(outs)
    kept = totals[1].view(world, row)
    assert not kept[:, shard:].any(), "the padding kept a residual"
    torch.testing.assert_close(sent + kept[:, :shard].reshape(-1), totals[0], rtol=0, atol=1e-5)
    assert residual.abs().max() > 0
    width = gradcomp.payload.buffer_size(c.payload_layout(row, x.dtype, {}))
    assert stats.bytes_sent == (world - 1) * width


@pytest.mark.slow
def test_reduce_scatter_error_feedback_is_conserved():
    run_ranks(_conservation, 2)


# ---------------------------------------------------------------- resume, settings, refusals


def _train(model, state, steps, world, rank, lr=0.05):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in steps:
        optimizer.zero_grad()
        x, y = models.batches(step, world)[rank]
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _resume(rank: int, world: int) -> None:
    shard_mesh, replicas = models.meshes(world, hsdp=True)
    options = {"replicate_group": replicas, "reduce_scatter": "int8", "residual": "fp32"}
    straight = models.sharded(shard_mesh)
    state = gradcomp.fsdp.register(straight, "int4", **options)
    _train(straight, state, range(2), world, rank)
    saved_model = {k: v.clone() for k, v in straight.state_dict().items()}
    saved = state.state_dict()
    checkpoint = gradcomp.fsdp.Checkpointable(state).state_dict()  # for torch.distributed.checkpoint
    _train(straight, state, range(2, 4), world, rank)
    resumed = models.sharded(shard_mesh)
    resumed.load_state_dict(saved_model)
    again = gradcomp.fsdp.register(resumed, "int4", **options)
    gradcomp.fsdp.Checkpointable(again).load_state_dict(checkpoint)
    _train(resumed, again, range(2, 4), world, rank)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local()), "the resumed run differs"
    assert again.step == state.step == 4
    other = gradcomp.fsdp.register(models.sharded(shard_mesh), "int8", **options)
    with pytest.raises(ValueError, match="compressor"):
        other.load_state_dict(saved)


@pytest.mark.slow
def test_resume_continues_bit_for_bit():
    run_ranks(_resume, 4)


def _refusals(rank: int, world: int) -> None:
    shard_mesh, replicas = models.meshes(world, hsdp=True)
    model = models.sharded(shard_mesh)
    with pytest.raises(ValueError, match="ranks"):  # rank 0 asks for another compressor
        gradcomp.fsdp.register(model, "int8" if rank else "int4", replicate_group=replicas)
    with pytest.raises(ValueError, match="does not fit the mesh"):  # the shard group is no replica group
        gradcomp.fsdp.register(model, "int8", replicate_group=shard_mesh.get_group())
    with pytest.raises(ValueError, match="quantizers"):
        gradcomp.fsdp.register(model, "topk")
    with pytest.raises(ValueError, match="not 'auto'"):
        gradcomp.fsdp.register(model, "auto")
    with pytest.raises(ValueError, match="flat shard"):
        gradcomp.fsdp.register(model, "powersgd", replicate_group=replicas)
    with pytest.raises(ValueError, match="spans nodes"):
        gradcomp.fsdp.register(model, "int8", replicate_group=replicas, scatter_algorithm="hierarchical")
    with pytest.raises(ValueError, match="quantizers"):
        gradcomp.fsdp.register(model, "int8", parameters="topk")
    with pytest.raises(ValueError, match="beside a replicate_group"):
        gradcomp.fsdp.register(model, "int8", reduce_scatter="bf16")
    # A unit FSDP all-gathers in two dtypes (as bytes): refused at register, not at its first forward.
    mixed = models.net()
    mixed[0].bias.data = mixed[0].bias.data.double()
    for layer in (mixed[0], mixed):
        fully_shard(layer, mesh=shard_mesh)
    with pytest.raises(ValueError, match=r"FSDP unit '0' all-gathers its parameters in float32, float64"):
        gradcomp.fsdp.register(mixed, "bf16", parameters="int8")
    native = models.net()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(native, mesh=mesh)
    with pytest.raises(ValueError, match="native HSDP"):
        gradcomp.fsdp.register(native, "int8")


@pytest.mark.slow
def test_bad_configurations_are_refused_on_every_rank():
    run_ranks(_refusals, 4)


def _auto(rank: int, world: int) -> None:
    shard_mesh, replicas = models.meshes(world, hsdp=True)
    model, reference = models.sharded(shard_mesh), models.net()
    # planner.Auto, all_reduce's chooser, is "auto" with its candidates.
    state = gradcomp.fsdp.register(
        model, gradcomp.planner.Auto(allow=("int8", "int4")), replicate_group=replicas
    )
    batches = models.batches(0, world)
    x, y = batches[rank]
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert models.grad_error(model, models.reference_grads(reference, batches)) <= 0.1
    assert models.same_in_group(models.local_grads(model), replicas)
    chosen = {how.split()[0] for how in state.last_stats.compressors.values()}
    assert chosen <= {"none", "int8", "int4"}  # dense is always weighed


@pytest.mark.slow
def test_auto_chooses_for_the_replicas():
    run_ranks(_auto, 4)


# ---------------------------------------------------------------- host cost on the GPU path


def _launches(rank: int, world: int, results: dict) -> None:
    from tests.counting import counted

    os.environ["GRADCOMP_BACKEND"] = "triton"
    c = gradcomp.get_compressor("int8")
    shard = 3 * 2**10 + 77
    x = torch.randn(world * shard, generator=torch.Generator().manual_seed(rank))
    residual, out = torch.zeros(world * padded_row(c, shard)), torch.empty(shard)
    compressed_reduce_scatter(out, x.clone(), c, dist.group.WORLD, residual=residual)
    with counted() as counts:
        counts.active = True
        compressed_reduce_scatter(out, x.clone(), c, dist.group.WORLD, residual=residual)
        counts.active = False
    assert not counts.syncs, f"host syncs at {world} ranks: {dict(counts.syncs)}"
    if rank == 0:
        results["flat", world] = counts.total_launches
    if world < 4:
        return
    hierarchy = hierarchy_for(InlineGroup(dist.group.WORLD), 2)
    residual = torch.zeros(world // 2 * padded_row(c, shard))
    hierarchical_reduce_scatter(out, x.clone(), c, hierarchy, intra_dtype=torch.bfloat16, residual=residual)
    with counted() as counts:
        counts.active = True
        hierarchical_reduce_scatter(
            out, x.clone(), c, hierarchy, intra_dtype=torch.bfloat16, residual=residual
        )
        counts.active = False
    assert not counts.syncs, f"hierarchical: host syncs at {world} ranks: {dict(counts.syncs)}"
    if rank == 0:
        results["hierarchical", world] = counts.total_launches


@pytest.mark.slow
def test_reduce_scatter_makes_no_host_sync_and_launches_independent_of_the_world_size(monkeypatch):
    import torch.multiprocessing as mp

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    results = mp.Manager().dict()
    for world in (2, 4, 8):
        run_ranks(_launches, world, results)
    flat = {results["flat", world] for world in (2, 4, 8)}
    hierarchical = {results["hierarchical", world] for world in (4, 8)}
    assert len(flat) == 1 and flat.pop() <= 6, dict(results)
    assert len(hierarchical) == 1 and hierarchical.pop() <= 12, dict(results)


def _parameter_gather(rank: int, world: int) -> None:
    """int8 weights in FSDP's all-gather: every rank computes with the same decoded
    weights, within int8's bound of the exact ones, at about a quarter of the bytes."""
    shard_mesh, _ = models.meshes(world, hsdp=False)
    model, reference = models.sharded(shard_mesh), models.net()
    state = gradcomp.fsdp.register(model, "bf16", parameters="int8")
    batches = models.batches(0, world)
    x, y = batches[rank]
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    assert models.grad_error(model, models.reference_grads(reference, batches)) <= 0.05
    everyone = [torch.empty(1) for _ in range(world)]
    dist.all_gather(everyone, loss.detach().reshape(1))
    assert len({t.item() for t in everyone}) == world  # each rank its own batch
    # The same batch on every rank: the same decoded weights give the same loss bits.
    same = torch.nn.functional.mse_loss(model(batches[0][0]), batches[0][1]).detach().reshape(1)
    dist.all_gather(everyone, same)
    assert all(torch.equal(t, same) for t in everyone)
    exact = torch.nn.functional.mse_loss(reference(batches[0][0]), batches[0][1]).item()
    assert abs(same.item() - exact) <= 0.01 * abs(exact)
    gathers = {k: v for k, v in state.last_stats.compressors.items() if k[1] == "parameter_gather"}
    assert set(gathers.values()) == {"int8 parameter_gather"} and len(gathers) == 3


@pytest.mark.slow
def test_parameter_gather_gives_every_rank_the_same_weights():
    run_ranks(_parameter_gather, 4)


def _no_deprecated_calls(rank: int, world: int) -> None:
    # torch 2.13 warns at every call of all_gather_into_tensor and reduce_scatter_tensor.
    warnings.simplefilter("error", FutureWarning)
    shard_mesh, _ = models.meshes(world, hsdp=False)
    model = models.sharded(shard_mesh)
    state = gradcomp.fsdp.register(model, "int8", parameters="int8", warmup_steps=1)
    for step in range(2):  # a dense warm-up step, then a compressed one
        x, y = models.batches(step, world)[rank]
        torch.nn.functional.mse_loss(model(x), y).backward()
    assert {how.split()[0] for how in state.stats[0].compressors.values()} == {"none"}
    assert {how.split()[0] for how in state.stats[1].compressors.values()} == {"int8"}


@pytest.mark.slow
def test_fsdp_paths_call_no_deprecated_collective():
    run_ranks(_no_deprecated_calls, 2)
