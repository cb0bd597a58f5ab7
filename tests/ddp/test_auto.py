"""``compressor="auto"`` in the DDP hook: the plan from every rank's figures, checkpoints,
re-planning, trials."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from gradcomp import planner, spawn
from gradcomp.collectives import cost_model
from tests.planner.profiles import FREE, GBIT, profile

# ----------------------------------------------------------------------------- "auto" in the DDP hook


def _auto_body(rank, world_size, bandwidths, steps, resume_at):
    import io

    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp
    from gradcomp.collectives import ring_all_reduce_bytes

    def build():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4096))
        net.append(torch.nn.Linear(4096, 4))
        return net, DistributedDataParallel(net, bucket_cap_mb=4)

    net, model = build()
    # Each rank's injected profile differs: the plan must come from their combination.
    state = ddp.register(model, "auto", warmup_steps=3, profile=profile(bandwidths[rank], overhead=20e-3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 64, generator=generator) for _ in range(steps)]
    saved = None
    for step, x in enumerate(batches):
        if step == resume_at:
            buffer = io.BytesIO()
            torch.save(
                {"model": net.state_dict(), "optim": optimizer.state_dict(), "hook": state.state_dict()},
                buffer,
            )
            saved = buffer.getvalue()
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    state.flush()
    final = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    finals = [torch.empty_like(final) for _ in range(world_size)]
    dist.all_gather(finals, final)
    numel = sum(p.numel() for p in net.parameters())
    result = dict(
        plan=[(p.numel, p.compressor, p.algorithm) for p in state.plan],
        stats=[(s.step, dict(s.compressors), s.bytes_sent) for s in state.stats],
        dense_bytes=ring_all_reduce_bytes(numel * 4, world_size),
        replicas_equal=all(torch.equal(finals[0], f) for f in finals),
        final=final,
        offsets=state.ready_offsets,
    )
    # Resume from the checkpoint taken after the plan: the same steps, bit for bit.
    net, model = build()
    state = ddp.register(model, "auto", warmup_steps=3, profile=profile(bandwidths[rank], overhead=20e-3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    checkpoint = torch.load(io.BytesIO(saved), weights_only=False)
    net.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optim"])
    state.load_state_dict(checkpoint["hook"])
    for x in batches[resume_at:]:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    result["resumed_equal"] = torch.equal(
        torch.cat([p.detach().reshape(-1) for p in net.parameters()]), final
    )
    result["resumed_offsets"] = state.ready_offsets
    return result


@pytest.mark.slow
def test_auto_plans_once_from_every_ranks_figures_and_compresses_the_large_buckets():
    # Rank 0 sees 10 Gbit/s, rank 1 a 0.1 Gbit/s link: the slower decides, and low bits pay.
    result = spawn.run_ranks(_auto_body, 2, [10 * GBIT, 0.1 * GBIT], 8, 5, timeout=240)
    plan = result["plan"]
    slowest = planner.combine([profile(10 * GBIT, overhead=20e-3), profile(0.1 * GBIT, overhead=20e-3)])
    expected = planner.best_plan([n for n, _, _ in plan], 2, slowest)
    assert plan == [(p.numel, p.compressor, p.algorithm) for p in expected]
    # Two buckets: the large one in 4 bits, the small one (20 ms to start a codec) dense.
    assert [p[1] for p in plan] == ["int4", "none"] and plan[0][0] > 2**20 > plan[1][0]
    # Every step's statistics, each with every bucket: dense for the 3 warm-up
    # steps, then each bucket through its plan.
    assert [s[0] for s in result["stats"]] == list(range(8))
    # A bucket that gradcomp all-reduces sends its fingerprint's 64 lanes with it (those
    # left to torch's own all-reduce do not).
    lanes = cost_model.ring_all_reduce_bytes(64 * 4, 2)
    for step, compressors, sent in result["stats"]:
        if step < 3:
            assert set(compressors.values()) == {"none dense"}
            assert 0 <= sent - result["dense_bytes"] <= len(compressors) * lanes
        else:
            assert [compressors[i] for i in range(len(plan))] == [" ".join(p[1:]) for p in plan]
            assert sent < result["dense_bytes"] / 4
    assert result["replicas_equal"] and result["resumed_equal"]
    # When each bucket was handed over in the step before the plan, before the backward
    # pass ended (the last one: 0), kept with the plan for re-plans, and in the checkpoint.
    offsets = result["offsets"]
    assert len(offsets) == len(plan) and max(offsets) == 0.0 and min(offsets) < 0
    assert result["resumed_offsets"] == offsets


def _ready_body(rank, world_size, replan_from=None):
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)
    )
    model = DistributedDataParallel(net, bucket_cap_mb=4)
    slow = profile(0.1 * GBIT)
    state = ddp.register(model, "auto", warmup_steps=3, profile=slow, check_every=2, trial_steps=0)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(5 if replan_from is None else 8):
        if step == 5 and replan_from is not None:
            # Offsets as a checkpoint of each rank's own would hold them; a re-plan at step 6.
            state.flush()
            state.auto.offsets = list(replan_from[rank])
            state.replan()
        if step == 3:  # the step before's marks, as if the ranks' backward passes had differed:
            # rank 0 hands every bucket but the last over 10 s before the end, rank 1 1 ms before.
            count = len(state.auto.sizes.numels)
            early = 0.0 if rank == 0 else 9.999
            marks = {**{i: early for i in range(count - 1)}, count - 1: 10.0}
            state.auto.ready = ddp.auto.ReadyMarks(2, 0.0, marks)
        optimizer.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
    state.flush()
    sizes = [p.numel for p in state.plan]
    alone = [-10.0 if rank == 0 else -0.001] * (len(sizes) - 1) + [0.0]
    mine = planner.best_plan(sizes, world_size, slow, ready=alone)
    plans, offsets = [None] * world_size, [None] * world_size
    dist.all_gather_object(plans, [(p.compressor, p.algorithm) for p in state.plan])
    dist.all_gather_object(offsets, state.ready_offsets)
    return plans, offsets, [(p.compressor, p.algorithm) for p in mine], sizes


@pytest.mark.slow
def test_ranks_whose_buckets_were_ready_at_different_times_agree_on_the_plan():
    plans, offsets, rank0_alone, sizes = spawn.run_ranks(_ready_body, 2, timeout=120)
    assert len(sizes) >= 3
    # Per bucket the latest rank's offset (its reduction starts when the last rank hands it
    # over), on both ranks; so one plan, every bucket compressed (none fits in 1 ms).
    assert offsets[0] == offsets[1] == pytest.approx([-0.001] * (len(sizes) - 1) + [0.0])
    assert plans[0] == plans[1] and all(c != "none" for c, _ in plans[0])
    # From its own marks, rank 0 would have kept the early buckets dense: a different plan.
    assert rank0_alone != plans[0] and rank0_alone[0] == ("none", "dense")


@pytest.mark.slow
def test_a_re_plan_agrees_the_offsets_it_was_given():
    # Each rank's own offsets (as a checkpoint from before the ranks agreed them would hold).
    own = [[-10.0, -10.0, 0.0], [-0.001, -0.001, 0.0]]
    plans, offsets, _, sizes = spawn.run_ranks(_ready_body, 2, own, timeout=120)
    assert len(sizes) == 3 and offsets[0] == offsets[1] == own[1]
    assert plans[0] == plans[1]


def test_auto_options_are_checked():
    from gradcomp import ddp

    with pytest.raises(ValueError, match="unknown compressor"):
        ddp.HookState("auto", allow=("int3",))
    with pytest.raises(ValueError, match="low-rank"):
        ddp.HookState("auto", allow=("int8", "powersgd"))
    for bad in ({"algorithm": "allgather"}, {"inter_algorithm": "allgather"}):
        with pytest.raises(ValueError, match="chooses the algorithm"):
            ddp.HookState("auto", **bad)
    with pytest.raises(ValueError, match="node_size must be a positive integer"):
        ddp.HookState("auto", node_size=0)
    assert ddp.HookState("auto", node_size=2).options.node_size == 2  # says where the nodes are
    with pytest.raises(ValueError, match="options of compressor='auto'"):
        ddp.HookState("int8", allow=("int8",))
    with pytest.raises(TypeError, match="Profile"):
        ddp.HookState("auto", profile={"link": 1})
    with pytest.raises(TypeError, match="allow holds compressors' names or Compressors, got 5"):
        ddp.HookState("auto", allow=[5])
    # A profile without a candidate's measurement is refused at once, not after the warm-up.
    partial = dataclasses.replace(profile(GBIT), codecs={"int8": profile(GBIT).codecs["int8"]})
    for make in (lambda: ddp.HookState("auto", profile=partial), lambda: planner.Auto(profile=partial)):
        with pytest.raises(ValueError, match="no measurement of 'bf16', 'int4' \\(it has \\['int8'\\]\\)"):
            make()
    allowed = ddp.HookState("auto", allow=("none", "int8"), profile=partial).auto.options.allow
    assert allowed == ("none", "int8")
    # planner.Auto, the chooser all_reduce takes, is "auto" with its candidates and profile.
    chooser = ddp.HookState(planner.Auto(allow=("none", "int8"), profile=partial)).auto.options
    assert (chooser.allow, chooser.profile) == (allowed, partial)
    with pytest.raises(ValueError, match="given by the planner.Auto"):
        ddp.HookState(planner.Auto(), allow=("int8",))
    for only_auto in ({"replan_every": 100}, {"check_every": 5}, {"drift": 0.2}, {"drift": None}):
        with pytest.raises(ValueError, match="options of compressor='auto'"):
            ddp.HookState("int8", **only_auto)
    bad_options = [{"check_every": 0}, {"check_every": None}, {"replan_every": 1.5}]
    bad_options += [{"drift": 0}, {"drift": "x"}, {"drift": float("nan")}, {"drift": float("inf")}]
    bad_options += [{"warmup_steps": -5}, {"warmup_steps": True}, {"warmup_steps": 2.5}]
    for bad in bad_options:
        with pytest.raises(ValueError, match=next(iter(bad))):
            ddp.HookState("auto", **bad)
    with pytest.raises(RuntimeError, match="auto"):
        ddp.HookState("int8").replan()
    state = ddp.HookState("auto")
    assert (
        state.auto
        and state.options.warmup_steps == ddp.AUTO_MIN_WARMUP
        and state.auto.options.allow == planner.SAFE
    )
    assert state.state_dict()["settings"] == {"name": "auto", "allow": list(planner.SAFE)}
    with pytest.raises(ValueError, match="settings"):
        state.load_state_dict(ddp.HookState("int8").state_dict())


def test_a_checkpoint_of_the_unversioned_schema_loads_as_it_was_saved():
    from gradcomp import ddp

    state = ddp.HookState("auto", allow=("int8", "int4"), profile=profile(GBIT))
    fresh = state.state_dict()
    # What the unversioned schema saved: auto's fields flat beside the others, a "step" key
    # among the bucket indices, plans of 3 (before predictions were kept) and 7 fields.
    v1 = {k: v for k, v in fresh.items() if k not in ("version", "auto")} | {
        "step": 9,
        "auto_sizes": {"step": 1, 0: 4096, 1: 512},
        "auto_ready": [-0.5, 0.0],
        "plan": [(4096, "int8", "allgather"), (512, "none", "dense", 0, 0.1, 0.0, 0.0)],
        "auto_adopted_at": 7,
        "auto_last": {0: ("int8", "allgather", None), 1: ("none", "dense")},
        "next_plan": [(4096, "int4", "allgather", 1, 0.1, 0.1, 0.0, None), (512, "none", "dense")],
        "auto_remeasure": "requested",
        "auto_trials": [{"kept": 0}],
    }
    state.load_state_dict(v1)
    auto = state.auto
    assert auto.phase is ddp.Phase.RUNNING and auto.adopted_at == 7 and state.step == 9
    assert [(p.numel, p.compressor, p.algorithm) for p in state.plan] == [
        (4096, "int8", "allgather"),
        (512, "none", "dense"),
    ]
    assert state.plan[1].exchange_seconds == 0.1 and state.plan[0].inter_algorithm is None
    assert [p.compressor for p in auto.next_plan] == [
        "int4",
        "none",
    ] and auto.remeasure_due.why == "requested"
    assert (auto.sizes.step, auto.sizes.numels) == (1, {0: 4096, 1: 512}) and state.ready_offsets == [
        -0.5,
        0.0,
    ]
    assert state.sent_as(1)[1:] == ("dense", None) and state.trials == [{"kept": 0}]
    again = state.state_dict()
    assert again["version"] == ddp.SCHEMA_VERSION and again["auto"]["plan"][0][:3] == (
        4096,
        "int8",
        "allgather",
    )
    with pytest.raises(ValueError, match="schema 3"):
        state.load_state_dict(again | {"version": 3})


def test_loading_a_checkpoint_from_before_the_plan_forgets_the_plan():
    from gradcomp import ddp

    before = ddp.HookState("auto").state_dict()
    state = ddp.HookState("auto", profile=profile(GBIT))
    auto = state.auto
    auto.plan, auto.phase = [planner.Prediction("int8", "allgather", 4096, 1, 0.1, 0.1)], ddp.Phase.RUNNING
    auto.planned_at, auto.adopted_at, auto.hooked_step, auto.replan_requested = 4, 5, 7, True
    state.load_state_dict(before)
    auto = state.auto
    assert state.plan is None and auto.phase is ddp.Phase.WARMUP and auto.compressors == []
    assert auto.planned_at is None and auto.adopted_at is None and auto.hooked_step == -1
    assert not auto.replan_requested


def _auto_edge_body(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64)
    model = DistributedDataParallel(net)
    state = ddp.register(model, "auto", allow="int8,int4", profile=profile(0.01 * GBIT))
    # A checkpoint taken after the warm-up without the bucket sizes (what
    # Checkpointable(mismatch="drop") leaves): one more dense step, then the plan.
    saved = state.state_dict()
    saved["step"] = 5
    saved["auto"]["sizes"] = None
    state.load_state_dict(saved)
    for _ in range(3):
        model(torch.randn(4, 64)).sum().backward()
    state.flush()
    return (
        state.auto.options.allow,
        [(p.numel, p.compressor) for p in state.plan],
        [dict(s.compressors) for s in state.stats],
    )


@pytest.mark.slow
def test_auto_without_the_bucket_sizes_plans_a_step_later_and_one_rank_stays_dense():
    allow, plan, stats = spawn.run_ranks(_auto_edge_body, 2, timeout=120)
    assert allow == ("int8", "int4") and plan == [(64 * 64 + 64, "int4")]
    assert [set(s.values()) for s in stats] == [{"none dense"}, {"int4 allgather"}, {"int4 allgather"}]
    one, plan, stats = spawn.run_ranks(_auto_edge_body, 1, timeout=120)
    assert plan == [(64 * 64 + 64, "none")] and stats[-1] == {0: "none dense"}


# ----------------------------------------------------------------------------- re-planning


def _codecs(**rates):
    """A profile's codecs: each named compressor at its rate (elements a second), 50 us a call."""
    return {name: planner.Codec(*[planner.Linear(50e-6, rate)] * 2) for name, rate in rates.items()}


# Three links and codec sets: int4 pays on the first, Top-K on the second (int4 and int8
# slow to encode there), dense on the third (fast, every codec costly to start).
REPLAN_PROFILES = [
    planner.Profile("a", cost_model.Link(0.01 * GBIT, 20e-6), _codecs(int8=1e9, int4=1e9, topk=1e5), 3),
    planner.Profile("b", cost_model.Link(0.01 * GBIT, 20e-6), _codecs(int8=1e6, int4=1e6, topk=1e9), 3),
    planner.Profile("c", cost_model.Link(100 * GBIT, 1e-6), _codecs(int8=1e6, int4=1e6, topk=1e6), 3),
]


# Steps at which the next profile comes in and one rank asks for a re-plan.
REQUESTS = (4, 6, 9)


def _replan_body(rank, world_size, steps, periodic, profiles=REPLAN_PROFILES, node_size=None, outputs=512):
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp
    from gradcomp.collectives import two_phase

    two_phase.SEGMENT_ELEMENTS = 2**12  # several segments: the owner's chunks lie apart
    torch.manual_seed(0)
    net = torch.nn.Linear(128, outputs)
    model = DistributedDataParallel(net)
    allow = ("int8", "int4", "topk")
    every = 2 if periodic else None
    state = ddp.register(
        model,
        "auto",
        allow=allow,
        profile=profiles[0],
        warmup_steps=2,
        check_every=2,
        replan_every=every,
        node_size=node_size,
        trial_steps=0,  # re-plans only: trials have their own tests
    )
    # A linear loss: every step's gradient is the same, so error feedback must deliver
    # steps * lr * (their mean) in all, whatever the compressors did on the way.
    generator = torch.Generator().manual_seed(rank)
    x, c = torch.randn(16, 128, generator=generator), torch.randn(16, outputs, generator=generator)
    start = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
    mean_grad = torch.cat([(c.T @ x).reshape(-1), c.sum(0)]).double()
    dist.all_reduce(mean_grad)
    mean_grad /= world_size
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    plans, gaps = {}, {}
    for step in range(steps):
        # Requests from one rank at a time (0, the last, 1): every rank re-plans at
        # the next check (periodic: every check re-plans).
        if step in REQUESTS[: len(profiles) - 1]:
            i = REQUESTS.index(step)
            state.auto.options = dataclasses.replace(state.auto.options, profile=profiles[i + 1])
            if rank == (0, world_size - 1, 1)[i] and not periodic:
                state.replan()
        optimizer.zero_grad()
        (model(x) * c).sum().backward()
        optimizer.step()
        now = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).double()
        gaps[step] = (now - (start.double() - 0.5 * (step + 1) * mean_grad)).norm().item()
        plans[step] = [(p.compressor, p.algorithm) for p in state.plan] if state.plan else None
    state.flush()
    final = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    finals = [torch.empty_like(final) for _ in range(world_size)]
    dist.all_gather(finals, final)
    return dict(
        stats=[(s.step, s.compressors[0]) for s in state.stats],
        gaps=gaps,
        scale=(0.5 * steps * mean_grad).norm().item(),
        residuals=list(state.feedback.keys()),
        replicas_equal=all(torch.equal(finals[0], f) for f in finals),
        observed=[p.observed_seconds for p in state.plan],
    )


@pytest.mark.slow
@pytest.mark.parametrize("periodic", [False, True], ids=["requested", "replan_every"])
def test_a_plan_change_mid_run_carries_the_residuals_and_loses_nothing(periodic):
    result = spawn.run_ranks(_replan_body, 3, 12, periodic, timeout=240)
    # Planned at step 2 (its buckets on the worker already go through the plan);
    # rank 0's request at step 4 (or replan_every=2) re-plans at the check of
    # step 5, the new plan applies from step 6; rank 2's at step 6 re-plans at
    # step 8 (checks come every 2 steps after a plan), from step 9.
    expected = ["none dense"] * 2 + ["int4 two_phase"] * 4 + ["topk allgather"] * 3 + ["none dense"] * 3
    assert [how for _, how in result["stats"]] == expected
    # While compressed, what error feedback holds back is far from zero;
    # int4's residuals carried into Top-K's feedback,
    # and the first dense step sends them all: the run has moved exactly as
    # many gradients as it took (up to fp32 rounding), and no residual is left.
    gaps, scale_ = result["gaps"], result["scale"]
    assert gaps[1] < 1e-7 * scale_ and min(gaps[s] for s in range(2, 9)) > 0.01 * scale_
    assert max(gaps[s] for s in range(9, 12)) < 1e-6 * scale_
    assert result["residuals"] == [] and result["replicas_equal"]
    assert all(0 < t < 5 for t in result["observed"])


def _nodes(stages: planner.Linear = FREE) -> planner.Nodes:
    """Two nodes of two ranks: a slow link between them (its all-to-all faster: two_phase pays)."""
    slow, fast = cost_model.Link(0.01 * GBIT, 20e-6), cost_model.Link(GBIT, 20e-6)
    return planner.Nodes(2, 2, stages, slow, {"all_gather": slow, "all_to_all": fast})


# On 2 nodes of 2 ranks: int4 hierarchical, Top-K flat (the node's stages slow), int8
# hierarchical, then dense (every link fast); each compressed one two_phase (owners' residuals).
NODE_PROFILES = [
    planner.Profile("a", _nodes().link, _codecs(int8=1e9, int4=1e9, topk=1e5), 4, nodes=_nodes()),
    planner.Profile(
        "b", _nodes().link, _codecs(int8=1e6, int4=1e6, topk=1e9), 4, nodes=_nodes(planner.Linear(1.0, 1e3))
    ),
    planner.Profile("c", _nodes().link, _codecs(int8=1e9, int4=1e6, topk=1e5), 4, nodes=_nodes()),
    planner.Profile(
        "d",
        cost_model.Link(100 * GBIT, 1e-6),
        _codecs(int8=1e6, int4=1e6, topk=1e6),
        4,
        nodes=planner.Nodes(2, 2, FREE, cost_model.Link(100 * GBIT, 1e-6)),
    ),
]


@pytest.mark.slow
def test_a_plan_moving_between_hierarchical_and_flat_carries_the_residuals():
    # 513 outputs: 66,177 elements, so the last node shard holds a padding element.
    result = spawn.run_ranks(_replan_body, 4, 15, False, NODE_PROFILES, 2, 513, timeout=300)
    expected = ["none dense"] * 2 + ["int4 hierarchical(two_phase)"] * 4 + ["topk two_phase"] * 3
    expected += ["int8 hierarchical(two_phase)"] * 3 + ["none dense"] * 3
    assert [how for _, how in result["stats"]] == expected
    # Shards' residuals (sender's and owner's between nodes) went into the flat Top-K's
    # input, its residuals into int8's shards, and the first dense step sent the rest.
    gaps, scale_ = result["gaps"], result["scale"]
    assert gaps[1] < 1e-7 * scale_ and min(gaps[s] for s in range(2, 9)) > 0.01 * scale_
    assert min(gaps[s] for s in range(9, 12)) > 1e-4 * scale_  # int8 holds back less
    assert max(gaps[s] for s in range(12, 15)) < 1e-6 * scale_
    assert result["residuals"] == [] and result["replicas_equal"]


# int8 predicted a little faster than int4 on this link (within the margin): a trial.
NEAR = planner.Profile("near", cost_model.Link(0.1 * GBIT, 20e-6), _codecs(int8=1e8, int4=4e7), 2)


def test_the_runner_up_is_a_choice_the_model_cannot_tell_from_the_plans():
    numel = 128 * 512 + 512
    allow = ("int8", "int4")
    plan = planner.best_plan([numel], 2, NEAR, allow)
    assert [(p.compressor, p.algorithm) for p in plan] == [("int8", "allgather")]
    (other,) = planner.runner_up([numel], 2, NEAR, plan, allow)
    # Another compressor first (int8's two_phase is closer still), within the margin.
    assert (other.compressor, other.algorithm) == ("int4", "allgather")
    assert abs(other.seconds - plan[0].seconds) <= planner.MARGIN * plan[0].seconds
    # int4 far slower: int8's other algorithm is the one left within the margin.
    slow4 = planner.Profile("s", NEAR.link, _codecs(int8=1e8, int4=1e7), 2)
    (other,) = planner.runner_up([numel], 2, slow4, planner.best_plan([numel], 2, slow4, allow), allow)
    assert (other.compressor, other.algorithm) == ("int8", "two_phase")
    # Dense kept though int8 is predicted far faster (as the overlap with the backward
    # pass may decide): no runner-up, nor where nothing comes within the margin.
    dense = [planner.predict("none", numel, 2, NEAR)]
    assert planner.runner_up([numel], 2, NEAR, dense, allow) is None
    assert planner.runner_up([numel], 2, NEAR, plan, ("int8",), within=0.001) is None
    # Buckets without one keep the plan's choice in the runner-up plan.
    two = planner.best_plan([numel, 100], 2, NEAR, allow)
    assert two[1].compressor == "none"
    assert planner.runner_up([numel, 100], 2, NEAR, two, allow, within=0.1)[1] is two[1]


def _trial_body(rank, world_size, steps, slow, stall=None):
    import time

    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    torch.manual_seed(0)
    net = torch.nn.Linear(128, 512)
    model = DistributedDataParallel(net)
    state = ddp.register(model, "auto", allow=("int8", "int4"), profile=NEAR, warmup_steps=2, check_every=2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(rank))
    saved = None
    for step in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if rank == 1 and state.plan and state.plan[0].compressor == slow:
            time.sleep(0.25)  # one rank's steps slower with this compressor: every rank's are
        if rank == 1 and step == stall:
            time.sleep(1.5)  # the loop's own business (an evaluation, a checkpoint): one step
        if step == 10:  # in the runner-up's turn: a checkpoint keeps the trial
            state.flush()
            saved = state.state_dict()
    state.flush()
    resumed = ddp.HookState("auto", allow=("int8", "int4"), profile=NEAR)
    resumed.load_state_dict(saved)
    saved_trial = [[p.compressor for p in plan] for plan in resumed.auto.trial.plans]
    saved_seconds = list(resumed.auto.trial.seconds)
    # Resumed from step 11 in a fresh model: the trial goes on from the steps it runs.
    again = DistributedDataParallel(torch.nn.Linear(128, 512))
    again.register_comm_hook(resumed, ddp.hook)
    for _ in range(11, steps):
        again(x).square().mean().backward()
        if rank == 1 and resumed.plan[0].compressor == slow:
            time.sleep(0.25)
    resumed.flush()
    final = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    finals = [torch.empty_like(final) for _ in range(world_size)]
    dist.all_gather(finals, final)
    trials = [None] * world_size
    dist.all_gather_object(trials, state.trials)
    return dict(
        hows=[s.compressors[0] for s in state.stats],
        trials=trials,
        plan=[(p.compressor, p.algorithm) for p in state.plan],
        saved_trial=saved_trial,
        saved_seconds=saved_seconds,
        resumed=([s.compressors[0] for s in resumed.stats], [t["kept"] for t in resumed.trials]),
        replicas_equal=all(torch.equal(finals[0], f) for f in finals),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("slow", "stall"), [("int8", None), ("int4", None), ("int8", 9)], ids=["int8", "int4", "int8-stall"]
)
def test_auto_tries_a_close_runner_up_and_keeps_the_faster(slow, stall):
    result = spawn.run_ranks(_trial_body, 2, 20, slow, stall, timeout=240)
    # Planned at step 2 (int8); it runs to step 7, whose check times steps 4-6; int4
    # runs steps 8-12 (timed 9-11), int8 again steps 13-17 (timed 14-16), and the faster
    # plan applies from step 18. A stall of 1.5 s in int4's step 9 (6x what int8 loses
    # a step) is one step of three: the median passes over it.
    kept = "int4" if slow == "int8" else "int8"
    turns = ["int8 allgather"] * 6 + ["int4 allgather"] * 5 + ["int8 allgather"] * 5
    assert result["hows"] == ["none dense"] * 2 + turns + [f"{kept} allgather"] * 2
    (trial,) = result["trials"][0]
    assert trial["plans"] == [["int8 allgather"], ["int4 allgather"]]
    assert trial["kept"] == ("int8", "int4").index(kept)
    # The slow plan's steps took the 0.25 s sleep more (the slowest rank's, every rank's);
    # int8's time is the mean of its two turns'.
    assert trial["step_ms"][1 - trial["kept"]] > trial["step_ms"][trial["kept"]] + 150
    first, second, third = trial["turns_ms"]
    assert trial["step_ms"] == [pytest.approx((first + third) / 2), second]
    assert result["plan"] == [(kept, "allgather")] and result["replicas_equal"]
    # A checkpoint in int4's turn holds the trial: int8's time, int4's still to come.
    assert result["saved_trial"] == [["int8"], ["int4"]] and len(result["saved_seconds"]) == 1
    # Resumed at step 11 (DDP's first iteration there, untimed), it judged int4's turn a
    # step later, from step 12's time, ran int8's second turn (steps 14-18) and kept the same.
    resumed = ["int4 allgather"] * 3 + ["int8 allgather"] * 5 + [f"{kept} allgather"]
    assert result["resumed"] == (resumed, [trial["kept"]])
    assert result["trials"][0] == result["trials"][1]  # every rank kept the same


def _no_trial_below_min_numel(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    torch.manual_seed(0)
    net = torch.nn.Linear(128, 512)
    model = DistributedDataParallel(net)
    # Every bucket below min_numel goes dense whatever the plan: nothing to try.
    state = ddp.register(model, "auto", allow=("int8", "int4"), profile=NEAR, min_numel=10**9)
    for _ in range(8):
        model(torch.randn(4, 128)).sum().backward()
    state.flush()
    return state.plan[0].compressor, state.trials, state.auto.trial, {s.compressors[0] for s in state.stats}


@pytest.mark.slow
def test_no_trial_where_the_plans_differ_only_in_buckets_reduced_dense():
    planned, trials, under_way, hows = spawn.run_ranks(_no_trial_below_min_numel, 2, timeout=120)
    # The plan says what is sent: dense, under min_numel.
    assert planned == "none" and trials == [] and under_way is None and hows == {"none dense"}


def _half_precision_auto_body(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    plans = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        net = torch.nn.Linear(128, 512).to(dtype)
        model = DistributedDataParallel(net)
        # Fast codecs on a 5 Gbit/s link: a cast to bf16 pays for fp32 gradients.
        fast = profile(5 * GBIT, rate=1e11, overhead=1e-6)
        state = ddp.register(model, "auto", allow=("none", "bf16"), profile=fast, min_numel=0, trial_steps=0)
        for _ in range(5):
            model(torch.randn(4, 128, dtype=dtype)).sum().backward()
        state.flush()
        plans[str(dtype)] = [(p.compressor, p.bytes_sent) for p in state.plan]
    return plans


@pytest.mark.slow
def test_auto_plans_half_precision_buckets_by_their_own_bytes():
    plans = spawn.run_ranks(_half_precision_auto_body, 2, timeout=120)
    numel = 128 * 512 + 512
    # With the payloads' fingerprints: a gathered row's 8 bytes, or 64 lanes of 2 bytes.
    assert plans["torch.float32"] == [("bf16", numel * 2 + 8)]
    assert plans["torch.bfloat16"] == [("none", (numel + 64) * 2)]  # already 2 bytes: nothing to save


def test_trial_steps_is_checked():
    from gradcomp import ddp

    for bad in (1, -1, True, 2.0, ddp.MAX_TRIAL_STEPS + 1):
        with pytest.raises(ValueError, match="trial_steps"):
            ddp.HookState("auto", trial_steps=bad)
    assert ddp.HookState("auto", trial_steps=0).auto.options.trial_steps == 0
    assert ddp.HookState("auto").auto.options.trial_steps == ddp.DEFAULT_TRIAL_STEPS
    with pytest.raises(ValueError, match="options of compressor='auto'"):
        ddp.HookState("int8", trial_steps=4)


def _said() -> list[str]:
    """(in a rank) The messages the hook logs at INFO from now on, as they come."""
    import logging

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("gradcomp.ddp")  # every module of the hook logs there
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return said


# dense 2.2 ms, int8 allgather 2.7 ms a bucket of Linear(128, 512) on 2 ranks: dense planned,
# int8 the runner-up (within the margin).
CLOSE_TO_DENSE = planner.Profile("close", cost_model.Link(1 * GBIT, 20e-6), _codecs(int8=1e8), 2)


def _logged_plans_body(rank, world_size, steps):
    import time

    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    said = _said()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.Linear(512, 4))
    model = DistributedDataParallel(net, bucket_cap_mb=0.005)  # a bucket a layer
    state = ddp.register(
        model, "auto", allow=("int8",), profile=CLOSE_TO_DENSE, min_numel=4096, trial_steps=2, check_every=2
    )
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        model(x).square().mean().backward()
        if rank == 1 and any(p.compressor == "int8" for p in state.plan or ()):
            time.sleep(0.25)  # int8's steps slower on one rank: on every rank
    state.flush()
    return said, [s.compressors for s in state.stats], [p.numel for p in state.plan]


@pytest.mark.slow
def test_auto_logs_every_plan_it_adopts_and_why_a_bucket_stays_dense():
    said, hows, numels = spawn.run_ranks(_logged_plans_body, 2, 14, timeout=240)
    assert numels == [2052, 128 * 512 + 512]  # the premise: DDP's buckets, the small layer's first
    plans = [line for line in said if line.startswith("gradcomp auto plan from step")]
    # The first plan (dense: the model predicts int8 slower), the trial's turns, the plan kept.
    small = "bucket 0: none dense, below min_numel=4,096"
    first, runner_up, again, kept = plans
    assert first.startswith("gradcomp auto plan from step 3 (first plan): 0 of 2 buckets compressed")
    assert (
        small in first
        and "bucket 1: none dense, dense predicted fastest, 2.2 ms against int8 allgather" in first
    )
    assert runner_up.startswith(
        "gradcomp auto plan from step 6 (trial, the runner-up's turn (2 of 3)): 1 of 2"
    )
    assert small in runner_up and "bucket 1: int8 allgather" in runner_up
    assert again.startswith("gradcomp auto plan from step 9 (trial, the plan's turn (3 of 3)): 0 of 2")
    # The settled plan, with the trial's verdict as the dense bucket's reason.
    assert kept.startswith("gradcomp auto plan from step 11 (trial kept the plan, ")
    assert small in kept and "bucket 1: none dense, trial kept dense, " in kept
    assert kept.endswith(" ms with int8 allgather")
    # What the log says is what the buckets went through (DDP settles its buckets after step 0).
    assert [h[1] for h in hows[1:]] == ["none dense"] * 5 + ["int8 allgather"] * 3 + ["none dense"] * 5


def _drift_body(rank, world_size, steps, slow_from):
    import time

    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    said = _said()
    torch.manual_seed(0)
    net = torch.nn.Linear(512, 2048)
    model = DistributedDataParallel(net)
    # Planned on a claimed 100 Gbit/s link: dense.
    fast = profile(100 * GBIT, overhead=20e-3)
    state = ddp.register(model, "auto", profile=fast, warmup_steps=2, check_every=3)
    all_reduce = dist.all_reduce

    def slow_all_reduce(tensor, *args, **kwargs):  # all-reduces at 20 MB/s from now on
        time.sleep(tensor.numel() * tensor.element_size() / 20e6)
        return all_reduce(tensor, *args, **kwargs)

    for step in range(steps):
        if step == slow_from:
            dist.all_reduce = slow_all_reduce
            state.auto.options = dataclasses.replace(
                state.auto.options, profile=None
            )  # the next plan measures
        model(torch.randn(4, 512)).sum().backward()
        if step == 9:
            observed = [p.observed_seconds for p in state.plan]  # of the old plan, at the check of step 9
    state.flush()
    dist.all_reduce = all_reduce
    return [s.compressors[0] for s in state.stats], said, observed


@pytest.mark.slow
def test_auto_notices_a_slower_link_and_re_plans_from_new_measurements():
    hows, said, observed = spawn.run_ranks(_drift_body, 2, 12, 6, timeout=240)
    # Checks at steps 6 (the first window after the plan: calibrates) and 9
    # (steps 6-8, on the slower link: drift), the new plan from step 10.
    assert hows[:10] == ["none dense"] * 10
    # Only the all-reduce got slower: the new plan gathers or scatters instead.
    assert all(how.split()[1] in ("allgather", "two_phase") for how in hows[10:]), hows
    # One line a plan, with its cause: the first, then the re-plan in force from step 10.
    plans = [line for line in said if line.startswith("gradcomp auto plan from step")]
    assert plans[0].startswith("gradcomp auto plan from step 3 (first plan): 0 of 1 buckets compressed")
    assert plans[1].startswith("gradcomp auto plan from step 10 (re-plan, drift ") and len(plans) == 2
    assert not any("requested" in line for line in said)
    # What the plan says it observed on the slower link: at least the 0.2 s its 4 MB take.
    assert observed[0] >= 0.2
