"""gradcomp.DiLoCo on Gloo ranks: replicas identical after each synchronisation, DDP
when there is nothing local about it, error feedback conserved, resume bit for bit."""

from __future__ import annotations

import copy
import functools
import platform
import sys

import pytest
import torch
import torch.distributed as dist

import gradcomp
from gradcomp.diloco.fragments import split, starting
from tests.utils import run_ranks, same_on_all_ranks


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)


def _train(model, inner, outer, steps, rank, after=None) -> None:
    for step in steps:
        x, y = _batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        outer.step()
        if after is not None:
            after(step)


def _fresh(sync_every: int, **options):
    """A model, its AdamW and an int4 DiLoCo over them: what a resumed run starts from."""
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, inner, gradcomp.DiLoCo(model, inner, sync_every=sync_every, compressor="int4", **options)


def _resumed(fresh, model, inner, outer, steps, rank):
    """``steps`` more of the run, and of another started by ``fresh()`` from its state
    (saved per rank, as torch.distributed.checkpoint would under Checkpointable)."""
    saved = [copy.deepcopy(state.state_dict()) for state in (model, inner)]
    saved.append(gradcomp.ddp.Checkpointable(outer).state_dict())
    _train(model, inner, outer, steps, rank)
    again, again_inner, again_outer = fresh()
    again.load_state_dict(saved[0])
    again_inner.load_state_dict(saved[1])
    gradcomp.ddp.Checkpointable(again_outer).load_state_dict(saved[2])
    _train(again, again_inner, again_outer, steps, rank)
    return again, again_outer, saved[2]


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    "options, match",
    [
        ({"sync_every": 0}, "sync_every"),
        ({"sync_every": 2.5}, "sync_every"),
        ({"sync_every": 2, "outer_lr": 0.0}, "outer_lr"),
        ({"sync_every": 2, "outer_momentum": 1.0}, "outer_momentum"),
        ({"sync_every": 2, "compressor": "auto", "block": 64}, "no compressor options"),
        ({"sync_every": 4, "fragments": 0}, "fragments"),
        ({"sync_every": 4, "fragments": 1.5}, "fragments"),
        ({"sync_every": 4, "fragments": 5}, "more than the model's 4 trained parameters"),
        ({"sync_every": 4, "overlap_steps": 4}, "overlap_steps"),
        ({"sync_every": 4, "overlap_steps": -1}, "overlap_steps"),
        ({"sync_every": 2, "total_steps": 0}, "total_steps"),
        ({"sync_every": 2, "total_steps": 2.5}, "total_steps"),
        ({"sync_every": 2, "node_size": 2}, "apply to algorithm='hierarchical'"),
        ({"sync_every": 2, "algorithm": "hierarchical", "node_size": 0}, "node_size"),
    ],
)
def test_bad_options_are_refused(options, match):
    model = _net()
    with pytest.raises(ValueError, match=match):
        gradcomp.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)


def _replicas(rank: int, world: int) -> None:
    torch.manual_seed(rank)  # each rank starts elsewhere: the construction broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = gradcomp.DiLoCo(model, inner, sync_every=3, compressor="int4")
    assert same_on_all_ranks(_flat(model))

    def check(step: int) -> None:
        synced = (step + 1) % 3 == 0
        assert same_on_all_ranks(_flat(model)) == synced, f"step {step}"
        if synced:
            # int4 on 354 elements, cut in blocks and chunks: over 3x fewer bytes than fp32
            assert outer.last_stats.ratio > 3

    _train(model, inner, outer, range(9), rank, check)
    assert outer.outer_step == 3 and outer.local_step == 9


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_replicas_are_identical_after_every_synchronisation(world):
    run_ranks(_replicas, world)


def _like_ddp(rank: int, world: int) -> None:
    """H = 1, plain SGD inside, no compression, an outer SGD at lr 1 without momentum:
    each step is SGD on the ranks' mean gradient, as DDP's."""
    model, reference = _net(), _net()
    outer = gradcomp.DiLoCo(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 1, "none", outer_lr=1.0, outer_momentum=0.0
    )
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(5):
        _train(model, outer.inner, outer, [step], rank)
        sgd.zero_grad()
        batches = [_batch(step, r) for r in range(world)]
        loss = sum(torch.nn.functional.mse_loss(reference(x), y) for x, y in batches) / world
        loss.backward()
        sgd.step()
        # Within float rounding: (anchor - (anchor - lr g)) reassociates lr g, then the mean.
        torch.testing.assert_close(_flat(model), _flat(reference), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_one_step_a_synchronisation_without_compression_is_ddp():
    run_ranks(_like_ddp, 2)


def _conserved(rank: int, world: int, compressor: str) -> None:
    """What the exchange dropped stays in the residuals: over the ranks, the decoded mean
    times the ranks plus the new residuals is the pseudo-gradients plus the old ones."""
    model = _net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"algorithm": "allgather", "outer_momentum": 0.0}
    outer = gradcomp.DiLoCo(model, inner, 2, compressor, **options)
    _train(model, inner, outer, range(3), rank)  # one exchange (a residual), one local step
    x, y = _batch(3, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    inner.step()
    (key,) = outer.feedback.keys()
    old = outer.feedback.get(key).clone()
    anchor = torch.cat([a.reshape(-1) for a in outer.anchor])
    delta = anchor - _flat(model)
    outer.step()  # the second exchange
    new = outer.feedback.get(key)
    # Without momentum the outer step is anchor - lr * mean: the mean the ranks decoded.
    mean = (anchor - torch.cat([a.reshape(-1) for a in outer.anchor])) / outer.outer_lr
    totals = torch.stack([delta + old, new])
    dist.all_reduce(totals)
    torch.testing.assert_close(world * mean + totals[1], totals[0], rtol=0, atol=1e-5)
    assert new.abs().max() > 0 and old.abs().max() > 0


# The pseudo-gradients' compressors: 4 and 2 bits, Top-K, and Top-K with 2-bit values (SparseLoCo's).
OUTER_COMPRESSORS = ["int4", "int2", "topk:ratio=0.1", "topk:ratio=0.1,value_bits=2"]


@pytest.mark.slow
@pytest.mark.parametrize("compressor", OUTER_COMPRESSORS)
def test_error_feedback_is_conserved_across_synchronisations(compressor):
    run_ranks(_conserved, 2, compressor)


def _fragments_identical(rank: int, world: int, compressor: str, fragments: int, overlap: int) -> None:
    """Each fragment's weights and anchor are every rank's alike once its exchange
    has landed (the others' weights still this rank's own); all of them after synchronize()."""
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = gradcomp.DiLoCo(model, inner, 4, compressor, fragments=fragments, overlap_steps=overlap)
    landed = 0
    for step in range(13):  # ends a step after a landing: the ranks' weights differ
        before = list(outer.outer_steps)
        _train(model, inner, outer, [step], rank)
        for fragment, indices in enumerate(outer.fragments):
            if outer.outer_steps[fragment] > before[fragment]:
                landed += 1
                anchor = torch.cat([outer.anchor[i].reshape(-1) for i in indices])
                assert same_on_all_ranks(anchor), (step, fragment)
                if not overlap:  # overlapped, the weights hold what this rank learnt meanwhile
                    weights = torch.cat([outer.params[i].detach().reshape(-1) for i in indices])
                    assert same_on_all_ranks(weights), (step, fragment)
    assert landed >= 2 * fragments and not same_on_all_ranks(_flat(model))
    outer.synchronize()
    assert same_on_all_ranks(_flat(model)) and outer.bytes_sent > 0


@pytest.mark.slow
@pytest.mark.parametrize("compressor", OUTER_COMPRESSORS[1:])
@pytest.mark.parametrize("fragments, overlap", [(1, 0), (2, 1)])
def test_each_fragment_is_identical_on_every_rank_once_it_lands(compressor, fragments, overlap):
    run_ranks(_fragments_identical, 2, compressor, fragments, overlap)


def _resume(rank: int, world: int, follow_inner_lr: bool) -> None:
    fresh = functools.partial(_fresh, 3, follow_inner_lr=follow_inner_lr)
    model, inner, outer = fresh()
    _train(model, inner, outer, range(4), rank)  # one synchronisation, then one step into the next
    # (follow_inner_lr: the next outer step scales by the learning rates of 3 steps, 1 of them before)
    again, again_outer, saved = _resumed(fresh, model, inner, outer, range(4, 8), rank)
    assert torch.equal(_flat(again), _flat(model)) and again_outer.outer_step == outer.outer_step == 2
    if follow_inner_lr:
        return
    other = gradcomp.DiLoCo(_net(), torch.optim.SGD(_net().parameters(), lr=0.1), sync_every=4)
    with pytest.raises(ValueError, match="sync_every"):
        gradcomp.ddp.Checkpointable(other).load_state_dict(saved)
    # A state of schema 1 (one fragment, no exchange in flight) still loads.
    state = outer.state_dict()
    old = {k: v for k, v in state.items() if k not in ("outer_steps", "in_flight")}
    old.update(version=1, outer_step=outer.outer_step)
    old["settings"] = {k: v for k, v in state["settings"].items() if k not in ("fragments", "overlap_steps")}
    _, _, reloaded = fresh()
    reloaded.load_state_dict(old)
    assert reloaded.outer_steps == outer.outer_steps and reloaded.local_step == outer.local_step
    assert all(torch.equal(a, b) for a, b in zip(reloaded.anchor, outer.anchor, strict=True))
    # A state saved before node_size existed loads; one of another layout does not.
    _, _, reloaded = fresh()
    reloaded.load_state_dict({**state, "settings": dict(state["settings"], node_size=None)})
    reloaded.load_state_dict(
        {**state, "settings": {k: v for k, v in state["settings"].items() if k != "node_size"}}
    )
    with pytest.raises(ValueError, match="node_size"):
        reloaded.load_state_dict({**state, "settings": dict(state["settings"], node_size=2)})
    # A state saved before follow_inner_lr (schema 2) took DiLoCo's outer step: the default
    # refuses it and says how to resume it.
    before = {**state, "version": 2, "settings": dict(old["settings"], fragments=1, overlap_steps=0)}
    with pytest.raises(ValueError, match="follow_inner_lr=False to resume it"):
        _fresh(3)[2].load_state_dict(before)


@pytest.mark.slow
@pytest.mark.parametrize("follow_inner_lr", [False, True])
def test_resume_continues_bit_for_bit_between_synchronisations(follow_inner_lr):
    run_ranks(_resume, 2, follow_inner_lr)


def _follow_inner_lr(rank: int, world: int) -> None:
    def anchors(follow: bool, lrs: list[float]) -> list[torch.Tensor]:
        model = _net()
        inner = torch.optim.SGD(model.parameters(), lr=lrs[0])
        outer = gradcomp.DiLoCo(model, inner, 2, "none", follow_inner_lr=follow)
        found = []
        for step, lr in enumerate(lrs):
            inner.param_groups[0]["lr"] = lr
            _train(model, inner, outer, [step], rank)
            if (step + 1) % 2 == 0:
                found.append(torch.cat([a.reshape(-1) for a in outer.anchor]))
        return found

    # At a constant inner learning rate it is DiLoCo's outer step, up to rounding.
    for plain, follow in zip(anchors(False, [0.1] * 8), anchors(True, [0.1] * 8), strict=True):
        torch.testing.assert_close(follow, plain, rtol=1e-5, atol=1e-6)
    # A last period whose learning rate is 0 learns nothing: DiLoCo's momentum still moves
    # the anchor; following the inner learning rate, it stays.
    annealed = [0.1] * 4 + [0.05] * 2 + [0.0] * 2
    plain, follow = anchors(False, annealed), anchors(True, annealed)
    assert torch.equal(follow[-1], follow[-2]) and not torch.allclose(plain[-1], plain[-2])
    # A period at half the learning rate: its momentum part is half DiLoCo's.
    assert not torch.allclose(follow[2], plain[2])


@pytest.mark.slow
def test_following_the_inner_lr_stops_the_outer_momentum_where_the_schedule_ends():
    run_ranks(_follow_inner_lr, 2)


def _ends_with_the_average(rank: int, world: int) -> None:
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = gradcomp.DiLoCo(model, inner, sync_every=3, compressor="none", total_steps=7)
    _train(model, inner, outer, range(6), rank)  # two outer steps
    momentum = [m.clone() for m in outer.momentum]
    x, y = _batch(6, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    inner.step()
    weights = [torch.empty_like(_flat(model)) for _ in range(world)]
    dist.all_gather(weights, _flat(model))
    outer.step()  # the last: the replicas' average, no outer step
    assert same_on_all_ranks(_flat(model)) and not outer.in_flight and outer.outer_step == 3
    torch.testing.assert_close(_flat(model), sum(weights) / world, rtol=0, atol=1e-6)
    assert all(torch.equal(m, before) for m, before in zip(outer.momentum, momentum, strict=True))
    with pytest.raises(ValueError, match="past total_steps=7"):
        outer.step()
    assert outer.local_step == 7
    # A checkpoint resumes into a longer run: total_steps is the run's, not the state's.
    model, inner, outer = _fresh(3, total_steps=7)
    _train(model, inner, outer, range(5), rank)
    _, _, longer = _fresh(3, total_steps=12)
    gradcomp.ddp.Checkpointable(longer).load_state_dict(gradcomp.ddp.Checkpointable(outer).state_dict())
    assert longer.local_step == 5 and longer.total_steps == 12
    # Fragments in flight at the end land, then every fragment is averaged.
    model, inner, outer = _fresh(4, fragments=2, overlap_steps=1, total_steps=10)
    _train(model, inner, outer, range(10), rank)
    assert same_on_all_ranks(_flat(model)) and not outer.in_flight and outer.outer_steps == [3, 3]


@pytest.mark.slow
def test_total_steps_ends_the_run_with_the_replicas_average():
    run_ranks(_ends_with_the_average, 2)


def _node_replicas(rank: int, world: int) -> None:
    """2 nodes of 2 ranks, each node one replica (DDP over the node, DiLoCo between nodes
    through the hierarchical all-reduce), against 2 ranks each training on its node's batches."""
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    leaders = dist.new_group([0, 2])
    model = _net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=nodes[rank // 2])
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    options = dict(sync_every=3, compressor="none", total_steps=7)
    outer = gradcomp.DiLoCo(model, inner, algorithm="hierarchical", node_size=2, **options)
    alone = alone_inner = alone_outer = None
    if rank % 2 == 0:
        alone = _net()
        alone_inner = torch.optim.SGD(alone.parameters(), lr=0.1)
        alone_outer = gradcomp.DiLoCo(alone, alone_inner, group=leaders, **options)
    for step in range(7):
        _train(ddp, inner, outer, [step], rank)
        if alone is not None:
            batches = [_batch(step, r) for r in (rank, rank + 1)]
            sum(torch.nn.functional.mse_loss(alone(x), y) for x, y in batches).div(2).backward()
            alone_inner.step()
            alone_inner.zero_grad()
            alone_outer.step()
            torch.testing.assert_close(_flat(model), _flat(alone), rtol=0, atol=1e-6)
        if (step + 1) % 3 == 0 or step == 6:  # a node's two shards cross once, as one replica's whole
            inter = torch.tensor(float(outer.last_stats.bytes_sent_inter))
            dist.all_reduce(inter, group=nodes[rank // 2])
            if alone is not None:
                # Each shard's all-reduce carries its fingerprint's 64 lanes: one set more.
                lanes = gradcomp.collectives.ring_all_reduce_bytes(64 * 4, 2)
                assert inter.item() == alone_outer.last_stats.bytes_sent + lanes > lanes
    assert same_on_all_ranks(_flat(model))


@pytest.mark.slow
def test_a_node_of_ddp_ranks_is_one_replica():
    run_ranks(_node_replicas, 4)


def test_fragments_take_turns_each_every_sync_every_steps():
    """Streaming DiLoCo's schedule: F parts of about equal size, consecutive, each
    exchanged every H steps, their turns spread over the H steps."""
    turns = {step: starting(step, sync_every=8, count=4) for step in range(1, 17)}
    assert {step: f for step, f in turns.items() if f} == {
        2: [0],
        4: [1],
        6: [2],
        8: [3],
        10: [0],
        12: [1],
        14: [2],
        16: [3],
    }
    assert [step for step in range(1, 17) if starting(step, sync_every=8, count=1)] == [8, 16]


@pytest.mark.parametrize(
    "sizes, count, expected",
    [
        ([10, 10, 10, 10], 2, [[0, 1], [2, 3]]),
        ([100, 1, 1, 1], 3, [[0], [1], [2, 3]]),  # one large parameter: a fragment of its own
        ([1, 1, 1, 100], 3, [[0, 1], [2], [3]]),  # every fragment holds a parameter
        ([1, 2, 3, 4, 5, 6, 7, 8], 4, [[0, 1, 2, 3], [4], [5, 6], [7]]),  # 10, 5, 13, 8 of 9 each
    ],
)
def test_fragments_are_consecutive_parameters_of_about_equal_size(sizes, count, expected):
    assert split(sizes, count) == expected


def _overlapped(rank: int, world: int) -> None:
    """An exchange started at step t lands at t + T: the anchor moves by the ranks' mean
    pseudo-gradient of step t, and the weights keep what each rank learnt since t.
    Anchors are identical on every rank at every step; weights after synchronize()."""
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"outer_lr": 1.0, "outer_momentum": 0.0, "fragments": 2, "overlap_steps": 2}
    outer = gradcomp.DiLoCo(model, inner, sync_every=4, compressor="none", **options)
    taken = {}

    def check(step: int) -> None:
        assert same_on_all_ranks(torch.cat([a.reshape(-1) for a in outer.anchor])), f"step {step}"
        local = outer.local_step
        for exchange in outer.in_flight:
            if exchange.lands == local + 2:  # started at this step
                indices = outer.fragments[exchange.fragment]
                snapshot = torch.cat([t.reshape(-1) for t in exchange.snapshot])
                anchor = torch.cat([outer.anchor[i].reshape(-1) for i in indices])
                taken[exchange.lands] = (exchange.fragment, snapshot, anchor)
        if local in taken:
            fragment, snapshot, anchor = taken.pop(local)
            indices = outer.fragments[fragment]
            gathered = [torch.empty_like(snapshot) for _ in range(world)]
            dist.all_gather(gathered, snapshot)
            mean = anchor - sum(anchor - g for g in gathered) / world
            now = torch.cat([outer.anchor[i].reshape(-1) for i in indices])
            torch.testing.assert_close(now, mean, rtol=0, atol=1e-6)
            learnt = before[0] - snapshot
            weights = torch.cat([outer.params[i].detach().reshape(-1) for i in indices])
            torch.testing.assert_close(weights, now + learnt, rtol=0, atol=1e-6)
            landed[0] += 1

    before, landed = [None], [0]
    for step in range(12):
        x, y = _batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        lands = [e for e in outer.in_flight if e.lands == outer.local_step + 1]
        if lands:
            indices = outer.fragments[lands[0].fragment]
            before[0] = torch.cat([outer.params[i].detach().reshape(-1).clone() for i in indices])
        outer.step()
        check(step)
    assert landed[0] == 5  # fragment 0's at steps 4, 8, 12 and fragment 1's at 6, 10, each checked
    assert outer.outer_steps == [3, 2] and len(outer.in_flight) == 1  # fragment 1's of step 12 in flight
    assert not same_on_all_ranks(_flat(model))
    outer.synchronize()
    assert same_on_all_ranks(_flat(model)) and not outer.in_flight and outer.outer_steps == [4, 4]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_overlapped_fragments_land_late_on_what_each_rank_learnt(world):
    run_ranks(_overlapped, world)


def _resume_mid_fragment(rank: int, world: int) -> None:
    fresh = functools.partial(_fresh, 4, fragments=2, overlap_steps=2)
    model, inner, outer = fresh()
    _train(model, inner, outer, range(5), rank)  # fragment 1's exchange of step 4 lands at 6
    assert [e.fragment for e in outer.in_flight] == [1]
    again, again_outer, _ = _resumed(fresh, model, inner, outer, range(5, 11), rank)
    assert torch.equal(_flat(again), _flat(model))
    assert again_outer.outer_steps == outer.outer_steps == [2, 2]
    # Nothing a checkpoint waits for is lost: the bytes of a run that took none.
    straight, straight_inner, straight_outer = fresh()
    _train(straight, straight_inner, straight_outer, range(11), rank)
    assert torch.equal(_flat(straight), _flat(model))
    assert again_outer.bytes_sent == outer.bytes_sent == straight_outer.bytes_sent > 0
    # Fragment 0's exchange of step 10 is still on its way: state_dict() waits for it.
    mine, theirs = (o.state_dict()["feedback"]["residuals"] for o in (again_outer, outer))
    assert mine.keys() == theirs.keys() and len(mine) == 2
    assert all(torch.equal(mine[key], theirs[key]) for key in mine)


@pytest.mark.slow
def test_resume_continues_bit_for_bit_mid_fragment():
    run_ranks(_resume_mid_fragment, 2)


def _distributed_checkpoint(rank: int, world: int, directory: str) -> None:
    """torch.distributed.checkpoint keeps one copy of the model's and the optimizer's
    plain tensors for all ranks; Checkpointable(outer) holds each rank's own: a resume
    mid-fragment is bit for bit on every rank."""
    import torch.distributed.checkpoint as dcp

    fresh = functools.partial(_fresh, 4, fragments=2, overlap_steps=1)

    def everything(model, outer, **options):
        # The model's entry is one copy for all ranks; the DiLoCo state, loaded after it,
        # brings back each rank's own weights and inner optimizer state.
        return {"model": model.state_dict(), "diloco": gradcomp.ddp.Checkpointable(outer, **options)}

    model, inner, outer = fresh()
    _train(model, inner, outer, range(6), rank)  # fragment 0's exchange of step 6 lands at 7
    assert not same_on_all_ranks(_flat(model)) and [e.fragment for e in outer.in_flight] == [0]
    dcp.save(everything(model, outer), checkpoint_id=directory)
    _train(model, inner, outer, range(6, 11), rank)
    again, again_inner, again_outer = fresh()
    dcp.load(everything(again, again_outer), checkpoint_id=directory)
    _train(again, again_inner, again_outer, range(6, 11), rank)
    assert torch.equal(_flat(again), _flat(model)), "weights"
    assert again_outer.bytes_sent == outer.bytes_sent, (again_outer.bytes_sent, outer.bytes_sent)

    # Another world size, by choice: the shared state from rank 0, no residuals, the ranks agreeing.
    blob = gradcomp.ddp.Checkpointable(outer).state_dict()[f"rank{rank}"]
    other = {"world_size": world + 1, **({f"rank{rank}": blob} if rank == 0 else {})}
    _, _, dropped = fresh()
    gradcomp.ddp.Checkpointable(dropped, mismatch="drop").load_state_dict(other)
    assert not dropped.in_flight and len(dropped.feedback) == 0 and dropped.outer_steps == outer.outer_steps
    assert same_on_all_ranks(torch.cat([a.reshape(-1) for a in dropped.anchor]))
    assert same_on_all_ranks(_flat(dropped.model)) and dropped.local_step == outer.local_step


@pytest.mark.slow
def test_distributed_checkpoint_resumes_every_rank_bit_for_bit(tmp_path):
    run_ranks(_distributed_checkpoint, 2, str(tmp_path))


def _disagree(rank: int, world: int) -> None:
    model = _net()
    with pytest.raises(ValueError, match="sync_every"):
        gradcomp.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2 + rank)
    with pytest.raises(ValueError, match="total_steps"):
        gradcomp.DiLoCo(
            model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, total_steps=8 + rank
        )


@pytest.mark.slow
def test_ranks_with_other_settings_raise_on_every_rank():
    run_ranks(_disagree, 2)


# ----------------------------------------------------------------------------- parity with torchft

PARITY_H, PARITY_STEPS = 3, 9


def _synced_weights(model, inner, step_outer, rank: int) -> list[torch.Tensor]:
    """The weights after each synchronisation of ``PARITY_STEPS`` AdamW steps on ``rank``'s batches."""
    synced = []
    for step in range(PARITY_STEPS):
        x, y = _batch(step, rank)
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        step_outer()
        if (step + 1) % PARITY_H == 0:
            synced.append(_flat(model).clone())
    return synced


def _torchft_replica(replica: int, lighthouse: str, path: str) -> None:
    """One replica group of one process under torchft's Manager and DiLoCo (its own store,
    Gloo; the weights start alike, so no first sync), DiLoCo's outer SGD of 0.7 and
    Nesterov momentum 0.9."""
    from datetime import timedelta

    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    timeout = timedelta(seconds=60)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=2,
        use_async_quorum=False,
        load_state_dict=lambda state: model.load_state_dict(state["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        replica_id=str(replica),
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        port=0,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        init_sync=False,
    )
    options = {"backup_device": torch.device("cpu"), "pin_memory": False}
    try:
        with DiLoCo(manager, [model], inner, outer, PARITY_H, **options):
            synced = _synced_weights(model, inner, lambda: None, replica)  # torchft syncs in inner's hook
    finally:
        manager.shutdown(wait=False)
    torch.save(synced, path)


def _gradcomp_replica(rank: int, world: int) -> list[torch.Tensor]:
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"outer_lr": 0.7, "outer_momentum": 0.9, "follow_inner_lr": False}  # torchft's outer step
    outer = gradcomp.DiLoCo(model, inner, PARITY_H, "none", **options)
    return _synced_weights(model, inner, outer.step, rank)


@pytest.mark.slow
@pytest.mark.skipif(
    not (sys.platform == "linux" and platform.machine() == "x86_64"),
    reason="torchft ships wheels for Linux x86-64 only ('.[test]' installs it there)",
)
def test_uncompressed_diloco_is_torchfts_bit_for_bit(tmp_path):
    """torchft's DiLoCo (2 replica groups, a Lighthouse, Gloo) and gradcomp's without
    compression hold the same weights after every synchronisation."""
    import multiprocessing

    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    context = multiprocessing.get_context("spawn")
    paths = [str(tmp_path / f"replica{r}.pt") for r in range(2)]
    address = lighthouse.address()
    replicas = [context.Process(target=_torchft_replica, args=(r, address, paths[r])) for r in range(2)]
    try:
        for process in replicas:
            process.start()
        for process in replicas:
            process.join(timeout=180)
            assert process.exitcode == 0, f"a torchft replica ended with {process.exitcode}"
    finally:
        for process in replicas:
            process.kill()
        lighthouse.shutdown()
    theirs = [torch.load(path) for path in paths]
    ours = run_ranks(_gradcomp_replica, 2)
    assert len(theirs[0]) == PARITY_STEPS // PARITY_H
    for synced in theirs:
        for n, (mine, torchfts) in enumerate(zip(ours, synced, strict=True)):
            assert torch.equal(mine, torchfts), f"synchronisation {n}: {(mine - torchfts).abs().max()}"
